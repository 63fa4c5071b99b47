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
SEED = 0  # hypothesis is pinned: the same batches on every run


def test_fuzzed_batches_are_answered_or_refused_by_name_and_leave_the_engine_serving(dsbd_tiny_spec_llm):
    tally = Tally()
    run_fuzz(Offline(dsbd_tiny_spec_llm, lambda llm: engine_metric(llm, "vllm:kv_cache_usage_perc")), EXAMPLES, SEED,
             tally)
    assert tally.requests >= EXAMPLES and tally.engine_deaths == 0 and tally.kv_leaks == 0
    outcomes = {outcome for (_, outcome), count in tally.outcomes.items() if count}
    assert {"answered", "refused"} <= outcomes  # the draws reach both sides
    assert {kind for (kind, outcome), count in tally.outcomes.items() if outcome == "answered"} == set(KINDS)
    assert tally.twins_compared > 0
