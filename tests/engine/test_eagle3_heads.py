"""EAGLE-3 heads written by ``tests/eagle3_heads.py`` are heads vLLM runs: its own greedy speculative decoding
(``method: "eagle3"``) with a random head in either checkpoint layout returns the target's greedy tokens,
and the permutation head is right at depth 1 (DSBD drafting with heads: tests/engine/test_dsbd_eagle3.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

PROMPTS = ["hello there", "The capital of France is", "def add(a, b):"]


@pytest.mark.parametrize("layout", ["speculators", "eagle3"])
def test_vllm_eagle3_speculative_decoding_runs_a_written_head(engine_pool, tiny_pair, tiny_llm, tmp_path, layout):
    from eagle3_heads import write_tiny_head  # tests/eagle3_heads.py
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import engine_kwargs

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False)]
    head = write_tiny_head(tiny_pair.target, tmp_path / layout, layout)
    llm = engine_pool.get(f"eagle3_{layout}_llm", lambda: LLM(**{
        **engine_kwargs(str(tiny_pair.target)), "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20,
        "speculative_config": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}}))
    hf_config = llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config
    assert hf_config.draft_vocab_size == 1024 and hf_config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want


def test_vllm_eagle3_accepts_the_permutation_heads_first_drafts(engine_pool, tiny_pair, tmp_path_factory):
    """The head that DSBD's feature test uses (tests/engine/test_dsbd_eagle3.py) is right at depth 1 in vLLM's
    own eagle3 decoding too: both feed it the target's feature of the position before the token."""
    from beam_checks import engine_metric  # tests/engine/beam_checks.py
    from eagle3_heads import write_permutation_head, write_permutation_target
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import engine_kwargs

    def start():
        root = tmp_path_factory.mktemp("vllm-permutation")
        target = write_permutation_target(tiny_pair.target, root / "target")
        return LLM(**{**engine_kwargs(str(target)), "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20,
                      "disable_log_stats": False, "speculative_config": {
                          "method": "eagle3", "model": str(write_permutation_head(target, root / "head")),
                          "num_speculative_tokens": 2}})

    llm = engine_pool.get("eagle3_permutation_llm", start)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    drafts = engine_metric(llm, "vllm:spec_decode_num_drafts")
    assert drafts >= 8 * len(PROMPTS)
    assert engine_metric(llm, "vllm:spec_decode_num_accepted_tokens") == drafts  # depth 1 always, depth 2 never
