"""Where each DSBD row of a ``bench_dsbd`` run spends its time, and what would reach a speed goal.

    .venv/bin/python -m benchmarks.gap benchmarks/results/dsbd-head-9-gap/dsbd.json
    .venv/bin/python -m benchmarks.gap RUN/dsbd.json --goal dynamic=1.5 --goal fixed=1.3 --goal t0=1.3

Reads the step profile that ``bench_dsbd`` records per row (worker seconds per step kind: its model
forward, its DSBD decisions, the rest of the step) and compares every DSBD row with the in-engine row of
its temperature, in the same run. These numbers per row answer "what would close the gap":

- ``if_decide_as_beam``: the speedup if a verify step's decisions (verification, in-step drafting) cost
  what a beam step's decisions cost;
- ``if_verify_as_beam``: the speedup if a whole verify step cost a beam step (forest rows free, as on an
  accelerator whose forward does not grow with its rows, and decisions as cheap): the ceiling that the
  tokens per target forward alone set;
- ``draft_per_beam_step``: the draft's work per verify step (its draft steps and the next forests drawn
  inside verify steps, ``draft_in_step``) over a beam step: issue #27 asks at most 0.1 for a head;
- ``layers_factor``: at today's step costs, how many times the beam layers each verify step yields would
  have to grow to reach the goal (``None``: unreachable by acceptance alone, the row's other time
  already exceeds the goal's wall time); with ``--batch 1``, ``verify_layers`` is what a verify step
  yields now and ``verify_layers_for_goal`` what it would have to (at most γ + 1 can be);
  ``verify_ms_for_goal`` is the other way round: what a verify step may cost at today's acceptance.

A beam step's cost is the baseline's decode step: its beam steps less its prompt steps, whose cost is
estimated from the DSBD rows of the same temperature, which run the same prompts as ``other`` steps.
Goals default to issue #27's for the run's pair. Writes ``gap.json`` and ``gap.png`` beside the input
(or into ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.scripts import write_result

GOALS = {  # issue #27: speedup over in-engine beam decoding, per kind of row
    "default": {"dynamic": 1.5, "fixed": 1.3, "t0": 1.3},
    "qwen2.5-coder": {"dynamic": 1.35, "fixed": 1.2, "t0": 1.2},
}
FIELDS = ("steps", "step_s", "forward_s", "decide_s", "draft_s")  # draft_s: 0 in runs before it was recorded


def goal_kind(row: dict) -> str:
    """``t0`` (beam search), ``fixed`` (fixed-width beam sampling) or ``dynamic`` (every other T > 0 row)."""
    if row["temperature"] == 0:
        return "t0"
    return "fixed" if "fixed" in row["method"] else "dynamic"


def _kind(profile: dict, kind: str) -> dict[str, float]:
    return {k: float(profile.get(kind, {}).get(k, 0.0)) for k in FIELDS}


def prompt_totals(rows: list[dict], temperature: float) -> dict[str, float] | None:
    """The prompt steps' totals at ``temperature``: the median over the DSBD rows that ran every prompt as an
    ``other`` step (the most prompt tokens in ``other``); ``None`` if no row did."""
    others = [r["step_profile"]["other"] for r in rows
              if r["gamma"] and r["temperature"] == temperature and "other" in r["step_profile"]]
    if not others:
        return None
    most = max(o["tokens"] for o in others)
    full = [o for o in others if o["tokens"] == most]
    return {k: statistics.median(float(o.get(k, 0.0)) for o in full) for k in FIELDS}


def beam_step(baseline: dict, prompts: dict[str, float] | None) -> dict[str, float]:
    """The baseline's seconds per decode step (its beam steps less its prompt steps)."""
    beam = _kind(baseline["step_profile"], "beam")
    if prompts is not None:
        beam = {k: beam[k] - prompts[k] for k in FIELDS}
    return {k: beam[k] / beam["steps"] for k in FIELDS if k != "steps"}


def _rest(p: dict[str, float]) -> float:
    return p["step_s"] - p["forward_s"] - p["decide_s"]


def _ms(step: dict[str, float]) -> dict[str, float]:
    """A step's seconds as milliseconds: the step, its forward, its decisions and the rest."""
    return {"step": 1e3 * step["step_s"], "forward": 1e3 * step["forward_s"], "decide": 1e3 * step["decide_s"],
            "rest": 1e3 * _rest(step)}


def verify_layers(row: dict) -> float | None:
    """Beam layers per verify step of a row run one prompt at a time: every other target step (a prompt's, a
    beam step) yields one layer of its one request, so the verify steps yield the rest."""
    profile = row["step_profile"]
    n = _kind(profile, "verify")["steps"]
    if not n or "beam_layers" not in row:
        return None
    return (row["beam_layers"] - _kind(profile, "beam")["steps"] - _kind(profile, "other")["steps"]) / n


def gap(row: dict, base_wall: float, step: dict[str, float], goal: float, one_at_a_time: bool = True) -> dict:
    """One DSBD row against its baseline (``base_wall`` seconds, ``step`` its decode step's seconds);
    ``one_at_a_time``: the run's prompts ran one after another (``--batch 1``)."""
    profile, wall = row["step_profile"], row["wall_s"]
    verify = _kind(profile, "verify")
    n = verify["steps"]
    layers = verify_layers(row) if one_at_a_time else None
    recorded = "draft_s" in profile.get("verify", {})  # runs before 2026-12-06 did not split the decisions
    seconds = {kind: float(p["step_s"]) for kind, p in profile.items()}
    seconds["host"] = wall - sum(seconds.values())

    def speedup_saving(saved: float) -> float:
        return base_wall / (wall - saved)

    budget = base_wall / goal - (wall - verify["step_s"])  # what the verify steps may take at the goal
    reachable = n > 0 and budget > 0
    verify_ms = dict.fromkeys(("step", "forward", "decide", "drafting", "rest"))  # None without verify steps
    if n:
        verify_ms.update(_ms({k: verify[k] / n for k in FIELDS if k != "steps"}),
                         drafting=1e3 * verify["draft_s"] / n if recorded else None)
    return {
        "method": row["method"], "temperature": row["temperature"], "gamma": row["gamma"],
        "draft": row.get("draft"), "draft_in_step": row.get("draft_in_step"),
        "goal": goal, "speedup": base_wall / wall,
        "tokens_per_target_forward": row.get("tokens_per_target_forward"),
        "seconds": seconds, "verify_steps": n,
        "verify_seconds": {"forward": verify["forward_s"], "decisions": verify["decide_s"] - verify["draft_s"],
                           "drafting": verify["draft_s"], "rest": _rest(verify)},
        "verify_ms": verify_ms,
        # the draft's work per verify step: its draft steps (a prompt's head KV included) and its in-step drafting
        "draft_per_beam_step": ((seconds.get("draft", 0.0) + verify["draft_s"]) / n / step["step_s"]
                                if n and (recorded or not row.get("draft_in_step")) else None),
        "beam_ms": _ms(step),
        "if_decide_as_beam": speedup_saving(verify["decide_s"] - n * step["decide_s"]),
        "if_forward_as_beam": speedup_saving(verify["forward_s"] - n * step["forward_s"]),
        "if_verify_as_beam": speedup_saving(verify["step_s"] - n * step["step_s"]),
        "if_no_draft_steps": speedup_saving(seconds.get("draft", 0.0)),
        "layers_factor": verify["step_s"] / budget if reachable else None,
        "verify_ms_for_goal": 1e3 * budget / n if reachable else None,
        # at most γ + 1 layers a verify step (its forest's γ and the layer its target logits give)
        "verify_layers": layers,
        "verify_layers_for_goal": layers * verify["step_s"] / budget if reachable and layers else None,
    }


def analyse(result: dict, goals: dict[str, float]) -> dict:
    """Every DSBD row of a ``bench_dsbd`` result against the in-engine row of its temperature."""
    rows = result["results"]
    one_at_a_time = str(result["settings"].get("batch", "1")).startswith("1")
    out = []
    for temperature in sorted({r["temperature"] for r in rows}):
        baseline = next(r for r in rows if r["temperature"] == temperature and r["gamma"] == 0)
        prompts = prompt_totals(rows, temperature)
        step = beam_step(baseline, prompts)
        beam_s = baseline["step_profile"]["beam"]["step_s"]
        host_s = baseline["wall_s"] - beam_s
        base_seconds = ({"beam": beam_s, "host": host_s} if prompts is None  # else the prompt steps apart
                        else {"other": prompts["step_s"], "beam": beam_s - prompts["step_s"], "host": host_s})
        out.append({"method": "in-engine", "temperature": temperature, "gamma": 0, "speedup": 1.0,
                    "seconds": base_seconds, "beam_ms": _ms(step), "prompts_separated": prompts is not None})
        out += [gap(r, baseline["wall_s"], step, goals[goal_kind(r)], one_at_a_time)
                for r in rows if r["temperature"] == temperature and r["gamma"]]
    return {"benchmark": "gap", "source": result.get("benchmark", "dsbd"), "settings": result["settings"],
            "machine": result["machine"], "goals": goals, "rows": out}


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(analysis: dict) -> str:
    """A markdown table of the rows (one line each)."""
    lines = ["| T | row | γ | speedup | goal | tokens/fwd | verify ms (fwd / decide (drafting) / rest) | beam ms | "
             "draft / beam step | decide as beam | verify as beam | layers/verify: now, for goal (at most γ+1) | "
             "verify ms for goal |",
             "|---|---|--:|--:|--:|--:|---|---|--:|--:|--:|---|--:|"]
    several = len(analysis["settings"].get("drafts") or []) > 1
    for r in analysis["rows"]:
        if not r["gamma"]:
            continue
        v, b = r["verify_ms"], r["beam_ms"]
        verify = "-" if v["step"] is None else (f"{v['step']:.1f} ({v['forward']:.1f} / {v['decide']:.1f} "
                                                 f"({_fmt(v['drafting'], '.1f')}) / {v['rest']:.1f})")
        name = r["method"] + (", in-step" if r.get("draft_in_step") else "") + (f", {r['draft']}" if several else "")
        lines.append(f"| {r['temperature']:g} | {name} | {r['gamma']} | {r['speedup']:.2f}x | {r['goal']:g}x | "
                     f"{_fmt(r['tokens_per_target_forward'])} | {verify} | "
                     f"{b['step']:.1f} ({b['forward']:.1f} / {b['decide']:.1f} / {b['rest']:.1f}) | "
                     f"{_fmt(r['draft_per_beam_step'])} | {r['if_decide_as_beam']:.2f}x | {r['if_verify_as_beam']:.2f}x | "
                     f"{_fmt(r['verify_layers'])}, {_fmt(r['verify_layers_for_goal'])} ({r['gamma'] + 1}) | "
                     f"{_fmt(r['verify_ms_for_goal'], '.1f')} |")
    return "\n".join(lines)


def plot(analysis: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in analysis["rows"]})
    parts = ("other", "beam", "draft", "forward", "decisions", "drafting", "rest", "host")
    labels = {"other": "prompts (other steps)", "beam": "beam steps", "draft": "draft steps",
              "forward": "verify steps: forward", "decisions": "verify steps: verification",
              "drafting": "verify steps: drafting in them", "rest": "verify steps: the rest",
              "host": "outside the worker's steps"}
    fig, axes = plt.subplots(len(temperatures), 1, figsize=(10, 1.2 + 0.45 * len(analysis["rows"])), squeeze=False)
    for ax, temperature in zip(axes[:, 0], temperatures):
        rows = [r for r in analysis["rows"] if r["temperature"] == temperature]
        names = [f"{r['method']} γ{r['gamma']}" + (" in-step" if r.get("draft_in_step") else "")
                 + (f" ({r['speedup']:.2f}x)" if r["gamma"] else "") for r in rows]
        left = [0.0] * len(rows)
        for part in parts:
            widths = [{**r["seconds"], **r.get("verify_seconds", {})}.get(part, 0.0) for r in rows]
            ax.barh(names, widths, left=left, label=labels[part] if temperature == temperatures[0] else None)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel("seconds (the row's wall time)")
        s = analysis["settings"]
        ax.set_title(f"T={temperature:g}, W={s['width']}, {s['num_prompts']} prompts x {s['max_tokens']} tokens x "
                     f"{s.get('repeat', 1)}, {s.get('dtype', 'float32')}, {analysis['machine']['cpu']}", fontsize=8)
    fig.legend(loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


def _goal(text: str) -> tuple[str, float]:
    kind, _, value = text.partition("=")
    if kind not in ("dynamic", "fixed", "t0") or not value:
        raise argparse.ArgumentTypeError(f"--goal {text!r}: expected KIND=SPEEDUP, KIND one of dynamic, fixed, t0")
    return kind, float(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a dsbd.json written by benchmarks.bench_dsbd")
    parser.add_argument("--goal", type=_goal, action="append", default=[],
                        help="KIND=SPEEDUP, KIND one of dynamic, fixed, t0 (default: issue #27's for the pair)")
    parser.add_argument("--out", type=Path, default=None, help="folder for gap.json and gap.png (default: beside it)")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    goals = {**GOALS.get(result["settings"].get("pair", "default"), GOALS["default"]), **dict(args.goal)}
    analysis = analyse(result, goals)
    write_result(analysis, args.out or args.result.parent, "gap", plot)
    print(table(analysis))


if __name__ == "__main__":
    main()
