"""Every figure in the README's results table is the figure its run's JSON holds (read here, never copied).

Each row of the table names its run (A, B, C); the expected figures of a row are computed from that run's JSON
under ``benchmarks/results/`` and compared, in order, with every decimal number written in the row.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = {"A": "quick/summary.json", "B": "dsbd-head-13/dsbd.json", "C": "paired-quality-pooled/paired_quality.json"}
DECIMAL = re.compile(r"-?\d+\.\d+")


@cache
def run(name: str) -> dict:
    return json.loads((RESULTS / RUNS[name]).read_text())


def quick_ratio(slow: str, fast: str) -> str:
    """``fast`` against ``slow`` in run A: the ratio of their wall times, as the table writes it."""
    methods = run("A")["methods"]
    return f"{methods[slow]['wall_s'] / methods[fast]['wall_s']:.2f}"


def dsbd_row(method: str, temperature: float, auto_depth: bool = False, gamma: int | None = None) -> dict:
    rows = [r for r in run("B")["results"] if r["method"] == method and r["temperature"] == temperature
            and r["auto_depth"] == auto_depth and (gamma is None or r["gamma"] == gamma)]
    assert len(rows) == 1, (method, temperature, auto_depth, gamma, len(rows))
    return rows[0]


def speedup(method: str, temperature: float, auto_depth: bool = False, gamma: int | None = 1) -> str:
    return f"{dsbd_row(method, temperature, auto_depth, None if auto_depth else gamma)['speedup_vs_in_engine']:.2f}"


def mean_width(method: str) -> str:
    return f"{dsbd_row(method, 1.0, gamma=1)['mean_beam_width']:.2f}"


def expected_rows() -> dict[str, list[str]]:
    """Row label (its first cell, start) -> the decimal figures the row must show, in order."""
    paired = run("C")["summary"]["best_beam"]
    return {
        "in-engine beam search": [quick_ratio("vllm-beam-search", "dsbd-engine-beam-search"),
                                  quick_ratio("hf-beam-search", "dsbd-engine-beam-search")],
        "in-engine beam sampling": [quick_ratio("vllm-beam-search", "dsbd-engine-beam-sampling"),
                                    quick_ratio("hf-beam-sampling", "dsbd-engine-beam-sampling")],
        "DSBD beam search": [speedup("dsbd-fixed", 0.0)],
        "DSBD fixed width": [speedup("dsbd-fixed", 1.0), f"{paired['mean']:.3f}", f"{paired['se']:.3f}"],
        "DSBD dynamic width": [f"{run('B')['settings']['width_threshold']:.1f}", mean_width("dsbd-dynamic"),
                               speedup("dsbd-dynamic", 1.0)],
        "DSBD memory-efficient": [mean_width("dsbd-memory-efficient"), speedup("dsbd-memory-efficient", 1.0)],
        "DSBD `auto_depth`": [speedup("dsbd-auto-fixed", 0.0, auto_depth=True),
                              speedup("dsbd-auto-fixed", 1.0, auto_depth=True)],
    }


def results_section() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## Results\n(.*?)^## ", readme, re.S | re.M)
    assert match, "README.md has no '## Results' section"
    return match.group(1)


def table_rows(section: str) -> list[list[str]]:
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]  # header, rule


def test_the_runs_the_table_names_are_in_the_repository():
    for name, path in RUNS.items():
        assert (RESULTS / path).is_file(), f"run {name}: {path} is missing"


def test_every_row_of_the_results_table_equals_its_json():
    rows = table_rows(results_section())
    expected = expected_rows()
    assert len(rows) == len(expected), [r[0] for r in rows]
    for cells in rows:
        label = cells[0]
        key = next((k for k in expected if label.startswith(k)), None)
        assert key is not None, f"a row the test does not know: {label!r}"
        assert DECIMAL.findall(" ".join(cells)) == expected[key], f"row {label!r}"
        runs = set(re.findall(r"[A-Z]", cells[-1]))
        assert runs and runs <= set(RUNS), f"row {label!r} names no known run: {cells[-1]!r}"


def test_the_caption_states_each_runs_setting_and_date():
    section = results_section()
    a, b, c = run("A"), run("B"), run("C")
    assert a["settings"]["beam_width"] == b["settings"]["width"] == 4 and "beam width 4" in section
    assert a["settings"]["max_tokens"] == b["settings"]["max_tokens"] == 32
    assert a["prompt_set"]["num_prompts"] == b["settings"]["num_prompts"] == 4 and "4 prompts x 32 tokens" in section
    assert a["settings"]["batch_size"] == 1 and b["settings"]["batch"].startswith("1 ") and "batch 1" in section
    assert a["machine"]["cpu"] == b["machine"]["cpu"] == c["machine"]["cpu"] == "AMD EPYC"
    assert f"`benchmarks/results/quick/` ({a['created'][:10]}, {a['settings'].get('dtype', 'float32')}" in section
    assert f", {b['settings']['dtype'].replace('bfloat16', 'bf16')} on an EPYC" in section
    assert b["settings"]["repeat"] == 2 and "2 timed repeats" in section
    assert b["settings"]["compiled"] and "run B in vLLM's default compiled mode" in " ".join(section.split())
    assert f"{c['summary']['best_beam']['n']:,} paired requests" in section
    assert c["settings"]["width"] == 4 and c["settings"]["dtype"] == "float32"


@pytest.mark.parametrize("text, figures", [("| 3.20x | -0.012 ± 0.010 | τ 0.7 | 1,032 |", ["3.20", "-0.012", "0.010",
                                                                                            "0.7"])])
def test_the_figures_of_a_row_are_its_decimal_numbers(text, figures):
    assert DECIMAL.findall(text) == figures
