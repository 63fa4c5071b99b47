"""T 0's bound: a target beam the draft missed is left out when nothing it could grow can matter.

``verify_forest_greedy`` passes a layer whose missing beams are *left out*: (a) every hypothesis such a beam's
children could finish scores below the ``n``-th best finished so far (``prune_floor``), and (b) every live
child scores below the W-th beam the kept beams make in the next step (checked once that step is computed; if
it fails, the layer did not pass). These tests hold it to vLLM's beam search token for token, on random toy
pairs made to miss beams (widths 2-16, length penalties 0.5 / 1 / 2, EOS, ``ignore_eos``, stop tokens and stop
strings, ``n`` 1 or W), through the reference decoder and through the engine's own group and verification
code (``benchmarks.toy_engine``), and on hand-made cases at each edge. Each planted bug (the rule's source
with one comparison changed) is rejected by the test that names it.
"""

from __future__ import annotations

import inspect
import math
import random
import sys
import types

import pytest
import torch

from benchmarks import toy_engine
from vllm_dsbd.algorithm import DecodeParams, beam_search, dsbd_decode, reference, verify_greedy
from vllm_dsbd.algorithm.toy import MarkovLM, perturbed_draft, random_markov
from vllm_dsbd.engine import verify_step

B_UNCHECKED = ("confirmed = step.valid.all(-1) & (left_out_best < step.scores.min(-1).values)",
               "confirmed = step.valid.any(-1)")
B_TIES = ("left_out_best < step.scores", "left_out_best <= step.scores")
A_IGNORED = ("left_out = step.valid & ~found & (finished_bound < _below(prune_floor)[:, None])",
             "left_out = step.valid & ~found")
A_NO_MARGIN = ("finished_bound < _below(prune_floor)", "finished_bound <= prune_floor")
ROLLBACK_KEEPS_HYPOTHESES = ("fin_valid.append(step.finished_valid & active[:, None])",
                             "fin_valid.append(step.finished_valid)")


def _planted(old: str, new: str):
    """``verify_forest_greedy`` compiled from its source with ``old`` replaced by ``new``."""
    source = inspect.getsource(verify_greedy)
    assert source.count(old) == 1, old
    module = types.ModuleType("planted_verify_greedy")
    sys.modules[module.__name__] = module  # its dataclass looks its module up
    exec(compile(source.replace(old, new), module.__name__, "exec"), module.__dict__)
    return module.verify_forest_greedy


def _use(monkeypatch, rule) -> dict[str, int]:
    """Make the reference decoder and the engine's verification call ``rule``; count the layers it passes
    that the rule without the bound (``prune_floor`` None) does not, and those with a finite floor."""
    gained = {"layers": 0, "finite_floor": 0}

    def counting(*args, **kwargs):
        res = rule(*args, **kwargs)
        floor = kwargs.pop("prune_floor", args[14] if len(args) > 14 else None)
        base = verify_greedy.verify_forest_greedy(*args[:14], **kwargs)
        more = res.num_passed > base.num_passed
        gained["layers"] += int(more.sum())
        gained["finite_floor"] += int((more & floor.isfinite()).sum())
        return res

    monkeypatch.setattr(reference, "verify_forest_greedy", counting)
    monkeypatch.setattr(verify_step, "verify_forest_greedy", counting)
    return gained


def _random_config(rng: random.Random, stop_strings: bool):
    vocab = rng.choice([6, 10, 16, 40])
    target = random_markov(vocab, order=rng.choice([1, 2]), seed=rng.randrange(10**6), scale=rng.choice([1.5, 3.0]))
    eos = vocab - 1 if rng.random() < 0.8 else None
    if eos is not None:  # EOS strong in some contexts: hypotheses finish, and floors form
        boost = torch.rand(target.table.shape[0], generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        target = MarkovLM(target.table.index_add(1, torch.tensor([eos]), 6 * boost[:, None] - 2), target.order)
    draft = perturbed_draft(target, rng.choice([0.8, 0.9, 0.95]), seed=rng.randrange(10**6))
    width = rng.choice([2, 3, 4, 6, 8, 16])  # at W 1 a missed beam is every beam: nothing is left out
    pair = (rng.randrange(vocab), rng.randrange(vocab))
    params = DecodeParams(
        beam_width=width, num_speculative_tokens=rng.choice([1, 2, 3]), temperature=0.0,
        max_tokens=rng.randint(4, 12), eos_token_id=eos, ignore_eos=rng.random() < 0.3,
        length_penalty=rng.choice([0.5, 1.0, 2.0]), n=rng.choice([1, width]),
        stop_token_ids=(rng.randrange(vocab),) if rng.random() < 0.3 else (),
        stop_fn=(lambda gen, tok: bool(gen) and (gen[-1], tok) == pair) if stop_strings and rng.random() < 0.2
        else None)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(2)]
    return target, draft, params, prompts


def _decode(path: str, target, draft, prompts, params: DecodeParams) -> list[list[tuple[tuple[int, ...], float]]]:
    """(tokens, cum log-prob) of each prompt's hypotheses, best first, by the reference decoder or the engine."""
    if path == "reference":
        return [[(h.token_ids, h.cum_logprob) for h in hyps]
                for hyps in dsbd_decode(target, draft, prompts, params).hypotheses]
    p = toy_engine.params(beam_width=params.beam_width, n=params.n, length_penalty=params.length_penalty,
                          max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                          eos_token_id=params.eos_token_id, num_speculative_tokens=params.num_speculative_tokens,
                          stop_token_ids=params.stop_token_ids)
    return [[(h.tokens, h.cum_score) for h in toy_engine.run_dsbd(target, draft, prompt, p)] for prompt in prompts]


def _mismatches(path: str, configs: int, seed: int = 123) -> int:
    """Random configs whose DSBD hypotheses differ from beam search's (tokens, or cum log-probs by > 1e-9)."""
    rng, bad = random.Random(seed), 0
    for _ in range(configs):
        target, draft, params, prompts = _random_config(rng, stop_strings=path == "reference")
        want = [[(h.token_ids, h.cum_logprob) for h in hyps] for hyps in beam_search(target, prompts, params)]
        got = _decode(path, target, draft, prompts, params)
        bad += any([t for t, _ in w] != [t for t, _ in g] or any(abs(a - b) > 1e-9 for (_, a), (_, b) in zip(w, g))
                   for w, g in zip(want, got))
    return bad


@pytest.mark.parametrize("path", ["reference", "engine"])
def test_left_out_beams_keep_speculative_beam_search_exact(path: str, monkeypatch):
    """100 random configs made to miss beams: beam search's hypotheses exactly, and the bound passed layers
    today's rule does not, some of them where hypotheses could finish (a finite floor)."""
    gained = _use(monkeypatch, verify_greedy.verify_forest_greedy)
    assert _mismatches(path, 100) == 0
    assert gained["layers"] >= 10 and gained["finite_floor"] >= 3, gained


def test_the_random_configs_reject_an_unchecked_next_step(monkeypatch):
    """Planted: (b) never checked (a left-out beam's live children assumed never to rank)."""
    _use(monkeypatch, _planted(*B_UNCHECKED))
    assert _mismatches("reference", 100) > 0


def _table(rows: dict[int, dict[int, float]], vocab: int) -> MarkovLM:
    """First-order model: the given rows' probabilities (the rest of each given row at e^-30), nearly flat
    random rows elsewhere (no ties) in which token 0, the prompt, is never drawn again."""
    table = 0.3 * torch.randn((vocab, vocab), generator=torch.Generator().manual_seed(0))
    table[:, 0] = -30.0
    for ctx, probs in rows.items():
        table[ctx] = -30.0
        for tok, p in probs.items():
            table[ctx, tok] = math.log(p)
    return MarkovLM(table, 1)


def _tie_case():
    """W 3 from [0]: beams 1 (p .5), then 2 and 3 (.125 each, tied; 2 first by token id). The draft proposes
    1, 3 and 4: it misses 2. Step 2 from the kept beams: 1 -> 5, 6 (.5 each), 3 -> 8 (p 1): the third of them
    ties 2 -> 7 (p 1) exactly, and 2's child comes first in vLLM's order, so 2 may not be left out."""
    target = _table({0: {1: .5, 2: .125, 3: .125, **{t: .25 / 12 for t in range(4, 16)}},
                     1: {5: .5, 6: .5}, 2: {7: 1.0}, 3: {8: 1.0}, 7: {10: 1.0}}, 16)
    draft = _table({0: {1: .4, 3: .3, 4: .2, 2: .01}}, 16)
    return target, draft


@pytest.mark.parametrize("path", ["reference", "engine"])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
def test_a_tie_at_the_wth_place_keeps_the_missed_beam(path: str, length_penalty: float, monkeypatch):
    target, draft = _tie_case()
    params = DecodeParams(beam_width=3, num_speculative_tokens=1, temperature=0.0, max_tokens=3,
                          eos_token_id=None, n=3, length_penalty=length_penalty)
    want = [[(h.token_ids, h.cum_logprob) for h in beam_search(target, [[0]], params)[0]]]
    assert any(t[:2] == (2, 7) for t, _ in want[0])  # the missed beam's child is among the results
    assert _decode(path, target, draft, [[0]], params) == want
    monkeypatch.setattr(reference, "verify_forest_greedy", _planted(*B_TIES))
    monkeypatch.setattr(verify_step, "verify_forest_greedy", _planted(*B_TIES))
    assert _decode(path, target, draft, [[0]], params) != want  # planted: `<=` in (b)


def _eos_case():
    """W 2 from [0]: beams 1 (p .6) and 2 (p .2); the draft proposes 1 and 3, missing 2. 1's children (p .3
    each) outrank all of 2's, but 2 ends with EOS (15) at p .99: its hypothesis beats every longer beam."""
    target = _table({0: {1: .6, 2: .2, 3: .05, **{t: .15 / 11 for t in range(4, 15)}}, 2: {15: .99, 9: .01},
                     1: {5: .5, 6: .5}, 5: {9: .3, 10: .3, 11: .4}, 6: {9: .3, 10: .3, 11: .4}}, 16)
    draft = _table({0: {1: .5, 3: .4, 2: .01}}, 16)
    return target, draft


@pytest.mark.parametrize("path", ["reference", "engine"])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0])
def test_a_missed_beam_whose_eos_hypothesis_wins_is_not_left_out(path: str, length_penalty: float, monkeypatch):
    target, draft = _eos_case()
    params = DecodeParams(beam_width=2, num_speculative_tokens=1, temperature=0.0, max_tokens=5, eos_token_id=15,
                          n=2, length_penalty=length_penalty)
    want = [[(h.token_ids, h.cum_logprob) for h in beam_search(target, [[0]], params)[0]]]
    assert want[0][0][0] == (2, 15)  # the missed beam's EOS hypothesis wins
    assert _decode(path, target, draft, [[0]], params) == want
    monkeypatch.setattr(reference, "verify_forest_greedy", _planted(*A_IGNORED))
    monkeypatch.setattr(verify_step, "verify_forest_greedy", _planted(*A_IGNORED))
    assert _decode(path, target, draft, [[0]], params) != want  # planted: (a) not asked


def _verify(rule, table: torch.Tensor, floor: float, eos: int | None = None):
    """One group, W 3, γ 1, root scores 0 and prompt length 1: ``table`` [2, 3, V] raw target log-probs at the
    root and at the draft's layer-1 nodes 1, 3, 4 (the tie case's draft)."""
    return rule(table[None], torch.zeros(1, 3, dtype=torch.float64), torch.tensor([[True, False, False]]),
                torch.zeros(1, 1, 3, dtype=torch.long), torch.tensor([[[1, 3, 4]]]),
                torch.ones(1, 1, 3, dtype=torch.bool), torch.tensor([1]), torch.tensor([1]), 3, eos, torch.tensor([False]),
                torch.tensor([1.0], dtype=torch.float64), (), None, torch.tensor([floor], dtype=torch.float64))


def _tie_table_with_eos() -> torch.Tensor:
    """The tie case's target log-probs, as ``_verify`` takes them, with beam 1 ending in EOS (15) at p .1."""
    target, _ = _tie_case()
    rows = torch.log_softmax(target.table, -1)
    first = torch.full((16,), -30.0)
    first[5], first[6], first[15] = math.log(.45), math.log(.45), math.log(.1)
    return torch.stack([torch.stack([rows[0]] * 3), torch.stack([first, rows[3], rows[4]])])


def test_a_left_out_beam_whose_check_fails_drops_the_next_steps_hypotheses():
    """The tie case with EOS in step 2 and a floor that lets beam 2 go: (b) fails (the tie), so layer 1 did not
    pass and step 2's EOS hypothesis never was. Planted: the rolled-back step's hypotheses kept."""
    table = _tie_table_with_eos()
    res = _verify(verify_greedy.verify_forest_greedy, table, floor=0.0, eos=15)
    assert res.num_passed.tolist() == [0] and not res.finished_valid[0, 1].any()
    assert res.out_token[0].tolist() == [1, 2, 3]  # step 1's beams, the missed one included
    planted = _verify(_planted(*ROLLBACK_KEEPS_HYPOTHESES), table, floor=0.0, eos=15)
    assert planted.num_passed.tolist() == [0] and planted.finished_valid[0, 1].any()


def test_the_floor_is_strict_with_a_margin():
    """EOS 9; beam 1's children 5, 6, 7 (p 1/3 each) outrank every child of the missed beam 2, so (b) holds;
    beam 2 is left out exactly when its finished children's bound (log .125 over its length 2) is below the
    floor less 1e-9 of it. Planted: `<=` and no margin, which lets a hypothesis tie the floor."""
    target, _ = _tie_case()
    rows = torch.log_softmax(target.table, -1)
    strong = torch.full((16,), -30.0)
    strong[5] = strong[6] = strong[7] = math.log(1 / 3)
    table = torch.stack([torch.stack([rows[0]] * 3), torch.stack([strong, rows[3], rows[4]])])
    bound = float(rows[0, 2].double()) / 2
    for floor, left_out in [(bound * (1 - 2e-9), True), (bound * (1 - 1e-10), False), (bound, False)]:
        res = _verify(verify_greedy.verify_forest_greedy, table, floor, eos=9)
        assert res.num_passed.tolist() == [int(left_out)], floor
        assert res.beam_nodes[0, 0].tolist() == ([0, -1, 1] if left_out else [-1, -1, -1])
    assert _verify(_planted(*A_NO_MARGIN), table, bound, eos=9).num_passed.tolist() == [1]
