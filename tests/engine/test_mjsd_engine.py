"""MJSD (``decoder: "mjsd"``) inside real vLLM engines on CPU.

References: the target's greedy output from plain vLLM engines (T = 0, where
MJSD with τ > 0 is greedy speculative decoding), and the reference decoder
``algorithm.mjsd.mjsd_decode`` over Hugging Face logits of the same models
with the engine's seeding (T > 0).
"""

from __future__ import annotations

import pytest
from beam_checks import (  # tests/engine/beam_checks.py
    PROMPTS, _hf_logits_fn, assert_kv_freed_after_finish_and_abort, beam_search, engine_metric,
    plant_draft_joint_at_another_temperature, start_spec_llm)

pytestmark = pytest.mark.engine


def _mjsd(max_tokens, temperature=0.0, seed=None, ignore_eos=False, **knobs):
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos,
                          extra_args={"decoder": "mjsd", **knobs})


def _greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("beams, gamma, tau", [(1, 1, 0.5), (3, 3, 0.3), (8, 3, 1.0), (4, 2, 5.0)])
def test_temperature_zero_mjsd_is_the_target_greedy_output_with_eos(dsbd_tiny_spec_llm, tiny_eos_llm, beams, gamma,
                                                                    tau):
    want = _greedy(tiny_eos_llm, PROMPTS, 24)
    outs = dsbd_tiny_spec_llm.generate(PROMPTS, _mjsd(24, beam_width=beams, num_speculative_tokens=gamma,
                                                      mjsd_tau=tau), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert [len(o.outputs) for o in outs] == [1, 1, 1]


@pytest.mark.model
def test_temperature_zero_mjsd_is_greedy_on_smollm2(dsbd_spec_target_llm, target_llm):
    tok = target_llm.get_tokenizer()
    prompts = [PROMPTS[0], tok.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                                   tokenize=False, add_generation_prompt=True)]
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
    before = [engine_metric(dsbd_spec_target_llm, n) for n in names]
    outs = dsbd_spec_target_llm.generate(prompts, _mjsd(16, beam_width=4, num_speculative_tokens=3),
                                         use_tqdm=False)
    after = [engine_metric(dsbd_spec_target_llm, n) for n in names]
    assert [list(o.outputs[0].token_ids) for o in outs] == _greedy(target_llm, prompts, 16)
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    assert 0 < drafts < 2 * 16 and accepted > 0  # fewer target forwards than tokens: drafts were accepted


def test_seeded_mjsd_sampling_equals_the_reference_decoder(dsbd_tiny_spec_llm, tiny_eos_target, tiny_pair):
    """T = 1 (with top-k / top-p): the engine's tokens equal ``mjsd_decode`` over Hugging Face logits of the
    same target and draft, seeded as the engine seeds its draws (per iteration and draw)."""
    _assert_seeded_mjsd_is_the_reference_decoder(dsbd_tiny_spec_llm, tiny_eos_target, tiny_pair.draft)


def test_seeded_mjsd_with_accepted_drafts_equals_the_reference_decoder(self_draft_llm, tiny_eos_target):
    """The same with the target as its own draft: drafts are accepted (at least 0.3 of the proposed tokens),
    so the paths the draft drew, their acceptance by joint likelihood and the bonus after them are checked,
    not only the target's fallback. Top-k 20 throughout: the tiny target is nearly flat over its 49,152
    tokens, and a draw from a 3-beam joint over all of them can move with a 1e-5 change of the draft's logits
    (measured on the reference decoder alone), which is how far vLLM's and Hugging Face's float32 logits
    differ; with top-k 20, 80 of 80 seeded requests (K 2-3, γ 2-3) matched."""
    _assert_seeded_mjsd_is_the_reference_decoder(self_draft_llm, tiny_eos_target, tiny_eos_target,
                                                 min_acceptance=0.3, top_ks=(20, 20))


def test_the_seeded_mjsd_check_rejects_a_draft_joint_at_another_temperature(self_draft_llm, tiny_eos_target,
                                                                             monkeypatch):
    """A planted bug in the engine path: the runner keeps, for verification, the draft joint at 4x the
    temperature the layer drew from (so MJSD reads log Q at the wrong temperature). The check above fails."""
    plant_draft_joint_at_another_temperature(monkeypatch, 4.0)
    with pytest.raises(AssertionError):
        _assert_seeded_mjsd_is_the_reference_decoder(self_draft_llm, tiny_eos_target, tiny_eos_target,
                                                     top_ks=(20, 20))


def _assert_seeded_mjsd_is_the_reference_decoder(llm, target_path, draft_path, min_acceptance: float = 0.0,
                                                 top_ks: tuple[int, int] = (0, 20)):
    """Eight seeded T 1 requests (K 3, γ 3, τ 0 / 0.3 / 0.9, top-k alternating over ``top_ks``, top-p 1 / 0.9)
    equal the reference decoder's; other seeds give other tokens; at least ``min_acceptance`` of the proposed
    draft tokens were accepted."""
    from vllm_dsbd.algorithm.mjsd import MJSDParams, mjsd_decode
    from vllm_dsbd.engine.streams import generator

    import torch

    def rows_fn(path):  # Hugging Face logits of rows of different lengths, one row at a time
        fn = _hf_logits_fn(path)
        return lambda rows: torch.cat([fn([row]) for row in rows])

    target, draft = rows_fn(str(target_path)), rows_fn(str(draft_path))
    tok = llm.get_tokenizer()
    cases = [(seed, PROMPTS[seed % 3], dict(top_k=top_ks[seed % 2], top_p=[1.0, 0.9][seed // 2 % 2]),
              [0.0, 0.3, 0.9][seed % 3]) for seed in range(8)]
    names = {k: f"vllm:spec_decode_num_{k}" for k in ("draft_tokens", "accepted_tokens")}
    before = {k: engine_metric(llm, n) for k, n in names.items()}
    differ = 0
    for seed, prompt, sampling, tau in cases:
        params = _mjsd(12, temperature=1.0, beam_width=3, num_speculative_tokens=3, mjsd_tau=tau, seed=seed)
        params.top_k, params.top_p = sampling["top_k"] or 0, sampling["top_p"]
        got = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        ref = mjsd_decode(target, draft, [tok.encode(prompt)], MJSDParams(
            num_beams=3, num_speculative_tokens=3, tau=tau, temperature=1.0, max_tokens=12, eos_token_id=2,
            **sampling), rng=lambda it, salt, s=seed: generator(s, it, salt))
        assert got == ref.tokens[0], (seed, prompt)
        shifted = mjsd_decode(target, draft, [tok.encode(prompt)], MJSDParams(
            num_beams=3, num_speculative_tokens=3, tau=tau, temperature=1.0, max_tokens=12, eos_token_id=2,
            **sampling), rng=lambda it, salt, s=seed: generator(s + 100, it, salt))
        differ += shifted.tokens[0] != got
    assert differ >= 4  # the comparison has power: other seeds give other sequences
    after = {k: engine_metric(llm, n) - before[k] for k, n in names.items()}
    assert after["accepted_tokens"] >= min_acceptance * after["draft_tokens"], after


def test_mjsd_dsbd_and_plain_requests_share_a_batch(dsbd_tiny_spec_llm, tiny_eos_llm):
    """One generate call: an MJSD request, a DSBD beam-search request and a plain greedy request per prompt;
    each equals its own reference."""
    from vllm import SamplingParams

    mjsd = _mjsd(16, beam_width=4, num_speculative_tokens=2)
    beam = SamplingParams(n=3, temperature=0.0, max_tokens=10, extra_args={"beam_width": 3,
                                                                           "num_speculative_tokens": 3})
    plain = SamplingParams(temperature=0.0, max_tokens=16)
    outs = dsbd_tiny_spec_llm.generate(PROMPTS * 3, [mjsd] * 3 + [beam] * 3 + [plain] * 3, use_tqdm=False)
    greedy = _greedy(tiny_eos_llm, PROMPTS, 16)
    assert [list(o.outputs[0].token_ids) for o in outs[:3]] == greedy
    assert [list(o.outputs[0].token_ids) for o in outs[6:]] == greedy
    want = beam_search(tiny_eos_llm, PROMPTS, 3, 10)
    for w, g in zip(want, outs[3:6]):
        prompt_len = len(g.prompt_token_ids)
        assert [list(c.token_ids) for c in g.outputs] == [s.tokens[prompt_len:] for s in w.sequences]


def test_mjsd_with_stop_strings_is_the_greedy_output_cut_at_them(dsbd_tiny_spec_llm, tiny_eos_llm):
    """A stop string that greedy decoding writes mid-text (once the MJSD worker died on any stop string: a
    local name shadowed the node-id helper): MJSD returns the greedy request's text, tokens and finish reason
    under the same stop rule, and the engine keeps serving."""
    from vllm import SamplingParams

    full = tiny_eos_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    # two characters greedy decoding writes mid-text (of the outputs long enough: EOS ends some early)
    stops = [o.outputs[0].text[3:5] for o in full if len(o.outputs[0].text) >= 6]
    for include in (False, True):
        rules = dict(temperature=0.0, max_tokens=16, stop=stops, include_stop_str_in_output=include)
        want = tiny_eos_llm.generate(PROMPTS, SamplingParams(**rules), use_tqdm=False)
        got = dsbd_tiny_spec_llm.generate(PROMPTS, SamplingParams(**rules, extra_args={
            "decoder": "mjsd", "beam_width": 3, "num_speculative_tokens": 3}), use_tqdm=False)
        fields = ("text", "token_ids", "finish_reason", "stop_reason")
        for g, w in zip(got, want):
            assert [getattr(g.outputs[0], f) for f in fields] == [getattr(w.outputs[0], f) for f in fields]
        assert sum(w.outputs[0].stop_reason in stops for w in want) >= len(stops) >= 1  # the stops were hit
    assert _greedy(dsbd_tiny_spec_llm, PROMPTS[:1], 4) == _greedy(tiny_eos_llm, PROMPTS[:1], 4)


def test_mjsd_frees_its_kv(dsbd_tiny_spec_llm):
    assert_kv_freed_after_finish_and_abort(
        dsbd_tiny_spec_llm, _mjsd(12, temperature=1.0, beam_width=4, seed=1),
        lambda i: _mjsd(400, temperature=1.0, beam_width=4, seed=i, ignore_eos=True), "mjsd-abort")


@pytest.mark.parametrize("knobs, n, match", [
    ({"decoder": "mjsdd"}, 1, "decoder"),
    ({"decoder": "mjsd", "mjsd_tau": -0.5}, 1, "mjsd_tau"),
    ({"decoder": "mjsd", "mjsd_tau": float("nan")}, 1, "mjsd_tau"),
    ({"decoder": "mjsd"}, 2, "n=2"),
    ({"decoder": "mjsd", "num_speculative_tokens": 0}, 1, "num_speculative_tokens"),
    ({"decoder": "mjsd", "auto_depth": True}, 1, "auto_depth"),
    ({"decoder": "mjsd", "beam_width": 9}, 1, "beam_width"),
    ({"mjsd_taux": 0.5}, 1, "mjsd_tau"),
])
def test_bad_mjsd_knobs_are_refused_with_the_knob_named(dsbd_tiny_spec_llm, knobs, n, match):
    from vllm import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, max_tokens=4, extra_args=knobs)
    with pytest.raises(ValueError, match=match):
        dsbd_tiny_spec_llm.generate(PROMPTS[:1], params, use_tqdm=False)


@pytest.fixture
def mjsd_engine(engine_pool, tiny_eos_target, tiny_pair):
    """An engine whose decoder is MJSD (speculative config "decoder": "mjsd")."""
    return engine_pool.get("mjsd_engine", lambda: start_spec_llm(
        tiny_eos_target, tiny_pair.draft, {}, knobs={"decoder": "mjsd", "mjsd_tau": 0.5}))


def test_an_mjsd_engine_decodes_plain_requests_by_mjsd(mjsd_engine, tiny_eos_llm):
    """Plain requests get MJSD (T 0: greedy; the spec-decode counters move); beam search stays beam search;
    n > 1 is refused; a user's params are not changed."""
    from vllm import SamplingParams

    drafts = engine_metric(mjsd_engine, "vllm:spec_decode_num_drafts")
    plain = SamplingParams(temperature=0.0, max_tokens=16)
    outs = mjsd_engine.generate(PROMPTS, plain, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _greedy(tiny_eos_llm, PROMPTS, 16)
    assert engine_metric(mjsd_engine, "vllm:spec_decode_num_drafts") > drafts
    assert plain.extra_args is None
    want, got = beam_search(tiny_eos_llm, PROMPTS, 3, 8), beam_search(mjsd_engine, PROMPTS, 3, 8)
    assert [[s.tokens for s in g.sequences] for g in got] == [[s.tokens for s in w.sequences] for w in want]
    with pytest.raises(ValueError, match="n=2"):
        mjsd_engine.generate(PROMPTS[:1], SamplingParams(n=2, temperature=1.0, max_tokens=4), use_tqdm=False)
