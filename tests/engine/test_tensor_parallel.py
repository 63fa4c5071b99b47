"""DSBD with speculation on a tensor-parallel engine (TP 2, vLLM's multiprocessing executor, CPU).

Every rank runs the draft and target shards, gathers the full logits and
makes the group decisions itself (seeded per group and step); each rank feeds
its own decisions back as the next input tokens, so the ranks must decide
alike. Checked: both ranks' running hashes of their decisions are equal,
T = 0 stays token for token vLLM's beam search on a single-process engine,
and T > 0 requests reproduce for a seed. The same on vLLM's Ray executor:
test_ray_executor.py.
"""

from __future__ import annotations

import pytest
from beam_checks import (  # tests/engine/beam_checks.py
    PROMPTS, beam_search, engine_metric, start_spec_llm, tiny_draft_two_heads,
)

pytestmark = pytest.mark.engine


@pytest.fixture
def tp2_llm(engine_pool, tiny_eos_target):
    # vLLM's CPU workers bind threads per NUMA node; this machine has one, so each rank gets a core by hand
    return engine_pool.get("tp2_llm", lambda: start_spec_llm(
        tiny_eos_target, tiny_draft_two_heads(), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, tensor_parallel_size=2,
        distributed_executor_backend="mp"), alone=True)


@pytest.mark.parametrize("width", [2, 4])
def test_lossless_speculative_beam_search_with_tensor_parallelism(tp2_llm, tiny_eos_llm, width):
    before = engine_metric(tp2_llm, "vllm:spec_decode_num_drafts")
    got = beam_search(tp2_llm, PROMPTS, width, 10)
    assert engine_metric(tp2_llm, "vllm:spec_decode_num_drafts") > before  # it speculated
    want = beam_search(tiny_eos_llm, PROMPTS, width, 10)
    for w, g in zip(want, got):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]


def test_speculative_beam_sampling_with_tensor_parallelism_reproduces_for_a_seed(tp2_llm):
    from vllm import SamplingParams

    params = [SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=12,
                             extra_args={"beam_width": 4, "num_speculative_tokens": 3, **extra})
              for seed in range(3) for extra in ({}, {"fixed_width": True})]
    first = tp2_llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
    again = tp2_llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
    texts = [[c.token_ids for c in o.outputs] for o in first]
    assert texts == [[c.token_ids for c in o.outputs] for o in again]
    assert len({tuple(map(tuple, t)) for t in texts}) > 1  # the seeds matter


def test_every_rank_made_the_same_decisions(tp2_llm):
    from vllm import SamplingParams

    before = tp2_llm.collective_rpc("dsbd_decisions_digest")
    tp2_llm.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12,
                                             extra_args={"beam_width": 4, "num_speculative_tokens": 2}),
                     use_tqdm=False)
    after = tp2_llm.collective_rpc("dsbd_decisions_digest")
    assert len(after) == 2 and after[0] == after[1] and after != before
