"""The reduced-vocabulary draft head (``draft_vocab_size``) and the verify step's shared logits rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dsbd.engine.draft_head import install_reduced_head, reduced_vocab_ids
from vllm_dsbd.engine.protocol import VerifyStep
from vllm_dsbd.engine.spec_step import shared_node_rows


def test_reduced_vocab_keeps_the_lowest_ids_and_the_special_tokens():
    ids = reduced_vocab_ids(20, 5, always=[2, 17, 19, 17, 25])
    assert ids.tolist() == [0, 1, 2, 3, 4, 17, 19]  # 2 is already kept; 25 is outside the vocabulary


@pytest.mark.parametrize("size", [-1, 0, 20, 21])
def test_reduced_vocab_size_out_of_range_is_refused(size):
    with pytest.raises(ValueError, match=r"draft_vocab_size.*allowed: 0 \(the whole vocabulary\) or 1\.\.19"):
        reduced_vocab_ids(20, size, always=[])


def _model(weight: torch.Tensor, start: int = 0):
    shard = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=start + weight.shape[0])
    return SimpleNamespace(lm_head=SimpleNamespace(weight=weight, shard_indices=shard, bias=None),
                           logits_processor=SimpleNamespace(soft_cap=None))


@pytest.mark.parametrize("start", [0, 8])  # one rank's shard of a tensor-parallel head: ids start..start+7
def test_reduced_head_computes_the_kept_rows_and_minus_inf_elsewhere(start):
    weight = torch.randn(8, 3)
    model = _model(weight, start)
    keep = torch.tensor([1, 4, 9, 14])
    install_reduced_head(model, keep)
    hidden = torch.randn(5, 3)
    logits = model.logits_processor._apply_head(model.lm_head, hidden, None)
    local = [t - start for t in keep.tolist() if start <= t < start + 8]
    full = hidden @ weight.T
    assert logits.shape == (5, 8)
    assert torch.equal(torch.isfinite(logits).nonzero()[:, 1].unique(), torch.tensor(local))
    torch.testing.assert_close(logits[:, local], full[:, local])


def test_reduced_head_refuses_a_soft_capped_head():
    model = _model(torch.randn(8, 3))
    model.logits_processor.soft_cap = 30.0
    with pytest.raises(ValueError, match="soft-cap"):
        install_reduced_head(model, torch.tensor([0, 1]))


def _verify_step(group_id, rids, paths, shared=()) -> VerifyStep:
    return SimpleNamespace(group_id=group_id, path_req_ids=tuple(rids), paths=tuple(paths),
                           skip=lambda k: shared[k] if shared else 0)


def test_shared_rows_point_repeated_nodes_at_their_first_row():
    """W 2, one layer: root 0 is on two paths; its second row takes the first row's logits."""
    vs = _verify_step("g", ["a", "b", "c"], [(0, 2), (0, 3), (1,)])
    source = shared_node_rows([vs], {"a": 0, "b": 2, "c": 4}, 5)
    assert source.tolist() == [0, 1, 0, 3, 4]


def test_shared_rows_follow_the_batch_layout_and_keep_groups_apart():
    """Two groups with the same node ids, path requests out of path order in the batch, a plain request's
    row in between: a node's logits come from its first *path* (what ``verify`` reads), not its first row."""
    g1 = _verify_step("g1", ["a", "b"], [(0, 2, 4), (0, 2, 5)])
    g2 = _verify_step("g2", ["c", "d"], [(1, 3), (1, 2)])
    source = shared_node_rows([g1, g2], {"c": 0, "b": 2, "a": 6, "d": 9}, 11)
    #   rows:  c: nodes 1 3 | b: nodes 0 2 5 | plain | a: nodes 0 2 4 | d: nodes 1 2
    assert source.tolist() == [0, 1, 6, 7, 4, 5, 6, 7, 8, 0, 10]


def test_no_shared_rows_without_repeated_nodes():
    vs = _verify_step("g", ["a", "b"], [(0, 2), (1, 3)])
    assert shared_node_rows([vs], {"a": 0, "b": 2}, 4) is None


def test_no_shared_rows_where_a_path_holds_the_nodes_an_earlier_one_computes():
    """``VerifyStep.shared``: the second path's request holds root 0 and has one row, its own node 3."""
    vs = _verify_step("g", ["a", "b", "c"], [(0, 2), (0, 3), (1,)], shared=(0, 1, 0))
    assert shared_node_rows([vs], {"a": 0, "b": 2, "c": 3}, 4) is None
