"""benchmarks/paired_quality.py: its paired statistics and the pooling of parts, on hand-made results.

No engine starts; the expected values are worked out by hand from the records below.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import paired_quality


def _part(tmp_path, name, seed, diffs, **settings):
    """A part's result folder: one record per difference (DSBD's best and mean beam ``diff`` above beam
    sampling's -1.0), seeds from ``seed``."""
    records = [{"prompt": "p", "seed": seed + k, "beam_best": -1.0, "beam_mean": -1.0,
                "dsbd_best": -1.0 + d, "dsbd_mean": -1.0 + d} for k, d in enumerate(diffs)]
    counters = {"accepted_tokens": 3.0, "draft_tokens": 4.0, "beam_layers": 6.0, "drafts": 4.0}
    result = {"benchmark": "paired_quality",
              "settings": {"pair": "qwen2.5-coder", "width": 4, "gamma": 1, "pairs": len(records), "seed": seed,
                           "omp_threads_bind": "auto", **settings},
              "machine": {"cpu": "test"}, "complete": False,
              "summary": paired_quality.summarize(records, counters, {"beam": 1.0, "dsbd": 2.0}, 0.02, quiet=True),
              "records": records}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "paired_quality.json").write_text(json.dumps(result))
    return folder


def test_paired_stats_by_hand():
    s = paired_quality.paired_stats([0.1, -0.1, 0.3, -0.3], detect=0.2)
    # mean 0, sample variance (0.01 + 0.01 + 0.09 + 0.09) / 3 = 0.2 / 3, se = sqrt(0.2 / 3 / 4)
    se = math.sqrt(0.2 / 12)
    assert s["n"] == 4 and s["mean"] == pytest.approx(0.0, abs=1e-12) and s["se"] == pytest.approx(se)
    assert s["ci95"] == pytest.approx([-paired_quality.Z95 * se, paired_quality.Z95 * se])
    z = 0.2 / se
    assert s["power_to_detect"] == pytest.approx(paired_quality._normal_cdf(z - paired_quality.Z95)
                                                 + paired_quality._normal_cdf(-z - paired_quality.Z95))
    # pairs for 0.80: ((1.96 + 0.84) x sd / detect)^2, sd = sqrt(0.2 / 3)
    expected = math.ceil(((paired_quality.Z95 + paired_quality.Z80) * math.sqrt(0.2 / 3) / 0.2) ** 2)
    assert s["pairs_for_80pct_power"] == expected


def test_parts_on_other_worker_cores_pool_into_one_result(tmp_path):
    a = _part(tmp_path, "a", 0, [0.1, 0.3])
    b = _part(tmp_path, "b", 2, [-0.1, -0.3], omp_threads_bind="0-1")
    pooled = paired_quality.pool([a, b], detect=0.2)
    assert pooled["settings"]["pairs"] == 4
    assert pooled["settings"]["seed"] == [0, 2]
    assert pooled["settings"]["omp_threads_bind"] == ["auto", "0-1"]
    best, expected = pooled["summary"]["best_beam"], paired_quality.paired_stats([0.1, 0.3, -0.1, -0.3], 0.2)
    assert best["n"] == 4 and best["pairs_for_80pct_power"] == expected["pairs_for_80pct_power"]
    for key in ("mean", "se", "power_to_detect"):
        assert best[key] == pytest.approx(expected[key], abs=1e-12)
    assert pooled["summary"]["counters"]["accepted_tokens"] == 6.0
    assert pooled["summary"]["seconds"] == {"beam": 2.0, "dsbd": 4.0}


def test_parts_that_differ_in_a_method_setting_or_repeat_pairs_do_not_pool(tmp_path):
    a = _part(tmp_path, "a", 0, [0.1, 0.3])
    wider = _part(tmp_path, "wider", 2, [0.1], width=8)
    with pytest.raises(SystemExit, match="width"):
        paired_quality.pool([a, wider], detect=0.02)
    again = _part(tmp_path, "again", 1, [0.2])  # seed 1 of prompt "p" is already in part a
    with pytest.raises(SystemExit, match="repeats"):
        paired_quality.pool([a, again], detect=0.02)


def test_parts_of_two_dtypes_pool_only_when_asked(tmp_path):
    a = _part(tmp_path, "a", 0, [0.1, 0.3], dtype="float32", dtype_reason="no native bf16")
    b = _part(tmp_path, "b", 2, [-0.1], dtype="bfloat16", dtype_reason="native bf16")
    with pytest.raises(SystemExit, match="dtype"):
        paired_quality.pool([a, b], detect=0.02)
    pooled = paired_quality.pool([a, b], detect=0.02, across=["dtype"])
    assert pooled["settings"]["dtype"] == ["float32", "bfloat16"]
    assert pooled["settings"]["dtype_reason"] == ["no native bf16", "native bf16"]
    assert pooled["summary"]["best_beam"]["mean"] == pytest.approx(0.1)
    wider = _part(tmp_path, "wider", 4, [0.1], dtype="bfloat16", dtype_reason="native bf16", width=8)
    with pytest.raises(SystemExit, match="width"):  # the other settings must still agree
        paired_quality.pool([a, wider], detect=0.02, across=["dtype"])


def test_rescore_measures_how_far_reported_logprobs_are_from_transformers(tiny_pair):
    from benchmarks.scoring import load_scorer, mean_logprob

    model = load_scorer(str(tiny_pair.target))
    prompt, long, short = [5, 17, 3], [9, 12, 40, 2], [9, 12]
    exact_long, exact_short = mean_logprob(model, prompt, long), mean_logprob(model, prompt, short)
    # beam sampling reports what transformers computes; "dsbd" reports one beam 0.05 too high, one 0.01 too low
    kept = [(prompt, {"beam": [(long, exact_long)], "dsbd": [(long, exact_long + 0.05), (short, exact_short - 0.01)]})]
    out = paired_quality.rescore(str(tiny_pair.target), kept)
    assert out["beam"]["beams"] == 1 and out["beam"]["max_abs_diff"] < 1e-5
    assert out["dsbd"]["beams"] == 2
    assert out["dsbd"]["max_abs_diff"] == pytest.approx(0.05, abs=1e-5)
    assert out["dsbd"]["mean_diff"] == pytest.approx(0.02, abs=1e-5)
