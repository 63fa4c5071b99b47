"""In-step drafting under load: every group's next forest drawn in one batched head forward per layer,
against one head forward per group (how the runner drew until 2026-12-07).

With an EAGLE-3 head drafting inside the verify step (``draft_in_step``), the runner draws the next forest
of every group that verified in the step (``engine.forest_draft.draw``): each layer of all of them is one
head forward over every group's forest rows. This script times that against the per-group drawing on one
engine, in one process, on the same prompts: the ``per-group`` rows call ``draw`` with one group at a time
(the same code, so the same decisions), the ``batched`` rows let the runner draw them together. Rows
alternate, each (batch, T, γ) cell runs both in turn ``--repeat`` times, and each run reports its wall time
and the worker's own profile (``dsbd_step_profile``): the drawing's milliseconds per verify step and the
verify step's. Outputs of the two modes are compared (T 0: token for token; T > 0 seeded: the same draws).

    python -m benchmarks.bench_in_step_draw --out benchmarks/results/in-step-draw
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.machine import machine_facts
from benchmarks.run import load_prompts
from benchmarks.scripts import add_enforce_eager_argument, write_result
from vllm_dsbd import pairs
from vllm_dsbd.dtypes import add_dtype_argument, resolve_dtype

MODES = ("per-group", "batched")
HEAD = "vllm_dsbd/draft/default-head"


def per_group(draw):
    """``forest_draft.draw`` one group at a time: the drawing before it was batched."""
    def draw_each(runner, jobs):
        for job in jobs:
            draw(runner, [job])
    return draw_each


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the drawing is switched here
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import dsbd_engine_kwargs
    from vllm_dsbd.engine import forest_draft

    dtype = resolve_dtype(args.dtype)
    target = str(pairs.pair_paths("default").target)
    gammas = [int(g) for g in args.gammas.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(Path(args.prompts_file), max(batches), tokenizer)
    started = time.perf_counter()
    llm = LLM(**dsbd_engine_kwargs(target, args.draft, max(gammas), args.width, dtype.dtype, draft_in_step=True,
                                   enforce_eager=args.enforce_eager))
    start_seconds = time.perf_counter() - started
    batched = forest_draft.draw
    drawings = {"per-group": per_group(batched), "batched": batched}

    def params(temperature: float, gamma: int, seed: int) -> SamplingParams:
        extra = {"beam_width": args.width, "num_speculative_tokens": gamma, "fixed_width": True}
        return SamplingParams(n=args.width, temperature=temperature, seed=seed, max_tokens=args.max_tokens,
                              ignore_eos=True, extra_args=extra)

    def once(mode: str, batch: int, temperature: float, gamma: int) -> dict:
        forest_draft.draw = drawings[mode]
        inputs = [{"prompt_token_ids": list(p.token_ids)} for p in prompts[:batch]]
        before = llm.collective_rpc("dsbd_step_profile")[0]
        t0 = time.perf_counter()
        outs = llm.generate(inputs, [params(temperature, gamma, k) for k in range(batch)], use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = llm.collective_rpc("dsbd_step_profile")[0]
        verify = {k: after.get("verify", {}).get(k, 0.0) - before.get("verify", {}).get(k, 0.0)
                  for k in ("steps", "step_s", "draft_s")}
        return {"seconds": seconds, "verify_steps": verify["steps"], "verify_step_s": verify["step_s"],
                "draft_s": verify["draft_s"], "outputs": [[list(c.token_ids) for c in o.outputs] for o in outs]}

    once("batched", 2, 1.0, max(gammas))  # warm up
    cells = []
    try:
        for batch in batches:
            for temperature in temperatures:
                for gamma in gammas:
                    runs = {mode: [] for mode in MODES}
                    for r in range(args.repeat):
                        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                            runs[mode].append(once(mode, batch, temperature, gamma))
                    cells.append(_cell(batch, temperature, gamma, runs))
    finally:
        forest_draft.draw = batched
        llm.llm_engine.engine_core.shutdown()
    return {"benchmark": "bench_in_step_draw",
            "settings": {"target": target, "draft": Path(args.draft).name, "width": args.width,
                         "max_tokens": args.max_tokens, "batches": batches, "gammas": gammas,
                         "temperatures": temperatures, "repeat": args.repeat, "fixed_width": True,
                         "ignore_eos": True, **dtype.as_dict(), "enforce_eager": args.enforce_eager,
                         "engine_start_s": start_seconds},
            "machine": machine_facts(),
            "cells": cells}


def _cell(batch: int, temperature: float, gamma: int, runs: dict) -> dict:
    """One (batch, T, γ): each mode's summed seconds and profile, the ratio, and whether outputs agree."""
    cell = {"batch": batch, "temperature": temperature, "gamma": gamma}
    for mode, rs in runs.items():
        steps = sum(r["verify_steps"] for r in rs)
        cell[mode] = {"seconds": sum(r["seconds"] for r in rs), "verify_steps": steps,
                      "draw_ms_per_verify_step": 1e3 * sum(r["draft_s"] for r in rs) / max(steps, 1),
                      "verify_step_ms": 1e3 * sum(r["verify_step_s"] for r in rs) / max(steps, 1)}
    cell["speedup"] = cell["per-group"]["seconds"] / cell["batched"]["seconds"]
    cell["draw_speedup"] = cell["per-group"]["draw_ms_per_verify_step"] / max(
        cell["batched"]["draw_ms_per_verify_step"], 1e-9)
    cell["same_outputs"] = all(a["outputs"] == b["outputs"] for a, b in zip(runs["per-group"], runs["batched"]))
    print(f"[in-step draw] batch {batch} T {temperature} γ {gamma}: draw "
          f"{cell['per-group']['draw_ms_per_verify_step']:.1f} -> {cell['batched']['draw_ms_per_verify_step']:.1f} "
          f"ms per verify step, verify step {cell['per-group']['verify_step_ms']:.0f} -> "
          f"{cell['batched']['verify_step_ms']:.0f} ms, end to end {cell['speedup']:.2f}x, same outputs "
          f"{cell['same_outputs']}", flush=True)
    return cell


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    labels = [f"B{c['batch']} T{c['temperature']:g} γ{c['gamma']}" for c in cells]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    x = range(len(cells))
    for k, mode in enumerate(MODES):
        axes[0].bar([i + 0.4 * k for i in x], [c[mode]["draw_ms_per_verify_step"] for c in cells], 0.4, label=mode)
    axes[0].set_ylabel("in-step drawing (ms per verify step)")
    axes[1].bar(list(x), [c["speedup"] for c in cells], 0.6)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_ylabel("end to end: batched vs per-group (x)")
    for ax in axes:
        ax.set_xticks([i + 0.2 for i in x], labels, rotation=60, fontsize=7)
    axes[0].legend(fontsize=8)
    st = result["settings"]
    fig.suptitle(f"in-step drafting, default pair + head, W {st['width']}, {st['max_tokens']} tokens, {st['dtype']}, "
                 f"{'eager' if st['enforce_eager'] else 'compiled'}, {result['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=HEAD, help="the EAGLE-3 head (default: the shipped one)")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--gammas", default="1,2")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--batches", default="1,4,16", help="prompts per generate call (groups in a step)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2, help="runs per mode and cell, the modes alternating")
    parser.add_argument("--prompts-file", default="benchmarks/prompts/prompts.json")
    parser.add_argument("--out", default="benchmarks/results/in-step-draw")
    add_enforce_eager_argument(parser)
    add_dtype_argument(parser)
    args = parser.parse_args()
    write_result(run(args), Path(args.out), "in_step_draw", plot)


if __name__ == "__main__":
    main()
