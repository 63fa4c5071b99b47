"""What a row of a target forward costs: beam rows against forest rows, and the matrix products under both.

    .venv/bin/python -m benchmarks.bench_rows                          # default pair, machine's dtype, compiled
    .venv/bin/python -m benchmarks.bench_rows --dtype float32 --enforce-eager --out /tmp/rows

A verify step's target forward runs the beams' rows and the forest's (γ 1, W 4: 4 + 4 rows); a beam step
runs W. Two measurements, one run:

- ``gemm``: the target's matrix products alone (every layer's q/k/v, o, gate/up and down projections and
  the logits head, the shapes read from the target's config, random weights in the run's dtype) through
  vLLM's own CPU dispatch (``dispatch_cpu_unquantized_gemm``: oneDNN, or AMX kernels where present), timed
  at 1 to 16 rows, in the benchmark's own process (vLLM's worker computes on the cores that
  ``VLLM_CPU_OMP_THREADS_BIND`` gives it: its default ``auto`` leaves one to the engine core; ``--omp-bind``;
  ``torch.set_num_threads`` does not change what oneDNN runs on, so the script does not try).
- ``engine``: one DSBD engine with the shipped head (default pair; else the pair's draft; a head drafts in
  the verify step), batch 1, T 0:
  in-engine beam search at W 1, 2, 4, 8 (a beam step runs W rows) and DSBD at W 4, γ 1 and 2 (a verify step
  runs the beams' and the forest's rows), each prompt running every row in turn. From the runner's step
  profile: a beam or verify step's rows and its target forward (logits included) in ms; the prompt steps
  of the beam rows are measured by a one-token run of each prompt and taken out.

If forest rows cost what beam rows cost, the verify steps lie on the beam steps' line of forward ms over
rows. Writes ``rows.json`` and ``rows.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.bench_dsbd import _profile, _profile_delta
from benchmarks.machine import machine_facts
from benchmarks.run import load_prompts
from benchmarks.scripts import (add_enforce_eager_argument, add_omp_bind_argument, add_prompt_args, apply_omp_bind,
                                write_result)
from vllm_dsbd import models, pairs
from vllm_dsbd.dtypes import add_dtype_argument, resolve_dtype

GEMM_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
BEAM_WIDTHS = (1, 2, 4, 8)
GAMMAS = (1, 2)
FIELDS = ("steps", "tokens", "forward_s", "step_s")


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of one decoder layer's projections and of the logits head, from an HF config."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", heads)
    return {"qkv": (hidden, (heads + 2 * kv) * head_dim), "o": (heads * head_dim, hidden),
            "gate_up": (hidden, 2 * config.intermediate_size), "down": (config.intermediate_size, hidden),
            "logits": (hidden, config.vocab_size)}


def time_gemms(config, dtype, rows=GEMM_ROWS, repeats: int = 20, rounds: int = 5) -> list[dict]:
    """Per number of rows: ms of one forward's matrix products (layers x projections + logits head) in this
    process, the median of ``rounds`` rounds that each time every number of rows in turn."""
    import gc
    import statistics

    import torch

    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    torch.manual_seed(0)
    layers = {}
    for name, (n_in, n_out) in projection_shapes(config).items():
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(n_out, n_in, dtype=dtype) * 0.02, requires_grad=False)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        layers[name] = layer
    inputs = {m: {name: torch.randn(m, layer.weight.shape[1], dtype=dtype) for name, layer in layers.items()}
              for m in rows}
    times = {m: {name: [] for name in layers} for m in rows}
    for _ in range(rounds):
        for m in rows:
            for name, layer in layers.items():
                for _ in range(3):
                    layer.cpu_linear(inputs[m][name], layer.weight, None)
                start = time.perf_counter()
                for _ in range(repeats):
                    layer.cpu_linear(inputs[m][name], layer.weight, None)
                times[m][name].append((time.perf_counter() - start) / repeats * 1e3)
    del layers, inputs
    gc.collect()  # vLLM's oneDNN handlers are freed now, not during the engine's compilation
    out = []
    for m in rows:
        ms = {name: statistics.median(t) for name, t in times[m].items()}
        layer_ms = sum(v for k, v in ms.items() if k != "logits")
        out.append({"rows": m, "threads": torch.get_num_threads(), "layer_ms": layer_ms, "logits_ms": ms["logits"],
                    "forward_ms": config.num_hidden_layers * layer_ms + ms["logits"]})
    return out


def decode_step(full: dict, prompt: dict, kind: str) -> dict[str, float]:
    """A step kind's decode steps: the row's totals less its prompt steps' (both ``StepProfile`` totals);
    per step: rows, forward ms, step ms."""
    f = {k: full.get(kind, {}).get(k, 0.0) - prompt.get(kind, {}).get(k, 0.0) for k in FIELDS}
    if f["steps"] <= 0:
        raise ValueError(f"no {kind} step left once the prompt steps are taken out: {full} / {prompt}")
    return {"steps": f["steps"], "rows": f["tokens"] / f["steps"], "forward_ms": 1e3 * f["forward_s"] / f["steps"],
            "step_ms": 1e3 * f["step_s"] / f["steps"]}


def _add(total: dict, part: dict) -> None:
    for kind, values in part.items():
        slot = total.setdefault(kind, dict.fromkeys(FIELDS, 0.0))
        for k in FIELDS:
            slot[k] += values.get(k, 0.0)


def time_engine(args, target: str, draft: str, dtype: str, prompts) -> tuple[list[dict], float]:
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import dsbd_engine_kwargs

    specs = [("beam", w, 0) for w in BEAM_WIDTHS] + [("verify", 4, g) for g in GAMMAS]
    start = time.perf_counter()
    llm = LLM(**dsbd_engine_kwargs(target, draft, max(GAMMAS), max(BEAM_WIDTHS), dtype, args.enforce_eager),
              disable_log_stats=False)
    start_s = time.perf_counter() - start

    def run(spec, prompt, max_tokens):
        _, width, gamma = spec
        params = SamplingParams(n=width, temperature=0.0, seed=args.seed, max_tokens=max_tokens, ignore_eos=True,
                                extra_args={"beam_width": width, "num_speculative_tokens": gamma,
                                            "fixed_width": True, "auto_depth": False})
        before = _profile(llm)
        llm.generate([{"prompt_token_ids": list(prompt.token_ids)}], params, use_tqdm=False)
        return _profile_delta(before, _profile(llm))

    for spec in specs:
        run(spec, prompts[0], 4)  # warm-up
    for p in prompts:  # every prompt's blocks in the prefix cache: each row's prompt steps then cost alike
        run(specs[0], p, 1)
    full = {spec: {} for spec in specs}
    first = {spec: {} for spec in specs}
    for _ in range(args.repeat):
        for p in prompts:  # interleaved: each prompt runs every row in turn
            for spec in specs:
                _add(full[spec], run(spec, p, args.max_tokens))
                _add(first[spec], run(spec, p, 1))
    llm.llm_engine.engine_core.shutdown()
    rows = []
    for spec in specs:
        kind, width, gamma = spec
        prompt_steps = first[spec] if kind == "beam" else {}  # a DSBD row's prompt steps are "other" steps
        rows.append({"kind": kind, "beam_width": width, "gamma": gamma,
                     **decode_step(full[spec], prompt_steps, kind),
                     "totals": full[spec], "prompt_totals": prompt_steps})
    return rows, start_s


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    omp_bind = apply_omp_bind(args)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    dtype = resolve_dtype(args.dtype)
    pair = pairs.pair_paths(args.pair)
    target = args.target or str(pair.target)
    draft = args.draft or str(models.default_head_path() if args.pair == "default" else pair.draft)
    config = AutoConfig.from_pretrained(target)
    gemm = time_gemms(config, getattr(torch, dtype.dtype))
    print("[rows] matrix products of one forward, ms: " +
          ", ".join(f"{g['rows']} rows {g['forward_ms']:.1f}" for g in gemm), flush=True)
    prompts = load_prompts(Path(args.prompts_file), args.num_prompts, AutoTokenizer.from_pretrained(target))
    engine, start_s = time_engine(args, target, draft, dtype.dtype, prompts)
    for r in engine:
        print(f"[rows] {r['kind']:6s} W {r['beam_width']} γ {r['gamma']}: {r['rows']:.1f} rows a step, forward "
              f"{r['forward_ms']:.1f} ms, step {r['step_ms']:.1f} ms", flush=True)
    return {"benchmark": "bench_rows",
            "settings": {"pair": args.pair, "target": target, "draft": draft, "temperature": 0.0,
                         "max_tokens": args.max_tokens, "num_prompts": len(prompts), "repeat": args.repeat,
                         "prompt_ids": [p.id for p in prompts], "batch": 1, "ignore_eos": True,
                         **dtype.as_dict(), "compiled": not args.enforce_eager, "engine_start_s": start_s,
                         "omp_threads_bind": omp_bind, "torch_threads": torch.get_num_threads(),
                         "cpu_capability": torch.backends.cpu.get_cpu_capability()},
            "machine": machine_facts(), "gemm": gemm, "engine": engine}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, marker in (("beam", "o"), ("verify", "s")):
        rows = [r for r in result["engine"] if r["kind"] == kind]
        ax.plot([r["rows"] for r in rows], [r["forward_ms"] for r in rows], marker=marker, linestyle="-",
                label={"beam": "beam steps (W 1, 2, 4, 8)", "verify": "verify steps (W 4, γ 1, 2)"}[kind])
        for r in rows:
            ax.annotate(f"W {r['beam_width']}" if kind == "beam" else f"γ {r['gamma']}", (r["rows"], r["forward_ms"]),
                        textcoords="offset points", xytext=(4, -10), fontsize=8)
    for threads in sorted({g["threads"] for g in result["gemm"]}):
        gemm = [g for g in result["gemm"] if g["threads"] == threads]
        ax.plot([g["rows"] for g in gemm], [g["forward_ms"] for g in gemm], linestyle="--" if threads == 1 else ":",
                color="grey", label=f"matrix products alone, {threads} thread{'s' if threads > 1 else ''}")
    s = result["settings"]
    ax.set_xlabel("rows of the target forward")
    ax.set_ylabel("ms per step (forward and logits)")
    ax.set_title(f"{s['pair']} pair, {s['dtype']}, {'compiled' if s['compiled'] else 'eager'}, batch 1, T 0\n"
                 f"{result['machine'].get('cpu', '')}, worker cores: {s['omp_threads_bind']}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_args(parser, max_tokens=32, num_prompts=4)
    parser.add_argument("--pair", default="default", help="model pair (vllm-dsbd models prepare --pair NAME)")
    parser.add_argument("--draft", default=None, help="draft checkpoint or EAGLE-3 head (default: the shipped "
                                                      "head on the default pair, else the pair's draft)")
    parser.add_argument("--repeat", type=int, default=2, help="run the prompts this many times, rows interleaved")
    add_omp_bind_argument(parser)
    add_dtype_argument(parser)
    add_enforce_eager_argument(parser)
    parser.add_argument("--out", default="benchmarks/results/rows")
    args = parser.parse_args()
    write_result(run(args), Path(args.out), "rows", plot)


if __name__ == "__main__":
    main()
