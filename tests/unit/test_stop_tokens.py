"""Stop tokens (``SamplingParams.stop_token_ids``) on beam requests: a hypothesis whose new token is a stop
token finishes exactly as one that drew EOS, also with ``ignore_eos``; speculative = non-speculative."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_dsbd.algorithm.reference import DecodeParams, beam_sampling, beam_search, dsbd_decode
from vllm_dsbd.algorithm.toy import MarkovLM, random_markov
from vllm_dsbd.engine.beam_group import BeamParams

from test_beam_step import _decode_with_engine_steps
from test_spec_iterations import perturbed_draft, run_dsbd


def prone(vocab: int, seed: int, tokens: tuple[int, ...], bias: float = 2.0) -> MarkovLM:
    """A toy target that often proposes ``tokens`` (EOS and stop tokens show up within a few steps)."""
    model = random_markov(vocab, order=2, seed=seed)
    table = model.table.clone()
    table[:, list(tokens)] += bias
    return MarkovLM(table, model.order)


def as_eos_and_as_stop(eos: int, **kw) -> tuple[DecodeParams, DecodeParams]:
    """The same decoding with ``eos`` as the EOS token, and with no EOS but ``eos`` as a stop token."""
    base = DecodeParams(eos_token_id=eos, **kw)
    return base, dataclasses.replace(base, eos_token_id=None, stop_token_ids=(eos,))


@pytest.mark.parametrize("width, length_penalty, seed", [(1, 1.0, 0), (2, 0.5, 1), (3, 1.0, 2), (4, 2.0, 3)])
def test_a_stop_token_finishes_and_ranks_exactly_as_eos_in_beam_search(width, length_penalty, seed):
    model = prone(7, seed, (0, 4))
    as_eos, as_stop = as_eos_and_as_stop(4, beam_width=width, temperature=0.0, max_tokens=6,
                                         length_penalty=length_penalty, num_speculative_tokens=0)
    want, got = (beam_search(model, [[1, 3]], p)[0] for p in (as_eos, as_stop))
    assert [(h.token_ids, h.score) for h in got] == [(h.token_ids, h.score) for h in want]
    assert any(h.token_ids[-1] == 4 for h in got)  # the comparison covers finished hypotheses


def test_stop_tokens_finish_beside_eos_and_despite_ignore_eos():
    model = prone(8, 5, (0, 3, 6))
    for ignore_eos in (False, True):
        p = DecodeParams(beam_width=4, temperature=0.0, max_tokens=7, eos_token_id=0, ignore_eos=ignore_eos,
                         stop_token_ids=(3, 6), num_speculative_tokens=0)
        hyps = beam_search(model, [[1, 2]], p)[0]
        ends = {h.token_ids[-1] for h in hyps if len(h.token_ids) < 7}
        assert ends and ends <= ({3, 6} if ignore_eos else {0, 3, 6})
        for h in hyps:  # nothing goes on after a stop token
            assert not set(h.token_ids[:-1]) & {3, 6}
            assert ignore_eos or 0 not in h.token_ids[:-1]


def test_beam_sampling_with_a_stop_token_draws_as_with_that_token_as_eos():
    model = prone(6, 7, (2,))
    as_eos, as_stop = as_eos_and_as_stop(2, beam_width=3, temperature=0.9, max_tokens=6, num_speculative_tokens=0)
    for seed in range(20):
        want, got = (beam_sampling(model, [[1]], p, torch.Generator().manual_seed(seed))[0]
                     for p in (as_eos, as_stop))
        assert [(h.token_ids, h.score) for h in got] == [(h.token_ids, h.score) for h in want]


@pytest.mark.parametrize("temperature, fixed_width", [(0.0, True), (1.0, True), (1.0, False)])
def test_reference_dsbd_with_a_stop_token_equals_dsbd_with_it_as_eos(temperature, fixed_width):
    target = prone(6, 11, (0, 5))
    draft = perturbed_draft(target, 0.7, seed=12)
    as_eos, as_stop = as_eos_and_as_stop(5, beam_width=3, temperature=temperature, max_tokens=7,
                                         num_speculative_tokens=2, fixed_width=fixed_width, width_threshold=0.7)
    for seed in range(5):
        want, got = (dsbd_decode(target, draft, [[1, 2]], p, torch.Generator().manual_seed(seed)).hypotheses[0]
                     for p in (as_eos, as_stop))
        assert [(h.token_ids, h.score) for h in got] == [(h.token_ids, h.score) for h in want]


def engine_params(**kw) -> BeamParams:
    base = dict(beam_width=3, n=3, temperature=0.0, top_k=0, top_p=1.0, length_penalty=1.0, max_tokens=7,
                ignore_eos=False, eos_token_id=0, num_logprobs=-1, seed=0)
    return BeamParams(**{**base, **kw})


@pytest.mark.parametrize("ignore_eos, gamma, seed", [(False, 0, 0), (True, 0, 1), (False, 2, 4), (True, 3, 3), (False, 1, 6)])
def test_engine_steps_with_stop_tokens_equal_the_extended_reference(ignore_eos, gamma, seed):
    """T = 0: BeamGroup + the runner's decisions (beam steps, or draft layers and verification) with stop
    tokens equal the reference beam search extended with the same rule."""
    target = prone(7, seed, (0, 3, 5))
    prompt, stops = [1, 2], (3, 5)
    ref = beam_search(target, [prompt], DecodeParams(beam_width=3, temperature=0.0, max_tokens=7, eos_token_id=0,
                                                     ignore_eos=ignore_eos, stop_token_ids=stops,
                                                     num_speculative_tokens=0))[0]
    p = engine_params(ignore_eos=ignore_eos, stop_token_ids=stops, num_speculative_tokens=gamma)
    if gamma == 0:
        ours = _decode_with_engine_steps(target, prompt, p)
    else:
        ours = run_dsbd(target, perturbed_draft(target, 0.8, seed=seed + 50), prompt, p)
    assert [h.tokens for h in ours] == [h.token_ids for h in ref]
    assert [h.cum_score for h in ours] == pytest.approx([h.cum_logprob for h in ref], abs=1e-6)
    assert any(h.tokens[-1] in stops for h in ours)


# ---------------------------------------------------------------------------
# Stop strings: a toy tokenizer whose pieces can complete "ab" inside one token or across two.
# ---------------------------------------------------------------------------

PIECES = ["", "a", "b", "c", "ab", "ba", "x"]  # token 0 is EOS (decodes to nothing)
STOP = "ab"


def toy_decode(tokens) -> str:
    return "".join(PIECES[t] for t in tokens)


def reference_completes(generated, token) -> bool:
    """The rule on the whole generated text (the engine sees only a tail of it)."""
    return STOP in toy_decode([*generated, token])


def stops():
    from vllm_dsbd.engine.stops import StopCheckers

    return StopCheckers(lambda: toy_decode)


def test_stop_string_checker_sees_completions_inside_a_token_and_across_tokens():
    from vllm_dsbd.engine.stops import StopStrings

    checker = StopStrings(toy_decode, (STOP,))
    assert checker.completes([3], 4) and checker.completes([1], 2) and checker.completes([1], 5)
    assert not checker.completes([2], 1) and not checker.completes([], 1) and not checker.completes([4], 3)
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(toy_decode, ("",))


@pytest.mark.parametrize("width, gamma, seed", [(2, 0, 0), (3, 0, 1), (3, 2, 2), (4, 3, 3), (2, 1, 4)])
def test_stop_string_beam_search_in_engine_steps_equals_the_extended_reference(width, gamma, seed):
    """T = 0: the runner's decisions from beam tails equal the reference on whole texts; speculative =
    non-speculative; no returned hypothesis holds the stop string except at its end."""
    target = prone(7, seed, (1, 2, 4))
    prompt = [3, 1]  # the prompt's text is never searched
    ref = beam_search(target, [prompt], DecodeParams(beam_width=width, temperature=0.0, max_tokens=7, eos_token_id=0,
                                                     stop_fn=reference_completes, num_speculative_tokens=0))[0]
    p = engine_params(beam_width=width, n=width, stop=(STOP,), num_speculative_tokens=gamma)
    if gamma == 0:
        ours = _decode_with_engine_steps(target, prompt, p, stops=stops())
    else:
        ours = run_dsbd(target, perturbed_draft(target, 0.7, seed=seed + 50), prompt, p, stops=stops())
    assert [h.tokens for h in ours] == [h.token_ids for h in ref]
    assert [h.cum_score for h in ours] == pytest.approx([h.cum_logprob for h in ref], abs=1e-6)
    assert [h.score for h in ours] == pytest.approx([h.score for h in ref], abs=1e-9)  # ranked as EOS
    ended = [h for h in ours if h.finish_reason == "stop_string"]
    assert ended and all(STOP in toy_decode(h.tokens) for h in ended)
    for h in ours:
        assert STOP not in toy_decode(h.tokens[:-1])


def test_reference_dsbd_with_a_stop_string_equals_reference_beam_search():
    target = prone(7, 9, (1, 2, 4))
    draft = perturbed_draft(target, 0.7, seed=10)
    base = DecodeParams(beam_width=3, n=3, temperature=0.0, max_tokens=7, eos_token_id=0,
                        stop_fn=reference_completes, num_speculative_tokens=0)
    want = beam_search(target, [[3]], base)[0]
    got = dsbd_decode(target, draft, [[3]], dataclasses.replace(base, num_speculative_tokens=2)).hypotheses[0]
    assert [(h.token_ids, h.score) for h in got] == [(h.token_ids, h.score) for h in want]
    assert any(STOP in toy_decode(h.token_ids) for h in got)


def test_sampled_stop_string_that_is_one_token_draws_as_that_stop_token():
    """T > 0, beam steps: stop string "x" (only token 6 holds an x) gives the draws of stop token 6."""
    target = prone(7, 12, (6,))
    for seed in range(20):
        outs = []
        for kw in ({"stop": ("x",)}, {"stop_token_ids": (6,)}):
            hyps = _decode_with_engine_steps(target, [1], engine_params(temperature=1.0, seed=seed, **kw),
                                             stops=stops())
            outs.append([(h.tokens, round(h.score, 9)) for h in hyps])
        assert outs[0] == outs[1]


def test_fixed_width_dsbd_with_a_stop_string_is_distributed_as_beam_sampling():
    """T > 0 through draft layers and verification (the draft ignores stop strings; verification does
    not): complete outputs against exact beam sampling in which the stop string's token finishes
    (4,000 seeds); the same samples reject the planted bug of uniform parent weights."""
    from exact_dist import chi2_pvalue, exact_beam_sampling
    from vllm_dsbd.engine.stops import StopCheckers

    target = random_markov(4, order=2, seed=11)
    draft = perturbed_draft(target, 0.5, seed=12)
    checkers = StopCheckers(lambda: lambda tokens: "".join("abcx"[t] for t in tokens))
    prompt, width, max_tokens = [1], 2, 4
    samples = []
    for seed in range(4000):
        hyps = run_dsbd(target, draft, prompt, engine_params(
            beam_width=width, n=64, max_tokens=max_tokens, temperature=1.0, eos_token_id=None, stop=("x",),
            num_speculative_tokens=2, seed=seed), stops=checkers)  # n = 64: every hypothesis, as counted below
        samples.append(tuple(sorted(h.tokens for h in hyps)))
    assert any(3 in s for hyps in samples for s in hyps)
    expected = exact_beam_sampling(target, tuple(prompt), width, max_tokens, eos=3)
    assert chi2_pvalue(samples, expected) > 1e-3
    wrong = exact_beam_sampling(target, tuple(prompt), width, max_tokens, eos=3, uniform_parents=True)
    assert chi2_pvalue(samples, wrong) < 1e-3


def test_the_runners_stop_checker_cache_keeps_the_most_recently_used_sets_only():
    """A server sees a new stop set with every request that brings one: the cache stays bounded (LRU)."""
    from vllm_dsbd.engine.stops import StopCheckers

    checkers = StopCheckers(lambda: toy_decode, max_checkers=3)
    first = checkers.get([STOP])
    for k in range(5):
        checkers.get([f"x{k}"])
        checkers.get([STOP])  # used again: stays
    assert len(checkers) == 3
    assert checkers.get([STOP]) is first
    assert checkers.get([]) is None and len(checkers) == 3
