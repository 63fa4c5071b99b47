"""DSBD against in-engine beam decoding, draft depth γ side by side.

    .venv/bin/python -m benchmarks.bench_dsbd                        # W 4, γ 0-4, 4 prompts x 64 tokens
    .venv/bin/python -m benchmarks.bench_dsbd --gammas 0,1,2 --temperatures 1 --out /tmp/dsbd
    .venv/bin/python -m benchmarks.bench_dsbd --pair qwen2.5-coder --gammas 0,1,2 --auto --max-tokens 32

One DSBD engine drafting with the default draft (or ``--draft``) serves every
row, in one process, on the same chat prompts
(``benchmarks/prompts/prompts.json``): γ = 0 is in-engine beam decoding
without speculation (the baseline), γ >= 1 is DSBD with that many draft
layers per iteration, with a fixed width and with a dynamic width (τ). Each
temperature runs beam search (T = 0; DSBD must return the baseline's tokens,
which the script checks and records) or beam sampling (T > 0, seeded).
``ignore_eos`` keeps every output at ``max_tokens`` tokens. Every row is
warmed up on a short run first; the timed runs process the prompts as one
batch (``--batch all``) or one after another (``--batch 1``, the default: latency),
interleaved: each prompt runs every row in turn, so a drift of the machine's
speed during the run hits every row alike (``--repeat N``: all of it N times,
still interleaved). Rows with
``--auto`` let the engine choose γ per iteration (``auto_depth``, at most ``--auto-max``); with
``--memory-efficient``, rows at T > 0 with dynamic width that carry one beam between iterations
(``memory_efficient``, one sequence out).
Besides wall time, each row records from the engine's own counters
(``llm.get_metrics()``) its DSBD iterations, i.e. target forwards per group,
the draft nodes proposed and accepted, and the beam layers produced and
their widths: ``tokens_per_target_forward`` (beam layers per iteration) and
``mean_beam_width`` are the engine's ``vllm:dsbd_*`` metrics; ``step_profile`` is
the runner's time per step kind (draft / verify / beam steps: worker seconds,
model forward and logits, DSBD decisions, of them the next forests drawn in the
step) and ``wall_per_forward`` the row's
wall time over the model forwards it contains. ``forward_bound_speedup`` is
the speedup the row would have if nothing but its model forwards took time
(the baseline's forward seconds over the row's): the ceiling that removing
every other cost could reach. ``--omp-bind`` sets vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` for the engine (``0-1``: the worker computes on
cores 0 and 1; vLLM's default ``auto`` leaves one core to the engine core).

Quality beside speed (:mod:`benchmarks.frontier`): at T > 0 the run adds in-engine beam sampling at the
narrower widths ``--beam-widths`` (default 1, 2, 3) as rows of their own, interleaved with the rest; after the
engines shut down, every row's beams are scored under the target (``quality_best``: the best returned beam's
mean log-prob per token, averaged over requests; ``quality_mean``: all returned beams'), and each DSBD row at
T > 0 gets ``speedup_at_equal_quality``: against the narrowest beam sampling whose beams are as likely.

The engine runs in vLLM's default compiled mode (``compiled: true`` in the settings, with the seconds the
engine took to start, compilation included; vLLM caches the compiled graphs under ``~/.cache/vllm``) unless
``--enforce-eager``.

Writes ``dsbd.json`` and ``dsbd.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.frontier import QUALITY, place, plot_frontier, score_rows
from benchmarks.machine import machine_facts
from benchmarks.run import load_prompts
from benchmarks.scripts import add_enforce_eager_argument, add_omp_bind_argument, add_prompt_args, apply_omp_bind, write_result
from vllm_dsbd import pairs
from vllm_dsbd.config import DRAFT_DTYPES
from vllm_dsbd.dtypes import add_dtype_argument, resolve_dtype

COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted_tokens": "vllm:spec_decode_num_accepted_tokens", "beam_layers": "vllm:dsbd_beam_layers",
            "beam_width_sum": "vllm:dsbd_beam_width_sum", "draft_layers": "vllm:dsbd_draft_layers"}


def _counters(llm) -> dict[str, float]:
    values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return {k: values.get(name, 0.0) for k, name in COUNTERS.items()}


def _profile(llm) -> dict[str, dict[str, float]]:
    """The output rank's runner step profile (vllm_dsbd.engine.model_runner.StepProfile)."""
    return llm.collective_rpc("dsbd_step_profile")[0]


def _profile_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {kind: {k: v - before.get(kind, {}).get(k, 0.0) for k, v in values.items()}
            for kind, values in after.items() if values["steps"] > before.get(kind, {}).get("steps", 0)}


WIDTHS = ("fixed", "dynamic", "memory-efficient")
"""How a DSBD row sets its width: fixed W, dynamic (τ), or dynamic carrying one beam between iterations
(``memory_efficient``: one sequence out, against in-engine beam sampling's W)."""


def _rows(gammas: list[int], temperature: float, auto: int, in_step: list[bool], scales: list[float | None],
          memory_efficient: bool = False, beam_widths: Sequence[int] = ()
          ) -> list[tuple[str, int, str, bool, bool, float | None]]:
    """(name, γ (the maximum with auto), width (``WIDTHS``, or ``beam-N``: in-engine at width N), auto_depth,
    draft_in_step, draft_temperature_scale) of every row; γ = 0 (the baseline) first, then at T > 0 in-engine
    beam sampling at each of ``beam_widths``. Every DSBD row comes once per ``in_step`` mode and once per draft
    temperature scale (None: the knob is not sent, the engine's value applies; at T 0 it scales how the draft
    ranks its candidates); memory-efficient rows at T > 0 only with ``memory_efficient``."""
    widths = ["fixed"] if temperature == 0 else [w for w in WIDTHS if memory_efficient or w != "memory-efficient"]
    rows = [("in-engine", 0, "fixed", False, False, 1.0)]
    if temperature:
        rows += [("in-engine", 0, f"beam-{w}", False, False, 1.0) for w in beam_widths]
    for gamma in (g for g in gammas if g > 0):
        rows += [(f"dsbd-{width}", gamma, width, False, mode, scale)
                 for width in widths for mode in in_step for scale in scales]
    if auto:
        rows += [(f"dsbd-auto-{width}", auto, width, True, mode, scale)
                 for width in widths for mode in in_step for scale in scales]
    return rows


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    omp_bind = apply_omp_bind(args)
    from transformers import AutoTokenizer
    from vllm import LLM

    from vllm_dsbd.demo import dsbd_engine_kwargs

    dtype = resolve_dtype(args.dtype)
    print(f"[dsbd] dtype {dtype.dtype} ({dtype.reason})", flush=True)
    pair = pairs.pair_paths(args.pair) if not (args.target and args.draft) else None
    target = args.target or str(pair.target)
    drafts = args.draft.split(",") if args.draft else [str(pair.draft)]
    gammas = [int(g) for g in args.gammas.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    scales = [None if s == "draft" else float(s) for s in args.draft_temperature_scales.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(Path(args.prompts_file), args.num_prompts, tokenizer)
    inputs = [{"prompt_token_ids": list(p.token_ids)} for p in prompts]
    batches = ([inputs] if args.batch == "all" else [[x] for x in inputs]) * args.repeat
    auto_max = (args.auto_max or max(gammas)) if args.auto else 0  # γmax of the auto_depth rows
    vocab_sizes = [int(v) for v in args.draft_vocab_sizes.split(",")]
    beam_widths = [int(w) for w in args.beam_widths.split(",") if w and int(w) != args.width]
    rows, baselines = [], {}  # baselines: temperature -> (seconds, tokens, forward seconds) of in-engine decoding
    # both: one engine with the knob, each fixed-depth row run with it turned on and off per request, in turn
    in_step = {"off": [False], "on": [True], "both": [False, True]}[args.draft_in_step]
    engines = [(d, v) for d in drafts for v in vocab_sizes]
    engine_start_s = []
    for engine_index, (draft, vocab_size) in enumerate(engines):
        knobs = {"draft_vocab_size": vocab_size} if vocab_size else {}
        if args.draft_dtype != "auto":
            knobs["draft_dtype"] = args.draft_dtype
        head = _is_head(draft)
        if head:  # a draft model drafts in draft steps (the knob is refused)
            knobs["draft_in_step"] = args.draft_in_step != "off"
        kwargs = dsbd_engine_kwargs(target, draft, max(max(gammas), auto_max, 1), args.width, dtype.dtype,
                                    args.enforce_eager, **knobs)
        start = time.perf_counter()
        llm = LLM(**kwargs, disable_log_stats=False)
        engine_start_s.append(time.perf_counter() - start)
        print(f"[dsbd] engine started in {engine_start_s[-1]:.0f} s "
              f"({'eager' if args.enforce_eager else 'compiled'})", flush=True)
        # γ 0 runs no draft: the first engine's in-engine rows are every engine's baseline
        rows += _run_rows(llm, args, inputs, batches, gammas, temperatures, auto_max, draft, vocab_size, baselines,
                          with_baseline=engine_index == 0, in_step=in_step if head else [False], scales=scales,
                          beam_widths=beam_widths)
        llm.llm_engine.engine_core.shutdown()
        del llm
    score_rows(target, [p.token_ids for p in prompts], rows)
    place(rows)
    for r in rows:
        print(f"[dsbd] T={r['temperature']} γ={r['gamma']} W {r['beam_width']} {_label(r):25s} quality "
              f"{r['quality_best']:.3f} (mean beam {r['quality_mean']:.3f})"
              + (f"; beam sampling at equal quality: W {r['equal_quality_beam_width']}, "
                 f"{r['speedup_at_equal_quality']:.2f}x" if "speedup_at_equal_quality" in r else ""), flush=True)
    return {
        "benchmark": "bench_dsbd",
        "settings": {"pair": args.pair, "target": target, "drafts": drafts, "width": args.width, "gammas": gammas,
                     "auto_depth_rows": args.auto, "memory_efficient_rows": args.memory_efficient,
                     "temperatures": temperatures, "width_threshold": args.tau,
                     "draft_vocab_sizes": vocab_sizes, "draft_in_step": args.draft_in_step,
                     "draft_temperature_scales": ["draft" if s is None else s for s in scales],
                     "max_tokens": args.max_tokens, "num_prompts": len(prompts),
                     "prompt_ids": [p.id for p in prompts],
                     "batch": "all prompts" if args.batch == "all" else "1 (prompts one after another)",
                     "repeat": args.repeat,
                     "ignore_eos": True, "seed": args.seed, **dtype.as_dict(), "draft_dtype": args.draft_dtype,
                     "block_size": 32, "compiled": not args.enforce_eager, "engine_start_s": engine_start_s,
                     "beam_widths": beam_widths, "quality": QUALITY,
                     "omp_threads_bind": omp_bind},
        "machine": machine_facts(),
        "results": rows,
    }


def _beam_width(width: str, request_width: int) -> int:
    """The beam width of a row: N for an in-engine ``beam-N`` row, else the requests' width."""
    return int(width.removeprefix("beam-")) if width.startswith("beam-") else request_width


def _label(row: dict) -> str:
    """A row's method, marked when its engine drafts inside the verify step and with its draft's temperature
    scale when not 1."""
    scale = row.get("draft_temperature_scale", 1.0)
    return (row["method"] + ("" if row["gamma"] else f" W {row.get('beam_width', '')}")
            + (" in-step" if row.get("draft_in_step") else "")
            + (f" q-T x{scale:g}" if scale != 1 else ""))


def _is_head(draft: str) -> bool:
    """Whether ``draft`` is an EAGLE-3 head (the knob ``draft_in_step`` is for heads only)."""
    import json
    from types import SimpleNamespace

    from vllm_dsbd.engine.eagle3 import head_architecture

    config = json.loads((Path(draft) / "config.json").read_text())
    return head_architecture(SimpleNamespace(architectures=config.get("architectures"))) is not None


def _run_rows(llm, args, inputs, batches, gammas, temperatures, auto_max, draft, vocab_size, baselines,
              with_baseline: bool, in_step: list[bool], scales: list[float | None],
              beam_widths: Sequence[int]) -> list[dict]:
    """Every row of one engine (one draft and draft_vocab_size); the in-engine rows only ``with_baseline``."""
    from vllm import SamplingParams

    from vllm_dsbd.config import DSBDConfig

    engine_scale = DSBDConfig.from_vllm_config(llm.llm_engine.vllm_config).draft_temperature_scale

    def decode(gamma, temperature, width, auto, in_step_row, scale, max_tokens, batch):
        beams = _beam_width(width, args.width)
        extra = {"beam_width": beams, "num_speculative_tokens": gamma, "width_threshold": args.tau,
                 "auto_depth": auto}
        if scale is not None:
            extra["draft_temperature_scale"] = scale
        if width == "fixed":
            extra["fixed_width"] = True
        elif width == "memory-efficient":
            extra["memory_efficient"] = True
        if args.draft_in_step != "off":  # the engine drafts in the verify step unless the request turns it off
            extra["draft_in_step"] = in_step_row
        n = 1 if width == "memory-efficient" else beams  # one sequence out when one beam is carried
        params = SamplingParams(n=n, temperature=temperature, seed=args.seed, max_tokens=max_tokens,
                                ignore_eos=True, extra_args=extra)
        return llm.generate(batch, params, use_tqdm=False)

    rows = []
    for temperature in temperatures:
        specs = [spec for spec in _rows(gammas, temperature, auto_max, in_step, scales, args.memory_efficient,
                                        beam_widths) if spec[1] > 0 or with_baseline]
        for _, gamma, *knobs in specs:
            decode(gamma, temperature, *knobs, 4, inputs[:1])  # warm-up
        # Interleaved: each batch runs every row in turn, so a drift of the machine's speed during the
        # run (seen here: ~10 % over half an hour) hits every row alike instead of the later rows.
        runs = {spec: {"secs": 0.0, "out": [], "counters": dict.fromkeys(COUNTERS, 0.0), "profile": {}}
                for spec in specs}
        for batch in batches:
            for spec in specs:
                _, gamma, *knobs = spec
                run = runs[spec]
                before, profile_before = _counters(llm), _profile(llm)
                start = time.perf_counter()
                run["out"] += decode(gamma, temperature, *knobs, args.max_tokens, batch)
                run["secs"] += time.perf_counter() - start
                after = _counters(llm)
                for k in COUNTERS:
                    run["counters"][k] += after[k] - before[k]
                for kind, values in _profile_delta(profile_before, _profile(llm)).items():
                    total = run["profile"].setdefault(kind, dict.fromkeys(values, 0.0))
                    for k, v in values.items():
                        total[k] += v
        for spec in specs:
            name, gamma, width, auto, in_step_row, scale = spec
            run = runs[spec]
            secs, out, profile = run["secs"], run["out"], run["profile"]
            tokens = [[list(c.token_ids) for c in o.outputs] for o in out]
            forward_s = sum(p["forward_s"] for p in profile.values())
            row = {"method": name, "gamma": gamma, "beam_width": _beam_width(width, args.width),
                   "auto_depth": auto, "temperature": temperature,
                   "draft_in_step": in_step_row,
                   "draft_temperature_scale": engine_scale if scale is None else scale,
                   "draft": Path(draft).name if gamma else None, "draft_vocab_size": vocab_size if gamma else 0,
                   "wall_s": secs,
                   **run["counters"], "step_profile": profile,
                   "wall_per_forward": secs / max(forward_s, 1e-9), "_beams": tokens}
            if gamma == 0 and width == "fixed":
                baselines[temperature] = (secs, tokens, forward_s)
            elif gamma == 0:  # in-engine at a narrower width: its cost beside the request's width
                row["speedup_vs_in_engine"] = baselines[temperature][0] / secs
            else:
                base_secs, base_tokens, base_forward_s = baselines[temperature]
                row["speedup_vs_in_engine"] = base_secs / secs
                row["forward_bound_speedup"] = base_forward_s / max(forward_s, 1e-9)
                row["tokens_per_target_forward"] = row["beam_layers"] / max(row["drafts"], 1)
                row["mean_beam_width"] = row["beam_width_sum"] / max(row["beam_layers"], 1)
                row["mean_draft_depth"] = row["draft_layers"] / max(row["drafts"], 1)
                row["node_acceptance"] = row["accepted_tokens"] / max(row["draft_tokens"], 1)
                if temperature == 0:
                    row["same_tokens_as_in_engine"] = tokens == base_tokens
            rows.append(row)
            print(f"[dsbd] T={temperature} γ={gamma} {row['draft']} V'={vocab_size} {_label(row)} {secs:.2f} s "
                  + " ".join(f"{k}={v:.3g}" for k, v in row.items() if k in (
                      "speedup_vs_in_engine", "tokens_per_target_forward", "mean_beam_width", "mean_draft_depth",
                      "node_acceptance", "wall_per_forward", "forward_bound_speedup")), flush=True)
            for kind, p in sorted(profile.items()):
                print(f"         {kind:7s} steps {p['steps']:4.0f}  tokens/step {p['tokens'] / p['steps']:6.1f}  "
                      f"ms/step {1e3 * p['step_s'] / p['steps']:7.1f}  forward {1e3 * p['forward_s'] / p['steps']:7.1f}"
                      f"  decide {1e3 * p['decide_s'] / p['steps']:6.1f}"
                      f"  drafting in it {1e3 * p.get('draft_s', 0.0) / p['steps']:6.1f}", flush=True)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    scored = any(r.get("quality_best") is not None for r in result["results"])
    fig, axes = plt.subplots(2 if scored else 1, len(s["temperatures"]),
                             figsize=(5 * len(s["temperatures"]), 11 if scored else 6.5), squeeze=False)
    if scored:
        for ax, temperature in zip(axes[1], s["temperatures"]):
            if temperature:
                plot_frontier(ax, result["results"], temperature)
            else:
                ax.axis("off")  # T 0: every exact row returns the baseline's beams
    for ax, temperature in zip(axes[0], s["temperatures"]):
        rows = [r for r in result["results"] if r["temperature"] == temperature]
        engines = sorted({(r.get("draft"), r.get("draft_vocab_size", 0), bool(r.get("draft_in_step")),
                           r.get("draft_temperature_scale", 1.0)) for r in rows if r["gamma"]}, key=str)
        for draft, vocab, in_step, scale in engines:
            suffix = ((f", {draft}" if len({e[0] for e in engines}) > 1 else "")
                      + (f", draft vocab {vocab}" if vocab else "") + (", in-step" if in_step else "")
                      + (f", q at T x{scale:g}" if scale != 1 else ""))
            mine = [r for r in rows if r.get("draft") == draft and r.get("draft_vocab_size", 0) == vocab
                    and bool(r.get("draft_in_step")) == in_step and r.get("draft_temperature_scale", 1.0) == scale]
            for name, marker in (("dsbd-fixed", "o"), ("dsbd-dynamic", "s"), ("dsbd-memory-efficient", "^")):
                pts = [(r["gamma"], r["speedup_vs_in_engine"]) for r in mine if r["method"] == name]
                if pts:
                    ax.plot(*zip(*pts), marker=marker, label=name + suffix)
            for name, marker in (("dsbd-auto-fixed", "*"), ("dsbd-auto-dynamic", "P"),
                                 ("dsbd-auto-memory-efficient", "X")):
                pts = [(r["gamma"], r["speedup_vs_in_engine"]) for r in mine if r["method"] == name]
                if pts:
                    ax.scatter(*zip(*pts), marker=marker, s=90, label=f"{name} (γ chosen, at most x){suffix}")
        ceilings = [(r["gamma"], r["forward_bound_speedup"]) for r in rows if "forward_bound_speedup" in r]
        if ceilings:
            ax.scatter(*zip(*ceilings), marker="_", s=200, color="black", label="ceiling: model forwards only")
        ax.axhline(1.0, color="gray", ls="--", lw=1, label="in-engine beam decoding (γ = 0)")
        ax.set_xlabel("γ (draft layers per iteration)")
        ax.set_ylabel("speedup vs in-engine (wall time)")
        ax.set_title(f"T={temperature}, W={s['width']}, {s['num_prompts']} prompts x {s['max_tokens']} tokens, "
                     f"{s.get('dtype', 'float32')}, {'compiled' if s.get('compiled') else 'eager'}, "
                     f"{result['machine']['cpu']}, worker cores {s.get('omp_threads_bind', 'auto')}", fontsize=8)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below: never over the points
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_args(parser)
    parser.add_argument("--draft", default=None,
                        help="draft checkpoint or EAGLE-3 head, or several comma-separated (one engine each, rows "
                             "side by side against the first engine's in-engine rows; default: the pair's draft)")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--gammas", default="0,1,2,3,4", help="0 (the baseline) must come first")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--tau", type=float, default=0.7, help="width_threshold of the dynamic rows")
    parser.add_argument("--pair", default="default", help="model pair (vllm-dsbd models prepare --pair NAME)")
    parser.add_argument("--batch", choices=("1", "all"), default="1",
                        help="1: prompts one after another (latency); all: the prompts as one batch")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the prompts this many times, every row in turn each time (times summed): "
                             "on a noisy machine, one batch of 16 prompts per row varies by 10 %% run to run")
    parser.add_argument("--memory-efficient", action="store_true",
                        help="also rows at T > 0 with dynamic width carrying one beam between iterations "
                             "(memory_efficient, n 1), against the same in-engine beam sampling")
    parser.add_argument("--auto", action="store_true",
                        help="also rows with auto_depth (γ chosen per iteration, at most --auto-max)")
    parser.add_argument("--auto-max", type=int, default=None, help="γmax of the auto rows (default: the largest γ)")
    parser.add_argument("--draft-vocab-sizes", default="0",
                        help="draft_vocab_size of each engine, comma-separated (0: the whole vocabulary); "
                             "every engine runs every DSBD row against the first engine's in-engine rows")
    parser.add_argument("--draft-in-step", choices=("off", "on", "both"), default="on",
                        help="the knob draft_in_step (an EAGLE-3 head drafts each forest inside the verify step "
                             "before it; on: the engine's default for a head on CPU); both: one engine with it, "
                             "every fixed-depth DSBD row run with it and without it (per request), in turn; a draft "
                             "model's engine runs draft steps")
    parser.add_argument("--draft-temperature-scales", default="draft",
                        help="the knob draft_temperature_scale (the draft samples at T x this), comma-separated: "
                             "every DSBD row at T > 0 once per value, in turn; 'draft': the knob not sent, the "
                             "engine's value (what the draft's dsbd.json recommends, else 1)")
    add_omp_bind_argument(parser)
    add_dtype_argument(parser)
    parser.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPES,
                        help="the draft's dtype (DSBD knob draft_dtype; auto: the target's)")
    parser.add_argument("--beam-widths", default="1,2,3",
                        help="at T > 0, in-engine beam sampling at these narrower widths too, comma-separated "
                             "(empty: none): the frontier each DSBD row's quality is placed on")
    add_enforce_eager_argument(parser)
    parser.add_argument("--out", default="benchmarks/results/dsbd")
    args = parser.parse_args()
    if not args.gammas.startswith("0"):
        parser.error("--gammas must start with 0: in-engine beam decoding is the baseline of every row")
    result = run(args)
    out = Path(args.out)
    write_result(result, out, "dsbd", plot)
    for r in result["results"]:
        extra = "".join(f"  {k} {r[k]:.2f}" for k in ("speedup_vs_in_engine", "forward_bound_speedup",
                                                      "tokens_per_target_forward", "mean_beam_width") if k in r)
        print(f"T={r['temperature']} γ={r['gamma']} {r['draft']} V'={r['draft_vocab_size']} {_label(r):25s} "
              f"{r['wall_s']:7.2f} s{extra}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
