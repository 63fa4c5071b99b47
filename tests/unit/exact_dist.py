"""Exact distributions by enumeration, and the chi-square check, for the statistical tests.

Written independently of ``vllm_dsbd.algorithm`` (float64 maths from the toy
models' logits tables), so expected values never come from the code under test.

A *complete output* of beam sampling / DSBD for one prompt is the sorted tuple
of the generated token sequences of every hypothesis it returns with
``n=None``: every finished hypothesis plus the live beams at the end.
"""

from __future__ import annotations

import gc
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable
from contextlib import contextmanager
from functools import lru_cache
from itertools import combinations_with_replacement

import torch
from scipy.stats import chi2

Seq = tuple[int, ...]

ALPHA = 1e-3
"""Significance level of every statistical check (seeds are fixed, so verdicts are reproducible)."""


def token_logprobs_fn(model, prompt: Seq, temperature: float) -> Callable[[Seq], list[float]]:
    """Cached float64 ``log softmax(logits / T)`` after ``prompt + generated``."""

    @lru_cache(maxsize=None)
    def logprobs(generated: Seq) -> list[float]:
        logits = model([list(prompt) + list(generated)])[0].double()
        return torch.log_softmax(logits / temperature, dim=-1).tolist()

    return logprobs


def restrict(pairs: list[float], top_k: int, top_p: float) -> list[float]:
    """Top-k then top-p on a list of probabilities (ties: lower index first), renormalised."""
    order = sorted(range(len(pairs)), key=lambda i: (-pairs[i], i))
    keep = [i for i in order if pairs[i] > 0]
    if top_k > 0:
        keep = keep[:top_k]
    total = sum(pairs[i] for i in keep)
    if top_p < 1:
        kept, mass = [], 0.0
        for i in keep:
            if mass < top_p:
                kept.append(i)
            mass += pairs[i] / total
        keep = kept
    total = sum(pairs[i] for i in keep)
    out = [0.0] * len(pairs)
    for i in keep:
        out[i] = pairs[i] / total
    return out


def multiset_draws(dist: dict[Hashable, float], num: int) -> Iterable[tuple[tuple, float]]:
    """(sorted multiset of ``num`` i.i.d. draws, its probability)."""
    support = sorted(k for k, p in dist.items() if p > 0)
    for combo in combinations_with_replacement(support, num):
        counts = Counter(combo)
        coef = math.factorial(num)
        prob = 1.0
        for item, c in counts.items():
            coef //= math.factorial(c)
            prob *= dist[item] ** c
        yield combo, coef * prob


def exact_beam_sampling(model, prompt: Seq, width: int, max_tokens: int, temperature: float = 1.0,
                        top_k: int = 0, top_p: float = 1.0, eos: int | None = None,
                        ignore_eos: bool = False, uniform_parents: bool = False) -> dict[tuple[Seq, ...], float]:
    """Exact distribution of the complete output of beam sampling (docs/algorithm.md).

    ``uniform_parents`` gives a *wrong* procedure (every live beam weighted
    equally instead of by exp(score)), for checking that a test has power.
    """
    logprobs = token_logprobs_fn(model, prompt, temperature)

    @lru_cache(maxsize=None)
    def score(seq: Seq) -> float:
        return sum(logprobs(seq[:i])[t] for i, t in enumerate(seq))

    states: dict[tuple[tuple[Seq, ...], tuple[Seq, ...]], float] = {((( ),), ()): 1.0}
    for _ in range(max_tokens):
        new_states: dict = defaultdict(float)
        for (live, finished), prob in states.items():
            if not live:
                new_states[(live, finished)] += prob
                continue
            beam_w = [1.0 if uniform_parents else math.exp(score(seq)) for seq in live]
            total_w = sum(beam_w)
            pairs, seqs = [], []
            for seq, w in zip(live, beam_w):
                for tok, lp in enumerate(logprobs(seq)):
                    pairs.append(w / total_w * math.exp(lp))
                    seqs.append(seq + (tok,))
            seq_dist: dict[Seq, float] = defaultdict(float)
            for s, p in zip(seqs, restrict(pairs, top_k, top_p)):
                seq_dist[s] += p
            for combo, p in multiset_draws(seq_dist, width):
                done = tuple(s for s in combo if s[-1] == eos and not ignore_eos)
                alive = tuple(s for s in combo if not (s[-1] == eos and not ignore_eos))
                new_states[(alive, tuple(sorted(finished + done)))] += prob * p
        states = new_states
    outcomes: dict[tuple[Seq, ...], float] = defaultdict(float)
    for (live, finished), prob in states.items():
        outcomes[tuple(sorted(live + finished))] += prob
    return dict(outcomes)


def exact_sequences(model, prompt: Seq, length: int, temperature: float = 1.0) -> dict[Seq, float]:
    """Exact distribution of ``length`` ancestrally sampled tokens (no EOS)."""
    logprobs = token_logprobs_fn(model, prompt, temperature)
    dist = {(): 1.0}
    for _ in range(length):
        dist = {s + (t,): p * math.exp(lp) for s, p in dist.items() for t, lp in enumerate(logprobs(s))}
    return dist


def chi2_statistic(samples: Iterable[Hashable], expected: dict[Hashable, float],
                   min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; every cell expected under ``min_expected`` times is
    pooled into one cell (with the smallest regular cell too if the pool stays under it).

    An observed outcome with expected probability 0 gives an infinite statistic.
    """
    counts = Counter(samples)
    n = sum(counts.values())
    if any(expected.get(o, 0.0) <= 0 for o in counts):
        return math.inf, 1
    cells = sorted((p * n, counts.get(o, 0)) for o, p in expected.items() if p > 0)
    small = [c for c in cells if c[0] < min_expected]
    cells = cells[len(small):]
    pooled_e, pooled_o = sum(e for e, _ in small), sum(o for _, o in small)
    if 0 < pooled_e < min_expected and cells:
        e, o = cells.pop(0)
        pooled_e, pooled_o = pooled_e + e, pooled_o + o
    if pooled_e > 0:
        cells.append((pooled_e, pooled_o))
    stat = sum((o - e) ** 2 / e for e, o in cells)
    return stat, max(len(cells) - 1, 1)


def chi2_pvalue(samples: Iterable[Hashable], expected: dict[Hashable, float]) -> float:
    """Goodness-of-fit p-value of ``samples`` against the exact ``expected`` distribution."""
    stat, dof = chi2_statistic(samples, expected)
    return float(chi2.sf(stat, dof))


def combined_pvalue(groups: Iterable[tuple[list[Hashable], dict[Hashable, float]]]) -> float:
    """One chi-square over several conditional distributions (statistics and dofs add up)."""
    stat, dof = 0.0, 0
    for samples, expected in groups:
        s, d = chi2_statistic(samples, expected)
        stat, dof = stat + s, dof + d
    return float(chi2.sf(stat, dof))


@contextmanager
def no_gc():
    """The batched reference makes many small lists; cyclic GC passes over them dominate its time."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
