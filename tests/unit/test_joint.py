"""Joint beam distributions, top-k/top-p on the joint, and sampling, on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from exact_dist import restrict  # tests/unit/exact_dist.py: the reference enumeration

from vllm_dsbd.algorithm import (
    PROB_FLOOR,
    beam_search_score,
    joint_probs,
    probs_from_logprobs_,
    restrict_joint,
    sample_from_uniforms,
    sample_joint,
    tempered_logprobs,
)


def test_joint_weights_beams_by_score_times_token_probability():
    """P(b, v) = exp(S_b) p(v | b) / sum exp(S): beams weighted 1 : 3."""
    scores = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    token_lp = torch.tensor([[[0.5, 0.5], [0.1, 0.9]]]).log()
    probs = joint_probs(scores, torch.tensor([[True, True]]), token_lp)
    torch.testing.assert_close(probs, torch.tensor([[0.125, 0.125, 0.075, 0.675]]))


def test_joint_ignores_invalid_beams_and_empty_groups():
    """Invalid beam slots get zero mass whatever their rows hold; a group with none is all zeros."""
    scores = torch.tensor([[-1.0, 5.0], [0.0, 0.0]], dtype=torch.float64)
    token_lp = torch.tensor([[[0.2, 0.8], [float("nan"), 0.0]], [[0.5, 0.5], [0.5, 0.5]]]).log()
    probs = joint_probs(scores, torch.tensor([[True, False], [False, False]]), token_lp)
    torch.testing.assert_close(probs, torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(-200.0, 5.0, width=32), st.just(float("-inf"))), min_size=1, max_size=64))
def test_probabilities_are_exp_above_the_floor_and_zero_below(values):
    """``probs_from_logprobs_`` is ``exp`` wherever that exceeds ``PROB_FLOOR`` (a normal float32 number), and 0
    elsewhere (-inf included): it never returns a subnormal number, which x86 CPUs compute 20-200 times slower."""
    logp = torch.tensor(values, dtype=torch.float32)
    plain = logp.exp()
    probs = probs_from_logprobs_(logp.clone())
    above = plain > PROB_FLOOR
    assert torch.equal(probs[above], plain[above])
    assert bool((probs[~above] == 0).all())
    assert not bool(((probs > 0) & (probs < SMALLEST_NORMAL)).any())
    assert PROB_FLOOR >= SMALLEST_NORMAL


def test_joint_has_no_subnormal_mass():
    """A peaked joint whose tail lies far below float32's normal range: its tail is 0, the rest as ``exp``."""
    token_lp = torch.log_softmax(torch.linspace(0.0, 300.0, 1000), -1).reshape(1, 2, 500)
    scores = torch.tensor([[0.0, -10.0]], dtype=torch.float64)
    probs = joint_probs(scores, torch.tensor([[True, True]]), token_lp)
    plain = (torch.log_softmax(scores, -1).float()[:, :, None] + token_lp).exp().flatten(1)
    assert bool(((plain > 0) & (plain < SMALLEST_NORMAL)).any())  # the case exists
    assert not bool(((probs > 0) & (probs < SMALLEST_NORMAL)).any())
    kept = plain > PROB_FLOOR
    assert torch.equal(probs[kept], plain[kept])
    assert float(plain[~kept].double().sum()) < 1e-35


def test_temperature_one_is_the_plain_log_softmax():
    """At T = 1 the tempered log-probs skip the division, bit for bit what dividing by 1 gives."""
    logits = torch.randn(3, 97, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(tempered_logprobs(logits, 1.0), torch.log_softmax(logits.float() / 1.0, dim=-1))
    assert torch.equal(tempered_logprobs(logits, 1), torch.log_softmax(logits.float() / 1.0, dim=-1))


def test_joint_is_float32_for_bf16_logits():
    """bf16 logits give float32 maths equal to upcasting first."""
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)).bfloat16()
    lp = tempered_logprobs(logits, 0.7)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.log_softmax(logits.float() / 0.7, -1))
    probs = joint_probs(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), lp)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_temperature_sharpens_token_distribution():
    """p_T ∝ p^(1/T): probabilities (1/3, 2/3) at T = 0.5 become (1/5, 4/5)."""
    lp = tempered_logprobs(torch.tensor([0.0, math.log(2.0)]), 0.5)
    torch.testing.assert_close(lp.exp(), torch.tensor([0.2, 0.8]))


@pytest.mark.parametrize(("top_k", "top_p", "expected"), [
    (2, 1.0, [4 / 7, 3 / 7, 0, 0]),
    (0, 0.6, [4 / 7, 3 / 7, 0, 0]),    # mass before the 3rd pair is 0.7 >= 0.6
    (0, 0.75, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]),
    (3, 0.5, [4 / 7, 3 / 7, 0, 0]),    # top-p on the renormalised top-3: 0.444 < 0.5 keeps the 2nd
    (0, 1.0, [0.4, 0.3, 0.2, 0.1]),
])
def test_top_k_then_top_p_on_the_joint(top_k: int, top_p: float, expected: list[float]):
    """Top-k, then top-p on the renormalised remainder, restrict the joint's support (pairs in shuffled order)."""
    order = [2, 0, 3, 1]
    joint = torch.tensor([[0.4, 0.3, 0.2, 0.1]])[:, order].log()
    out = restrict_joint(joint, torch.tensor([top_k]), torch.tensor([top_p])).exp()
    torch.testing.assert_close(out, torch.tensor([expected])[:, order])


def test_top_k_ties_keep_lower_index():
    """Equal joint probabilities: the lower flat index (lower beam, then token) is kept."""
    joint = torch.tensor([[0.25, 0.25, 0.25, 0.25]]).log()
    out = restrict_joint(joint, torch.tensor([3]), None).exp()
    torch.testing.assert_close(out, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]]))


def test_restriction_is_per_group():
    """Each group uses its own top-k/top-p; 0 and 1.0 mean off."""
    joint = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]).log()
    out = restrict_joint(joint, torch.tensor([1, 0]), torch.tensor([1.0, 1.0])).exp()
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.3, 0.2]]))


def _tied_rows(num: int, levels: int, dead: float, hot: int, seed: int, heat: float = 9.0) -> torch.Tensor:
    """[3, num] normalised log-probs with few distinct values (ties), ``dead`` of them -inf and ``hot`` entries
    of each row ``heat`` above the rest (mass concentrated where top-p alone can stop early)."""
    gen = torch.Generator().manual_seed(seed)
    joint = torch.randint(0, levels, (3, num), generator=gen).float() * -0.7
    joint[torch.rand((3, num), generator=gen) < dead] = float("-inf")
    joint[:, torch.randint(num, (1,), generator=gen)] = 0.0  # every row has mass
    joint[:, torch.randint(num, (hot,), generator=gen)] = heat
    return joint - torch.logsumexp(joint, -1, keepdim=True)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(num=st.integers(1, 1500), levels=st.integers(1, 6), dead=st.floats(0.0, 0.9), hot=st.integers(0, 8),
       heat=st.sampled_from([3.0, 4.0, 5.0, 9.0]),
       seed=st.integers(0, 2**31 - 1), top_k=st.lists(st.integers(-1, 40), min_size=3, max_size=3),
       top_p=st.lists(st.sampled_from([1.0, 0.31415926535, 0.57721566490, 0.91893853320]), min_size=3, max_size=3))
def test_restriction_keeps_what_a_stable_sort_of_the_whole_row_keeps(num, levels, dead, hot, heat, seed, top_k,
                                                                     top_p):
    """Top-k, then top-p, as the reference enumeration does it (ties: lower index first), on rows full of ties
    and -inf entries, whether only the rows' shortlists are sorted (their top-k, or the top entries holding
    top-p of the mass, at most 1/8 of the row) or whole rows are, rows with top-k, top-p, both or neither
    mixed in one batch. (top-p values no sum of these probabilities hits exactly, where float rounding may
    decide either way.)"""
    joint = _tied_rows(num, levels, dead, hot, seed, heat)
    out = restrict_joint(joint, torch.tensor(top_k), torch.tensor(top_p)).exp().double()
    for row, k, p, got in zip(joint, top_k, top_p, out, strict=True):
        want = restrict(row.double().exp().tolist(), k, p)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.91893853320), (40, 0.57721566490)])
def test_a_restriction_that_fits_a_shortlist_never_sorts_whole_rows(monkeypatch, top_k, top_p):
    """Top-k of a few entries, or top-p held by a few hot entries of 4,096: no whole row is sorted (a whole-row
    sort of W x V pairs was most of a sampled beam step) and the result is the reference enumeration's."""
    from vllm_dsbd.algorithm import joint as joint_module

    def whole_row_sort(*args):
        raise AssertionError("sorted whole rows")

    monkeypatch.setattr(joint_module, "_keep_in_sorted_row", whole_row_sort)
    rows = _tied_rows(4096, 6, 0.2, 8, seed=3)
    out = restrict_joint(rows, torch.full((3,), top_k), torch.full((3,), top_p)).exp().double()
    for row, got in zip(rows, out, strict=True):
        want = restrict(row.double().exp().tolist(), top_k, top_p)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0)


def test_inverse_cdf_hits_each_index_in_proportion():
    """A uniform grid of u lands on index i for exactly a p_i share of the grid, never on zero-mass entries."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]])
    grid = (torch.arange(400, dtype=torch.float32)[None] + 0.5) / 400
    counts = torch.bincount(sample_from_uniforms(probs, grid)[0], minlength=6)
    assert counts.tolist() == [0, 100, 0, 200, 100, 0]
    edge = sample_from_uniforms(probs, torch.tensor([[0.0, 0.99999994]]))
    assert edge.tolist() == [[1, 4]]


def _one_level_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The textbook draw the two-level one must equal: one float64 cumulative sum over the whole row."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(num=st.integers(1, 5000), block=st.sampled_from([1, 3, 64, 1024]), zeros=st.floats(0.0, 0.99),
       seed=st.integers(0, 2**31 - 1))
def test_two_level_inverse_cdf_equals_one_cumulative_sum(num, block, zeros, seed):
    """Blocked sampling draws the same index as one float64 cumulative sum over the row, for any row length,
    block size and share of zero-mass entries (padding of the last block and empty blocks included)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand((3, num), generator=gen) * (torch.rand((3, num), generator=gen) >= zeros)
    probs[:, torch.randint(num, (1,), generator=gen)] += 1e-3  # every row has some mass
    u = torch.rand((3, 64), generator=gen)
    got = sample_from_uniforms(probs, u, block_size=block)
    want = _one_level_inverse_cdf(probs, u)
    assert bool((probs.gather(1, got) > 0).all())
    assert torch.equal(got, want)


def test_per_group_generators_do_not_depend_on_the_batch():
    """With one generator per group, a group's draws are the same alone or in a batch."""
    probs = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(1)), -1)
    batch = sample_joint(probs, 5, [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    alone = sample_joint(probs[1:2], 5, [torch.Generator().manual_seed(2)])
    assert torch.equal(batch[1:2], alone)
    with pytest.raises(ValueError, match="generators"):
        sample_joint(probs, 5, [torch.Generator()])


def test_beam_search_score_is_vllms():
    """cum / max(len - [ends with EOS], 1) ** length_penalty, len including the prompt."""
    score = beam_search_score(torch.tensor([-6.0, -6.0, -6.0]), torch.tensor([4, 4, 1]),
                              torch.tensor([False, True, True]), torch.tensor(0.5))
    torch.testing.assert_close(score, torch.tensor([-3.0, -6.0 / math.sqrt(3), -6.0], dtype=torch.float64))
