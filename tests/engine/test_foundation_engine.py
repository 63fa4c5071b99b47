"""The plugin inside real vLLM engines on the default target and the tiny pair."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine


def test_default_target_answers_paris_greedily(target_llm):
    from vllm import SamplingParams

    out = target_llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    assert "Paris" in out[0].outputs[0].text


def test_an_engine_in_this_process_outlives_the_shutdown_of_another_here(tiny_pair):
    """The suite's pool starts engines in the test process, side by side (tests/engine_pool.py): one's shutdown
    leaves the distributed state the others use, and the last one's tears it down as vLLM does."""
    import torch.distributed
    from engine_pool import _IN_THIS_PROCESS, EnginePool, in_this_process  # tests/engine_pool.py
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import engine_kwargs

    kwargs = {**engine_kwargs(str(tiny_pair.target)), "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    pool = EnginePool(2)
    pool.plan([{"first", "second"}, {"second"}])
    pool.at(0)
    first, second = (pool.get(name, lambda: LLM(**kwargs)) for name in ("first", "second"))
    assert in_this_process(first) and in_this_process(second)
    want = first.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    pool.at(1)  # the first is not needed again: it shuts down, and no engine starts after it
    assert pool.live() == ["second"]
    assert second.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids == want
    pool.clear()  # the suite's pool may still hold engines here: then the state stays, else it is gone
    assert torch.distributed.is_initialized() == bool(_IN_THIS_PROCESS)


def test_tiny_target_generates_to_max_tokens(tiny_llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    out = tiny_llm.generate(["Hello", "The capital of France is"], params)
    for o in out:
        assert len(o.outputs[0].token_ids) == 16
        assert all(-50.0 < next(iter(lp.values())).logprob <= 0.0 for lp in o.outputs[0].logprobs)


def test_tiny_draft_serves_as_vllm_draft_model(engine_pool, tiny_pair, tiny_llm):
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
    spec_llm = engine_pool.get("tiny_draft_model_llm", lambda: LLM(**kwargs))  # shut down after this test
    spec = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    assert spec == plain
