"""Fixed-width DSBD and in-engine beam sampling, each against exact beam sampling simulated in torch.

    .venv/bin/python -m benchmarks.exact_reference --pairs 4000 --samples 12000

``paired_quality`` compares the two methods with each other; this places each against the definition. The
pair is a bigram (``benchmarks/bigram.py``, made from the tiny pair): the target at logit scale 1.5 (the
permutation's token holds about half the mass, the rest spreads over the 49,152 tokens), the draft *model* the
same bigram at 2.0 (sharper: it proposes the target's first candidate nearly always), in draft steps, so drafts
are both accepted and rejected and every draw of the target's other tokens is a residual draw over the whole
vocabulary, with no top-k: the path of a pair such as Qwen2.5-Coder 1.5B with its 0.5B draft. ``paired_quality``
runs both methods (W 4, γ 1, T 1, 32 tokens, ``ignore_eos``, float32, eager) on one prompt, one seed per
pair; beam sampling is then simulated from its definition (each step ``W`` draws with replacement from the
joint over the live beams' children, weighted by each beam's cumulative probability) on the bigram's log-probs,
computed from its weights. Each method's mean log-prob per token (best beam, mean beam) is compared with the
simulation's: the z of each says which side a bias is on. Result: ``--out``/exact_reference.json and .png.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from benchmarks import paired_quality
from benchmarks.bigram import bigram_logprobs, write_permutation_target
from benchmarks.machine import machine_facts
from benchmarks.scripts import write_result

TARGET_SCALE, DRAFT_SCALE = 1.5, 2.0


def simulate(logprobs, last_token: int, width: int, length: int, samples: int, seed: int,
             batch: int = 250) -> dict[str, list[float]]:
    """Exact beam sampling at T 1 with replacement from a bigram: per sample, the best and the mean of its
    ``width`` beams' log-prob per token after ``length`` tokens (one input beam, every step ``width`` i.i.d.
    draws of (beam, token) from the joint ``exp(S_b) p(token | beam)``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[float]] = {"best": [], "mean": []}
    for start in range(0, samples, batch):
        b = min(batch, samples - start)
        last, scores = torch.full((b, 1), last_token), torch.zeros(b, 1)
        for _ in range(length):
            lp = logprobs(last.flatten()).view(b, last.shape[1], -1)
            joint = (scores[:, :, None] + lp).flatten(1)  # log joint over (beam, token): [b, W * V]
            draws = _draw(joint, width, gen)
            scores, last = joint.gather(1, draws), draws % lp.shape[-1]
        per_token = scores / length
        out["best"] += per_token.amax(1).tolist()
        out["mean"] += per_token.mean(1).tolist()
    return out


def _draw(joint, width: int, gen):
    """``width`` i.i.d. draws (with replacement) of each row's (beam, token) from its log joint [B, W * V]."""
    import torch

    return torch.multinomial(joint.softmax(-1), width, replacement=True, generator=gen)


def _mean_se(xs: list[float]) -> tuple[float, float]:
    stats = paired_quality.paired_stats(xs, detect=1.0)  # its mean and standard error (any sample, not only diffs)
    return stats["mean"], stats["se"]


def compare(records: list[dict], reference: dict[str, list[float]]) -> dict:
    """Per statistic (best, mean beam) the reference's and each method's mean ± standard error and the z of
    each method's difference from the reference."""
    out = {}
    for stat in ("best", "mean"):
        ref, ref_se = _mean_se(reference[stat])
        row = {"reference": {"mean": ref, "se": ref_se, "n": len(reference[stat])}}
        for method in ("beam", "dsbd"):
            m, se = _mean_se([r[f"{method}_{stat}"] for r in records])
            row[method] = {"mean": m, "se": se, "n": len(records), "diff": m - ref,
                           "z": (m - ref) / math.sqrt(se ** 2 + ref_se ** 2)}
        out[stat] = row
    return out


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="exact-reference-") as work:
        return _run(args, Path(work))


def _run(args: argparse.Namespace, work: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    from benchmarks.run import load_prompts
    from vllm_dsbd import models

    tiny = models.build_tiny_pair(models.cache_root() / "tiny", seed=0)
    target = write_permutation_target(tiny.target, work / "target", logit_scale=TARGET_SCALE)
    draft = write_permutation_target(tiny.target, work / "draft", logit_scale=DRAFT_SCALE)
    entries = json.loads(Path(args.prompts_file).read_text())["prompts"][:1]
    prompts_file = work / "prompt.json"
    prompts_file.write_text(json.dumps({"prompts": entries}))
    engine_args = paired_quality.build_parser().parse_args([
        "--target", str(target), "--draft", str(draft), "--pairs", str(args.pairs), "--chunk", "48",
        "--width", str(args.width), "--gamma", "1", "--max-tokens", str(args.max_tokens), "--seed", str(args.seed),
        "--prompts-file", str(prompts_file), "--out", str(Path(args.out) / "paired"), "--dtype", "float32"])
    paired = paired_quality.run(engine_args)

    torch.set_num_threads(args.threads)
    prompt = load_prompts(prompts_file, None, AutoTokenizer.from_pretrained(str(target)))[0].token_ids
    logprobs, shortcut_error = bigram_logprobs(target, prompt)
    t0 = time.perf_counter()
    reference = simulate(logprobs, prompt[-1], args.width, args.max_tokens, args.samples, args.seed)
    result = {"settings": {**paired["settings"], "target_logit_scale": TARGET_SCALE,
                           "draft_logit_scale": DRAFT_SCALE, "reference_samples": args.samples,
                           "reference_seconds": time.perf_counter() - t0, "shortcut_max_abs_error": shortcut_error},
              "machine": machine_facts(),
              "node_acceptance": paired["summary"]["node_acceptance"],
              "paired": {k: paired["summary"][k] for k in ("best_beam", "mean_beam")},
              "against_reference": compare(paired["records"], reference)}  # the records: paired/
    for stat, row in result["against_reference"].items():
        print(f"[reference] {stat} beam: exact {row['reference']['mean']:.4f} ± {row['reference']['se']:.4f}; "
              + "; ".join(f"{m} {row[m]['mean']:.4f} ± {row[m]['se']:.4f} (z {row[m]['z']:+.2f})"
                          for m in ("beam", "dsbd")), flush=True)
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, stat in enumerate(("best", "mean")):
        row = result["against_reference"][stat]
        for j, (name, color) in enumerate((("reference", "black"), ("beam", "tab:blue"), ("dsbd", "tab:orange"))):
            ax.errorbar([k + 0.2 * (j - 1)], [row[name]["mean"]], yerr=[1.96 * row[name]["se"]], fmt="o",
                        capsize=5, color=color, label=name if k == 0 else None)
    ax.set_xticks([0, 1], ["best beam", "mean of the W beams"])
    ax.set_ylabel("log-prob per token (95 % interval)")
    s = result["settings"]
    ax.set_title(f"exact beam sampling (simulated) vs the engine, bigram pair, W {s['width']}, "
                 f"{s['max_tokens']} tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4000, help="engine requests per method (one seed each)")
    parser.add_argument("--samples", type=int, default=12000, help="simulated beam-sampling runs")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the simulation")
    parser.add_argument("--prompts-file", default="benchmarks/prompts/prompts.json",
                        help="its first prompt is used (a bigram's output depends on the last token only)")
    parser.add_argument("--out", default="benchmarks/results/exact-reference")
    args = parser.parse_args()
    write_result(run(args), Path(args.out), "exact_reference", plot)


if __name__ == "__main__":
    main()
