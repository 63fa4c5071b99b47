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
from beam_checks import engine_metric  # tests/engine/beam_checks.py

from benchmarks.fuzz import KINDS, Offline, Tally, run_fuzz

pytestmark = pytest.mark.engine

EXAMPLES = 150
HEAD_EXAMPLES = 100
SEED = 0  # hypothesis is pinned: the same batches on every run


def test_fuzzed_batches_are_answered_or_refused_by_name_and_leave_the_engine_serving(dsbd_tiny_spec_llm):
    _assert_fuzzed_batches_pass(dsbd_tiny_spec_llm, EXAMPLES)


def test_fuzzed_batches_on_a_head_drafting_inside_the_verify_step(in_step_llm):
    """The same on an engine drafting with a random EAGLE-3 head, ``draft_in_step`` on (requests may turn
    it off): in-step forests, MJSD and memory-efficient requests drafted in-step, mixed with the rest."""
    _assert_fuzzed_batches_pass(in_step_llm, HEAD_EXAMPLES)


def _assert_fuzzed_batches_pass(llm, examples: int) -> None:
    tally = Tally()
    run_fuzz(Offline(llm, lambda engine: engine_metric(engine, "vllm:kv_cache_usage_perc")), examples, SEED, tally)
    assert tally.requests >= examples and tally.engine_deaths == 0 and tally.kv_leaks == 0
    outcomes = {outcome for (_, outcome), count in tally.outcomes.items() if count}
    assert {"answered", "refused"} <= outcomes  # the draws reach both sides
    assert {kind for (kind, outcome), count in tally.outcomes.items() if outcome == "answered"} == set(KINDS)
    assert tally.twins_compared > 0
