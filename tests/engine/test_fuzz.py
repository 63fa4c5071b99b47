"""Property-based fuzzing (hypothesis) of request batches on the speculative tiny engine: seeded and bounded.

Every decoder, the options users send and the DSBD / MJSD knobs with good and
bad values, mixed in batches with aborts (``benchmarks/fuzz.py``; its long run
is a script, see docs/testing.md). Each request is answered with its
guarantees holding, or refused naming one of its options; T 0 speculation
returns what γ 0 returns, T 0 MJSD the greedy text; after every batch the
engine serves and holds no KV.
"""

from __future__ import annotations

import pytest
from beam_checks import engine_metric, start_spec_llm  # tests/engine/beam_checks.py

from benchmarks.fuzz import KINDS, PRESSURE_BALLAST, PRESSURE_KV_BYTES, Offline, Tally, run_fuzz

pytestmark = pytest.mark.engine

EXAMPLES = 150
HEAD_EXAMPLES = 100
PRESSURE_EXAMPLES = 6
SEED = 0  # hypothesis is pinned: the same batches on every run


def test_fuzzed_batches_are_answered_or_refused_by_name_and_leave_the_engine_serving(dsbd_tiny_spec_llm):
    _assert_fuzzed_batches_pass(dsbd_tiny_spec_llm, EXAMPLES)


def test_fuzzed_batches_on_a_head_drafting_inside_the_verify_step(in_step_llm):
    """The same on an engine drafting with a random EAGLE-3 head, ``draft_in_step`` on (requests may turn
    it off): in-step forests, MJSD and memory-efficient requests drafted in-step, mixed with the rest."""
    _assert_fuzzed_batches_pass(in_step_llm, HEAD_EXAMPLES)


@pytest.mark.parametrize("engine", ["pressure_spec_llm", "pressure_in_step_llm"])
def test_fuzzed_batches_under_memory_pressure(request, engine):
    """The same on engines whose KV cache fits a third of a batch with the plain requests growing beside it:
    vLLM preempts beam groups mid-iteration (a draft model in draft steps; a head drafting in-step), and
    every request still keeps its guarantees, no KV and no draft joint is left behind."""
    tally = _assert_fuzzed_batches_pass(request.getfixturevalue(engine), PRESSURE_EXAMPLES, PRESSURE_BALLAST,
                                        all_kinds=False)
    assert tally.preemptions > 0


@pytest.fixture
def pressure_in_step_llm(engine_pool, tiny_eos_target, heads):
    """``in_step_llm`` (a random head drafting inside the verify step) with the fuzzing's tight KV cache."""
    return engine_pool.get("pressure_in_step_llm", lambda: start_spec_llm(
        tiny_eos_target, heads["speculators"], {}, knobs={"draft_in_step": True},
        kv_cache_memory_bytes=PRESSURE_KV_BYTES))


def _assert_fuzzed_batches_pass(llm, examples: int, ballast: int = 0, all_kinds: bool = True) -> Tally:
    """``examples`` seeded batches, each with ``ballast`` growing plain requests beside it; ``all_kinds``: the
    draws must also reach every decoder and a T 0 twin (the long unpressured runs)."""
    tally = Tally()
    run_fuzz(Offline(llm, engine_metric), examples, SEED, tally,
             ballast=ballast)
    assert tally.requests >= examples and tally.engine_deaths == 0 and tally.kv_leaks == 0
    assert tally.store_leaks == 0
    outcomes = {outcome for (_, outcome), count in tally.outcomes.items() if count}
    assert {"answered", "refused"} <= outcomes  # the draws reach both sides
    if all_kinds:  # the long runs: every decoder answered, T 0 speculation compared with γ 0
        assert {kind for (kind, outcome), count in tally.outcomes.items() if outcome == "answered"} == set(KINDS)
        assert tally.twins_compared > 0
    return tally
