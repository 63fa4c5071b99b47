"""Layer verification, the acceptance-count DP and the width rule, on hand-built distributions.

Statistical checks follow test_dsbd_sampling's protocol (fixed seeds, chi-square, ALPHA = 1e-3).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from exact_dist import ALPHA, chi2_pvalue
from planted_bugs import BUGS
from vllm_dsbd.algorithm import (
    acceptance_count_distribution,
    choose_width,
    residual_ladder,
    restrict_to_parents,
    verify,
    verify_layer,
)

NUM_ROWS = 20_000

# Two parent slots (the second invalid) x 3 tokens. The valid part of Q has
# mass 0.8; α_0 = 0.5, R_1 = (0.4, 0.6, 0), α_1 = 0.5, R_2 = (0, 1, 0), α_2 = 0.1.
CRAFTED_P = [[0.6, 0.4, 0.0], [0.0, 0.0, 0.0]]
CRAFTED_Q = [[0.4, 0.1, 0.3], [0.2, 0.0, 0.0]]
VALID = [True, False]


def _layer(p_rows, q_rows, valid, num_drafts: int, width: int, num_out: int, seed: int):
    """Run verify_layer on NUM_ROWS copies of one layer; drafts drawn from Q here."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.tensor(p_rows).flatten()[None].expand(NUM_ROWS, -1).contiguous()
    q = torch.tensor(q_rows).flatten()[None].expand(NUM_ROWS, -1).contiguous()
    drafts = torch.multinomial(q, num_drafts, replacement=True, generator=gen)
    parent_valid = torch.tensor(valid)[None].expand(NUM_ROWS, -1)
    exists = torch.ones(NUM_ROWS, num_drafts, dtype=torch.bool)
    widths = torch.full((NUM_ROWS,), width)
    return verify_layer(p, q, parent_valid, drafts, exists, widths, num_out, gen)


def _random_layer(seed: int, num_parents: int, vocab: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(num_parents, vocab, generator=gen) ** 3
    p[-1] = 0  # the last parent is invalid: no target mass
    q = torch.rand(num_parents, vocab, generator=gen) ** 3
    return (p / p.sum()).tolist(), (q / q.sum()).tolist(), [True] * (num_parents - 1) + [False]


def _slot_tuples(res, num: int) -> list[tuple[int, ...]]:
    return [tuple(row) for row in res.out_index[:, :num].tolist()]


def _iid_expected(p_rows, num: int) -> dict[tuple[int, ...], float]:
    flat = [x for row in p_rows for x in row]
    support = [i for i, x in enumerate(flat) if x > 0]
    expected = {}
    for combo in itertools.product(support, repeat=num):
        prob = 1.0
        for i in combo:
            prob *= flat[i]
        expected[combo] = prob
    return expected


@pytest.mark.parametrize("layer", ["crafted", "random"])
def test_fixed_width_layer_slots_are_iid_target_draws(layer: str):
    """All W slots of a layer (pass or fail, invalid parents present) are i.i.d. draws from P."""
    if layer == "crafted":
        p, q, valid = CRAFTED_P, CRAFTED_Q, VALID
    else:
        p, q, valid = _random_layer(seed=3, num_parents=3, vocab=3)
    res = _layer(p, q, valid, num_drafts=3, width=3, num_out=3, seed=1)
    assert bool(res.passed.any()) and bool((~res.passed).any()), "both outcomes must occur"
    assert chi2_pvalue(_slot_tuples(res, 3), _iid_expected(p, 3)) >= ALPHA


@pytest.mark.parametrize("bug", ["no-residual-update", "no-reset-after-acceptance", "renormalised-restricted-draft"])
def test_layer_check_detects_planted_bug(bug: str, monkeypatch):
    """The layer exactness check fails on each broken acceptance rule."""
    monkeypatch.setattr(verify, *BUGS[bug])
    res = _layer(CRAFTED_P, CRAFTED_Q, VALID, num_drafts=3, width=3, num_out=3, seed=1)
    assert chi2_pvalue(_slot_tuples(res, 3), _iid_expected(CRAFTED_P, 3)) < ALPHA


def test_acceptance_count_dp_matches_monte_carlo():
    """The DP's distribution of K equals the acceptance counts of verify_layer run on all W drafts."""
    for seed, (p, q, valid) in enumerate([(CRAFTED_P, CRAFTED_Q, VALID), _random_layer(7, 2, 4)]):
        num_drafts = 4
        res = _layer(p, q, valid, num_drafts=num_drafts, width=num_drafts, num_out=num_drafts, seed=seed)
        counts = res.accepted.sum(-1).tolist()
        pt = torch.tensor(p).flatten()[None]
        qr = restrict_to_parents(torch.tensor(q).flatten()[None], torch.tensor([valid]))
        dist = acceptance_count_distribution(residual_ladder(pt, qr, num_drafts)[1])[0].tolist()
        assert chi2_pvalue(counts, dict(enumerate(dist))) >= ALPHA


def _count_distribution(p: list[list[float]], q: list[list[float]], num_drafts: int) -> torch.Tensor:
    _, alpha = residual_ladder(torch.tensor(p), torch.tensor(q), num_drafts)
    return acceptance_count_distribution(alpha)[0]


def test_acceptance_count_dp_hand_cases():
    """Hand-computed K distributions: one acceptance blocks the rest; invalid mass gives a binomial."""
    # P = (1/2, 1/2), Q' = (1, 0): α_0 = 1/2 and, after any rejection, α = 0.
    torch.testing.assert_close(_count_distribution([[0.5, 0.5]], [[1.0, 0.0]], 3),
                               torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64))
    # P = (1, 0) on the valid parent, Q = 1/2 there and 1/2 on an invalid one: α_r = 1/2 for all r.
    qr = restrict_to_parents(torch.tensor([[0.5, 0.0, 0.5, 0.0]]), torch.tensor([[True, False]])).tolist()
    torch.testing.assert_close(_count_distribution([[1.0, 0.0, 0.0, 0.0]], qr, 3),
                               torch.tensor([1, 3, 3, 1], dtype=torch.float64) / 8)
    # Q' = P: every draft is accepted.
    torch.testing.assert_close(_count_distribution([[0.3, 0.7]], [[0.3, 0.7]], 2),
                               torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))


@pytest.mark.parametrize(("tau", "min_width", "expected"), [
    (0.6, 1, 1),    # Pr(K >= 1) = 0.5 < 0.6: nothing qualifies, min_width
    (0.6, 2, 2),
    (0.5, 1, 1),    # Pr(K >= 1) = 0.5 >= 0.5
    (0.3, 1, 1),    # Pr(K >= 2) = 0.25 < 0.3
    (0.25, 1, 2),   # Pr(K >= 2) = 0.25
    (0.2, 1, 2),
    (0.1, 1, 3),    # Pr(K >= 3) = 0.125
    (1.0, 1, 3),    # τ = 1: fixed width W
])
def test_width_rule_hand_cases(tau: float, min_width: int, expected: int):
    """w = max{k <= W : Pr(K >= k) >= τ}, at least min_width, on K ~ (1/2, 1/4, 1/8, 1/8)."""
    dist = torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=torch.float64)
    assert choose_width(dist, torch.tensor([tau]), min_width).tolist() == [expected]


def test_layer_stops_after_width_acceptances():
    """With Q = P every draft is accepted; the layer passes after exactly `width` of them."""
    p = [[0.2, 0.3, 0.5]]
    res = _layer(p, p, [True], num_drafts=4, width=2, num_out=4, seed=0)
    assert bool(res.passed.all())
    assert res.accepted.tolist() == [[True, True, False, False]] * NUM_ROWS
    assert res.out_count.tolist() == [2] * NUM_ROWS
    assert res.out_draft[:, :2].tolist() == [[0, 1]] * NUM_ROWS


def test_failed_layer_outputs_accepted_then_residual_then_fresh():
    """Failure output: accepted drafts first, then W_out - accepted target draws, none of them drafts."""
    p, q, valid = CRAFTED_P, CRAFTED_Q, VALID
    res = _layer(p, q, valid, num_drafts=3, width=3, num_out=3, seed=5)
    failed = ~res.passed
    accepted = res.accepted.sum(-1)
    slots = torch.arange(3)[None]
    is_draft = res.out_draft >= 0
    assert bool(failed.any())
    assert torch.equal(is_draft[failed], (slots < accepted[:, None])[failed])
    assert res.out_count[failed].eq(3).all()
    assert bool((res.out_index[failed] // 3 == 0).all()), "outputs come from valid parents only"


def test_memory_efficient_layer_outputs_one_slot():
    """num_out = 1: a failed layer outputs one beam, its first slot."""
    res = _layer(CRAFTED_P, CRAFTED_Q, VALID, num_drafts=3, width=3, num_out=1, seed=2)
    failed = ~res.passed
    assert res.out_count[failed].eq(1).all()
    first = [row[0] for row in res.out_index[:, :1].tolist()]
    expected = {i: x for i, x in enumerate(x for row in CRAFTED_P for x in row) if x > 0}
    assert chi2_pvalue(first, expected) >= ALPHA


def test_num_out_must_fit_the_drafts():
    """W_out larger than the number of drafts is refused with a clear error."""
    with pytest.raises(ValueError, match="num_out"):
        _layer(CRAFTED_P, CRAFTED_Q, VALID, num_drafts=2, width=2, num_out=3, seed=0)
