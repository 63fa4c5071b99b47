"""examples/dsbd_offline.py and examples/mjsd_offline.py on the engine they build (the default target drafted
by the shipped EAGLE-3 head), short: each comparison returns what its printout claims."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.model]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    """The module examples/{name}.py (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dsbd_example_gives_in_engine_beam_search_s_beams_and_vllm_s_loop_s(shipped_head_llm):
    dsbd_offline = example("dsbd_offline")
    prompt = dsbd_offline.PROMPTS[0]
    rows = dsbd_offline.compare(shipped_head_llm, [prompt], width=2, max_tokens=6)
    assert list(rows) == ["vLLM LLM.beam_search loop", "in-engine beam search", "DSBD beam search",
                          "in-engine beam sampling", "DSBD beam sampling (fixed width)"]
    assert all(seconds > 0 for seconds, _ in rows.values())
    search = rows["DSBD beam search"][1]
    assert search == rows["in-engine beam search"][1]  # lossless (float32 here)
    assert len(search[0]) == 2 and all(search[0])
    prompt_len = len(shipped_head_llm.get_tokenizer()(prompt)["input_ids"])
    assert [tokens[prompt_len:] for tokens in rows["vLLM LLM.beam_search loop"][1][0]] == search[0]
    for name in ("in-engine beam sampling", "DSBD beam sampling (fixed width)"):
        assert len(rows[name][1][0]) == 2, name


def test_the_mjsd_example_gives_greedy_s_tokens_at_temperature_0(shipped_head_llm):
    mjsd_offline = example("mjsd_offline")
    rows = mjsd_offline.compare(shipped_head_llm, mjsd_offline.PROMPTS[:1], max_tokens=8)
    assert rows["MJSD, T 0"][1] == rows["vLLM greedy"][1]
    assert all(0 < len(tokens[0]) <= 8 for _, tokens in rows.values())
