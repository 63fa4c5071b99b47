"""Cost of top-k / top-p on the joint (``restrict_joint``): sorting a shortlist against sorting whole rows.

A sampled beam step restricts each group's joint over ``W x V`` (beam, token)
pairs. ``restrict_joint`` sorts only the entries a row may keep (its top-k, or
the 64 / 1,024 top pairs when they hold top-p of its mass) and their ties; the
whole-row sort it used before is still its path for rows whose top-p needs
more. This times both paths on the same synthetic joints: ``peaked`` (logits
``6 * N(0, 1)``: the top 1,024 pairs hold most of the mass, as a trained LM's
do) and ``flat`` (``N(0, 1)``: top-p needs most of the row, the shortlist's
worst case: it tries two shortlists and sorts whole rows anyway).

    python -m benchmarks.probes.bench_restrict            # writes JSON + PNG under benchmarks/results/restrict/

Only torch (and matplotlib for the plot) is needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_verify import pyplot
from benchmarks.machine import machine_facts
from vllm_dsbd.algorithm import joint

VOCABS = {"SmolLM2": 49152, "Qwen2.5": 151936}
SETTINGS = {"top_k 50": (50, 1.0), "top_p 0.9": (0, 0.9), "top_k 50 + top_p 0.9": (50, 0.9)}
SHAPES = {"peaked": 6.0, "flat": 1.0}


def _time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _whole_rows(rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``restrict_joint`` with the shortlist path off: every row sorted whole."""
    share, joint.SHORTLIST_SHARE = joint.SHORTLIST_SHARE, rows.shape[-1] + 1
    try:
        return joint.restrict_joint(rows, top_k, top_p)
    finally:
        joint.SHORTLIST_SHARE = share


def run(groups: int, widths: list[int], repeat: int) -> list[dict]:
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for (vocab_name, vocab), width, (shape, scale) in (
            (v, w, s) for v in VOCABS.items() for w in widths for s in SHAPES.items()):
        rows = torch.log_softmax(torch.randn((groups, width * vocab), generator=gen) * scale, dim=-1)
        top1024 = float(torch.topk(rows, 1024).values.exp().sum(-1).mean())
        for name, (k, p) in SETTINGS.items():
            top_k, top_p = torch.full((groups,), k), torch.full((groups,), p)
            short = joint.restrict_joint(rows, top_k, top_p)
            whole = _whole_rows(rows, top_k, top_p)
            assert torch.equal(torch.isfinite(short), torch.isfinite(whole)), (vocab_name, width, shape, name)
            t_short = _time(lambda: joint.restrict_joint(rows, top_k, top_p), repeat)
            t_whole = _time(lambda: _whole_rows(rows, top_k, top_p), repeat)
            rows_out.append({"vocab": vocab_name, "V": vocab, "W": width, "groups": groups, "shape": shape,
                             "top_1024_mass": round(top1024, 4), "setting": name,
                             "kept_per_group": float(torch.isfinite(short).sum(-1).float().mean()),
                             "shortlist_ms": round(1e3 * t_short, 2), "whole_row_sort_ms": round(1e3 * t_whole, 2),
                             "speedup": round(t_whole / t_short, 2)})
            print(f"{vocab_name:8s} W {width} {shape:6s} {name:21s} shortlist {1e3 * t_short:8.1f} ms   "
                  f"whole rows {1e3 * t_whole:8.1f} ms   {t_whole / t_short:5.2f}x", flush=True)
    return rows_out


def _plot(rows: list[dict], machine: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(6 * len(SHAPES), 4.5), sharey=True)
    for ax, shape in zip(axes, SHAPES, strict=True):
        labels = [f"{r['vocab']} W{r['W']}\n{r['setting']}" for r in rows if r["shape"] == shape]
        speed = [r["speedup"] for r in rows if r["shape"] == shape]
        ax.barh(range(len(speed)), speed, color=["tab:green" if s >= 1 else "tab:red" for s in speed])
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_yticks(range(len(speed)), labels, fontsize=7)
        ax.set_xlabel("whole-row sort time / shortlist time (x)")
        ax.set_title(f"{shape} joints")
    fig.suptitle(f"top-k / top-p on the joint, {rows[0]['groups']} groups: shortlist vs whole-row sort\n"
                 f"{machine['cpu']}, {machine['torch_threads']} torch threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8, help="beam groups in the batch (default 8)")
    parser.add_argument("--widths", default="2,4,8", help="beam widths W, comma-separated (default 2,4,8)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repeats, median reported (default 5)")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/restrict"))
    args = parser.parse_args(argv)
    machine = machine_facts()
    rows = run(args.groups, [int(w) for w in args.widths.split(",")], args.repeat)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "restrict", "machine": machine, "settings": vars(args) | {"out_dir": str(args.out_dir)},
              "rows": rows}
    (args.out_dir / "restrict.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(rows, machine, args.out_dir / "restrict.png")
    print(f"wrote {args.out_dir}/restrict.json and .png")


if __name__ == "__main__":
    main()
