"""In-engine beam search against vLLM's built-in beam search, widths side by side.

    .venv/bin/python -m benchmarks.bench_beams                       # widths 2,4,8; 4 prompts x 64 tokens
    .venv/bin/python -m benchmarks.bench_beams --widths 4 --max-tokens 32 --out /tmp/beams
    .venv/bin/python -m benchmarks.bench_beams --widths 16,64,128 --num-prompts 1 --max-tokens 24 \
        --kv-cache-gib 2 --out benchmarks/results/beams-wide

One DSBD engine without a draft serves every method, in one process, on the
same chat prompts (``benchmarks/prompts/prompts.json``): vLLM greedy
decoding (for scale), vLLM's built-in ``LLM.beam_search`` (its front-end
loop, run unchanged: on a DSBD engine its one-token requests are plain
requests), and vllm-dsbd's in-engine beam search (``llm.beam_search``) and
beam sampling (``SamplingParams(n=W, temperature=1, extra_args=
{"beam_width": W})``). ``ignore_eos`` keeps every output at ``max_tokens``
tokens, so all methods do the same number of steps. Each (method, width) is
warmed up on a short run first; the timed runs process the prompts as one
batch. Speedups are ratios of wall times measured in this run. The two beam
searches must return the same tokens: the script checks it and records it.

Writes ``beams.json`` and ``beams.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.machine import machine_facts
from benchmarks.run import load_prompts
from benchmarks.scripts import add_prompt_args, write_result
from vllm_dsbd import models
from vllm_dsbd.dtypes import add_dtype_argument, resolve_dtype


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _compare(want, got) -> tuple[bool, float | None]:
    """Whether two beam searches returned the same sequences in the same order; where they did not,
    the largest difference between the cumulative log-probs of the sequences at the same rank (a
    near-tie flipped by float rounding shows as a gap near 1e-5, a wrong search as a large one)."""
    pairs = [(a, b) for x, y in zip(want, got) for a, b in zip(x.sequences, y.sequences)]
    same = all(len(x.sequences) == len(y.sequences) for x, y in zip(want, got)) and \
        all(a.tokens == b.tokens for a, b in pairs)
    gaps = [abs(a.cum_logprob - b.cum_logprob) for a, b in pairs if a.tokens != b.tokens]
    return same, max(gaps) if gaps else None


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import BeamSearchParams

    from vllm_dsbd.demo import beam_engine_kwargs
    from vllm_dsbd.entrypoints.beam_search import vllm_builtin_beam_search

    dtype = resolve_dtype(args.dtype)
    print(f"[beams] dtype {dtype.dtype} ({dtype.reason})", flush=True)
    target = args.target or str(models.prepare_target())
    widths = [int(w) for w in args.widths.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(Path(args.prompts_file), args.num_prompts, tokenizer)
    inputs = [{"prompt_token_ids": list(p.token_ids)} for p in prompts]
    widest = max(widths)
    # vLLM's loop asks for 2W logprobs per step; every beam is a sequence of the engine.
    llm = LLM(**{**beam_engine_kwargs(target, widest, dtype.dtype), "max_logprobs": max(20, 2 * widest),
                 "max_num_seqs": max(256, 2 * widest), "kv_cache_memory_bytes": int(args.kv_cache_gib * (1 << 30))})

    def greedy(max_tokens):
        return llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)

    def builtin(width, max_tokens):
        return vllm_builtin_beam_search(llm, inputs, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                                      ignore_eos=True))

    def in_engine(width, max_tokens):
        return llm.beam_search(inputs, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))

    def sampling(width, max_tokens):
        params = SamplingParams(n=width, temperature=1.0, seed=args.seed, max_tokens=max_tokens, ignore_eos=True,
                                extra_args={"beam_width": width})
        return llm.generate(inputs, params, use_tqdm=False)

    rows = []
    greedy(4)
    secs, _ = _timed(lambda: greedy(args.max_tokens))
    rows.append({"method": "vllm-greedy", "width": 1, "wall_s": secs})
    print(f"[beams] greedy {secs:.2f} s", flush=True)
    for width in widths:
        timings = {}
        for name, fn in (("vllm-builtin-beam-search", builtin), ("dsbd-engine-beam-search", in_engine),
                         ("dsbd-engine-beam-sampling", sampling)):
            fn(width, 4)  # warm-up
            timings[name], out = _timed(lambda: fn(width, args.max_tokens))
            if name == "vllm-builtin-beam-search":
                want = out
            elif name == "dsbd-engine-beam-search":
                same, gap = _compare(want, out)
            print(f"[beams] W={width} {name} {timings[name]:.2f} s", flush=True)
        for name, secs in timings.items():
            rows.append({"method": name, "width": width, "wall_s": secs,
                         "speedup_vs_builtin": timings["vllm-builtin-beam-search"] / secs})
        rows[-2]["same_tokens_as_builtin"] = same
        rows[-2]["max_score_gap_where_different"] = gap
    llm.llm_engine.engine_core.shutdown()
    return {
        "benchmark": "bench_beams",
        "settings": {"target": target, "widths": widths, "max_tokens": args.max_tokens,
                     "num_prompts": len(prompts), "prompt_ids": [p.id for p in prompts], "batch": "all prompts",
                     "ignore_eos": True, "seed": args.seed, "engine": "DSBD, num_speculative_tokens=0",
                     "max_logprobs": max(20, 2 * widest), "kv_cache_gib": args.kv_cache_gib,
                     **dtype.as_dict(), "block_size": 32},
        "machine": machine_facts(),
        "results": rows,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = result["settings"]["widths"]
    names = ["vllm-builtin-beam-search", "dsbd-engine-beam-search", "dsbd-engine-beam-sampling"]
    fig, ax = plt.subplots(figsize=(7, 4))
    bar = 0.27
    for i, name in enumerate(names):
        secs = [next(r["wall_s"] for r in result["results"] if r["method"] == name and r["width"] == w)
                for w in widths]
        ax.bar([j + (i - 1) * bar for j in range(len(widths))], secs, bar, label=name)
    greedy = next(r["wall_s"] for r in result["results"] if r["method"] == "vllm-greedy")
    ax.axhline(greedy, color="gray", ls="--", lw=1, label="vllm-greedy")
    ax.set_xticks(range(len(widths)), [f"W={w}" for w in widths])
    ax.set_ylabel("wall time (s)")
    s = result["settings"]
    ax.set_title(f"{s['num_prompts']} prompts x {s['max_tokens']} tokens, {s.get('dtype', 'float32')}, "
                 f"{result['machine']['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_args(parser)
    parser.add_argument("--widths", default="2,4,8")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache (wide beams need more)")
    add_dtype_argument(parser)
    parser.add_argument("--out", default="benchmarks/results/beams")
    args = parser.parse_args()
    result = run(args)
    out = Path(args.out)
    write_result(result, out, "beams", plot)
    for r in result["results"]:
        extra = f"  speedup vs built-in {r['speedup_vs_builtin']:.1f}x" if "speedup_vs_builtin" in r else ""
        print(f"{r['method']:28s} W={r['width']}  {r['wall_s']:7.2f} s{extra}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
