"""DSBD on vLLM's own Ray executor: tensor parallel 2 on CPU, the tiny pair, W up to 8, γ 2.

vLLM 0.32 refuses Ray on CPU (its CPU platform names no Ray device);
tests/ray_shim.py gets past that for the tests only and says exactly what it
changes. The engine core runs in this process so that the executor it creates
is the shimmed one; the workers are Ray actors (RayExecutorV2: message queues
for the scheduler's output, collective RPCs, gloo for the tensor-parallel
collectives). Checked: the plugin registers in the actors; T = 0 is vLLM's
beam search on a single-process engine token for token; seeded T > 0
reproduces; every rank decides alike (and a planted rank-dependent seed is
caught); aborted requests free their KV. First, with an EAGLE-3 head drafting
inside the verify step (the permutation pair, tests/engine/conftest.py): every
draft after a prompt's first iteration is accepted, as on one process.
"""

from __future__ import annotations

import json

import pytest
from beam_checks import (  # tests/engine/beam_checks.py
    PROMPTS, assert_kv_freed_after_finish_and_abort, assert_the_permutation_head_is_right_after_each_prompt,
    beam_search, engine_metric, start_permutation_llm, start_spec_llm, tiny_draft_two_heads,
)

pytestmark = pytest.mark.engine

GAMMA = 2


RAY_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""VLLM_ENABLE_V1_MULTIPROCESSING 0: the engine core, and so the executor, in this process."""


def _start_on_ray(start):
    """``start(env, **engine_overrides)`` on vLLM's Ray executor with TP 2, through the shim."""
    import ray_shim  # tests/ray_shim.py
    import vllm.envs

    ray_shim.apply()
    # An in-process engine core caches vLLM's environment variables: uncache them once it has started.
    try:
        return start(RAY_ENV, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        vllm.envs.disable_envs_cache()


def test_a_head_drafting_in_the_verify_step_on_the_ray_executor(ray_cluster, tiny_pair, tmp_path):
    """First in this module (its engine is shut down before the module's own starts): on the permutation
    pair every draft after a prompt's first iteration is right, and both ranks decided alike."""
    llm = _start_on_ray(lambda env, **kw: start_permutation_llm(tiny_pair.target, tmp_path, env,
                                                                knobs={"draft_in_step": True}, **kw))
    try:
        empty = llm.collective_rpc("dsbd_record_decisions")
        assert_the_permutation_head_is_right_after_each_prompt(llm)
        digests = llm.collective_rpc("dsbd_decisions_digest")
        assert len(digests) == 2 and digests[0] == digests[1] != empty[0]
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def ray_tp2_llm(ray_cluster, tiny_eos_target):
    llm = _start_on_ray(lambda env, **kw: start_spec_llm(tiny_eos_target, tiny_draft_two_heads(), env,
                                                         gamma=GAMMA, **kw))
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_the_engine_runs_on_ray_actors_where_the_plugin_registered(ray_tp2_llm, register_trace):
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    assert isinstance(ray_tp2_llm.llm_engine.engine_core.engine_core.model_executor, RayExecutorV2)
    from ray_shim import worker_pid

    pids = ray_tp2_llm.collective_rpc(worker_pid)
    registered = {json.loads(line)["pid"] for line in register_trace.read_text().splitlines()}
    assert len(set(pids)) == 2 and set(pids) <= registered


@pytest.mark.parametrize("width", [2, 4, 8])
def test_lossless_speculative_beam_search_on_the_ray_executor(ray_tp2_llm, tiny_eos_llm, width):
    before = engine_metric(ray_tp2_llm, "vllm:spec_decode_num_drafts")
    got = beam_search(ray_tp2_llm, PROMPTS, width, 10)
    assert engine_metric(ray_tp2_llm, "vllm:spec_decode_num_drafts") > before  # it speculated
    want = beam_search(tiny_eos_llm, PROMPTS, width, 10)
    for w, g in zip(want, got):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]


def _sampled(seed: int, max_tokens: int = 12, **extra):
    from vllm import SamplingParams

    return SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=max_tokens,
                          extra_args={"beam_width": 8, "num_speculative_tokens": GAMMA, **extra})


def test_seeded_speculative_beam_sampling_reproduces_on_the_ray_executor(ray_tp2_llm):
    params = [_sampled(seed, **extra) for seed in range(3) for extra in ({}, {"fixed_width": True})]
    first = ray_tp2_llm.generate([PROMPTS[1]] * len(params), params, use_tqdm=False)
    again = ray_tp2_llm.generate([PROMPTS[1]] * len(params), params, use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in first]
    assert tokens == [[c.token_ids for c in o.outputs] for o in again]
    assert len({tuple(map(tuple, t)) for t in tokens}) > 1  # the seeds matter


def test_aborted_requests_free_their_kv_on_the_ray_executor(ray_tp2_llm):
    assert_kv_freed_after_finish_and_abort(ray_tp2_llm, _sampled(1), lambda i: _sampled(i, max_tokens=200),
                                           "abort-ray")


def _digests_after_sampling(llm, seed: int) -> list[str]:
    llm.generate(PROMPTS, _sampled(seed), use_tqdm=False)
    return llm.collective_rpc("dsbd_decisions_digest")


def test_every_rank_decides_alike_and_a_rank_dependent_seed_is_caught(ray_tp2_llm):
    """Last in this module: the planted run leaves the ranks' running digests apart for good."""
    from ray_shim import plant_rank_dependent_seed

    before = ray_tp2_llm.collective_rpc("dsbd_record_decisions")
    after = _digests_after_sampling(ray_tp2_llm, 7)
    assert len(after) == 2 and after[0] == after[1] and after != before
    ray_tp2_llm.collective_rpc(plant_rank_dependent_seed, args=(True,))
    try:
        planted = _digests_after_sampling(ray_tp2_llm, 7)
    finally:
        ray_tp2_llm.collective_rpc(plant_rank_dependent_seed, args=(False,))
    assert planted[0] != planted[1]
