"""Writing a run's results: per-request JSONL, summary JSON, markdown table, PNG plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness import RequestRecord, check_comparable

_COLUMNS = (
    # (header, summary key, format)
    ("wall s", "wall_s", "{:.2f}"),
    ("speedup", "speedup_vs_baseline", "{:.2f}x"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("req/s", "requests_per_s", "{:.3f}"),
    ("p50 s", "latency_p50_s", "{:.2f}"),
    ("p90 s", "latency_p90_s", "{:.2f}"),
    ("fwd/tok", "target_forwards_per_output_token", "{:.2f}"),
    ("acc/draft", "mean_accepted_tokens_per_draft", "{:.2f}"),
    ("width", "mean_beam_width", "{:.2f}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
    ("peak KV blocks", "peak_kv_blocks", "{:d}"),
    ("logprob/tok", "mean_logprob_per_token", "{:.3f}"),
    ("distinct-2", "distinct_2", "{:.3f}"),
)


def engine_mode(settings: dict) -> str:
    """How a run's vLLM engines ran: runs before ``enforce_eager`` was recorded all ran eager."""
    return "eager" if settings.get("enforce_eager", True) else "compiled"


def _cell(summary: dict, key: str, fmt: str) -> str:
    value = summary.get(key)
    return "n/a" if value is None else fmt.format(value)


def markdown_table(result: dict) -> str:
    """The run as a markdown table, with machine, settings and skipped methods."""
    m, s, ps = result["machine"], result["settings"], result["prompt_set"]
    lines = [
        f"# Benchmark `{result['profile']}`",
        "",
        f"- machine: {m['cpu']}, {m['cpu_cores']} cores, {m['memory_gib']} GiB"
        + (f", GPU {m['gpu']}" if m["gpu"] else ", no GPU"),
        f"- versions: vllm {m['vllm']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"vllm_dsbd {m['vllm_dsbd']} (commit {m['git_commit']})",
        f"- prompts: {ps['num_prompts']} from `{ps['file']}` (hash {ps['hash'][:12]}); "
        f"max_tokens {s['max_tokens']}, batch_size {s['batch_size']}, beam width {s['beam_width']}, "
        f"temperature {s['temperature']} (sampling methods), seed {s['seed']}; vLLM engines "
        f"{engine_mode(s)}, {s.get('dtype', 'float32')}",
        f"- speedup = wall time of `{result['baseline']}` / wall time of the method, same run; "
        "warm-up excluded"
        + (f"; {result['rounds']} rounds (every backend started anew each round), each method's median "
           "round reported, every round's wall time in the JSON (`wall_s_rounds`)"
           if result.get("rounds", 1) > 1 else ""),
        f"- quality: {result['scoring']}",
        "- output tokens: of the best returned sequence, up to its first EOS; fwd/tok: vLLM engine "
        "steps (one target forward each) per output token; acc/draft: accepted draft tokens per draft; "
        "width: DSBD's mean beam width (`vllm:dsbd_beam_width_sum` / `vllm:dsbd_beam_layers`)",
        "- peak RSS: this process and its children (vLLM's engine core), sampled every 0.1 s; "
        "peak KV blocks: `vllm:kv_cache_usage_perc` sampled every 0.1 s x the engine's block count "
        "(LLM.beam_search runs one-token requests that can finish between samples)",
        "",
        "| method | " + " | ".join(h for h, _, _ in _COLUMNS) + " |",
        "| --- | " + " | ".join("---:" for _ in _COLUMNS) + " |",
    ]
    skipped = []
    for name, summary in result["methods"].items():
        if summary["status"] == "ok":
            lines.append(f"| {name} | " + " | ".join(_cell(summary, k, f) for _, k, f in _COLUMNS) + " |")
        else:
            skipped.append(f"- `{name}` {summary['status']}: {summary['reason']}")
    if skipped:
        lines += ["", "Not run:", "", *skipped]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Speedup vs the baseline (bars) and quality vs speed (scatter), one PNG."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: v for k, v in result["methods"].items() if v["status"] == "ok"}
    names = list(ok)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.5 * len(names) + 3))

    speedups = [ok[n].get("speedup_vs_baseline") for n in names]  # None: the baseline did not run
    shown = [v or 0.0 for v in speedups]
    known = [1.0, *(v for v in speedups if v)]
    left.barh(names, shown, color="tab:blue")
    left.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set_xscale("log")
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlim(min(known) / 1.5, max(known) * 2)  # room for the labels
    left.invert_yaxis()
    left.set_xlabel(f"speedup vs {result['baseline']} (wall time ratio, log scale)")
    for y, value in enumerate(speedups):
        label = f"{value:.2f}x" if value else "n/a"
        left.annotate(label, (value or min(known) / 1.5, y), xytext=(3, 0), textcoords="offset points", va="center")

    for n in names:
        x, y = ok[n]["output_tokens_per_s"], ok[n]["mean_logprob_per_token"]
        if y is not None:
            right.scatter(x, y)
            right.annotate(n, (x, y), xytext=(4, 4), textcoords="offset points", fontsize=8)
    right.set_xscale("log")
    right.set_xlabel("output tokens/s (log scale)")
    right.set_ylabel("mean log-likelihood per token under the target")

    m, s = result["machine"], result["settings"]
    fig.suptitle(
        f"{result['profile']}: {result['prompt_set']['num_prompts']} prompts x {s['max_tokens']} tokens, "
        f"W={s['beam_width']}, T={s['temperature']}, batch {s['batch_size']}, {engine_mode(s)} | {m['cpu']} "
        f"({m['cpu_cores']} cores), vllm {m['vllm']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out_dir: Path, result: dict, records: Sequence[RequestRecord], texts: dict) -> None:
    """``requests.jsonl``, ``summary.json``, ``table.md`` and ``plot.png`` in ``out_dir``.

    ``texts`` maps (method, prompt_id) to the decoded best sequence.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "w") as f:
        for r in records:
            row = asdict(r) | {"num_output_tokens": r.num_output_tokens, "text": texts[r.method, r.prompt_id]}
            f.write(json.dumps(row) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "table.md").write_text(markdown_table(result))
    plot(result, out_dir / "plot.png")


def comparison_table(results: Sequence[dict], key: str = "output_tokens_per_s") -> str:
    """One metric of several runs side by side (same prompts and settings, or an error)."""
    check_comparable(results)
    methods = list(dict.fromkeys(name for r in results for name in r["methods"]))
    lines = [
        f"{key}; prompt set {results[0]['prompt_set']['hash'][:12]}",
        "",
        "| method | " + " | ".join(f"{r['profile']} ({r['created']})" for r in results) + " |",
        "| --- | " + " | ".join("---:" for _ in results) + " |",
    ]
    for name in methods:
        cells = []
        for r in results:
            summary = r["methods"].get(name, {"status": "absent"})
            value = summary.get(key)
            if value is not None:
                cells.append(f"{value:.4g}")
            else:
                cells.append("n/a" if summary["status"] == "ok" else summary["status"])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
