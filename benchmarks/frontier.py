"""Quality beside speed: every row of ``bench_dsbd`` scored under the target and placed on beam sampling's
quality-speed frontier.

Dynamic width changes the output distribution: it is faster by returning fewer, less likely beams. So each
row's beams are scored by their mean log-prob per token under the target (transformers, float32,
teacher-forced: :mod:`benchmarks.scoring`, after the engines are shut down), and each DSBD row at T > 0 is
compared with the narrowest in-engine beam sampling (W 1, 2, ... of the same run) whose beams are at least as
likely: the speedup at equal quality, not only against beam sampling at the request's width.
"""

from __future__ import annotations

from collections.abc import Sequence

QUALITY = ("mean log-prob per token under the target (transformers, float32, teacher-forced) of each request's "
           "best returned beam (quality_best) and of its returned beams on average (quality_mean)")


def score_rows(target: str, prompts: Sequence[Sequence[int]], rows: list[dict]) -> None:
    """Set ``quality_best`` / ``quality_mean`` on every row from its ``_beams`` (one list of beams per request,
    request i on ``prompts[i % len(prompts)]``), which it removes."""
    from benchmarks.scoring import load_scorer, score_outputs

    model = load_scorer(target)
    per_prompt: list[list[tuple[int, ...]]] = [[] for _ in prompts]
    for row in rows:
        for i, beams in enumerate(row["_beams"]):
            per_prompt[i % len(prompts)] += [tuple(b) for b in beams if b]
    scores = [score_outputs(model, prompt, outputs) for prompt, outputs in zip(prompts, per_prompt)]
    for row in rows:
        best, mean = [], []
        for i, beams in enumerate(row.pop("_beams")):
            beam_scores = [scores[i % len(prompts)][tuple(b)] for b in beams if b]
            if beam_scores:
                best.append(max(beam_scores))
                mean.append(sum(beam_scores) / len(beam_scores))
        row["quality_best"] = sum(best) / len(best) if best else None
        row["quality_mean"] = sum(mean) / len(mean) if mean else None


def place(rows: list[dict]) -> None:
    """For every DSBD row at T > 0: ``equal_quality_beam_width``, the narrowest in-engine beam sampling row of
    its temperature whose ``quality_best`` is at least the row's (the widest when none is), and
    ``speedup_at_equal_quality``, that row's seconds over this row's."""
    for row in rows:
        if not row["gamma"] or not row["temperature"] or row.get("quality_best") is None:
            continue
        beams = sorted((r for r in rows if r["gamma"] == 0 and r["temperature"] == row["temperature"]
                        and r.get("quality_best") is not None), key=lambda r: r["beam_width"])
        if not beams:
            continue
        match = next((r for r in beams if r["quality_best"] >= row["quality_best"]), beams[-1])
        row["equal_quality_beam_width"] = match["beam_width"]
        row["above_widest_beam_sampling"] = match["quality_best"] < row["quality_best"]
        row["speedup_at_equal_quality"] = match["wall_s"] / row["wall_s"]


def plot_frontier(ax, rows: list[dict], temperature: float) -> None:
    """Quality (best beam, log-prob per token) against speedup over the widest in-engine row, one point per row;
    in-engine beam sampling at W 1, 2, ... drawn as the frontier line."""
    mine = [r for r in rows if r["temperature"] == temperature and r.get("quality_best") is not None]
    beams = sorted((r for r in mine if r["gamma"] == 0), key=lambda r: r["beam_width"])
    if not beams:
        return
    base = beams[-1]["wall_s"]
    ax.plot([base / r["wall_s"] for r in beams], [r["quality_best"] for r in beams], marker="o", color="black",
            label="in-engine beam decoding, W " + ", ".join(str(r["beam_width"]) for r in beams))
    for r in beams:
        ax.annotate(f"W {r['beam_width']}", (base / r["wall_s"], r["quality_best"]), fontsize=7,
                    xytext=(4, -8), textcoords="offset points")
    for r in mine:
        if r["gamma"]:
            ax.scatter([base / r["wall_s"]], [r["quality_best"]], s=30,
                       label=f"{r['method']} γ {r['gamma']}" + (" in-step" if r.get("draft_in_step") else ""))
    ax.set_xlabel(f"speedup vs in-engine W {beams[-1]['beam_width']}")
    ax.set_ylabel("best beam: log-prob per token under the target")
    ax.set_title(f"T={temperature}: quality against speed", fontsize=8)
    ax.legend(fontsize=6)
