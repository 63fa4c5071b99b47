"""DSBD with speculation inside real vLLM engines on CPU: draft steps, one-pass forest verification.

References: vLLM's own built-in ``LLM.beam_search`` on plain engines (temperature 0:
lossless speculative beam search), exact enumeration of beam sampling over
Hugging Face logits (temperature > 0, fixed width). Drafts: the tiny draft
for the tiny EOS-prone target; the shipped default draft for SmolLM2 (the
default pair; it agrees with the target on about 30 % of tokens, so many
layers are rejected: the tests check exactness, not speed).
"""

from __future__ import annotations

import pytest
from beam_checks import (  # tests/engine/beam_checks.py
    EOS, PROMPTS, assert_kv_freed_after_finish_and_abort, beam_search, beam_sampling_pvalue, engine_metric,
    plant_beam_steps_on_the_draft_layers_streams, plant_draft_joint_at_another_temperature,
    sample_with_acceptances, start_spec_llm)

pytestmark = pytest.mark.engine


def _beam_request(width, gamma, max_tokens, temperature=0.0, **kw):
    from vllm import SamplingParams

    return SamplingParams(n=width, temperature=temperature, max_tokens=max_tokens, logprobs=0,
                          extra_args={"beam_width": width, "num_speculative_tokens": gamma, **kw.pop("extra", {})},
                          **kw)


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (2, 0.5), (4, 1.0), (4, 2.0), (8, 1.0)])
def test_lossless_speculative_beam_search_with_eos(dsbd_tiny_spec_llm, tiny_eos_llm, width, length_penalty):
    """T = 0 with draft forests (γ = 3) and EOS: token for token vLLM's built-in beam search."""
    want = beam_search(tiny_eos_llm, PROMPTS, width, 10, length_penalty)
    got = beam_search(dsbd_tiny_spec_llm, PROMPTS, width, 10, length_penalty)
    for w, g in zip(want, got):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx([s.cum_logprob for s in w.sequences], abs=1e-3)


@pytest.mark.model
@pytest.mark.parametrize("width, gamma", [(2, 1), (4, 3), (8, 5)])
def test_lossless_speculative_beam_search_on_smollm2(dsbd_spec_target_llm, target_llm, width, gamma):
    """The default pair: n = W best of DSBD's beam search (γ per request) equal vLLM's built-in beam search."""
    _assert_lossless_on_smollm2(dsbd_spec_target_llm, target_llm, width, gamma)


@pytest.mark.model
@pytest.mark.parametrize("width, gamma", [(2, 1), (4, 3)])
def test_lossless_speculative_beam_search_on_smollm2_with_the_shipped_head(shipped_head_llm, target_llm, width,
                                                                           gamma):
    """The same with the EAGLE-3 head that ships for the default target (vllm_dsbd/draft/default-head)."""
    _assert_lossless_on_smollm2(shipped_head_llm, target_llm, width, gamma)


def _assert_lossless_on_smollm2(llm, target_llm, width, gamma):
    tok = target_llm.get_tokenizer()
    prompts = [PROMPTS[0], PROMPTS[2], tok.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                                               tokenize=False, add_generation_prompt=True)]
    want = beam_search(target_llm, prompts, width, 10)
    got = llm.generate(prompts, _beam_request(width, gamma, 10), use_tqdm=False)
    for w, g in zip(want, got):
        prompt_len = len(g.prompt_token_ids)
        assert [list(c.token_ids) for c in g.outputs] == [s.tokens[prompt_len:] for s in w.sequences]
        assert [c.cumulative_logprob for c in g.outputs] == pytest.approx(
            [s.cum_logprob for s in w.sequences], abs=1e-3)


def _sharpened_self_draft_requests(num: int = 2000) -> list:
    """Fixed-width T 1 requests (W 2, γ 2, 3 tokens, top-k 3 on the joint) whose draft is the target sampled at
    half its temperature: it agrees often but not always, so layers pass, fail after acceptances (residual
    draws beside accepted drafts) and end in beam steps."""
    return [_beam_request(2, 2, 3, temperature=1.0, top_k=3, ignore_eos=True, seed=seed,
                          extra={"fixed_width": True, "draft_temperature_scale": 0.5}) for seed in range(num)]


def test_fixed_width_dsbd_with_accepted_drafts_is_distributed_as_beam_sampling(self_draft_llm, tiny_eos_target):
    """2,000 seeded requests of a draft that is accepted about nine times in ten: the sets of returned
    sequences follow exact beam sampling (chi-square against enumeration over Hugging Face logits)."""
    outs = sample_with_acceptances(self_draft_llm, PROMPTS[0], _sharpened_self_draft_requests(), min_acceptance=0.7)
    assert beam_sampling_pvalue(outs, tiny_eos_target, 2, 3, 3) > 1e-3


@pytest.mark.parametrize("plant", [plant_draft_joint_at_another_temperature, plant_beam_steps_on_the_draft_layers_streams],
                         ids=["draft-joint-at-another-temperature", "beam-step-on-a-draft-layers-stream"])
def test_the_accepted_drafts_check_rejects_a_bug_planted_in_the_engine(self_draft_llm, tiny_eos_target, plant,
                                                                       monkeypatch):
    """The same check on an engine whose runner keeps the wrong draft joint, or whose beam steps redraw a draft
    layer's uniforms (fixed-width DSBD had that bug: the check failed with p ~ 1e-8 to 1e-150)."""
    plant(monkeypatch)
    outs = sample_with_acceptances(self_draft_llm, PROMPTS[0], _sharpened_self_draft_requests(1200))
    assert beam_sampling_pvalue(outs, tiny_eos_target, 2, 3, 3) < 1e-3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_with_the_target_as_draft_every_draft_node_is_accepted(self_draft_llm, temperature):
    names = {k: f"vllm:spec_decode_num_{k}" for k in ("drafts", "draft_tokens", "accepted_tokens")}
    names.update({k: f"vllm:dsbd_{k}" for k in ("beam_layers", "beam_width_sum")})
    before = {k: engine_metric(self_draft_llm, name) for k, name in names.items()}
    self_draft_llm.generate(PROMPTS, _beam_request(3, 3, 12, temperature=temperature, seed=0, ignore_eos=True,
                                                   extra={"fixed_width": True}), use_tqdm=False)
    after = {k: engine_metric(self_draft_llm, name) for k, name in names.items()}
    proposed, accepted = after["draft_tokens"] - before["draft_tokens"], after["accepted_tokens"] - before["accepted_tokens"]
    iterations = after["drafts"] - before["drafts"]
    assert proposed > 0 and accepted == proposed
    assert iterations == 3 * 3  # 12 tokens = 4 + 4 + 4 per prompt: every iteration passes all 3 layers
    assert after["beam_layers"] - before["beam_layers"] == 3 * 12
    assert after["beam_width_sum"] - before["beam_width_sum"] == 3 * 12 * 3  # every layer holds W = 3 beams
    # The public API reads the same counters (this module's engine is the last one started, so it owns
    # vLLM's process-global Prometheus registry).
    public = {m.name: m.value for m in self_draft_llm.get_metrics() if m.name.startswith(("vllm:spec_decode_num_drafts",
                                                                                          "vllm:dsbd_"))}
    assert public["vllm:spec_decode_num_drafts"] == after["drafts"]
    assert public["vllm:dsbd_tokens_per_target_forward"] == pytest.approx(after["beam_layers"] / after["drafts"])
    assert public["vllm:dsbd_mean_beam_width"] == pytest.approx(after["beam_width_sum"] / after["beam_layers"])


def test_memory_efficient_mode_holds_one_sequence_between_iterations(self_draft_llm):
    """W_out = 1: whenever a group starts an iteration it owns one request and that request's KV blocks."""
    engine = self_draft_llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    engine.add_request("mem-eff", PROMPTS[1], _beam_request(1, 3, 20, temperature=1.0, seed=3, ignore_eos=True,
                                                              extra={"beam_width": 4, "memory_efficient": True,
                                                                     "width_threshold": 0.5}))
    starts = 0
    while engine.has_unfinished_requests():
        engine.step()
        for group in scheduler.groups.values():
            if group.in_iteration and not group.layers and not group.path_requests:
                starts += 1
                assert len(group.beams) == 1 and not group.extra_requests()
                held = {b for r in scheduler.requests.values() if scheduler._beam_group.get(r.request_id)
                        == group.group_id for b in kv.get_block_ids(r.request_id)[0]}
                assert held == set(kv.get_block_ids(group.beams[0].request.request_id)[0])
    assert starts >= 2


@pytest.mark.model
def test_speculation_gives_more_than_one_token_per_target_forward(dsbd_spec_target_llm):
    """On the default pair: generated tokens / target forwards > 1, as the engine's metrics report it
    (the engine core runs in its own process: the counts cross vLLM's serialization)."""
    names = ("vllm:spec_decode_num_drafts", "vllm:dsbd_beam_layers", "vllm:dsbd_beam_width_sum")
    before = [engine_metric(dsbd_spec_target_llm, name) for name in names]
    dsbd_spec_target_llm.generate([PROMPTS[0]], _beam_request(1, 5, 40, ignore_eos=True), use_tqdm=False)
    iterations, layers, widths = (engine_metric(dsbd_spec_target_llm, name) - b for name, b in zip(names, before))
    assert layers == widths == 40  # one beam, 40 tokens
    assert layers / iterations > 1.0


def test_mean_beam_width_metric_is_w_with_fixed_width_and_less_with_dynamic_width(dsbd_tiny_spec_llm):
    names = ("vllm:spec_decode_num_drafts", "vllm:dsbd_beam_layers", "vllm:dsbd_beam_width_sum")

    def run(extra, n=4, temperature=1.0, ignore_eos=True):
        before = [engine_metric(dsbd_tiny_spec_llm, name) for name in names]
        dsbd_tiny_spec_llm.generate(PROMPTS, _beam_request(n, 3, 12, temperature=temperature, seed=0,
                                                           ignore_eos=ignore_eos, extra={"beam_width": 4, **extra}),
                                    use_tqdm=False)
        return [engine_metric(dsbd_tiny_spec_llm, name) - b for name, b in zip(names, before)]

    iterations, layers, widths = run({"fixed_width": True})
    assert layers == 12 * len(PROMPTS) and widths == 4 * layers
    assert 1 <= layers / iterations <= 4
    iterations, layers, widths = run({"width_threshold": 0.9, "min_width": 1})
    assert layers == 12 * len(PROMPTS) and layers <= widths < 4 * layers
    iterations, layers, widths = run({"width_threshold": 0.9, "memory_efficient": True}, n=1)
    assert layers == 12 * len(PROMPTS) and layers <= widths < 4 * layers
    for temperature in (0.0, 1.0):  # with EOS (the target is EOS-prone): finished hypotheses are not width
        iterations, layers, widths = run({"fixed_width": True}, temperature=temperature, ignore_eos=False)
        assert 0 < layers <= 12 * len(PROMPTS) and widths <= 4 * layers


def test_mixed_batch_speculative_beam_and_plain_requests(dsbd_tiny_spec_llm):
    """DSBD requests (several W, γ, T), in-engine beam requests (γ = 0) and plain requests in one batch:
    each returns what it returns when run alone."""
    from vllm import SamplingParams

    jobs = [
        (PROMPTS[0], _beam_request(2, 3, 8)), (PROMPTS[1], _beam_request(4, 1, 8)),
        (PROMPTS[2], _beam_request(3, 0, 6)), (PROMPTS[0], _beam_request(8, 2, 9, temperature=0.8, seed=4)),
        (PROMPTS[1], _beam_request(1, 3, 7, temperature=1.0, seed=5, extra={"beam_width": 3,
                                                                            "memory_efficient": True})),
        (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8)),
        (PROMPTS[0], SamplingParams(temperature=1.0, seed=7, max_tokens=8)),
    ] * 2
    together = dsbd_tiny_spec_llm.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    for (prompt, params), out in zip(jobs, together):
        alone = dsbd_tiny_spec_llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]


@pytest.mark.parametrize("gamma", [0, 3])
def test_plain_top_k_sampling_beside_beam_groups_on_a_speculative_engine(dsbd_tiny_spec_llm, gamma):
    """A plain request with top-k at T > 0, alone, beside γ 0 beam groups (no draft token in the step) and
    beside DSBD verify steps. Both killed the worker (found by the fuzz run): vLLM's rejection sampler
    applied top-k to zero rows, and on CPU expanded top-k into uninitialised memory. Seeded, the request
    returns what it returns alone."""
    from vllm import SamplingParams

    plain = SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=6, ignore_eos=True)
    beams = _beam_request(3, gamma, 6, temperature=1.0, top_k=5, seed=1, ignore_eos=True)
    alone = dsbd_tiny_spec_llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed = dsbd_tiny_spec_llm.generate(PROMPTS * 2, [plain] * 3 + [beams] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed[:3]]
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 6 for c in o.outputs) for o in mixed[3:])
    assert all(len(o.outputs[0].token_ids) == 6 for o in alone)


def test_no_kv_blocks_leak_after_finished_and_aborted_dsbd_requests(dsbd_tiny_spec_llm):
    """KV usage returns to zero after DSBD groups finish, and after they are aborted mid-generation."""
    assert_kv_freed_after_finish_and_abort(  # the aborted ones are stopped in draft and verify steps
        dsbd_tiny_spec_llm, _beam_request(3, 3, 30, temperature=0.9, seed=1),
        lambda i: _beam_request(4, 3, 200, temperature=1.0, seed=i), "abort-spec")


@pytest.mark.parametrize("extra, message", [
    ({"beam_width": 9}, r"'beam_width'=9, above the engine's maximum 8"),
    ({"beam_width": 2, "num_speculative_tokens": 4}, r"'num_speculative_tokens'=4, above the engine's maximum 3"),
    ({"beam_width": 2, "width_threshold": 0.0}, r"'width_threshold'=0.0 is invalid"),
    ({"beam_width": 2, "memory_efficient": True, "n": 2}, r"n=2 with DSBD knob 'memory_efficient'=True"),
])
def test_bad_dsbd_request_gets_a_clear_error_and_the_engine_keeps_serving(dsbd_tiny_spec_llm, extra, message):
    from vllm import SamplingParams

    extra = dict(extra)
    n = extra.pop("n", 1)
    with pytest.raises(ValueError, match=message):
        dsbd_tiny_spec_llm.generate([PROMPTS[0]], SamplingParams(n=n, temperature=1.0, max_tokens=4, extra_args=extra),
                                    use_tqdm=False)
    ok = dsbd_tiny_spec_llm.generate([PROMPTS[0]], _beam_request(2, 3, 5), use_tqdm=False)
    assert all(len(c.token_ids) == 5 or c.token_ids[-1] == EOS for c in ok[0].outputs)
