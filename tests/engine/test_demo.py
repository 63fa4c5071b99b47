"""`vllm-dsbd demo` (the README's main job) end to end on the default pair: its DSBD rows draft with the
shipped EAGLE-3 head under auto_depth and give in-engine beam search's outputs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.model]


def test_the_demo_runs_dsbd_with_the_shipped_head_and_checks_its_outputs(engine_pool, target_path):
    """... and, with its default ``--dtype auto``, prints the machine's dtype with its reason and runs in it."""
    from vllm_dsbd import models
    from vllm_dsbd.dtypes import machine_dtype

    engine_pool.clear()  # the demo starts two engines of its own, one after the other

    out = subprocess.run([sys.executable, "-m", "vllm_dsbd.cli", "demo", "--beam-width", "2", "--max-tokens", "6",
                          "--num-speculative-tokens", "1", "--enforce-eager"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"(draft {models.default_head_path()}, auto depth γ ≤ 1)" in out.stdout
    assert "=== DSBD beam search (W=2, auto depth γ ≤ 1, lossless)" in out.stdout
    assert "x the speed of in-engine beam search, the same outputs." in out.stdout, out.stdout[-2000:]
    assert "x the speed of in-engine beam sampling" in out.stdout
    assert "Each row ran once untimed first, then 3 times (its median time above)" in out.stdout
    choice = machine_dtype()
    assert f"dtype: {choice.dtype} ({choice.reason})" in out.stdout
    assert f"(model {target_path}, {choice.dtype}, eager (--enforce-eager))" in out.stdout
    assert f"6 tokens each, {choice.dtype}, eager;" in out.stdout
