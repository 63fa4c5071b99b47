"""In-engine beam decoding (a DSBD engine without a draft) inside real vLLM engines on CPU.

References: vLLM's own built-in ``LLM.beam_search`` (a front-end loop) on a
plain engine of the same model for temperature 0, and exact enumeration of
beam sampling over Hugging Face logits of the same checkpoint for
temperature > 0. The tiny target here has its EOS embedding tripled, so EOS
candidates appear and finished hypotheses and the length penalty matter.
"""

from __future__ import annotations

import json
import math
import os

import psutil
import pytest
from beam_checks import (  # tests/engine/beam_checks.py
    EOS, PROMPTS, assert_distributed_as_beam_sampling, assert_kv_freed_after_finish_and_abort,
    beam_search, engine_metric)

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("width, length_penalty, max_tokens",
                         [(1, 1.0, 10), (2, 0.5, 10), (4, 1.0, 10), (4, 2.0, 10), (8, 1.0, 10), (8, 0.5, 6),
                          (4, 1.0, 1), (2, 1.0, 2)])
def test_beam_search_equals_vllm_builtin_with_eos(dsbd_tiny_llm, tiny_eos_llm, width, length_penalty, max_tokens):
    """T = 0: token for token (and cumulative log-prob) what vLLM's built-in beam search returns."""
    want = beam_search(tiny_eos_llm, PROMPTS, width, max_tokens, length_penalty)
    got = beam_search(dsbd_tiny_llm, PROMPTS, width, max_tokens, length_penalty)
    for w, g in zip(want, got):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx([s.cum_logprob for s in w.sequences], abs=1e-3)
        assert [s.text for s in g.sequences] == [s.text for s in w.sequences]


def test_eos_finishes_hypotheses_in_the_comparison(dsbd_tiny_llm):
    """The EOS-prone model does produce finished hypotheses, so the comparison above covers them."""
    out = beam_search(dsbd_tiny_llm, PROMPTS, 8, 10)
    finished = [s for o in out for s in o.sequences if s.tokens[-1] == EOS]
    assert finished and all(s.finish_reason == "stop" for s in finished)
    assert any(s.finish_reason == "length" for o in out for s in o.sequences)


def test_llm_beam_search_goes_through_the_engine_not_the_front_end_loop(dsbd_tiny_llm):
    """One engine request per returned hypothesis, not one per beam per step."""
    before = engine_metric(dsbd_tiny_llm, "vllm:request_success")
    beam_search(dsbd_tiny_llm, PROMPTS[:1], 4, 8)
    assert engine_metric(dsbd_tiny_llm, "vllm:request_success") - before == 4


def test_generate_returns_n_best_hypotheses_of_a_beam_request(dsbd_tiny_llm):
    """SamplingParams(n, extra_args={"beam_width": W}) at T = 0: the n best of the width-W search, in order."""
    from vllm import SamplingParams

    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, logprobs=0, extra_args={"beam_width": 4})
    (out,) = dsbd_tiny_llm.generate([PROMPTS[1]], params, use_tqdm=False)
    (full,) = beam_search(dsbd_tiny_llm, [PROMPTS[1]], 4, 8)
    prompt_len = len(out.prompt_token_ids)
    assert [list(c.token_ids) for c in out.outputs] == [s.tokens[prompt_len:] for s in full.sequences[:2]]
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(sum(next(iter(d.values())).logprob for d in c.logprobs))


def test_beam_sampling_is_distributed_as_exact_beam_sampling(dsbd_tiny_llm, tiny_eos_target):
    """T > 0 with top-k on the joint: 2,000 seeded requests against exact enumeration (chi-square, p > 1e-3);
    the same samples reject beam sampling with uniform parent weights (a planted bug)."""
    from vllm import SamplingParams

    prompt = "The capital of France is"
    width, max_tokens, top_k = 2, 3, 3
    params = [SamplingParams(n=width, temperature=1.0, top_k=top_k, max_tokens=max_tokens, ignore_eos=True,
                             seed=seed, extra_args={"beam_width": width}) for seed in range(2000)]
    outs = dsbd_tiny_llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert_distributed_as_beam_sampling(outs, tiny_eos_target, width, max_tokens, top_k)


def test_seeded_beam_sampling_is_reproducible(dsbd_tiny_llm):
    from vllm import SamplingParams

    params = SamplingParams(n=3, temperature=0.8, max_tokens=6, seed=11, extra_args={"beam_width": 3})
    a = dsbd_tiny_llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    b = dsbd_tiny_llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_mixed_concurrent_requests_all_complete_correctly(dsbd_tiny_llm):
    """Beam requests of several widths (T = 0 and seeded T > 0) next to plain requests, in one batch:
    each returns what it returns when run alone."""
    from vllm import SamplingParams

    def beam(width, n, temperature=0.0, seed=None, max_tokens=8):
        return SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens,
                              extra_args={"beam_width": width})

    jobs = [
        (PROMPTS[0], beam(1, 1)), (PROMPTS[1], beam(2, 2)), (PROMPTS[2], beam(3, 1, max_tokens=5)),
        (PROMPTS[0], beam(8, 4)), (PROMPTS[1], beam(4, 2, temperature=0.9, seed=3)),
        (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8)),
        (PROMPTS[0], SamplingParams(temperature=1.0, seed=5, max_tokens=8)),
        (PROMPTS[1], beam(8, 8, temperature=1.2, seed=4, max_tokens=12)),
        (PROMPTS[2], SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=4)),
    ] * 2
    together = dsbd_tiny_llm.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    for (prompt, params), out in zip(jobs, together):
        alone = dsbd_tiny_llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
        assert len(out.outputs) == params.n
        assert all(c.finish_reason in ("stop", "length") for c in out.outputs)


def test_no_kv_blocks_leak_after_finished_and_aborted_requests(dsbd_tiny_llm):
    """KV usage returns to zero after beam groups finish, and after they are aborted mid-generation."""
    from vllm import SamplingParams

    assert_kv_freed_after_finish_and_abort(
        dsbd_tiny_llm, SamplingParams(n=2, temperature=0.0, max_tokens=40, extra_args={"beam_width": 8}),
        lambda i: SamplingParams(n=3, temperature=1.0, max_tokens=200, seed=i, extra_args={"beam_width": 6}),
        "abort")


@pytest.mark.parametrize(
    "extra, kwargs, message",
    [
        ({"beam_width": 0}, {}, r"'beam_width'=0 is invalid"),
        ({"beam_width": 9}, {}, r"'beam_width'=9, above the engine's maximum 8"),
        ({"beam_width": 2}, {"n": 3, "temperature": 1.0}, r"n=3 is larger than DSBD knob 'beam_width'=2"),
        ({"beam_width": 2, "gamma": 2}, {}, r"Unknown key\(s\) \['gamma'\]"),
        ({"beam_width": 2, "length_penalty": -1}, {}, r"'length_penalty'=-1 is invalid"),
        ({"beam_width": 2}, {"presence_penalty": 0.5}, r"does not support SamplingParams.presence_penalty"),
    ],
)
def test_bad_beam_request_gets_a_clear_error_and_the_engine_keeps_serving(dsbd_tiny_llm, extra, kwargs, message):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=message):
        dsbd_tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, extra_args=extra, **kwargs),
                               use_tqdm=False)
    ok = dsbd_tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, extra_args={"beam_width": 2}),
                                use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 4


@pytest.mark.model
@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_vllm_builtin_on_smollm2(dsbd_target_llm, target_llm, width):
    """The real default target: in-engine beam search equals vLLM's built-in one token for token."""
    tok = target_llm.get_tokenizer()
    prompts = [PROMPTS[0], tok.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                                   tokenize=False, add_generation_prompt=True)]
    want = beam_search(target_llm, prompts, width, 12)
    got = beam_search(dsbd_target_llm, prompts, width, 12)
    for w, g in zip(want, got):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx([s.cum_logprob for s in w.sequences], abs=1e-3)
    assert not math.isnan(got[0].sequences[0].cum_logprob)


def _is_descendant(pid: int, ancestor: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def test_register_ran_in_engine_core_and_worker_processes(dsbd_target_llm, register_trace):
    """register() ran (version guard passed) inside the engine's own child processes (the pool starts
    ``dsbd_target_llm`` in processes of its own, as users run vLLM: tests/conftest.py)."""
    records = [json.loads(line) for line in register_trace.read_text().splitlines()]
    children = [r for r in records if _is_descendant(r["pid"], os.getpid())]
    names = {r["process"] for r in children}
    assert "EngineCore" in names, records
    assert any(n.startswith("VllmWorker") for n in names), records
    # One registration per process: the entry point is idempotent.
    pids = [r["pid"] for r in records]
    assert len(pids) == len(set(pids))


def test_beam_groups_survive_kv_pressure_with_preemption(engine_pool, dsbd_tiny_llm, tiny_eos_target):
    """A DSBD engine with room for ~48 KV blocks, beam groups mixed with plain requests: vLLM preempts
    (beams included), groups are preempted whole and recomputed, and every output equals the output
    of the same request on a roomy engine."""
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import beam_engine_kwargs

    tight = engine_pool.get("tight_kv_llm", lambda: LLM(**{  # shut down after this test
        **beam_engine_kwargs(str(tiny_eos_target), 8), "disable_log_stats": False, "max_model_len": 512,
        "kv_cache_memory_bytes": 48 * 32 * 512}))  # 48 blocks of 32 tokens x 512 B
    jobs = []
    for i in range(3):
        for prompt in PROMPTS:
            jobs.append((prompt, SamplingParams(n=2, temperature=0.0, max_tokens=60, ignore_eos=True,
                                                extra_args={"beam_width": 4})))
        jobs += [(p, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)) for p in PROMPTS[:2]]
    got = tight.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    preemptions = engine_metric(tight, "vllm:num_preemptions")
    want = dsbd_tiny_llm.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    assert preemptions > 0, "the test did not put the KV cache under pressure"
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
