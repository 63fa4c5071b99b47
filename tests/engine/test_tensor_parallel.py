"""DSBD with speculation on a tensor-parallel engine (TP 2, vLLM's multiprocessing executor, CPU).

Every rank runs the draft and target shards, gathers the full logits and
makes the group decisions itself (seeded per group and step); each rank feeds
its own decisions back as the next input tokens, so the ranks must decide
alike. Checked: both ranks' running hashes of their decisions are equal,
T = 0 stays token for token vLLM's beam search on a single-process engine,
and T > 0 requests reproduce for a seed. The same on vLLM's Ray executor:
test_ray_executor.py. With an EAGLE-3 head drafting inside the verify step
(the permutation pair, tests/engine/conftest.py): every rank's head reads the
target's gathered features, so its drafts are as right as on one process.
"""

from __future__ import annotations

import pytest
from beam_checks import (  # tests/engine/beam_checks.py
    PROMPTS, assert_the_permutation_head_is_right_after_each_prompt, beam_search, engine_metric,
    start_permutation_llm, start_spec_llm, tiny_draft_two_heads,
)

pytestmark = pytest.mark.engine

TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core a rank (see tp2_llm)


@pytest.fixture
def tp2_llm(engine_pool, tiny_eos_target):
    # vLLM's CPU workers bind threads per NUMA node; this machine has one, so each rank gets a core by hand
    return engine_pool.get("tp2_llm", lambda: start_spec_llm(
        tiny_eos_target, tiny_draft_two_heads(), TP2_ENV, tensor_parallel_size=2,
        distributed_executor_backend="mp"), alone=True)


@pytest.fixture
def tp2_head_llm(engine_pool, tiny_pair, tmp_path_factory):
    """The permutation pair's engine (tests/engine/conftest.py) with ``draft_in_step``, on TP 2."""
    return engine_pool.get("tp2_head_llm", lambda: start_permutation_llm(
        tiny_pair.target, tmp_path_factory.mktemp("permutation-tp2"), TP2_ENV, knobs={"draft_in_step": True},
        tensor_parallel_size=2, distributed_executor_backend="mp"), alone=True)


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

    assert tp2_llm.collective_rpc("dsbd_decisions_digest") == [None, None]  # off until asked for
    before = tp2_llm.collective_rpc("dsbd_record_decisions")
    tp2_llm.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12,
                                             extra_args={"beam_width": 4, "num_speculative_tokens": 2}),
                     use_tqdm=False)
    after = tp2_llm.collective_rpc("dsbd_decisions_digest")
    assert len(after) == 2 and after[0] == after[1] and after != before


def _counts(llm) -> dict[str, float]:
    return {k: engine_metric(llm, f"vllm:spec_decode_num_{k}") for k in ("drafts", "draft_tokens", "accepted_tokens")}


def _generate_counting(llm, params):
    before = _counts(llm)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs], {k: v - before[k] for k, v in _counts(llm).items()}


def test_a_head_drafting_in_the_verify_step_reads_the_gathered_features_on_every_rank(tp2_head_llm):
    """After a prompt's first iteration every draft of the permutation head is right, as on one process,
    only if the head on each rank reads the target's features of the position before each token."""
    assert_the_permutation_head_is_right_after_each_prompt(tp2_head_llm)


KINDS = {  # n, temperature, extra_args beside γ 2
    "T 0": (4, 0.0, {"beam_width": 4}),
    "T 1": (4, 1.0, {"beam_width": 4}),
    "T 1 memory-efficient": (1, 1.0, {"beam_width": 4, "memory_efficient": True}),
    "MJSD T 0": (1, 0.0, {"decoder": "mjsd", "beam_width": 1, "mjsd_tau": 0.5}),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_head_drafting_in_the_verify_step_on_tp2_gives_what_one_process_gives(tp2_head_llm,
                                                                                 permutation_in_step_llm, kind):
    """γ 2, dynamic width (or MJSD): the same seeded requests give the same outputs and accept the same drafts
    on TP 2 as on one process, and both ranks made the same decisions."""
    from vllm import SamplingParams

    n, temperature, extra = KINDS[kind]
    params = [SamplingParams(n=n, temperature=temperature, seed=3 + i, max_tokens=12, ignore_eos=True,
                             extra_args={"num_speculative_tokens": 2, **extra})
              for i in range(len(PROMPTS))]
    digest = tp2_head_llm.collective_rpc("dsbd_record_decisions")
    got, counts = _generate_counting(tp2_head_llm, params)
    want, want_counts = _generate_counting(permutation_in_step_llm, params)
    assert got == want
    assert counts == want_counts and counts["accepted_tokens"] > 0, (counts, want_counts)
    after = tp2_head_llm.collective_rpc("dsbd_decisions_digest")
    assert after[0] == after[1] != digest[0]
