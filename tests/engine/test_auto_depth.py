"""auto_depth inside real engines: the depth each iteration gets changes speed, never the result.

References as in test_dsbd_engine.py: vLLM's built-in ``LLM.beam_search`` (T = 0) and exact
enumeration of beam sampling (T > 0, fixed width). The engines are the session's speculative ones.
"""

from __future__ import annotations

import pytest
from beam_checks import (  # tests/engine/beam_checks.py
    PROMPTS, assert_distributed_as_beam_sampling, assert_kv_freed_after_finish_and_abort, beam_search,
    engine_metric, recording_policy, start_spec_llm)

pytestmark = pytest.mark.engine


def _auto_request(width, max_tokens, temperature=0.0, **kw):
    from vllm import SamplingParams

    return SamplingParams(n=width, temperature=temperature, max_tokens=max_tokens, logprobs=0,
                          extra_args={"beam_width": width, "auto_depth": True, **kw.pop("extra", {})}, **kw)


def _assert_same_as_beam_search(want, got):
    for w, g in zip(want, got):
        prompt_len = len(g.prompt_token_ids)
        assert [list(c.token_ids) for c in g.outputs] == [s.tokens[prompt_len:] for s in w.sequences]
        assert [c.cumulative_logprob for c in g.outputs] == pytest.approx(
            [s.cum_logprob for s in w.sequences], abs=1e-3)


@pytest.mark.parametrize("width", [2, 4])
def test_auto_depth_is_lossless_speculative_beam_search_with_eos(dsbd_tiny_spec_llm, tiny_eos_llm, width):
    want = beam_search(tiny_eos_llm, PROMPTS, width, 10)
    got = dsbd_tiny_spec_llm.generate(PROMPTS, _auto_request(width, 10), use_tqdm=False)
    _assert_same_as_beam_search(want, got)


@pytest.fixture
def inproc_spec_llm(engine_pool, tiny_eos_target, tiny_pair):
    """The tiny pair (γ <= 3) with its engine core in this process, so a test can set its depth policy."""
    return engine_pool.get("inproc_spec_llm", lambda: start_spec_llm(
        tiny_eos_target, tiny_pair.draft, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))


def test_auto_depth_weighs_the_batch_a_draft_that_pays_alone_steps_aside_among_eight(inproc_spec_llm):
    """Draft steps cost 0.2 s, target steps 1 s: with the prior α 0.5 one layer pays for a group alone
    (1.5 tokens for 1.2 s), but among 8 groups its draft step would stall the 7 others (8.5 tokens for
    1.2 s against 8 for 1 s), so every iteration of the batch gets depth 0."""
    alone = recording_policy(inproc_spec_llm, 0.2, 1.0)
    inproc_spec_llm.generate(PROMPTS[:1], _auto_request(2, 6, ignore_eos=True), use_tqdm=False)
    assert alone and alone[0] >= 1, alone
    crowd = recording_policy(inproc_spec_llm, 0.2, 1.0)
    prompts = (PROMPTS * 8)[:8]
    inproc_spec_llm.generate(prompts, _auto_request(2, 6, ignore_eos=True), use_tqdm=False)
    assert len(crowd) >= 8 * 4 and set(crowd) == {0}, crowd


def test_auto_depth_sees_a_group_alone_when_the_group_before_it_has_ended(inproc_spec_llm):
    """Prompts one after another: every depth choice, the admission's look-ahead included, models the group
    alone in its steps. (The tokens of a group that just ended used to count as others' work in the next
    target step, which makes speculation look cheaper than it is.)"""
    from vllm_dsbd.algorithm.depth import ALONE

    batches = []
    recording_policy(inproc_spec_llm, 0.2, 1.0, batches)
    for prompt in PROMPTS[:2]:
        inproc_spec_llm.generate([prompt], _auto_request(2, 4, ignore_eos=True), use_tqdm=False)
    assert len(batches) >= 4 and set(batches) == {ALONE}, batches


def test_auto_depth_groups_admitted_together_look_ahead_as_one_batch(inproc_spec_llm):
    """Four prompts arrive at once: each group's look-ahead at its first iteration (at its admission) sees
    the four groups, not itself alone, so it weighs stalling the others with a draft of its prompt. (Each
    used to see only the groups admitted before it, and the first one's view was kept for the step.)"""
    from vllm_dsbd.algorithm.depth import Batch

    batches = []
    recording_policy(inproc_spec_llm, 0.2, 1.0, batches)
    inproc_spec_llm.generate(PROMPTS[:1] * 4, _auto_request(2, 4, ignore_eos=True), use_tqdm=False)
    assert batches[:4] == [Batch(streams=4)] * 4, batches


def test_auto_depth_counts_the_others_next_tokens_not_the_prompts_they_just_computed(inproc_spec_llm):
    """Four groups whose prompts were computed in one step: the choices after it count each other group's
    beams (and forest), not its prompt, as the other tokens of the next target step. (Each used to count
    the others' prompts: under load the next step looked a few times dearer than it is and a forest nearly
    free, so every new group drafted.)"""
    batches = []
    recording_policy(inproc_spec_llm, 0.2, 1.0, batches)
    prompt_len, width = 64, 2
    prompts = [{"prompt_token_ids": list(range(3000 + 100 * i, 3000 + 100 * i + prompt_len))} for i in range(4)]
    inproc_spec_llm.generate(prompts, _auto_request(width, 4, ignore_eos=True), use_tqdm=False)
    seen = [b.other_tokens for b in batches if b.streams == 4]
    assert len(seen) >= 8, batches
    assert max(seen) <= 3 * width * 4, batches  # three other groups' forests at most (γ <= 3), no prompt


def test_auto_depth_groups_that_do_not_fit_with_their_depth_are_admitted_for_shallower_iterations(
        inproc_spec_llm, tiny_eos_llm):
    """The engine allows γ <= 3, and a group that may draft 3 layers holds W (γ + 3) request slots at most:
    with W 2 only max_num_seqs // 12 such groups used to run at once, the others waiting, although under
    load auto_depth gives nearly every iteration γ 0. A group that does not fit with γ is admitted with the
    deepest γ that fits (0: beam steps), so here all of them run at once, and T 0 is still vLLM's beam
    search token for token."""
    from vllm_dsbd.engine.beam_group import request_slots

    width = 2
    limit = inproc_spec_llm.llm_engine.engine_core.engine_core.scheduler.max_num_running_reqs
    num = limit // request_slots(width, 3) + 4  # more than fit with γ 3; all fit with beam steps
    assert num * width <= limit < num * request_slots(width, 3)
    batches = []
    recording_policy(inproc_spec_llm, 0.2, 1.0, batches)
    prompts = (PROMPTS * num)[:num]
    got = inproc_spec_llm.generate(prompts, _auto_request(width, 6), use_tqdm=False)
    assert max(b.streams for b in batches) == num, batches
    _assert_same_as_beam_search(beam_search(tiny_eos_llm, prompts, width, 6), got)


def test_auto_depth_fits_the_target_steps_cost_on_decoding_steps_only(inproc_spec_llm):
    """A target step that computes a prompt (a beam group's or a plain request's) stays out of the target
    step's cost fit: a prompt's tokens cost far less each than a forest's, and one long prompt flattened the
    fitted cost per token (under load the policy then took every forest for nearly free). Every decoding
    step is fitted."""
    from vllm import SamplingParams

    from vllm_dsbd.algorithm.depth import DepthPolicy

    policy, fitted = DepthPolicy(), []
    observe = policy.observe_step

    def record(is_draft, num_tokens, seconds):
        fitted.append((is_draft, num_tokens))
        observe(is_draft, num_tokens, seconds)

    policy.observe_step = record
    inproc_spec_llm.llm_engine.engine_core.engine_core.scheduler._depth = policy
    prompt_len = 64  # token ids no other test uses: nothing of them is in the prefix cache
    beams = {"prompt_token_ids": list(range(1000, 1000 + prompt_len))}
    plain = {"prompt_token_ids": list(range(2000, 2000 + prompt_len))}
    inproc_spec_llm.generate([beams], _auto_request(2, 8, ignore_eos=True), use_tqdm=False)
    inproc_spec_llm.generate([plain], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    target = [n for is_draft, n in fitted if not is_draft]
    assert target.count(1) == 3, fitted  # the plain request's decoding steps (its prompt step sampled one)
    assert len(target) > 3, fitted  # and the group's (2 beams: at least 2 tokens a step)
    assert max(target) < prompt_len, fitted  # a forest of 2 beams, 4 tokens deep, is 8 tokens


def test_auto_depth_is_lossless_at_every_depth_it_chooses(inproc_spec_llm, tiny_eos_llm):
    """The tests above may run on plain beam steps alone: on the tiny pair the measured costs make depth 0
    the choice. Here the engine's depth policy is told that draft steps cost almost nothing, so it
    speculates at full depth while its acceptance estimate is high, then falls back to depth 0 (probing now
    and then) as the unrelated draft fails: mixed depths, still vLLM's beam search token for token."""
    chosen = recording_policy(inproc_spec_llm, 1e-4, 1.0)  # draft steps 0.1 ms, target steps 1 s
    before = engine_metric(inproc_spec_llm, "vllm:dsbd_draft_layers")
    for width in (2, 4):
        want = beam_search(tiny_eos_llm, PROMPTS, width, 10)
        got = inproc_spec_llm.generate(PROMPTS, _auto_request(width, 10), use_tqdm=False)
        _assert_same_as_beam_search(want, got)
    assert engine_metric(inproc_spec_llm, "vllm:dsbd_draft_layers") > before  # speculation happened
    assert 3 in chosen and 0 in chosen, chosen
    policy = inproc_spec_llm.llm_engine.engine_core.engine_core.scheduler._depth
    assert policy.verify.num_observations > 0  # the runner timed the verifications, which auto_depth costs


@pytest.mark.model
def test_auto_depth_is_lossless_on_the_default_pair(dsbd_spec_target_llm, target_llm):
    want = beam_search(target_llm, PROMPTS, 4, 12)
    got = dsbd_spec_target_llm.generate(PROMPTS, _auto_request(4, 12), use_tqdm=False)
    _assert_same_as_beam_search(want, got)


def test_auto_depth_fixed_width_is_distributed_as_beam_sampling(dsbd_tiny_spec_llm, tiny_eos_target):
    """2,000 seeded requests whose iterations get whatever depth the engine chooses (0 to 3, probes
    included) against exact enumeration of beam sampling; a planted bug is rejected."""
    width, max_tokens, top_k = 2, 3, 3
    params = [_auto_request(width, max_tokens, temperature=1.0, top_k=top_k, ignore_eos=True, seed=seed,
                            extra={"fixed_width": True}) for seed in range(2000)]
    outs = dsbd_tiny_spec_llm.generate(["The capital of France is"] * len(params), params, use_tqdm=False)
    assert_distributed_as_beam_sampling(outs, tiny_eos_target, width, max_tokens, top_k)


def test_a_useless_draft_makes_auto_depth_stop_speculating(dsbd_tiny_spec_llm):
    """The tiny draft is an unrelated random model: at T = 0 its top-W beams are never the target's, so
    after a few probes the engine takes plain beam steps (depth 0); the fixed depth would draft 3 layers.
    A depth-0 iteration is decided as a beam step, not as the verification of an empty forest."""
    names = ("vllm:spec_decode_num_drafts", "vllm:dsbd_draft_layers", "vllm:spec_decode_num_accepted_tokens")
    before = [engine_metric(dsbd_tiny_spec_llm, n) for n in names]
    steps = lambda: {kind: p["steps"] for kind, p in dsbd_tiny_spec_llm.collective_rpc(  # noqa: E731
        "dsbd_step_profile")[0].items()}
    steps_before = steps()
    dsbd_tiny_spec_llm.generate(PROMPTS, _auto_request(4, 40, ignore_eos=True), use_tqdm=False)
    iterations, layers, _ = (engine_metric(dsbd_tiny_spec_llm, n) - b for n, b in zip(names, before))
    assert iterations >= 3 * 30  # about one token per iteration
    assert layers / iterations < 0.25
    new_steps = {kind: n - steps_before.get(kind, 0) for kind, n in steps().items()}
    assert new_steps.get("beam", 0) > 3 * new_steps.get("verify", 0), new_steps


def test_auto_depth_frees_all_kv_after_finish_and_abort(dsbd_tiny_spec_llm):
    assert_kv_freed_after_finish_and_abort(
        dsbd_tiny_spec_llm, _auto_request(4, 8, temperature=1.0, seed=0, extra={"width_threshold": 0.5}),
        lambda i: _auto_request(4, 200, temperature=1.0, seed=i, ignore_eos=True), prefix="abort-auto")


@pytest.mark.parametrize("value", ["yes", 2, None])  # 1 and 0 are true and false (JSON true over HTTP)
def test_bad_auto_depth_values_are_refused_naming_the_knob(dsbd_tiny_spec_llm, value):
    with pytest.raises(ValueError, match=r"'auto_depth'.*allowed: true or false"):
        dsbd_tiny_spec_llm.generate(PROMPTS[:1], _auto_request(2, 4, extra={"auto_depth": value}), use_tqdm=False)
