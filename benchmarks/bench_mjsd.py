"""MJSD with an EAGLE-3 head against vLLM's own eagle3 greedy speculative decoding with the same head, interleaved.

    .venv/bin/python -m benchmarks.bench_mjsd --draft vllm_dsbd/draft/default-head --repeat 3

The engines stay up side by side in one process: vLLM's ``eagle3``, greedy, one engine per γ of
``--eagle3-tokens`` (the baseline: the fastest of them), and a DSBD engine drafting with the same head and
``draft_in_step`` (γ ``--gamma``, K = W ``--width`` draft beams). Each MJSD row (one per τ of ``--taus``) runs twice on the DSBD engine: drafting in
draft steps (the request turns ``draft_in_step`` off) and inside the verify step. Every prompt runs every row
in turn, the order rotating from prompt to prompt, and ``--repeat N`` does all of it N times, so that a drift
of the machine's speed (on this 2-core VM a matmul loop varies by 30 % from second to second) hits every row
alike; ``benchmarks.run`` instead starts one engine after the other. MJSD rows record the DSBD engine's
counters (target forwards, accepted draft tokens); the target's log-probability of the text is scored by
``benchmarks.run --config benchmarks/configs/mjsd-head.json`` (same rows, one engine at a time).

Writes ``mjsd.json`` and ``mjsd.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.bench_dsbd import _counters
from benchmarks.machine import machine_facts
from benchmarks.run import load_prompts
from benchmarks.scripts import add_prompt_args, write_result
from vllm_dsbd.dtypes import add_dtype_argument, resolve_dtype

def _rows(taus: list[float], eagle3_tokens: list[int]) -> list[tuple[str, int | None, float | None, bool]]:
    """(name, γ of the vLLM eagle3 engine or None: the DSBD engine, τ, draft_in_step) of every row; eagle3's
    first."""
    rows: list[tuple[str, int | None, float | None, bool]] = [
        (f"vllm-eagle3-g{g}", g, None, False) for g in eagle3_tokens]
    for tau in taus:
        rows += [(f"mjsd-steps-tau-{tau:g}", None, tau, False), (f"mjsd-in-step-tau-{tau:g}", None, tau, True)]
    return rows


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    from vllm_dsbd import models
    from vllm_dsbd.demo import engine_kwargs

    dtype = resolve_dtype(args.dtype)
    target = args.target or str(models.default_target_path())
    taus = [float(t) for t in args.taus.split(",")]
    eagle3_tokens = [int(g) for g in args.eagle3_tokens.split(",")]
    # vLLM's engines first: llm.get_metrics() reads the engine started last, the DSBD one, whose counters we keep
    eagle3 = {g: LLM(**engine_kwargs(target, dtype.dtype), disable_log_stats=False, speculative_config={
        "method": "eagle3", "model": args.draft, "num_speculative_tokens": g}) for g in eagle3_tokens}
    dsbd = LLM(**engine_kwargs(target, dtype.dtype), disable_log_stats=False, speculative_config={
        "method": "dsbd", "model": args.draft, "num_speculative_tokens": args.gamma, "beam_width": args.width,
        "draft_in_step": True})
    prompts = load_prompts(Path(args.prompts_file), args.num_prompts, dsbd.get_tokenizer())
    rows = _rows(taus, eagle3_tokens)

    def params(tau: float | None, in_step: bool, max_tokens: int) -> SamplingParams:
        if tau is None:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=args.seed)
        return SamplingParams(temperature=args.temperature, max_tokens=max_tokens, seed=args.seed, extra_args={
            "decoder": "mjsd", "beam_width": args.width, "num_speculative_tokens": args.gamma, "mjsd_tau": tau,
            "draft_in_step": in_step})

    def decode(row, prompt, max_tokens: int) -> tuple[float, int, dict[str, float]]:
        _, gamma, tau, in_step = row
        llm = dsbd if gamma is None else eagle3[gamma]
        before = _counters(dsbd) if tau is not None else {}
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": list(prompt.token_ids)}], params(tau, in_step, max_tokens),
                           use_tqdm=False)
        seconds = time.perf_counter() - start
        after = _counters(dsbd) if tau is not None else {}
        return seconds, len(out[0].outputs[0].token_ids), {k: after[k] - before[k] for k in after}

    for row in rows:  # warm-up: every row once on a short run
        decode(row, prompts[0], 4)
    totals = {name: {"wall_s": 0.0, "tokens": 0, "counters": {}, "wall_s_per_repeat": []} for name, *_ in rows}
    for _ in range(args.repeat):
        for name, *_ in rows:
            totals[name]["wall_s_per_repeat"].append(0.0)
        for i, prompt in enumerate(prompts):
            for row in rows[i % len(rows):] + rows[:i % len(rows)]:  # the order rotates from prompt to prompt
                seconds, tokens, counters = decode(row, prompt, args.max_tokens)
                t = totals[row[0]]
                t["wall_s"] += seconds
                t["wall_s_per_repeat"][-1] += seconds
                t["tokens"] += tokens
                for k, v in counters.items():
                    t["counters"][k] = t["counters"].get(k, 0.0) + v
    for engine in (dsbd, *eagle3.values()):
        engine.llm_engine.engine_core.shutdown()
    baseline = min((f"vllm-eagle3-g{g}" for g in eagle3_tokens), key=lambda n: totals[n]["wall_s"] / totals[n]["tokens"])
    base = totals[baseline]
    results = []
    for name, _, tau, in_step in rows:
        t = totals[name]
        row = {"method": name, "mjsd_tau": tau, "draft_in_step": in_step, "wall_s": t["wall_s"],
               "wall_s_per_repeat": t["wall_s_per_repeat"], "output_tokens": t["tokens"],
               "ms_per_token": 1000 * t["wall_s"] / t["tokens"],
               "speedup_vs_best_eagle3": (base["wall_s"] / base["tokens"]) / (t["wall_s"] / t["tokens"]),
               "speedup_vs_best_eagle3_per_repeat": [(bw / base["tokens"]) / (w / t["tokens"]) for bw, w in
                                                zip(base["wall_s_per_repeat"], t["wall_s_per_repeat"])]}
        if tau is not None:
            forwards = t["counters"].get("drafts", 0.0)  # one target forward of the group an iteration
            row |= {"counters": t["counters"], "target_forwards_per_token": forwards / t["tokens"],
                    "accepted_draft_tokens_per_forward": t["counters"].get("accepted_tokens", 0.0) / forwards}
        results.append(row)
    return {
        "benchmark": "bench_mjsd",
        "settings": {"target": target, "draft": args.draft, "width": args.width, "gamma": args.gamma,
                     "eagle3_tokens": eagle3_tokens, "baseline": baseline, "taus": taus, "temperature": args.temperature,
                     "max_tokens": args.max_tokens, "num_prompts": len(prompts), "prompt_ids": [p.id for p in prompts],
                     "batch": "1 (prompts one after another)", "repeat": args.repeat, "seed": args.seed,
                     **dtype.as_dict(), "speedup": "ms per output token of the fastest vLLM eagle3 row / of the "
                     "row (MJSD may stop at EOS before max_tokens)"},
        "machine": machine_facts(),
        "results": results,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, rows = result["settings"], result["results"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 2))
    names = [r["method"] for r in rows]
    ax.barh(names, [r["speedup_vs_best_eagle3"] for r in rows],
            color=["gray" if r["mjsd_tau"] is None else "tab:blue" if r["draft_in_step"] else "tab:orange"
                   for r in rows])
    for y, r in enumerate(rows):
        spread = r["speedup_vs_best_eagle3_per_repeat"]
        ax.plot([min(spread), max(spread)], [y, y], color="black", lw=1)
        ax.text(r["speedup_vs_best_eagle3"], y, f" {r['speedup_vs_best_eagle3']:.2f}x", va="center", fontsize=8)
    ax.axvline(1.0, color="gray", ls="--", lw=1)
    ax.invert_yaxis()
    ax.set_xlabel(f"speedup vs the fastest eagle3 row, {s['baseline']} (ms/token; line: range over repeats)",
                  fontsize=9)
    ax.set_title(f"MJSD, K = {s['width']}, γ {s['gamma']}, T {s['temperature']} vs eagle3 γ {s['eagle3_tokens']}; "
                 f"{s['num_prompts']} prompts x {s['max_tokens']} tokens x {s['repeat']}, {s['dtype']}, "
                 f"{result['machine']['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_args(parser, max_tokens=32)
    parser.add_argument("--draft", required=True, help="an EAGLE-3 head (both engines draft with it)")
    parser.add_argument("--width", type=int, default=4, help="K, MJSD's draft beams")
    parser.add_argument("--gamma", type=int, default=3, help="MJSD's γ")
    parser.add_argument("--eagle3-tokens", default="2,3,4",
                        help="γ of vLLM's eagle3, comma-separated: one engine each; the fastest is the baseline")
    parser.add_argument("--taus", default="0.3,0.5,0.9")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the MJSD rows (eagle3 is greedy)")
    parser.add_argument("--repeat", type=int, default=3)
    add_dtype_argument(parser)
    parser.add_argument("--out", default="benchmarks/results/mjsd-head-interleaved")
    args = parser.parse_args()
    result = run(args)
    out = Path(args.out)
    write_result(result, out, "mjsd", plot)
    for r in result["results"]:
        print(f"{r['method']:24s} {r['ms_per_token']:6.1f} ms/token  {r['speedup_vs_best_eagle3']:.2f}x  "
              f"per repeat {', '.join(f'{x:.2f}' for x in r['speedup_vs_best_eagle3_per_repeat'])}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
