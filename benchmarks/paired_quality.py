"""Is fixed-width DSBD exact in a real engine? Paired quality of its beams against in-engine beam sampling.

Fixed-width DSBD at T > 0 must return exactly beam sampling's distribution at the same width. This script
measures what a user would: on one engine, for each (prompt, seed) pair, in-engine beam sampling (γ 0) and
fixed-width DSBD (γ > 0) decode the same prompt with the same seed, chunk by chunk, alternating which
runs first; each output's beams are scored by their mean target log-prob per token (``cumulative_logprob /
tokens``, the target's own log-probs, T 1). It reports the mean paired difference (DSBD minus beam sampling)
of the best beam's and of the mean beam's score, with its standard error and 95 % interval, the power to
see a difference of ``--detect`` nats per token, and the node acceptance that shows drafts were accepted.

The two methods draw with different random numbers, so the pairing removes the prompt's variance, not the
sampling noise: a difference within the interval is what an exact algorithm shows.

    python -m benchmarks.paired_quality --pairs 1024 --out benchmarks/results/paired-quality

Runs with disjoint seeds (``--seed``) pool into one result: ``--pool DIR DIR ... --out DIR`` recomputes the
statistics over every record (each part's settings must match but for seeds, pairs and the worker's cores,
``--omp-bind``). The result is written after every chunk (``"complete": false`` until the last), so a run
stopped early keeps its pairs and pools.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.bench_dsbd import COUNTERS, _counters, _is_head
from benchmarks.machine import machine_facts
from benchmarks.run import load_prompts
from benchmarks.scripts import add_omp_bind_argument, apply_omp_bind, write_result
from vllm_dsbd import pairs
from vllm_dsbd.dtypes import add_dtype_argument, resolve_dtype

Z95 = 1.959964
Z80 = 0.841621


def beam_quality(output) -> tuple[float, float]:
    """(best beam's, mean beam's) mean log-prob per token of one request's beams (best first)."""
    per_token = [_sum_logprobs(c) / max(len(c.token_ids), 1) for c in output.outputs]
    return max(per_token), sum(per_token) / len(per_token)


def _sum_logprobs(completion) -> float:
    """The target log-prob of a completion's tokens, from the log-probs it was returned with (``logprobs=0``)."""
    return sum(step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids))


def paired_stats(diffs: list[float], detect: float) -> dict:
    """Mean, standard error, 95 % interval of paired differences, and the power of a two-sided 5 % test to
    see a true mean difference of ``detect``."""
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1)
    se = math.sqrt(var / n)
    z = detect / se if se > 0 else math.inf
    power = _normal_cdf(z - Z95) + _normal_cdf(-z - Z95)
    return {"n": n, "mean": mean, "se": se, "ci95": [mean - Z95 * se, mean + Z95 * se],
            "z": mean / se if se > 0 else 0.0, "power_to_detect": power, "detect": detect,
            "pairs_for_80pct_power": math.ceil(((Z95 + Z80) * math.sqrt(var) / detect) ** 2)}


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    omp_bind = apply_omp_bind(args)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import dsbd_engine_kwargs

    dtype = resolve_dtype(args.dtype)
    pair = pairs.pair_paths(args.pair)
    target = args.target or str(pair.target)
    draft = args.draft or str(pair.draft)
    knobs = {}
    if _is_head(draft):
        knobs["draft_in_step"] = args.draft_in_step == "on"
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(Path(args.prompts_file), None, tokenizer)
    llm = LLM(**dsbd_engine_kwargs(target, draft, max(args.gamma, 1), args.width, dtype.dtype, **knobs),
              disable_log_stats=False)

    def params(gamma: int, seed: int) -> SamplingParams:
        extra = {"beam_width": args.width, "num_speculative_tokens": gamma, "fixed_width": True}
        if args.draft_temperature_scale is not None and gamma:
            extra["draft_temperature_scale"] = args.draft_temperature_scale
        return SamplingParams(n=args.width, temperature=args.temperature, seed=seed, max_tokens=args.max_tokens,
                              ignore_eos=True, logprobs=0, extra_args=extra)

    jobs = [(p, args.seed + k) for k in range(math.ceil(args.pairs / len(prompts))) for p in prompts][:args.pairs]
    records, secs, kept = [], {"beam": 0.0, "dsbd": 0.0}, []
    counters = dict.fromkeys(COUNTERS, 0.0)

    def result(complete: bool) -> dict:
        return {
            "benchmark": "paired_quality",
            "settings": {"pair": args.pair, "target": target, "draft": Path(draft).name, "width": args.width,
                         "gamma": args.gamma, "temperature": args.temperature, "max_tokens": args.max_tokens,
                         "pairs": len(records), "chunk": args.chunk, "seed": args.seed, "ignore_eos": True,
                         "draft_in_step": args.draft_in_step,
                         "draft_temperature_scale": args.draft_temperature_scale,
                         **dtype.as_dict(), "enforce_eager": True,
                         "omp_threads_bind": omp_bind},
            "machine": machine_facts(),
            "complete": complete,
            "summary": summarize(records, counters, secs, args.detect, quiet=not complete),
            "records": records,
        }

    start_all = time.perf_counter()
    for c, first in enumerate(range(0, len(jobs), args.chunk)):
        chunk = jobs[first:first + args.chunk]
        inputs = [{"prompt_token_ids": list(p.token_ids)} for p, _ in chunk]
        outs = {}
        for name in (("beam", "dsbd") if c % 2 == 0 else ("dsbd", "beam")):
            gamma = 0 if name == "beam" else args.gamma
            before = _counters(llm)
            t0 = time.perf_counter()
            outs[name] = llm.generate(inputs, [params(gamma, seed) for _, seed in chunk], use_tqdm=False)
            secs[name] += time.perf_counter() - t0
            if name == "dsbd":
                after = _counters(llm)
                for k in COUNTERS:
                    counters[k] += after[k] - before[k]
        for (p, seed), b, d in zip(chunk, outs["beam"], outs["dsbd"]):
            if len(kept) < args.rescore:  # (prompt, per method its beams' tokens and reported log-prob per token)
                beams = {name: [(list(c.token_ids), _sum_logprobs(c) / max(len(c.token_ids), 1)) for c in o.outputs]
                         for name, o in (("beam", b), ("dsbd", d))}
                kept.append((list(p.token_ids), beams))
            (bb, bm), (db, dm) = beam_quality(b), beam_quality(d)
            records.append({"prompt": p.id, "seed": seed, "beam_best": bb, "beam_mean": bm,
                            "dsbd_best": db, "dsbd_mean": dm})
        done = len(records)
        best = paired_stats([r["dsbd_best"] - r["beam_best"] for r in records], args.detect) if done > 1 else None
        print(f"[paired] {done}/{len(jobs)} pairs, {time.perf_counter() - start_all:.0f} s"
              + (f", best beam diff {best['mean']:+.4f} ± {best['se']:.4f}" if best else ""), flush=True)
        if done < len(jobs):
            # A checkpoint: a run stopped early keeps its pairs, and the part pools like a finished run.
            write_result(result(False), Path(args.out), "paired_quality", plot)
    llm.llm_engine.engine_core.shutdown()
    final = result(True)
    if kept:
        final["rescored"] = rescore(target, kept)
    return final


def rescore(target: str, kept: list) -> dict:
    """The measure checked: each kept pair's beams scored again by teacher forcing through the target in
    transformers (float32, ``benchmarks.scoring``), per method the largest and the mean difference between the
    engine's reported mean log-prob per token and that score (a bias in what either method reports would show
    here, not in the paired difference)."""
    from benchmarks.scoring import load_scorer, score_outputs

    model = load_scorer(target)
    gaps: dict[str, list[float]] = {"beam": [], "dsbd": []}
    for prompt, methods in kept:  # both methods' beams in one call: the prompt's cache computed once
        scored = score_outputs(model, prompt, [tokens for beams in methods.values() for tokens, _ in beams])
        for name, beams in methods.items():
            gaps[name] += [reported - scored[tuple(tokens)] for tokens, reported in beams if tokens]
    out = {name: {"beams": len(g), "max_abs_diff": max(map(abs, g)), "mean_diff": _mean(g)} for name, g in gaps.items()}
    for name, r in out.items():
        print(f"[paired] rescored {name}: {r['beams']} beams, reported - transformers: mean {r['mean_diff']:+.5f}, "
              f"largest {r['max_abs_diff']:.5f} nats per token", flush=True)
    return out


def summarize(records: list[dict], counters: dict, secs: dict, detect: float, quiet: bool = False) -> dict:
    """The paired statistics of ``records`` (printed unless ``quiet``), the DSBD requests' counters and the
    seconds."""
    acceptance = counters["accepted_tokens"] / max(counters["draft_tokens"], 1)
    summary = {
        "best_beam": paired_stats([r["dsbd_best"] - r["beam_best"] for r in records], detect),
        "mean_beam": paired_stats([r["dsbd_mean"] - r["beam_mean"] for r in records], detect),
        "beam_sampling": {"best": _mean([r["beam_best"] for r in records]),
                          "mean": _mean([r["beam_mean"] for r in records])},
        "dsbd": {"best": _mean([r["dsbd_best"] for r in records]), "mean": _mean([r["dsbd_mean"] for r in records])},
        "node_acceptance": acceptance,
        "tokens_per_target_forward": counters["beam_layers"] / max(counters["drafts"], 1),
        "counters": counters,
        "seconds": secs,
    }
    if quiet:
        return summary
    for key in ("best_beam", "mean_beam"):
        s = summary[key]
        print(f"[paired] {key}: DSBD - beam sampling = {s['mean']:+.4f} ± {s['se']:.4f} nats/token "
              f"(95 % CI {s['ci95'][0]:+.4f} .. {s['ci95'][1]:+.4f}; z {s['z']:+.2f}; "
              f"power to see {detect} {s['power_to_detect']:.2f})", flush=True)
    print(f"[paired] node acceptance {acceptance:.3f}, tokens per target forward "
          f"{summary['tokens_per_target_forward']:.2f}", flush=True)
    return summary


POOL_ACROSS = {"dtype": ("dtype", "dtype_reason")}  # settings parts may differ in when asked (--pool-across)


def pool(parts: list[Path], detect: float, across: Sequence[str] = ()) -> dict:
    """One result over the records of several runs with disjoint seeds and otherwise equal settings, except
    those named in ``across`` (keys of ``POOL_ACROSS``; each then recorded per part). Under exactness every
    pair's expected difference is 0 whatever the dtype, so parts of two dtypes pool into one test of that; the
    estimate is then a mixture of the dtypes' differences."""
    import json

    results = [json.loads((p / "paired_quality.json").read_text()) for p in parts]
    per_part = {"omp_threads_bind"} | {k for name in across for k in POOL_ACROSS[name]}
    varying = {"pairs", "seed"} | per_part  # the worker's cores change its speed, not its draws' law
    first = {k: v for k, v in results[0]["settings"].items() if k not in varying}
    for part, r in zip(parts, results):
        other = {k: v for k, v in r["settings"].items() if k not in varying}
        if other != first:
            raise SystemExit(f"--pool: {part} differs in {sorted(k for k in first if first[k] != other.get(k))}")
    seen: set = set()
    for part, r in zip(parts, results):
        keys = {(x["prompt"], x["seed"]) for x in r["records"]}
        if keys & seen:
            raise SystemExit(f"--pool: {part} repeats (prompt, seed) pairs of an earlier part")
        seen |= keys
    records = [x for r in results for x in r["records"]]
    counters = dict.fromkeys(COUNTERS, 0.0)
    secs = {"beam": 0.0, "dsbd": 0.0}
    for r in results:
        s = r["summary"]
        # Runs before the counters were stored: the acceptance rebuilt from its rate, weighted by pairs.
        part = s.get("counters") or {"accepted_tokens": s["node_acceptance"] * len(r["records"]),
                                     "draft_tokens": len(r["records"]),
                                     "beam_layers": s["tokens_per_target_forward"] * len(r["records"]),
                                     "drafts": len(r["records"])}
        for k in counters:
            counters[k] += part.get(k, 0.0)
        for k in secs:
            secs[k] += s["seconds"][k]
    return {"benchmark": "paired_quality",
            "settings": {**results[0]["settings"], "pairs": len(records),
                         "seed": [r["settings"]["seed"] for r in results],
                         **{k: [r["settings"].get(k, "auto") for r in results] for k in sorted(per_part)},
                         "pooled_from": [p.name for p in parts]},
            "machine": results[0]["machine"],
            "summary": summarize(records, counters, secs, detect),
            "records": records}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, key in enumerate(("best_beam", "mean_beam")):
        s = result["summary"][key]
        ax.errorbar([k], [s["mean"]], yerr=[[s["mean"] - s["ci95"][0]], [s["ci95"][1] - s["mean"]]], fmt="o",
                    capsize=6)
    ax.axhline(0, color="grey", lw=0.8)
    for sign in (-1, 1):
        ax.axhline(sign * result["summary"]["best_beam"]["detect"], color="red", lw=0.6, ls="--")
    ax.set_xticks([0, 1], ["best beam", "mean of the W beams"])
    ax.set_xlim(-0.6, 1.6)
    st = result["settings"]
    ax.set_ylabel("DSBD - beam sampling (nats / token)")
    ax.set_title(f"fixed-width DSBD vs beam sampling, {st['pairs']} pairs, W {st['width']} γ {st['gamma']}, "
                 f"{st['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="default", choices=sorted(pairs.PAIRS))
    parser.add_argument("--target", default=None, help="target checkpoint (default: the pair's)")
    parser.add_argument("--draft", default=None,
                        help="draft model or EAGLE-3 head (default: the pair's draft; the default pair's shipped "
                             "head is vllm_dsbd/draft/default-head)")
    parser.add_argument("--draft-in-step", choices=["on", "off"], default="on",
                        help="a head drafts inside the verify step (on) or in draft steps (off)")
    parser.add_argument("--draft-temperature-scale", type=float, default=None,
                        help="per-request draft temperature scale (default: the engine's)")
    parser.add_argument("--pairs", type=int, default=1024, help="(prompt, seed) pairs")
    parser.add_argument("--chunk", type=int, default=16, help="requests per generate call (one batch)")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--gamma", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--detect", type=float, default=0.02, help="difference (nats/token) the power is for")
    parser.add_argument("--prompts-file", default="benchmarks/prompts/prompts.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/paired-quality")
    parser.add_argument("--pool", nargs="+", type=Path, default=None, metavar="DIR",
                        help="pool earlier runs' results (disjoint seeds) into --out instead of running")
    parser.add_argument("--pool-across", nargs="+", default=[], choices=sorted(POOL_ACROSS),
                        help="with --pool: parts may differ in these settings (recorded per part)")
    parser.add_argument("--rescore", type=int, default=0, metavar="K",
                        help="after the run, score the first K pairs' beams again in transformers (float32) and "
                             "record how far the engine's reported log-probs are from those scores")
    add_omp_bind_argument(parser)
    add_dtype_argument(parser)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    result = pool(args.pool, args.detect, args.pool_across) if args.pool else run(args)
    write_result(result, Path(args.out), "paired_quality", plot)


if __name__ == "__main__":
    main()
