"""The benchmark harness (benchmarks/): metrics, timing and comparison checks, with mocked methods.

No vLLM engine starts here; every expected value is computed by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from benchmarks import harness, report
from benchmarks.harness import Completion, Probes, Prompt
from benchmarks.methods import METHODS, Settings, skip_reason

EOS = 2


def _prompts(n: int = 4, text: str = "hello") -> list[Prompt]:
    return [Prompt(f"p{i}", "qa", f"{text} {i}", (10 + i, 11 + i)) for i in range(n)]


class FakeClock:
    """Returns the given instants in order: each timed call lasts the difference of a pair."""

    def __init__(self, instants: list[float]):
        self.instants = iter(instants)

    def __call__(self) -> float:
        return next(self.instants)


def _run(generate, prompts, *, clock, counters=None, batch_size=1, warmup_tokens=3):
    return harness.run_method(
        "m",
        generate,
        prompts,
        max_tokens=8,
        batch_size=batch_size,
        warmup_tokens=warmup_tokens,
        eos_token_id=EOS,
        probes=Probes(counters=counters, kv_usage=lambda: 0.25, num_kv_blocks=100),
        rss=lambda: 3 * 2**20,
        clock=clock,
    )


def test_percentile_interpolates_linearly():
    assert harness.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert harness.percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)  # 3 + 0.7 * (4 - 3)
    assert harness.percentile([5.0], 90) == 5.0
    with pytest.raises(ValueError):
        harness.percentile([], 50)


def test_distinct_n_pools_ngrams_across_beams():
    beams = [[1, 2, 3], [1, 2, 4]]
    assert harness.distinct_n(beams, 1) == pytest.approx(4 / 6)  # {1,2,3,4} of 6 tokens
    assert harness.distinct_n(beams, 2) == pytest.approx(3 / 4)  # (1,2) twice, (2,3), (2,4)
    assert harness.distinct_n([[1, 2, 3]], 1) is None  # one sequence: not a beam method


def test_truncate_at_eos_keeps_the_first_eos():
    assert harness.truncate_at_eos([5, 6, EOS, 0, EOS], EOS) == [5, 6, EOS]
    assert harness.truncate_at_eos([5, 6], EOS) == [5, 6]


def test_run_method_times_batches_excludes_warmup_and_computes_metrics():
    calls = []
    outputs = {"p0": [5, 6, EOS, 0, 0], "p1": [5, 6, 7, 8], "p2": [1] * 5, "p3": [3] * 8}

    def generate(prompts, max_tokens):
        calls.append(([p.id for p in prompts], max_tokens))
        return [Completion([outputs[p.id], [9] * 3]) for p in prompts]

    counter_values = iter([{"engine_steps": 5.0}, {"engine_steps": 17.0}])
    # Four batches of one prompt lasting 1, 4, 2 and 3 s.
    clock = FakeClock([0.0, 1.0, 1.0, 5.0, 5.0, 7.0, 7.0, 10.0])
    run = _run(generate, _prompts(), clock=clock, counters=lambda: next(counter_values))

    assert calls[0] == (["p0"], 3)  # the warm-up: first prompt, warmup_tokens, untimed
    assert [c[0] for c in calls[1:]] == [["p0"], ["p1"], ["p2"], ["p3"]]
    assert run.requests[0].beams[0] == [5, 6, EOS]  # cut after EOS

    s = harness.summarize(run)
    assert s["wall_s"] == pytest.approx(10.0)
    assert s["output_tokens"] == 3 + 4 + 5 + 8
    assert s["output_tokens_per_s"] == pytest.approx(2.0)
    assert s["requests_per_s"] == pytest.approx(0.4)
    assert s["latency_p50_s"] == pytest.approx(2.5)
    assert s["latency_p90_s"] == pytest.approx(3.7)
    assert s["target_forwards_per_output_token"] == pytest.approx(12 / 20)
    assert s["peak_kv_blocks"] == 25
    assert s["peak_rss_mib"] == pytest.approx(3.0)
    # p0's beams [5,6,2] and [9,9,9]: 4 distinct of 6 tokens, 3 distinct of 4 bigrams.
    assert s["distinct_1"] == pytest.approx((4 / 6 + 5 / 7 + 2 / 8 + 2 / 11) / 4)
    assert s["mean_accepted_tokens_per_draft"] is None


def test_batches_share_their_latency_and_unobservable_metrics_are_none():
    def generate(prompts, max_tokens):
        return [Completion([[7] * max_tokens]) for _ in prompts]

    clock = FakeClock([0.0, 2.0, 2.0, 3.0])
    run = harness.run_method(
        "m", generate, _prompts(3), max_tokens=4, batch_size=2, warmup_tokens=0,
        eos_token_id=EOS, rss=None, clock=clock,
    )  # fmt: skip
    assert [r.latency_s for r in run.requests] == [2.0, 2.0, 1.0]
    s = harness.summarize(run)
    assert s["wall_s"] == pytest.approx(3.0)
    assert s["target_forwards_per_output_token"] is None
    assert s["peak_rss_mib"] is None and s["peak_kv_blocks"] is None
    assert s["distinct_2"] is None  # one sequence per request


def test_speedup_is_baseline_wall_over_method_wall():
    methods = {
        "base": {"status": "ok", "wall_s": 10.0},
        "fast": {"status": "ok", "wall_s": 2.5},
        "gone": {"status": "skipped", "reason": "no draft"},
    }
    harness.add_speedups(methods, "base")
    assert methods["base"]["speedup_vs_baseline"] == pytest.approx(1.0)
    assert methods["fast"]["speedup_vs_baseline"] == pytest.approx(4.0)
    assert "speedup_vs_baseline" not in methods["gone"]

    no_base = {"base": {"status": "error", "reason": "x"}, "fast": {"status": "ok", "wall_s": 1.0}}
    harness.add_speedups(no_base, "base")
    assert no_base["fast"]["speedup_vs_baseline"] is None


def test_prompt_set_hash_changes_with_text_tokens_and_order():
    base = harness.prompt_set_hash(_prompts())
    assert base == harness.prompt_set_hash(_prompts())
    assert base != harness.prompt_set_hash(_prompts(text="goodbye"))
    assert base != harness.prompt_set_hash(list(reversed(_prompts())))
    other_tokens = [Prompt(p.id, p.category, p.text, p.token_ids + (1,)) for p in _prompts()]
    assert base != harness.prompt_set_hash(other_tokens)


def _result(profile: str, prompts: list[Prompt], max_tokens: int = 32) -> dict:
    return {
        "profile": profile,
        "created": "now",
        "prompt_set": {"hash": harness.prompt_set_hash(prompts)},
        "settings": {"max_tokens": max_tokens},
        "methods": {"a": {"status": "ok", "output_tokens_per_s": 2.0}, "b": {"status": "skipped"}},
    }


def test_comparison_refuses_different_prompt_sets_or_settings():
    same = [_result("x", _prompts()), _result("y", _prompts())]
    table = report.comparison_table(same)
    assert "| a | 2 | 2 |" in table and "| b | skipped | skipped |" in table
    with pytest.raises(harness.PromptSetMismatchError, match="prompt_set"):
        report.comparison_table([_result("x", _prompts()), _result("y", _prompts(text="other"))])
    with pytest.raises(harness.PromptSetMismatchError, match="settings"):
        harness.check_comparable([_result("x", _prompts()), _result("y", _prompts(), max_tokens=64)])


def test_compare_cli_exits_2_on_different_prompt_sets(tmp_path, capsys):
    from benchmarks import compare

    paths = []
    for name, text in (("x", "hello"), ("y", "other")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(_result(name, _prompts(text=text))))
        paths.append(str(path))
    assert compare.main(paths) == 2
    assert "differ in prompt_set" in capsys.readouterr().err


def test_methods_needing_a_draft_are_skipped_with_a_reason():
    settings = Settings("target", None, beam_width=4, temperature=1.0, seed=0,
                        num_speculative_tokens=4, width_threshold=0.7)  # fmt: skip
    assert "--draft" in skip_reason(METHODS["vllm-draft-model"], settings)
    assert skip_reason(METHODS["vllm-greedy"], settings) is None
    for name in ("vllm-beam-search", "vllm-sampling", "hf-beam-search", "hf-beam-sampling", "dsbd-dynamic"):
        assert name in METHODS


def test_scoring_reads_the_logits_that_predict_each_output_token():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from benchmarks.scoring import mean_logprob

    vocab = 3
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2], [1 / 3] * 3]))

    def model(input_ids):
        assert input_ids.shape == (1, 4)
        return SimpleNamespace(logits=logits[: input_ids.shape[1], :vocab].unsqueeze(0))

    # Prompt [0, 1], output [2, 0]: p(2) at position 1 is 0.8, p(0) at position 2 is 0.6.
    expected = (torch.log(torch.tensor(0.8)) + torch.log(torch.tensor(0.6))).item() / 2
    assert mean_logprob(model, [0, 1], [2, 0]) == pytest.approx(expected, rel=1e-5)
    assert mean_logprob(model, [0, 1], []) is None


def test_results_are_written_with_na_for_unobservable_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    prompts = _prompts(1)
    result = {
        "profile": "t",
        "created": "now",
        "machine": {"cpu": "CPU", "cpu_cores": 2, "memory_gib": 24, "gpu": None, "vllm": "v",
                    "torch": "t", "transformers": "x", "vllm_dsbd": "d", "git_commit": None},
        "settings": {"max_tokens": 4, "batch_size": 1, "beam_width": 2, "temperature": 1.0, "seed": 0,
                     "enforce_eager": False, "dtype": "float32"},
        "prompt_set": {"file": "f", "num_prompts": 1, "hash": harness.prompt_set_hash(prompts)},
        "baseline": "a",
        "scoring": "s",
        "methods": {
            "a": {"status": "ok", "wall_s": 2.0, "speedup_vs_baseline": 1.0, "output_tokens_per_s": 2.0,
                  "mean_logprob_per_token": -1.0, "target_forwards_per_output_token": None},
            "b": {"status": "skipped", "reason": "needs a draft"},
        },
    }  # fmt: skip
    record = harness.RequestRecord("a", "p0", "qa", 0, 2.0, [[5, 6]], mean_logprob=-1.0)
    report.write_results(tmp_path, result, [record], {("a", "p0"): "hi"})
    table = (tmp_path / "table.md").read_text()
    assert "| a | 2.00 | 1.00x | 2.0 |" in table and "n/a" in table
    assert "`b` skipped: needs a draft" in table
    assert "vLLM engines compiled, float32" in table  # the mode is named
    assert json.loads((tmp_path / "requests.jsonl").read_text())["text"] == "hi"
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_the_harness_exits_non_zero_when_a_method_raised(tmp_path, monkeypatch, capsys):
    """A method whose run raised is recorded in the results and fails the command; skipped ones do not."""
    from benchmarks import run as bench_run

    def fake_run(config, settings, out_dir, status):
        (out_dir / "table.md").write_text("table\n")
        return {"methods": {"a": {"status": "ok"}, "b": {"status": "skipped"}, "c": {"status": status}}}

    for status, want in (("error", 1), ("ok", 0), ("skipped", 0)):
        monkeypatch.setattr(bench_run, "run", lambda c, s, o, rounds=1, st=status: fake_run(c, s, o, st))
        code = bench_run.main(["--config", "benchmarks/configs/quick.json", "--out", str(tmp_path),
                               "--target", "t", "--draft", "d"])
        assert code == want, status
    assert "FAILED: c" in capsys.readouterr().err


def test_the_harness_records_the_dtype_it_picked(tmp_path, monkeypatch):
    """``--dtype`` (default auto: the machine's, vllm_dsbd.dtypes) reaches the methods' settings and the result."""
    from benchmarks import run as bench_run
    from vllm_dsbd.dtypes import machine_dtype

    seen = []

    def fake_run(config, settings, out_dir, rounds=1):
        seen.append(settings)
        (out_dir / "table.md").write_text("table\n")
        return {"methods": {}}

    monkeypatch.setattr(bench_run, "run", fake_run)
    argv = ["--config", "benchmarks/configs/quick.json", "--out", str(tmp_path), "--target", "t", "--draft", "d"]
    assert bench_run.main(argv) == 0
    assert bench_run.main(argv + ["--dtype", "float32", "--enforce-eager"]) == 0
    auto, explicit = seen
    assert (auto.enforce_eager, explicit.enforce_eager) == (False, True)  # vLLM's default compiled mode unless asked
    assert (auto.dtype, auto.dtype_reason) == (machine_dtype().dtype, machine_dtype().reason)
    assert (explicit.dtype, explicit.dtype_reason) == ("float32", "asked for (--dtype float32)")
    assert dataclasses.asdict(explicit)["dtype"] == "float32"  # run() records asdict(settings) in the result


def test_rounds_start_every_backend_anew_and_report_each_methods_median_round(monkeypatch):
    """``--rounds 3``: every backend starts once a round, each method is reported by its round of median wall
    time (its metrics from that round), every round's wall time is recorded, and the speedup is of medians."""
    from contextlib import contextmanager

    from benchmarks import methods as bench_methods
    from benchmarks import run as bench_run

    walls = {"a": [5.0, 3.0, 4.0], "b": [1.0, 2.5, 2.0]}  # per round; medians: a 4.0 (round 3), b 2.0 (round 3)
    starts = []

    @contextmanager
    def backend(settings):
        starts.append(settings.target)
        yield None, Probes()

    def fake_run_method(name, generate, prompts, **kw):
        wall = walls[name].pop(0)
        record = harness.RequestRecord(name, "p0", "qa", 0, wall, [[5, 6]])
        return harness.MethodRun(name, [record], wall, counters={"engine_steps": wall})

    monkeypatch.setitem(bench_methods.BACKENDS, "fake", backend)
    for name in walls:
        monkeypatch.setitem(bench_methods.METHODS, name, bench_methods.Method(name, "fake", name, lambda h, s: None))
    monkeypatch.setattr(harness, "run_method", fake_run_method)
    monkeypatch.setattr(bench_run.scoring, "score", lambda *args: None)
    config = bench_run.BenchConfig(profile="t", prompts_file="f", num_prompts=None, max_tokens=4, beam_width=2,
                                   temperature=1.0, batch_size=1, seed=0, warmup_tokens=0, num_speculative_tokens=1,
                                   width_threshold=0.7, baseline="a", methods=["a", "b"], out_dir="o")
    settings = Settings("target", None, beam_width=2, temperature=1.0, seed=0, num_speculative_tokens=1,
                        width_threshold=0.7)
    methods, records = bench_run.run_methods(config, settings, _prompts(1), EOS, rounds=3)
    assert len(starts) == 3  # one backend, started anew each round
    assert methods["a"]["wall_s_rounds"] == [5.0, 3.0, 4.0] and methods["a"]["wall_s"] == 4.0
    assert methods["b"]["wall_s_rounds"] == [1.0, 2.5, 2.0] and methods["b"]["wall_s"] == 2.0
    assert methods["b"]["speedup_vs_baseline"] == pytest.approx(2.0)
    assert [r.latency_s for r in records] == [4.0, 2.0]  # the median rounds' records are the ones scored


def test_lossless_compare_reports_where_and_by_how_much_the_best_beams_differ():
    """benchmarks/lossless.py: a differing best beam is reported with its first differing position and the
    score gap; runs without logprobs (no cumulative log-prob) report the position and no gap, not a crash."""
    from types import SimpleNamespace as NS

    from benchmarks.lossless import compare

    def out(beams, scores):
        return NS(outputs=[NS(token_ids=b, cumulative_logprob=s) for b, s in zip(beams, scores)])

    same = out([[1, 2, 3], [1, 2, 4]], [-1.0, -2.0])
    base = out([[1, 2, 3], [1, 5, 6]], [-1.0, -1.5])
    spec = out([[1, 5, 6], [1, 2, 3]], [-1.25, -1.0])
    got = compare(["a", "b"], [same, base], [same, spec])
    assert (got["differ_best_beam"], got["differ_any_beam"]) == (1, 1)
    (d,) = got["differences"]
    assert (d["prompt"], d["first_difference_at"], d["score_difference"]) == ("b", 1, -0.25)
    assert d["dsbd_best_is_an_in_engine_beam"] is True
    unscored = compare(["b"], [out([[1, 2, 3]], [None])], [out([[1, 2]], [None])])["differences"][0]
    assert (unscored["first_difference_at"], unscored["score_difference"]) == (2, None)
    assert unscored["dsbd_best_is_an_in_engine_beam"] is False


def test_bench_dsbd_rows_memory_efficient_only_at_t_above_zero_when_asked():
    """``bench_dsbd --memory-efficient`` adds a memory-efficient row per γ (and auto) and in-step mode at T > 0;
    T 0 (beam search, compared token for token) never gets one."""
    from benchmarks.bench_dsbd import _rows

    names = lambda rows: [(r[0], r[1], r[4]) for r in rows]  # noqa: E731
    plain = _rows([0, 1, 2], 1.0, 2, [False, True], [None])
    wide = _rows([0, 1, 2], 1.0, 2, [False, True], [None], memory_efficient=True)
    extra = [r for r in wide if r not in plain]
    assert names(extra) == [(f"dsbd-{a}memory-efficient", g, mode) for a, g in (("", 1), ("", 2), ("auto-", 2))
                            for mode in (False, True)]
    assert all(r[2] == "memory-efficient" for r in extra)
    assert _rows([0, 1], 0.0, 0, [False], [None], memory_efficient=True) == _rows([0, 1], 0.0, 0, [False], [None])


def test_bench_dsbd_rows_add_narrower_beam_sampling_only_at_t_above_zero():
    """``--beam-widths``: in-engine rows at the narrower widths follow the baseline at T > 0, never at T 0."""
    from benchmarks.bench_dsbd import _beam_width, _rows

    rows = _rows([0, 1], 1.0, 0, [True], [None], beam_widths=[1, 2, 3])
    assert [(r[0], r[1], _beam_width(r[2], 4)) for r in rows[:5]] == [
        ("in-engine", 0, 4), ("in-engine", 0, 1), ("in-engine", 0, 2), ("in-engine", 0, 3), ("dsbd-fixed", 1, 4)]
    assert _rows([0, 1], 0.0, 0, [True], [None], beam_widths=[1, 2]) == _rows([0, 1], 0.0, 0, [True], [None])


def test_frontier_scores_every_beam_and_places_dsbd_on_the_narrowest_beam_sampling_as_likely(tiny_pair):
    """``quality_best`` / ``quality_mean`` are the scorer's per-beam means (best of a request's beams, then
    averaged over requests; request i on prompt i mod P); a DSBD row at T > 0 is compared with the narrowest
    in-engine row at least as likely (the widest when none is), and T 0 rows are not placed."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import scoring
    from benchmarks.frontier import place, score_rows

    prompts = [(5, 9, 17, 3), (11, 2)]
    beams = [[[7, 8, 9], [40, 1]], [[3, 3]], [[7, 8, 9]]]  # three requests: prompts 0, 1, 0
    rows = [{"gamma": 0, "temperature": 1.0, "_beams": beams}]
    score_rows(str(tiny_pair.target), prompts, rows)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair.target), dtype=torch.float32).eval()
    alone = [[scoring.mean_logprob(model, prompts[i % 2], b) for b in bs] for i, bs in enumerate(beams)]
    assert math.isclose(rows[0]["quality_best"], sum(max(s) for s in alone) / 3, rel_tol=1e-4)
    assert math.isclose(rows[0]["quality_mean"], sum(sum(s) / len(s) for s in alone) / 3, rel_tol=1e-4)

    def row(gamma, width, quality, secs, temperature=1.0):
        return {"gamma": gamma, "beam_width": width, "quality_best": quality, "wall_s": secs,
                "temperature": temperature}

    table = [row(0, 1, -2.0, 9.0), row(0, 2, -1.2, 9.5), row(0, 3, -0.9, 9.8), row(0, 4, -0.8, 10.0),
             row(1, 4, -1.25, 9.0), row(1, 4, -0.7, 12.5), row(1, 4, -0.8, 5.0, temperature=0.0)]
    place(table)
    assert (table[4]["equal_quality_beam_width"], table[4]["speedup_at_equal_quality"]) == (2, 9.5 / 9.0)
    assert not table[4]["above_widest_beam_sampling"]
    assert (table[5]["equal_quality_beam_width"], table[5]["above_widest_beam_sampling"]) == (4, True)
    assert table[5]["speedup_at_equal_quality"] == 10.0 / 12.5
    assert "speedup_at_equal_quality" not in table[6]
