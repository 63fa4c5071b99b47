"""A layer verified over the draft's own columns (``algorithm.draft_columns``) against the same layer over
the whole vocabulary."""

from __future__ import annotations

import torch

from exact_dist import ALPHA, chi2_pvalue
from vllm_dsbd.algorithm import residual_ladder, restrict_to_parents
from vllm_dsbd.algorithm.draft_columns import DraftColumns

WIDTH, VOCAB = 3, 12
SUPPORT = torch.tensor([0, 2, 3, 7, 8])


def _layer(seed: int):
    """A target joint P over W x V (the last parent invalid) and a draft joint Q that is 0 outside SUPPORT."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(WIDTH, VOCAB, generator=gen) ** 2
    p[-1] = 0
    q = torch.zeros(WIDTH, VOCAB)
    q[:, SUPPORT] = torch.rand(WIDTH, SUPPORT.numel(), generator=gen) ** 2
    valid = torch.tensor([[True, True, False]])
    return (p / p.sum()).flatten()[None], (q / q.sum()).flatten()[None], valid


def test_the_compact_ladder_has_the_whole_vocabularys_acceptance_rates():
    """Every level's α (what acceptance and the width DP read) is the same over W x (K + 1) entries as over
    W x V, and so are the residuals at the draft's columns."""
    columns = DraftColumns(SUPPORT, VOCAB, WIDTH)
    for seed in range(5):
        p, q, valid = _layer(seed)
        dense, alpha = residual_ladder(p, restrict_to_parents(q, valid), WIDTH)
        compact_p, _ = columns.target(p.clone())
        compact_q = columns.draft(q.view(WIDTH, VOCAB)[:, SUPPORT].reshape(1, -1))
        ladder, compact_alpha = residual_ladder(compact_p, restrict_to_parents(compact_q, valid), WIDTH)
        torch.testing.assert_close(compact_alpha, alpha, atol=1e-6, rtol=0)
        at_columns = dense.view(WIDTH + 1, 1, WIDTH, VOCAB)[..., SUPPORT]
        torch.testing.assert_close(ladder.view(WIDTH + 1, 1, WIDTH, -1)[..., :-1], at_columns, atol=1e-6, rtol=0)
        outside = dense.view(WIDTH + 1, 1, WIDTH, VOCAB).sum(-1) - at_columns.sum(-1)
        torch.testing.assert_close(ladder.view(WIDTH + 1, 1, WIDTH, -1)[..., -1], outside, atol=1e-6, rtol=0)


def test_indices_map_both_ways_and_outside_draws_follow_the_target_there():
    """A draft's flat index maps to its compact one and back; a token outside the columns maps to its
    parent's outside entry; draws on an outside entry are distributed as P at that parent outside the
    columns (20,000 draws, chi-square), and a planted uniform draw there is rejected."""
    columns = DraftColumns(SUPPORT, VOCAB, WIDTH)
    p, _, _ = _layer(7)
    flat = torch.tensor([[0 * VOCAB + 3, 1 * VOCAB + 8, 1 * VOCAB + 5]])
    compact = columns.index(flat)
    assert compact.tolist() == [[2, columns.row + 4, 2 * columns.row - 1]]
    _, outside = columns.target(p.clone())
    draws = 20_000
    index = torch.full((1, draws), columns.row + columns.num_columns)  # parent 1's outside entry
    index[0, :2] = compact[0, :2]
    gen = torch.Generator().manual_seed(0)
    out = columns.flat(index, outside, lambda groups, n: torch.rand((groups.numel(), n), generator=gen))
    assert out[0, :2].tolist() == flat[0, :2].tolist()
    tokens = (out[0, 2:] % VOCAB).tolist()
    assert set(tokens) <= set(range(VOCAB)) - set(SUPPORT.tolist()) and bool((out[0, 2:] // VOCAB == 1).all())
    row = outside[0, 1].double()
    expected = {(t,): float(row[t] / row.sum()) for t in range(VOCAB) if row[t] > 0}
    assert chi2_pvalue([(t,) for t in tokens], expected) >= ALPHA
    off = [t for t in range(VOCAB) if t not in SUPPORT.tolist()]
    uniform = {(t,): 1 / len(off) for t in off}
    assert chi2_pvalue([(t,) for t in tokens], uniform) < ALPHA
