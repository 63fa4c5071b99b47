"""Wide beams (W 64 and 128): the engine's beam search equals vLLM's built-in loop; sampling works."""

from __future__ import annotations

import pytest

from beam_checks import EOS, PROMPTS, assert_kv_freed_after_finish_and_abort  # tests/engine/beam_checks.py

pytestmark = pytest.mark.engine

MAX_WIDTH = 128


@pytest.fixture
def wide_llm(engine_pool, tiny_eos_target):
    """A DSBD beam engine allowing W 128; max_logprobs 2W so vLLM's own loop can run on it too."""
    from vllm import LLM

    from vllm_dsbd.demo import beam_engine_kwargs

    return engine_pool.get("wide_llm", lambda: LLM(**{
        **beam_engine_kwargs(str(tiny_eos_target), MAX_WIDTH), "max_model_len": 512,
        "kv_cache_memory_bytes": 256 << 20, "max_logprobs": 2 * MAX_WIDTH, "max_num_seqs": 2 * MAX_WIDTH,
        "disable_log_stats": False}))


@pytest.mark.parametrize("width", [64, MAX_WIDTH])
def test_wide_beam_search_equals_vllm_builtin_loop(wide_llm, width):
    from vllm.sampling_params import BeamSearchParams

    from vllm_dsbd.entrypoints.beam_search import vllm_builtin_beam_search

    prompts = [{"prompt": p} for p in PROMPTS[:2]]
    params = BeamSearchParams(beam_width=width, max_tokens=5)
    want = vllm_builtin_beam_search(wide_llm, prompts, params)  # vLLM's front-end loop, unchanged
    got = wide_llm.beam_search(prompts, params)  # the engine's beam groups
    for w, g in zip(want, got):
        assert len(g.sequences) == width
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx([s.cum_logprob for s in w.sequences], abs=1e-3)
    assert any(s.tokens[-1] == EOS for out in got for s in out.sequences)  # EOS finishes some hypotheses


def test_wide_beam_sampling_returns_n_best_reproducibly(wide_llm):
    from vllm import SamplingParams

    params = SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=3, extra_args={"beam_width": MAX_WIDTH})
    first, again = (wide_llm.generate(PROMPTS[:2], params, use_tqdm=False) for _ in range(2))
    for a, b in zip(first, again):
        assert len(a.outputs) == 8
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert all(1 <= len(o.token_ids) <= 6 for o in a.outputs)


def test_wide_groups_free_their_kv_after_finishing_and_aborts(wide_llm):
    from vllm import SamplingParams

    assert_kv_freed_after_finish_and_abort(
        wide_llm, SamplingParams(n=2, temperature=0.0, max_tokens=8, extra_args={"beam_width": MAX_WIDTH}),
        lambda i: SamplingParams(n=4, temperature=1.0, max_tokens=200, seed=i, extra_args={"beam_width": MAX_WIDTH}),
        prefix="wide")
