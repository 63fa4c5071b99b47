"""What deciding a step's groups together saves: the runner's verification pass, and a beam step's decisions,
at G groups a step.

The verifications are recorded from the toy engine (``benchmarks.toy_engine``: DSBD's own group and runner
code) on lazily drawn models at a real vocabulary's size (49,152, SmolLM2's; the draft a noisy copy of the
target, so layers pass and fail), W 4, 16 requests per mode. Then, for G = 1, 4, 16 requests a step, the same
G verifications are decided one group at a time (G calls of ``verify_step.verify_groups``, as the runner did
before) and in one call, interleaved, and checked to decide alike, with glibc keeping freed memory as the
CPU worker does (``engine.cpu_memory``). Reported: milliseconds per step and per
group (median of ``--repeats``), and each mode's per-group time at G against its time at G = 1. Pure torch,
no engine: the decision part of a verify step, not its forward.

Beside them (γ 0 rows), a beam step's decisions (``beam_step.decide``, in-engine beam decoding's and
``auto_depth``'s depth 0): G groups of W 4 live beams each on random logits of the same vocabulary, beam
search (T 0) and beam sampling (T 1), each group decided alone and all in one call, interleaved, checked to
decide alike.

    python -m benchmarks.bench_decisions --out benchmarks/results/decisions

``--profile G ...`` also runs PyTorch's profiler over the batched pass at G groups a step (every recorded step,
each mode and γ) and records where its time goes, by operator (``profile``: each operator's share of the
pass's own time, its calls, the largest first).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from benchmarks import toy_engine
from benchmarks.machine import machine_facts
from benchmarks.scripts import write_result
from vllm_dsbd.engine import beam_step, cpu_memory, verify_step
from vllm_dsbd.engine.protocol import GroupStep
from vllm_dsbd.engine.verify_step import verify_groups

MODES = {"T 0 (search)": dict(temperature=0.0), "fixed width": dict(temperature=1.0),
         "dynamic width": dict(temperature=1.0, width_threshold=0.5)}
BEAM_MODES = {"beam search (T 0)": 0.0, "beam sampling (T 1)": 1.0}
BATCHES = (1, 4, 16)


def record(mode: dict, gamma: int, requests: int, vocab: int) -> list[list[tuple]]:
    """Per request, its verifications: (path_logits, VerifyStep, joints, support)."""
    target = toy_engine.HashedLM(vocab, seed=1)
    draft = toy_engine.HashedLM(vocab, seed=1, noise=0.8)
    calls: list[tuple] = []

    def recording(path_logits, vs, joints, stops=None, support=None):
        calls.append((path_logits, vs, joints, support))
        return verify_step.verify(path_logits, vs, joints, stops, support)

    real, toy_engine.verify = toy_engine.verify, recording
    out = []
    try:
        for r in range(requests):
            start = len(calls)
            params = toy_engine.params(beam_width=4, n=4, max_tokens=12, num_speculative_tokens=gamma, seed=r,
                                       ignore_eos=True, eos_token_id=None, **mode)
            toy_engine.run_dsbd(target, draft, [r + 1, 2 * r + 3], params)
            out.append([(p, dataclasses.replace(vs, group_id=f"r{r}"), j, s) for p, vs, j, s in calls[start:]])
    finally:
        toy_engine.verify = real
    return out


def time_batch(batch: list[tuple], repeats: int) -> dict:
    """Seconds of the G groups decided one at a time and together (interleaved, medians)."""
    logits, inputs = toy_engine.packed_verifications(batch)
    one_by_one, together = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        alone = {}
        for g in inputs:
            alone.update(verify_groups(logits, [g]))
        one_by_one.append(time.perf_counter() - start)
        start = time.perf_counter()
        joint = verify_groups(logits, inputs)
        together.append(time.perf_counter() - start)
        if joint != alone:
            raise AssertionError("the batched verification decided otherwise than one group at a time")
    return {"one_by_one_s": statistics.median(one_by_one), "together_s": statistics.median(together)}


def beam_steps(temperature: float, groups: int, vocab: int, width: int = 4) -> tuple[torch.Tensor, dict, list]:
    """One beam step of ``groups`` groups of ``width`` live beams: (logits [G*W, V], row of each request, steps)."""
    gen = torch.Generator().manual_seed(groups)
    logits = 3 * torch.randn((groups * width, vocab), generator=gen)
    steps = [GroupStep(group_id=f"g{g}", req_ids=tuple(f"g{g}b{b}" for b in range(width)),
                       scores=tuple(-0.5 * (b + 1) for b in range(width)), seq_len=40, beam_width=width,
                       temperature=temperature, top_k=0, top_p=1.0, length_penalty=1.0, ignore_eos=False,
                       eos_token_id=0, num_logprobs=-1, seed=g, step=3) for g in range(groups)]
    return logits, {r: i for i, r in enumerate(r for st in steps for r in st.req_ids)}, steps


def time_beam_batch(logits, row_of, steps, repeats: int) -> dict:
    """Seconds of a beam step's groups decided one at a time and together (interleaved, medians)."""
    one_by_one, together = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        alone = {}
        for st in steps:
            alone.update(beam_step.decide(logits, row_of, [st]))
        one_by_one.append(time.perf_counter() - start)
        start = time.perf_counter()
        joint = beam_step.decide(logits, row_of, steps)
        together.append(time.perf_counter() - start)
        if joint != alone:
            raise AssertionError("the batched beam step decided otherwise than one group at a time")
    return {"one_by_one_s": statistics.median(one_by_one), "together_s": statistics.median(together)}


def _row(name: str, gamma: int, g: int, steps: int, seconds: list[dict]) -> dict:
    row = {"mode": name, "gamma": gamma, "groups": g, "steps": steps,
           "one_by_one_ms": 1000 * statistics.mean(x["one_by_one_s"] for x in seconds),
           "together_ms": 1000 * statistics.mean(x["together_s"] for x in seconds)}
    row["together_ms_per_group"] = row["together_ms"] / g
    row["one_by_one_ms_per_group"] = row["one_by_one_ms"] / g
    print(f"{name:19s} γ {gamma} G {g:2d}: one by one {row['one_by_one_ms']:7.2f} ms, together "
          f"{row['together_ms']:7.2f} ms ({row['together_ms_per_group']:.2f} ms a group)", flush=True)
    return row


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    cpu_memory.keep_freed_memory()  # as the CPU worker does: decision buffers reuse the heap
    rows, profiles = [], []
    for name, mode in MODES.items():
        for gamma in args.gammas:
            requests = record(mode, gamma, max(BATCHES), args.vocab)
            steps = min(len(r) for r in requests)
            for g in BATCHES:
                seconds = [time_batch([requests[r][s] for r in range(g)], args.repeats) for s in range(steps)]
                rows.append(_row(name, gamma, g, steps, seconds))
            for g in args.profile:
                print(f"{name:14s} γ {gamma} G {g:2d}, the batched pass by operator:", flush=True)
                profiles.append({"mode": name, "gamma": gamma, "groups": g,
                                 "operators": profile([[requests[r][s] for r in range(g)] for s in range(steps)])})
    for name, temperature in BEAM_MODES.items():
        for g in BATCHES:  # one step each, so four times the repeats
            seconds = time_beam_batch(*beam_steps(temperature, g, args.vocab), 4 * args.repeats)
            rows.append(_row(name, 0, g, 1, [seconds]))
    for row in rows:
        base = next(r for r in rows if r["mode"] == row["mode"] and r["gamma"] == row["gamma"] and r["groups"] == 1)
        row["per_group_vs_batch_1"] = row["together_ms_per_group"] / base["together_ms_per_group"]
    return {"machine": machine_facts(), "threads": args.threads, "vocab": args.vocab, "beam_width": 4,
            "repeats": args.repeats, "device": "cpu", "rows": rows, "profile": profiles}


def profile(steps: list[list[tuple]], top: int = 12) -> list[dict]:
    """Where the batched pass spends its time over ``steps`` (each a step's verifications): per operator, its
    share of the pass's own CPU time and its calls, the ``top`` largest."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    packed = [toy_engine.packed_verifications(batch) for batch in steps]
    for logits, inputs in packed:  # warm: the first pass allocates
        verify_groups(logits, inputs)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for logits, inputs in packed:
            verify_groups(logits, inputs)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    for e in ops[:top]:
        print(f"    {e.key:28s} {100 * e.self_cpu_time_total / total:5.1f} % ({e.count} calls)", flush=True)
    return [{"operator": e.key, "share": e.self_cpu_time_total / total, "calls": e.count,
             "ms_per_step": e.self_cpu_time_total / 1000 / len(steps)} for e in ops[:top]]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for (mode, gamma), marker in zip(sorted({(r["mode"], r["gamma"]) for r in result["rows"]}), "osd^v<>ph*"):
        rows = [r for r in result["rows"] if r["mode"] == mode and r["gamma"] == gamma]
        ax.plot([r["groups"] for r in rows], [r["together_ms_per_group"] for r in rows], marker=marker,
                label=f"{mode}, γ {gamma}: together")
        ax.plot([r["groups"] for r in rows], [r["one_by_one_ms_per_group"] for r in rows], marker=marker,
                linestyle=":", color=ax.lines[-1].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("groups decided in the step (γ 0: a beam step)")
    ax.set_ylabel("ms per group (dotted: one at a time)")
    ax.set_title(f"Step decisions, W 4, V {result['vocab']}, {result['threads']} thread(s), CPU", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2], help="draft layers per iteration")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size of the toy models")
    parser.add_argument("--repeats", type=int, default=5, help="timings per step (the median is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CPU worker runs on one)")
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="G",
                        help="also profile the batched pass at these groups a step, by operator (default: none)")
    parser.add_argument("--out", default="benchmarks/results/decisions", help="folder for the JSON and PNG")
    args = parser.parse_args()
    write_result(run(args), Path(args.out), "decisions", plot)


if __name__ == "__main__":
    main()
