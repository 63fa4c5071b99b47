"""T 0 losslessness per dtype: how many DSBD beam searches differ from in-engine beam search, and by how much.

    .venv/bin/python -m benchmarks.lossless                                  # default pair, float32 and bf16
    .venv/bin/python -m benchmarks.lossless --pair qwen2.5-coder --dtypes bfloat16 --out /tmp/lossless-qwen

For each dtype one DSBD engine drafting with the pair's draft (or ``--draft``:
a draft model or an EAGLE-3 head) runs, on the same chat prompts
(``benchmarks/prompts/prompts.json``, then the draft's held-out
``EVAL_PROMPTS``), all prompts as one batch per width: in-engine beam search
(``num_speculative_tokens`` 0 per request: no draft) and DSBD beam search (γ
``--gamma``), both at temperature 0 with every beam returned. In float32 the
two must be equal token for token (the exactness tests check it). In bf16 a
verify forward computes a node's logits with other shapes than a beam step
(many tokens per request, rows in other positions), and bf16 rounding of those
logits (about 3 significant digits) can flip two hypotheses whose scores are
that close. The script counts outputs that differ (the best beam; any of the W
beams) and, for each, the first position where the best beams part and both
runs' scores of their best beams (cumulative log-probabilities: both runs ask
for logprobs). Once two searches part, their continuations differ, so the final
scores can differ by far more than the rounding that parted them; what tells a
systematic loss from rounding is the sign (DSBD worse every time, or either
way) and the control: the same in-engine beam search run with each prompt
alone instead of batched (other shapes, no draft at all), whose differences
from the batched run are what this machine's kernels do without DSBD.

Writes ``lossless.json`` and ``lossless.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.machine import machine_facts
from benchmarks.scripts import write_result
from vllm_dsbd import pairs


def load_chat_prompts(prompts_file: Path, num_prompts: int, tokenizer) -> list[tuple[str, list[int]]]:
    """(id, token ids) of the first ``num_prompts`` of the benchmark prompts followed by the held-out
    evaluation prompts, each rendered as a user turn with the chat template."""
    import json

    from vllm_dsbd.draft.prompts import EVAL_PROMPTS

    texts = [(e["id"], e["text"]) for e in json.loads(prompts_file.read_text())["prompts"]]
    texts += [(f"eval-{i:02d}", t) for i, t in enumerate(EVAL_PROMPTS)]
    if not 1 <= num_prompts <= len(texts):
        raise ValueError(f"--num-prompts must be in [1, {len(texts)}], got {num_prompts}")
    out = []
    for pid, text in texts[:num_prompts]:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        out.append((pid, tokenizer(chat, add_special_tokens=False)["input_ids"]))
    return out


def compare(prompt_ids: list[str], base, spec) -> dict:
    """The differences between two runs' outputs (lists of vLLM RequestOutput, beams best first)."""
    details, any_beam = [], 0
    for pid, b, s in zip(prompt_ids, base, spec):
        b_beams = [list(c.token_ids) for c in b.outputs]
        s_beams = [list(c.token_ids) for c in s.outputs]
        any_beam += b_beams != s_beams
        if b_beams[0] != s_beams[0]:
            first = next((i for i, (x, y) in enumerate(zip(b_beams[0], s_beams[0])) if x != y),
                         min(len(b_beams[0]), len(s_beams[0])))
            b_score, s_score = b.outputs[0].cumulative_logprob, s.outputs[0].cumulative_logprob
            scored = b_score is not None and s_score is not None  # None unless the runs asked for logprobs
            details.append({"prompt": pid, "first_difference_at": first,
                            "best_score_in_engine": b_score, "best_score_dsbd": s_score,
                            "score_difference": s_score - b_score if scored else None,
                            "dsbd_best_is_an_in_engine_beam": s_beams[0] in b_beams})
    return {"differ_best_beam": len(details), "differ_any_beam": any_beam, "differences": details}


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_dsbd.demo import dsbd_engine_kwargs
    from vllm_dsbd.dtypes import resolve_dtype

    paths = pairs.pair_paths(args.pair)
    target, draft = str(paths.target), args.draft or str(paths.draft)
    widths = [int(w) for w in args.widths.split(",")]
    prompts = load_chat_prompts(Path(args.prompts_file), args.num_prompts, AutoTokenizer.from_pretrained(target))
    inputs = [{"prompt_token_ids": ids} for _, ids in prompts]
    ids = [pid for pid, _ in prompts]
    results = []
    for requested in args.dtypes.split(","):
        dtype = resolve_dtype(requested, "--dtypes")
        kwargs = dsbd_engine_kwargs(target, draft, args.gamma, max(widths), dtype.dtype)
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
        llm = LLM(**kwargs)
        for width in widths:
            def search(gamma: int, w: int = width) -> SamplingParams:  # T 0, every beam, scored (logprobs)
                return SamplingParams(n=w, temperature=0.0, max_tokens=args.max_tokens, logprobs=0,
                                      extra_args={"beam_width": w, "num_speculative_tokens": gamma})

            outs, secs = {}, {}
            for gamma in (0, args.gamma):
                start = time.perf_counter()
                outs[gamma] = llm.generate(inputs, search(gamma), use_tqdm=False)
                secs[gamma] = time.perf_counter() - start
            row = {"dtype": dtype.dtype, "width": width, "gamma": args.gamma, "num_prompts": len(inputs),
                   "in_engine_s": secs[0], "dsbd_s": secs[args.gamma], **compare(ids, outs[0], outs[args.gamma])}
            # The control: the same in-engine beam search, each prompt alone: other shapes, no draft at all.
            solo = [llm.generate([one], search(0), use_tqdm=False)[0] for one in inputs]
            control = compare(ids, outs[0], solo)
            row["control_solo_vs_batch"] = {"differ_best_beam": control["differ_best_beam"],
                                            "differ_any_beam": control["differ_any_beam"]}
            results.append(row)
            print(f"[lossless] {args.pair} {dtype.dtype} W={width} γ={args.gamma}: best beam differs in "
                  f"{row['differ_best_beam']} of {len(inputs)}, any beam in {row['differ_any_beam']}; "
                  f"control (in-engine, each prompt alone vs batched): {control['differ_best_beam']} and "
                  f"{control['differ_any_beam']}", flush=True)
            for d in row["differences"]:
                print(f"           {d['prompt']}: from token {d['first_difference_at']}, score "
                      f"{d['best_score_in_engine']} in-engine vs {d['best_score_dsbd']} DSBD "
                      f"(difference {d['score_difference']})", flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {
        "benchmark": "lossless",
        "settings": {"pair": args.pair, "target": target, "draft": draft, "widths": widths, "gamma": args.gamma,
                     "max_tokens": args.max_tokens, "num_prompts": len(inputs), "prompt_ids": ids,
                     "temperature": 0.0, "batch": "all prompts", "dtypes": args.dtypes.split(",")},
        "machine": machine_facts(),
        "results": results,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    rows = result["results"]
    labels = [f"{r['dtype']}\nW={r['width']}" for r in rows]
    fig, ax = plt.subplots(figsize=(2.0 * len(rows) + 3, 4))
    x = range(len(rows))
    series = ((-0.3, lambda r: r["differ_best_beam"], "DSBD: best beam differs"),
              (-0.1, lambda r: r["differ_any_beam"], "DSBD: any of the W beams differs"),
              (0.1, lambda r: r.get("control_solo_vs_batch", {}).get("differ_best_beam", 0),
               "control, solo vs batched: best beam differs"),
              (0.3, lambda r: r.get("control_solo_vs_batch", {}).get("differ_any_beam", 0),
               "control: any beam differs"))
    for offset, value, label in series:
        bars = ax.bar([i + offset for i in x], [value(r) for r in rows], width=0.2, label=label)
        ax.bar_label(bars, labels=[str(value(r)) for r in rows], fontsize=7)
    ax.set_xticks(list(x), labels)
    ax.set_ylim(0, s["num_prompts"])
    ax.set_ylabel(f"outputs (of {s['num_prompts']} prompts)")
    ax.set_title(f"DSBD (γ {s['gamma']}) vs in-engine beam search at T 0, {s['pair']} pair, "
                 f"draft {Path(s['draft']).name},\n"
                 f"{s['max_tokens']} tokens, {result['machine']['cpu']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default", help="model pair (vllm-dsbd models prepare --pair NAME)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; auto: the machine's")
    parser.add_argument("--draft", default=None, help="the draft model or EAGLE-3 head (default: the pair's draft)")
    parser.add_argument("--widths", default="4,8")
    parser.add_argument("--gamma", type=int, default=2, help="DSBD draft layers per iteration")
    parser.add_argument("--num-prompts", type=int, default=60, help="at most 72 (24 benchmark + 48 held-out)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="a whole batch of wide beams needs room")
    parser.add_argument("--prompts-file", default="benchmarks/prompts/prompts.json")
    parser.add_argument("--out", default="benchmarks/results/lossless")
    args = parser.parse_args()
    result = run(args)
    write_result(result, Path(args.out), "lossless", plot)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
