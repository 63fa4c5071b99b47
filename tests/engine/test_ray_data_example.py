"""examples/ray_data_offline.py: a dataset of prompts mapped through DSBD engines in Ray actors.

Two actors, each with its own engine (the speculative tiny pair), rows of beam
search (T 0) and seeded beam sampling (T 1) mixed in
batches of 3: every row's hypotheses equal the same request on a
single-process engine.
"""

from __future__ import annotations

import pytest
from beam_checks import PROMPTS  # tests/engine/beam_checks.py

pytestmark = pytest.mark.engine

# Each engine actor's reservation from the cluster's memory budget (conftest.RAY_MEMORY): a tiny speculative
# engine's processes hold about 1.5 GB.
ACTOR_MEMORY = 2 << 30


def test_ray_data_outputs_equal_a_single_process_engine(ray_cluster, dsbd_tiny_spec_kwargs, dsbd_tiny_spec_llm):
    from ray_data_offline import decode, sampling_params  # examples/ (on the path of the Ray workers too)

    rows = [{"id": i, "prompt": prompt, "width": width, "temperature": temperature,
             "seed": seed if temperature > 0 else -1, "max_tokens": 12}
            for i, (prompt, width, temperature, seed) in enumerate(
                (prompt, width, temperature, 10 * k + width)
                for k, prompt in enumerate(PROMPTS) for width, temperature in ((4, 0.0), (2, 1.0), (4, 1.0)))]
    # no silent restarts: an actor killed (by Ray's memory monitor, say) fails the test with Ray's error
    got = decode(rows, dsbd_tiny_spec_kwargs, num_engines=2, batch_size=3, max_restarts=0,
                 memory=ACTOR_MEMORY)

    assert [r["id"] for r in got] == [r["id"] for r in rows]
    want = dsbd_tiny_spec_llm.generate(
        [r["prompt"] for r in rows],
        [sampling_params(r["width"], r["temperature"], None if r["seed"] < 0 else r["seed"], r["max_tokens"])
         for r in rows], use_tqdm=False)
    for row, g, w in zip(rows, got, want):
        assert g["token_ids"] == [list(c.token_ids) for c in w.outputs], row
        assert g["texts"] == [c.text for c in w.outputs], row
    assert len({tuple(map(tuple, g["token_ids"])) for g in got}) == len(rows)  # no row decoded like another
