"""The plugin inside real vLLM engines on the default target and the tiny pair."""

from __future__ import annotations

import json
import os

import psutil
import pytest

pytestmark = pytest.mark.engine


def test_default_target_answers_paris_greedily(target_llm):
    from vllm import SamplingParams

    out = target_llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    assert "Paris" in out[0].outputs[0].text


def _is_descendant(pid: int, ancestor: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def test_register_ran_in_engine_core_and_worker_processes(target_llm, register_trace):
    """register() ran (version guard passed) inside the engine's own child processes."""
    records = [json.loads(line) for line in register_trace.read_text().splitlines()]
    children = [r for r in records if _is_descendant(r["pid"], os.getpid())]
    names = {r["process"] for r in children}
    assert "EngineCore" in names, records
    assert any(n.startswith("VllmWorker") for n in names), records
    # One registration per process: the entry point is idempotent.
    pids = [r["pid"] for r in records]
    assert len(pids) == len(set(pids))


def test_tiny_target_generates_to_max_tokens(tiny_llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    out = tiny_llm.generate(["Hello", "The capital of France is"], params)
    for o in out:
        assert len(o.outputs[0].token_ids) == 16
        assert all(-50.0 < next(iter(lp.values())).logprob <= 0.0 for lp in o.outputs[0].logprobs)


def test_tiny_draft_serves_as_vllm_draft_model(tiny_pair, tiny_llm):
    """The tiny pair shares a vocabulary: vLLM's draft_model method runs it and stays greedy-exact."""
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import engine_kwargs

    prompts = ["Hello", "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]
    kwargs = engine_kwargs(str(tiny_pair.target))
    kwargs.update(
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
        speculative_config={"method": "draft_model", "model": str(tiny_pair.draft), "num_speculative_tokens": 2},
    )
    spec_llm = LLM(**kwargs)
    try:
        spec = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    finally:
        spec_llm.llm_engine.engine_core.shutdown()
    assert spec == plain
