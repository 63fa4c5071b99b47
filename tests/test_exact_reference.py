"""The simulation ``benchmarks.exact_reference`` compares the engine with: exact beam sampling on a bigram."""

from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

from benchmarks.exact_reference import compare, simulate  # noqa: E402


def _table(vocab: int = 3, seed: int = 0):
    logits = torch.randn((vocab, vocab), generator=torch.Generator().manual_seed(seed)) * 1.5
    return logits.log_softmax(-1)


def _exact_w2_l2(table, first: int) -> tuple[float, float]:
    """E[best] and E[mean] per-token log-prob of width-2 beam sampling over 2 tokens, by enumeration."""
    vocab = table.shape[0]
    best = mean = 0.0
    for a in itertools.product(range(vocab), repeat=2):  # step 1: two i.i.d. draws from p(. | first)
        pa = math.exp(table[first, a[0]] + table[first, a[1]])
        joint = [(float(table[first, a[b]] + table[a[b], t])) for b in range(2) for t in range(vocab)]
        z = sum(math.exp(s) for s in joint)
        for j in itertools.product(range(len(joint)), repeat=2):  # step 2: two i.i.d. draws from the joint
            pj = math.exp(joint[j[0]]) * math.exp(joint[j[1]]) / z ** 2
            scores = [joint[j[0]] / 2, joint[j[1]] / 2]
            best += pa * pj * max(scores)
            mean += pa * pj * sum(scores) / 2
    return best, mean


def _check(out, table) -> bool:
    """Whether the simulation's best and mean beams agree with the enumeration within 4 standard errors."""
    best, mean = _exact_w2_l2(table, 0)
    ok = True
    for stat, exact in (("best", best), ("mean", mean)):
        m = sum(out[stat]) / len(out[stat])
        sd = math.sqrt(sum((x - m) ** 2 for x in out[stat]) / len(out[stat]))
        ok &= abs(m - exact) < 4 * sd / math.sqrt(len(out[stat]))
    return ok


def test_simulate_matches_width_2_beam_sampling_enumerated():
    table = _table()
    assert _check(simulate(lambda tokens: table[tokens], 0, width=2, length=2, samples=40000, seed=1,
                           batch=5000), table)


def test_the_check_rejects_drawing_without_replacement(monkeypatch):
    """Planted in the simulation: a step's W draws without replacement (distinct beams, as beam search keeps
    them), not beam sampling's i.i.d. draws. The same check rejects it."""
    from benchmarks import exact_reference

    table = _table()
    monkeypatch.setattr(exact_reference, "_draw", lambda joint, width, gen: torch.multinomial(
        joint.softmax(-1), width, replacement=False, generator=gen))
    assert not _check(simulate(lambda tokens: table[tokens], 0, width=2, length=2, samples=40000, seed=1,
                               batch=5000), table)


def test_compare_gives_each_method_its_distance_from_the_reference():
    records = [{"beam_best": -1.0 + 0.1 * (i % 2), "dsbd_best": -0.5 + 0.1 * (i % 2),
                "beam_mean": -1.0, "dsbd_mean": -1.0 + 0.01 * (i % 3)} for i in range(100)]
    reference = {"best": [-0.95 + 0.1 * (i % 2) for i in range(100)], "mean": [-1.0 + 0.01 * (i % 3) for i in range(100)]}
    out = compare(records, reference)
    assert out["best"]["beam"]["diff"] == pytest.approx(-0.05)
    assert out["best"]["dsbd"]["diff"] == pytest.approx(0.45)
    assert out["best"]["dsbd"]["z"] > 10 and out["best"]["beam"]["z"] < -3
    assert out["mean"]["dsbd"]["diff"] == pytest.approx(0.0, abs=1e-12)
