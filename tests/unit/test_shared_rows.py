"""Forest nodes on several verification paths, computed once (``engine.shared_rows``): which nodes a path
holds as computed, what its request carries, and where the target's KV update copies their K/V."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from test_beam_group import Req, three_beam_group  # tests/unit/test_beam_group.py

from vllm_dsbd.engine import shared_rows
from vllm_dsbd.engine.group_effects import Extend
from vllm_dsbd.engine.protocol import DraftDecision, TokenLogprob, VerifyChoice, VerifyDecision, shared_prefixes

# W 3: roots 0-2; layer 1 nodes 3 (root 0, token 20), 4 (root 0, 21), 5 (root 2, 22); layer 2 nodes
# 6 (node 4, 30), 7 (node 3, 31), 8 (node 3, 32). Root 1 has no child.
LAYERS = [DraftDecision("g", [0, 0, 2], [20, 21, 22], [-1.5, -1.6, -3.5]),
          DraftDecision("g", [1, 0, 0], [30, 31, 32], [-2.0, -2.1, -2.2])]
PATHS = [(0, 3, 7), (0, 3, 8), (0, 4, 6), (1,), (2, 5)]


def test_a_path_shares_the_nodes_an_earlier_path_holds():
    assert shared_prefixes(PATHS) == [0, 2, 1, 0, 0]
    assert shared_prefixes([(0,), (1,)]) == [0, 0] and shared_prefixes([]) == []


def _forest(share: bool):
    group, _ = three_beam_group(num_speculative_tokens=2)
    group.share_path_rows = share
    group.start_iteration(2)
    effects = group.apply_drafted(LAYERS)
    for k, op in enumerate(effects.ops):
        op.request = op.root if op.reuse_root else Req(f"path{k}")
    return group, effects.ops


def test_a_shared_paths_request_holds_its_shared_nodes_and_verifies_the_rest():
    """Sharing on: a later path's fork carries its shared nodes' tokens and its first own node's (the
    request's last token), and verifies the rest; the first path from each root is the root's request.
    Off: every path verifies all its nodes, a fork per repeated root, as before."""
    group, ops = _forest(True)
    assert group.paths == PATHS and group.path_skips == [0, 2, 1, 0, 0]
    assert [(op.tokens, op.spec_tokens, op.reuse_root) for op in ops] == [
        ([], [20, 31], True), ([20, 32], [], False), ([21], [30], False), ([], [], True), ([], [22], True)]
    vs = group.verify_plan()
    assert vs.shared == (0, 2, 1, 0, 0) and [vs.skip(k) for k in range(5)] == [0, 2, 1, 0, 0]
    group, ops = _forest(False)
    assert [(op.tokens, op.spec_tokens, op.reuse_root) for op in ops] == [
        ([], [20, 31], True), ([], [20, 32], False), ([], [21, 30], False), ([], [], True), ([], [22], True)]
    assert group.verify_plan().shared == ()


def test_an_accepted_shared_path_extends_its_request_by_what_it_does_not_hold():
    """New beams on nodes 8 (a path holding nodes 0, 3 and its own 8) and 6 (holding 0 and its own 4): the
    accepted tokens each request lacks are appended as computed, then the new token."""
    group, ops = _forest(True)
    lp = (TokenLogprob(-1.0, 1),) * 3
    decision = VerifyDecision("g", 2, [VerifyChoice(8, 40, -3.0, lp), VerifyChoice(6, 41, -3.5, lp)], [],
                              [3, 3], [3, 3], [2, 2, 2])
    effects = group.apply_verify(decision)
    extends = [(op.request.request_id, op.tokens, op.computed) for op in effects.ops if isinstance(op, Extend)]
    assert extends == [("path1", [40], False), ("path2", [30], True), ("path2", [41], False)]
    assert [b.tokens[-3:] for b in group.beams] == [[20, 32, 40], [21, 30, 41]]


def test_the_copies_take_each_shared_node_from_the_row_of_the_path_that_computes_it():
    """Requests a (path (0, 2, 4): 3 rows), b ((0, 2, 5), holding 0 and 2: 1 row), c ((1, 3, 6): 3 rows), in
    that batch order; roots' last tokens at position 9, block size 4, b's blocks 7, 8, 9, ...: nodes 0 and 2
    come from a's rows 0 and 1 to b's slots of positions 9 and 10 (block 9, offsets 1 and 2)."""
    vs = SimpleNamespace(paths=((0, 2, 4), (0, 2, 5), (1, 3, 6)), shared=(0, 2, 0), path_req_ids=("a", "b", "c"),
                         seq_len=10)
    vs.skip = lambda k: vs.shared[k]
    table = np.zeros((3, 6), dtype=np.int32)
    table[1] = [7, 8, 9, 10, 11, 12]
    copies = shared_rows.plan([vs], {"a": 0, "b": 1, "c": 2}, np.array([0, 3, 4, 7]), {0: (table, 4), 1: (table, 2)},
                              "cpu")
    assert copies.rows.tolist() == [0, 1]
    assert copies.slots[0].tolist() == [9 * 4 + 1, 9 * 4 + 2]
    assert copies.slots[1].tolist() == [11 * 2 + 1, 12 * 2 + 0]  # block size 2: the 5th and 6th blocks
    vs.shared = ()
    assert shared_rows.plan([vs], {"a": 0, "b": 1, "c": 2}, np.array([0, 3, 4, 7]), {0: (table, 4)}, "cpu") is None


def test_the_wrapped_kv_update_also_writes_the_shared_rows():
    """:class:`SharedRowsImpl` runs the layer's own update, then the same update on the copies' rows and slots;
    with no copies planned only the layer's own."""
    calls = []
    def update(layer, key, value, cache, slots):
        calls.append((key.tolist(), slots.tolist()))

    inner = SimpleNamespace(do_kv_cache_update=update, num_heads=2)
    shared = shared_rows.SharedRows()
    impl = shared_rows.SharedRowsImpl(inner, shared, 0)
    key = torch.arange(4.0)
    impl.do_kv_cache_update(None, key, key, None, torch.tensor([5, 6, 7, 8]))
    shared.now = shared_rows.RowCopies(torch.tensor([0, 2]), {0: torch.tensor([40, 41])})
    impl.do_kv_cache_update(None, key, key, None, torch.tensor([5, 6, 7, 8]))
    assert calls == [([0, 1, 2, 3], [5, 6, 7, 8]), ([0, 1, 2, 3], [5, 6, 7, 8]), ([0, 2], [40, 41])]
    assert impl.num_heads == 2
