"""benchmarks/gap.py: where a DSBD row's time goes and what would reach a goal, on a hand-made bench result.

No engine starts; every expected value is worked out by hand from the numbers below.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import gap


def _kind(steps, step_s, forward_s, decide_s, tokens=0, draft_s=0.0):
    return {"steps": steps, "tokens": tokens, "step_s": step_s, "forward_s": forward_s, "decide_s": decide_s,
            "draft_s": draft_s}


def _result():
    baseline = {"method": "in-engine", "temperature": 1.0, "gamma": 0, "wall_s": 2.0,
                # 1 prompt step (0.3 s, forward 0.28) and 10 decode steps of 0.12 s (forward 0.092, decide 0.01)
                "step_profile": {"beam": _kind(11, 1.5, 1.2, 0.1)}}
    dynamic = {"method": "dsbd-dynamic", "temperature": 1.0, "gamma": 1, "draft_in_step": True, "wall_s": 1.25,
               "tokens_per_target_forward": 2.0, "beam_layers": 11,  # the prompt step's layer and 10 in 5 verify steps
               "step_profile": {"other": _kind(1, 0.3, 0.28, 0.0, tokens=100),
                                "verify": _kind(5, 0.8, 0.6, 0.15, draft_s=0.06)}}
    fixed = {"method": "dsbd-fixed", "temperature": 1.0, "gamma": 1, "wall_s": 1.9,
             "step_profile": {"other": _kind(1, 0.3, 0.28, 0.0, tokens=100), "draft": _kind(4, 0.2, 0.1, 0.05),
                              "verify": _kind(8, 1.2, 0.9, 0.2)}}
    t0_base = {"method": "in-engine", "temperature": 0.0, "gamma": 0, "wall_s": 1.0,
               "step_profile": {"beam": _kind(10, 0.9, 0.8, 0.05)}}
    t0 = {"method": "dsbd-fixed", "temperature": 0.0, "gamma": 1, "wall_s": 1.0,
          "step_profile": {"verify": _kind(0, 0.0, 0.0, 0.0), "beam": _kind(10, 0.9, 0.8, 0.05)}}
    return {"benchmark": "dsbd", "settings": {"pair": "default", "width": 4, "num_prompts": 1, "max_tokens": 11,
                                              "dtype": "bfloat16", "batch": "1 (prompts one after another)"},
            "machine": {"cpu": "test"}, "results": [baseline, dynamic, fixed, t0_base, t0]}


def _rows(analysis):
    return {(r["temperature"], r["method"]): r for r in analysis["rows"]}


def test_a_row_is_split_against_the_baselines_decode_step():
    rows = _rows(gap.analyse(_result(), {"dynamic": 2.0, "fixed": 1.3, "t0": 1.3}))
    base = rows[1.0, "in-engine"]
    assert base["prompts_separated"]
    assert base["beam_ms"] == pytest.approx({"step": 120.0, "forward": 92.0, "decide": 10.0, "rest": 18.0})
    assert base["seconds"] == pytest.approx({"other": 0.3, "beam": 1.2, "host": 0.5})
    r = rows[1.0, "dsbd-dynamic"]
    assert r["speedup"] == pytest.approx(2.0 / 1.25)
    assert r["seconds"] == pytest.approx({"other": 0.3, "verify": 0.8, "host": 0.15})
    assert r["verify_seconds"] == pytest.approx({"forward": 0.6, "decisions": 0.09, "drafting": 0.06, "rest": 0.05})
    assert r["verify_ms"] == pytest.approx({"step": 160.0, "forward": 120.0, "decide": 30.0, "drafting": 12.0,
                                            "rest": 10.0})
    assert r["draft_per_beam_step"] == pytest.approx(0.1)  # 12 ms of drafting a verify step, a beam step 120
    assert r["beam_ms"] == pytest.approx({"step": 120.0, "forward": 92.0, "decide": 10.0, "rest": 18.0})
    # decisions at a beam step's 0.01 s save 0.15 - 0.05; a verify step at a beam step's 0.12 s saves 0.8 - 0.6
    assert r["if_decide_as_beam"] == pytest.approx(2.0 / 1.15)
    assert r["if_forward_as_beam"] == pytest.approx(2.0 / (1.25 - (0.6 - 0.46)))
    assert r["if_verify_as_beam"] == pytest.approx(2.0 / 1.05)
    assert r["if_no_draft_steps"] == pytest.approx(2.0 / 1.25)
    # goal 2x: 1.0 s in all, 0.45 s of it outside the verify steps, so they may take 0.55 s (now 0.8)
    assert r["goal"] == 2.0
    assert r["layers_factor"] == pytest.approx(0.8 / 0.55)
    assert r["verify_ms_for_goal"] == pytest.approx(110.0)
    assert r["verify_layers"] == pytest.approx(2.0)
    assert r["verify_layers_for_goal"] == pytest.approx(2.0 * 0.8 / 0.55)  # beyond the 2 that γ 1 allows


def test_a_run_that_did_not_record_the_drafting_in_its_verify_steps_says_so():
    result = _result()
    del result["results"][1]["step_profile"]["verify"]["draft_s"]
    r = _rows(gap.analyse(result, gap.GOALS["default"]))[1.0, "dsbd-dynamic"]
    assert r["verify_ms"]["drafting"] is None and r["draft_per_beam_step"] is None  # in-step: unknown, not 0
    assert r["verify_ms"]["decide"] == pytest.approx(30.0)


def test_layers_per_verify_step_need_the_prompts_run_one_at_a_time():
    result = _result()
    result["settings"]["batch"] = "all (the prompts as one batch)"
    rows = _rows(gap.analyse(result, gap.GOALS["default"]))
    assert rows[1.0, "dsbd-dynamic"]["verify_layers"] is None
    assert rows[1.0, "dsbd-dynamic"]["layers_factor"] == pytest.approx(0.8 / (2.0 / 1.5 - 0.45))


def test_each_kind_of_row_gets_its_goal_and_an_unreachable_goal_says_so():
    rows = _rows(gap.analyse(_result(), {"dynamic": 5.0, "fixed": 1.3, "t0": 1.25}))
    assert rows[1.0, "dsbd-dynamic"]["layers_factor"] is None  # 0.4 s at 5x, 0.45 s outside the verify steps
    assert rows[1.0, "dsbd-dynamic"]["verify_ms_for_goal"] is None
    fixed = rows[1.0, "dsbd-fixed"]
    assert fixed["goal"] == 1.3
    assert fixed["if_no_draft_steps"] == pytest.approx(2.0 / 1.7)
    assert fixed["draft_per_beam_step"] == pytest.approx(0.2 / 8 / 0.12)  # its draft steps, per verify step
    assert fixed["seconds"]["host"] == pytest.approx(1.9 - 1.7)
    t0 = rows[0.0, "dsbd-fixed"]
    assert t0["goal"] == 1.25
    assert t0["layers_factor"] is None  # no verify step: acceptance cannot help
    assert t0["verify_ms"]["step"] is None
    assert t0["draft_per_beam_step"] is None


def test_without_prompt_steps_in_any_row_the_baseline_step_keeps_its_prompts():
    rows = _rows(gap.analyse(_result(), gap.GOALS["default"]))
    base = rows[0.0, "in-engine"]
    assert not base["prompts_separated"]
    assert base["beam_ms"] == pytest.approx({"step": 90.0, "forward": 80.0, "decide": 5.0, "rest": 5.0})


def test_goal_kinds():
    assert gap.goal_kind({"temperature": 0.0, "method": "dsbd-auto-dynamic"}) == "t0"
    assert gap.goal_kind({"temperature": 1.0, "method": "dsbd-auto-fixed"}) == "fixed"
    assert gap.goal_kind({"temperature": 1.0, "method": "dsbd-memory-efficient"}) == "dynamic"


def test_the_command_writes_json_and_a_plot_and_refuses_a_bad_goal(tmp_path, capsys):
    path = tmp_path / "dsbd.json"
    path.write_text(json.dumps(_result()))
    gap.main([str(path), "--goal", "dynamic=2"])
    written = json.loads((tmp_path / "gap.json").read_text())
    assert written["goals"] == {"dynamic": 2.0, "fixed": 1.3, "t0": 1.3}
    assert (tmp_path / "gap.png").stat().st_size > 0
    assert "| 1 | dsbd-dynamic, in-step | 1 | 1.60x | 2x |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gap.main([str(path), "--goal", "fast=2"])
    assert "KIND one of dynamic, fixed, t0" in capsys.readouterr().err
