"""Speculative beam groups under memory pressure: preempted mid-iteration, resumed, and what the runner holds.

An engine whose KV cache fits only part of the batch preempts groups in every phase (draft steps, verify
steps, in-step drafting). A preempted group restarts its iteration from its beams; its randomness is keyed
by (seed, iteration, layer), so every output, T 0 and seeded T > 0 alike, equals the same request's output
on a roomy engine. After finishing, aborting and preempting, the runner holds no draft joints for finished
groups, and its stop-checker cache stays bounded.
"""

from __future__ import annotations

import pytest
from beam_checks import PROMPTS, engine_metric  # tests/engine/beam_checks.py

pytestmark = pytest.mark.engine

def _jobs():
    """Every speculative mode, seeded: T 0 (fixed and auto depth), fixed and dynamic width, memory-efficient,
    MJSD with a stop string; three prompts each, long enough to be preempted mid-way; and plain requests."""
    from vllm import SamplingParams

    def beams(width, gamma, temperature=0.0, n=None, seed=None, **extra):
        return SamplingParams(n=n or width, temperature=temperature, seed=seed, max_tokens=48, ignore_eos=True,
                              extra_args={"beam_width": width, "num_speculative_tokens": gamma, **extra})

    modes = [beams(4, 3), beams(3, 2, auto_depth=True),
             beams(4, 2, 1.0, seed=1, fixed_width=True), beams(4, 3, 0.9, seed=2),
             beams(4, 2, 1.0, n=1, seed=3, memory_efficient=True),
             SamplingParams(temperature=1.0, seed=4, max_tokens=48, ignore_eos=True, stop=["zz"],
                            extra_args={"decoder": "mjsd", "beam_width": 3, "num_speculative_tokens": 2})]
    plain = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)  # grows until vLLM must preempt
    jobs = []
    for k, params in enumerate(modes):
        jobs += [(PROMPTS[k % 2], plain)] + [(prompt, params) for prompt in PROMPTS]
    return jobs


def _held(llm) -> dict:
    return llm.collective_rpc("dsbd_held_state")[0]


def _assert_preempted_groups_resume_as_on_a_roomy_engine(tight, roomy):
    jobs = _jobs()
    got = tight.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    assert engine_metric(tight, "vllm:num_preemptions") > 0, "the test did not put the KV cache under pressure"
    want = roomy.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    for (_, params), g, w in zip(jobs, got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], params.extra_args
    assert _held(tight)["draft_store_groups"] == 0


def test_preempted_speculative_groups_of_a_draft_model_resume_to_the_same_outputs(tight_spec_llm,
                                                                                  dsbd_tiny_spec_llm):
    _assert_preempted_groups_resume_as_on_a_roomy_engine(tight_spec_llm, dsbd_tiny_spec_llm)


def test_preempted_speculative_groups_of_a_head_drafting_in_step_resume_to_the_same_outputs(tight_in_step_llm,
                                                                                           in_step_llm):
    _assert_preempted_groups_resume_as_on_a_roomy_engine(tight_in_step_llm, in_step_llm)


def test_aborted_groups_leave_no_draft_joints_in_the_runner(dsbd_tiny_spec_llm):
    """Groups aborted mid-iteration are forgotten even when the step that says so schedules no token (the
    runner returns before sampling there)."""
    from vllm import SamplingParams

    engine = dsbd_tiny_spec_llm.llm_engine
    ids = [f"abort-held-{i}" for i in range(len(PROMPTS))]
    for i, (rid, prompt) in enumerate(zip(ids, PROMPTS)):
        engine.add_request(rid, prompt, SamplingParams(
            n=4, temperature=1.0, seed=i, max_tokens=200, ignore_eos=True,
            extra_args={"beam_width": 4, "num_speculative_tokens": 3}))
    try:
        for _ in range(40):
            engine.step()
            if _held(dsbd_tiny_spec_llm)["draft_store_groups"] == len(ids):
                break
        assert _held(dsbd_tiny_spec_llm)["draft_store_groups"] == len(ids)
    finally:
        engine.abort_request(ids, internal=False)
    for _ in range(3):  # the step after the aborts schedules no token: it only reports them finished
        engine.step()
    assert not engine.has_unfinished_requests()
    assert _held(dsbd_tiny_spec_llm)["draft_store_groups"] == 0


def test_a_speculative_fork_without_a_free_block_does_not_stall_its_group(pressure_spec_llm, dsbd_tiny_spec_llm):
    """Wide groups beside plain requests that have grown into their room: a beam or draft node forked without a
    free block cannot recompute its KV in a draft step, so the fork preempts a plain request the step did not
    run, or else its group, and every request finishes (the engine stalled here, drafting forever). The
    outputs are the roomy engine's."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    plain = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    wide = SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY,  # all 8 beams at once, as generate() asks
                          extra_args={"beam_width": 8, "num_speculative_tokens": 3, "fixed_width": True})
    jobs = [("word " * 200, plain)] * 3 + [(prompt, wide) for prompt in PROMPTS[:2]]
    engine = pressure_spec_llm.llm_engine
    preempted = engine_metric(pressure_spec_llm, "vllm:num_preemptions")
    ids = [f"no-stall-{i}" for i in range(len(jobs))]
    for rid, (prompt, params) in zip(ids, jobs):
        engine.add_request(rid, prompt, params)
    got = {}
    try:
        for _ in range(1000):  # the plain requests need about 300 steps, the groups far fewer
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = [c.token_ids for c in out.outputs]
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), f"stalled: {sorted(set(ids) - set(got))} unfinished"
    finally:
        engine.abort_request(ids, internal=False)
    assert engine_metric(pressure_spec_llm, "vllm:num_preemptions") > preempted
    want = dsbd_tiny_spec_llm.generate([p for p, _ in jobs[3:]], [s for _, s in jobs[3:]], use_tqdm=False)
    assert [got[rid] for rid in ids[3:]] == [[c.token_ids for c in w.outputs] for w in want]
    assert _held(pressure_spec_llm)["draft_store_groups"] == 0
