"""Cost of verifying one DSBD iteration, per beam group, on synthetic forests.

Times ``tempered_logprobs`` + ``verify_forest`` (sampling, fixed and dynamic
width) and ``log_softmax`` + ``verify_forest_greedy`` (T = 0) for a batch of
groups, each with a full forest of ``γ`` layers of ``W`` drafts over a
vocabulary of ``V``; drafting and the target forward are not included. The
drafts are real draws from draft joints, in two scenarios: ``mixed`` (draft
logits = target logits + noise: most iterations stop at an early layer) and
``all-pass`` (draft = target: every layer is verified, the worst case). The
mean layers passed are reported next to the times.

    python -m benchmarks.bench_verify                 # CPU, writes JSON + PNG
    python -m benchmarks.bench_verify --device cuda   # on a GPU machine

It needs only torch (and matplotlib for the plot, skipped with a message if
absent), so it runs on a bare GPU machine from a checkout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from vllm_dsbd.algorithm import (
    beam_search_step,
    joint_probs,
    sample_joint,
    tempered_logprobs,
    verify_forest,
    verify_forest_greedy,
)

MODES = ("sampling-fixed", "sampling-dynamic", "greedy")
SCENARIOS = {"mixed": 2.0, "all-pass": 0.0}  # std of the noise added to the target logits for the draft


def _facts(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return {
        "cpu": cpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
    }


def _forest(groups: int, width: int, gamma: int, vocab: int, noise: float, device: torch.device,
            seed: int) -> dict:
    """Target logits per node and a forest drafted from correlated draft logits: [G, γ+1, W, V] etc."""
    gen = torch.Generator(device=device).manual_seed(seed)
    target_logits = 4.0 * torch.randn((groups, gamma + 1, width, vocab), generator=gen, device=device)
    draft_logits = target_logits + noise * torch.randn(target_logits.shape, generator=gen, device=device)
    q_lp = tempered_logprobs(draft_logits, 1.0)
    valid = torch.zeros((groups, width), dtype=torch.bool, device=device)
    valid[:, 0] = True  # one input beam
    scores = torch.zeros((groups, width), dtype=torch.float64, device=device)
    joints, parents, tokens = [], [], []
    for layer in range(gamma):
        q = joint_probs(scores, valid, q_lp[:, layer])
        index = sample_joint(q, width, gen)
        joints.append(q)
        parents.append(index // vocab)
        tokens.append(index % vocab)
        scores = q.log().gather(1, index).double()
        valid = torch.ones_like(valid)
    root_valid = torch.arange(width, device=device)[None].expand(groups, -1) == 0
    # T = 0: the draft runs beam search instead
    raw = torch.log_softmax(draft_logits.float(), -1)
    valid, scores = root_valid, torch.zeros((groups, width), dtype=torch.float64, device=device)
    greedy_parents, greedy_tokens = [], []
    for layer in range(gamma):
        step = beam_search_step(raw[:, layer], scores, valid, torch.full((groups,), 16 + layer, device=device), width,
                                None, torch.zeros(groups, dtype=torch.bool, device=device),
                                torch.ones(groups, dtype=torch.float64, device=device))
        greedy_parents.append(step.parents)
        greedy_tokens.append(step.tokens)
        valid, scores = step.valid, step.cum_logprobs
    return {
        "target_logits": target_logits,
        "draft_joints": torch.stack(joints, 1),
        "draft_parents": torch.stack(parents, 1),
        "draft_tokens": torch.stack(tokens, 1),
        "greedy_parents": torch.stack(greedy_parents, 1),
        "greedy_tokens": torch.stack(greedy_tokens, 1),
        "root_valid": root_valid,
    }


def _verify(mode: str, f: dict, width: int, gen: torch.Generator) -> torch.Tensor:
    """One timed verification; returns the layers passed per group."""
    groups, depth = f["target_logits"].shape[:2]
    device = f["target_logits"].device
    root_scores = torch.zeros((groups, width), dtype=torch.float64, device=device)
    exists = torch.ones_like(f["draft_parents"], dtype=torch.bool)
    num_layers = torch.full((groups,), depth - 1, device=device)
    if mode == "greedy":
        res = verify_forest_greedy(
            torch.log_softmax(f["target_logits"].float(), -1), root_scores, f["root_valid"], f["greedy_parents"],
            f["greedy_tokens"], exists, num_layers, torch.full((groups,), 16, device=device), width, None,
            torch.zeros(groups, dtype=torch.bool, device=device),
            torch.ones(groups, dtype=torch.float64, device=device),
        )
        return res.num_passed
    threshold = 1.0 if mode == "sampling-fixed" else 0.7
    res = verify_forest(
        tempered_logprobs(f["target_logits"], 1.0), root_scores, f["root_valid"], f["draft_joints"],
        f["draft_parents"], f["draft_tokens"], exists, num_layers,
        torch.full((groups,), threshold, device=device), 1, width, gen,
    )
    return res.num_passed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/verify"))
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)

    rows = []
    for scenario, noise in SCENARIOS.items():
        for groups, width in itertools.product(args.groups, args.widths):
            forest = _forest(groups, width, args.gamma, args.vocab, noise, device, seed=0)
            for mode in MODES:
                gen = torch.Generator(device=device).manual_seed(1)
                for _ in range(args.warmup):
                    _verify(mode, forest, width, gen)
                times, passed = [], []
                for _ in range(args.repeats):
                    _sync(device)
                    start = time.perf_counter()
                    num_passed = _verify(mode, forest, width, gen)
                    _sync(device)
                    times.append(time.perf_counter() - start)
                    passed.append(num_passed.float().mean().item())
                median = statistics.median(times)
                rows.append({
                    "scenario": scenario, "mode": mode, "beam_width": width, "num_speculative_tokens": args.gamma, "vocab": args.vocab,
                    "groups": groups, "median_s": median, "min_s": min(times),
                    "ms_per_group": 1000 * median / groups,
                    "mean_layers_passed": statistics.mean(passed), "times_s": times,
                })
                print(f"{scenario:8s} {mode:16s} W={width} G={groups:3d}: {rows[-1]['ms_per_group']:8.2f} "
                      f"ms/group/iteration  (layers passed {rows[-1]['mean_layers_passed']:.2f})", flush=True)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_verify_{device.type}"
    result = {"machine": _facts(device), "repeats": args.repeats, "warmup": args.warmup, "rows": rows}
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out_dir / f'{stem}.json'}")
    _plot(rows, result["machine"], args.out_dir / f"{stem}.png")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) where matplotlib is not installed:
    the torch-only benchmarks run on bare GPU machines."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: skipping the plot (the JSON has every number)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot(rows: list[dict], machine: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = [(scenario, groups) for scenario in SCENARIOS for groups in sorted({r["groups"] for r in rows})]
    widths = sorted({r["beam_width"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    bar = 0.8 / len(MODES)
    for ax, (scenario, groups) in zip(axes[0], panels):
        for k, mode in enumerate(MODES):
            values = [next(r["ms_per_group"] for r in rows if r["scenario"] == scenario and r["groups"] == groups
                           and r["beam_width"] == w and r["mode"] == mode) for w in widths]
            ax.bar([i + k * bar for i in range(len(widths))], values, bar, label=mode)
        ax.set_xticks([i + bar * (len(MODES) - 1) / 2 for i in range(len(widths))], [f"W={w}" for w in widths])
        ax.set_ylabel("ms per group per iteration")
        ax.set_title(f"{scenario}, {groups} group(s) per batch", fontsize=9)
        ax.legend(fontsize=8)
    gamma, vocab = rows[0]["num_speculative_tokens"], rows[0]["vocab"]
    fig.suptitle(f"DSBD verification, γ={gamma}, V={vocab} — {machine['device']} / {machine['cpu']}, "
                 f"torch {machine['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
