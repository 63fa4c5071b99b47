"""The method-independent part of the benchmarks: prompts, timing, metrics.

A method is a generate function ``(prompts, max_tokens) -> completions``. The
harness warms it up (untimed), times it batch by batch, samples peak memory
while it runs, and turns the records into metrics. Nothing here imports vLLM
or torch: ``tests/test_bench_harness.py`` checks it with mocked methods.

Definitions used in every result:

- *output tokens* of a request: the tokens of its best returned sequence, cut
  after the first EOS (the same rule for every method);
- *latency* of a request: wall time of the generate call that contained it
  (with ``batch_size`` 1, the request's own latency);
- *speedup*: the baseline's wall time divided by the method's, both measured in
  the same run on the same prompts (> 1 means faster than the baseline);
- *distinct-n*: unique n-grams over all n-grams, pooled across the returned
  sequences of one request; ``None`` for methods that return one sequence.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # as every method sees it (chat template applied)
    token_ids: tuple[int, ...]  # tokenised once by the harness; every method gets these


@dataclass(frozen=True)
class Completion:
    beams: list[list[int]]  # output token ids of each returned sequence, best first, no prompt


GenerateFn = Callable[[Sequence[Prompt], int], list[Completion]]


@dataclass(frozen=True)
class Probes:
    """What a backend lets the harness observe besides wall time and memory."""

    counters: Callable[[], dict[str, float]] | None = None
    """Cumulative engine counters (``engine_steps``, ``spec_drafts``, ...)."""
    kv_usage: Callable[[], float] | None = None
    """Fraction of the KV-cache blocks in use right now."""
    num_kv_blocks: int | None = None


@dataclass
class RequestRecord:
    method: str
    prompt_id: str
    category: str
    batch: int
    latency_s: float
    beams: list[list[int]]  # EOS-truncated output tokens, best first
    mean_logprob: float | None = None  # of beams[0] under the target; set by scoring

    @property
    def num_output_tokens(self) -> int:
        return len(self.beams[0])


@dataclass
class MethodRun:
    name: str
    requests: list[RequestRecord]
    wall_s: float  # sum of the timed generate calls (warm-up excluded)
    counters: dict[str, float] = field(default_factory=dict)  # deltas over the timed calls
    peak_rss_bytes: int | None = None
    peak_kv_usage: float | None = None
    num_kv_blocks: int | None = None


class PromptSetMismatchError(ValueError):
    """Results measured on different prompts (or settings) cannot be compared."""


# ---------------------------------------------------------------------------
# Prompt sets
# ---------------------------------------------------------------------------


def prompt_set_hash(prompts: Sequence[Prompt]) -> str:
    """SHA-256 over the ids, texts and token ids, in order."""
    payload = [[p.id, p.text, list(p.token_ids)] for p in prompts]
    return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()


def check_comparable(results: Sequence[dict]) -> None:
    """Raise :class:`PromptSetMismatchError` unless all summaries share prompts and settings."""
    if not results:
        return
    first = results[0]
    for other in results[1:]:
        for key in ("prompt_set", "settings"):
            a = first[key]["hash"] if key == "prompt_set" else first[key]
            b = other[key]["hash"] if key == "prompt_set" else other[key]
            if a != b:
                raise PromptSetMismatchError(
                    f"Runs '{first['profile']}' and '{other['profile']}' differ in {key} "
                    f"({a} vs {b}); ratios are only meaningful on the same prompts and settings."
                )


# ---------------------------------------------------------------------------
# Running one method
# ---------------------------------------------------------------------------


def truncate_at_eos(tokens: Sequence[int], eos_token_id: int | None) -> list[int]:
    """The tokens up to and including the first EOS."""
    tokens = list(tokens)
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens


def process_tree_rss() -> int:
    """Resident memory of this process and all its children (vLLM's engine core), in bytes."""
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:  # exited between listing and reading
            continue
    return total


@contextmanager
def peak_sampler(
    probes: dict[str, Callable[[], float]], interval_s: float = 0.1
) -> Iterator[dict[str, float]]:
    """Sample each probe on a background thread; the yielded dict holds the maxima.

    Peaks are sampled, so a spike shorter than ``interval_s`` may be missed.
    Every probe is read once on entry and once on exit as well.
    """
    peaks: dict[str, float] = {}
    stop = threading.Event()

    def sample() -> None:
        for name, probe in probes.items():
            value = probe()
            peaks[name] = max(peaks.get(name, value), value)

    def loop() -> None:
        while not stop.wait(interval_s):
            sample()

    sample()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield peaks
    finally:
        stop.set()
        thread.join()
        sample()


def batches(prompts: Sequence[Prompt], batch_size: int) -> list[list[Prompt]]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [list(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)]


def run_method(
    name: str,
    generate: GenerateFn,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int,
    batch_size: int,
    warmup_tokens: int,
    eos_token_id: int | None,
    probes: Probes = Probes(),
    rss: Callable[[], float] | None = process_tree_rss,
    clock: Callable[[], float] = time.perf_counter,
) -> MethodRun:
    """Warm up on the first prompt (untimed), then time ``generate`` batch by batch."""
    if warmup_tokens > 0:
        generate(prompts[:1], warmup_tokens)

    sampled = {"rss": rss} if rss is not None else {}
    if probes.kv_usage is not None:
        sampled["kv_usage"] = probes.kv_usage
    before = probes.counters() if probes.counters else {}

    records: list[RequestRecord] = []
    wall_s = 0.0
    with peak_sampler(sampled) as peaks:
        for index, batch in enumerate(batches(prompts, batch_size)):
            t0 = clock()
            completions = generate(batch, max_tokens)
            latency = clock() - t0
            wall_s += latency
            if len(completions) != len(batch):
                raise RuntimeError(f"{name}: {len(completions)} completions for {len(batch)} prompts")
            for prompt, completion in zip(batch, completions):
                records.append(
                    RequestRecord(
                        method=name,
                        prompt_id=prompt.id,
                        category=prompt.category,
                        batch=index,
                        latency_s=latency,
                        beams=[truncate_at_eos(b, eos_token_id) for b in completion.beams],
                    )
                )

    after = probes.counters() if probes.counters else {}
    return MethodRun(
        name=name,
        requests=records,
        wall_s=wall_s,
        counters={k: after[k] - before.get(k, 0.0) for k in after},
        peak_rss_bytes=int(peaks["rss"]) if "rss" in peaks else None,
        peak_kv_usage=peaks.get("kv_usage"),
        num_kv_blocks=probes.num_kv_blocks,
    )


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distinct_n(beams: Sequence[Sequence[int]], n: int) -> float | None:
    """Unique n-grams / all n-grams, pooled across ``beams``; None for fewer than 2 beams."""
    if len(beams) < 2:
        return None
    grams = [tuple(b[i : i + n]) for b in beams for i in range(len(b) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def summarize(run: MethodRun) -> dict:
    """The metrics of one method's run (``None`` where not observable)."""
    reqs = run.requests
    tokens = sum(r.num_output_tokens for r in reqs)
    latencies = [r.latency_s for r in reqs]
    steps = run.counters.get("engine_steps")
    drafts = run.counters.get("spec_drafts")
    peak_blocks = (
        round(run.peak_kv_usage * run.num_kv_blocks)
        if run.peak_kv_usage is not None and run.num_kv_blocks is not None
        else None
    )
    return {
        "num_requests": len(reqs),
        "wall_s": run.wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / run.wall_s,
        "requests_per_s": len(reqs) / run.wall_s,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p90_s": percentile(latencies, 90),
        "target_forwards_per_output_token": steps / tokens if steps is not None and tokens else None,
        "mean_accepted_tokens_per_draft": (
            run.counters["spec_accepted_tokens"] / drafts if drafts else None
        ),
        "mean_beam_width": (  # DSBD: beams per beam layer produced (vllm:dsbd_* metrics)
            run.counters["dsbd_beam_width_sum"] / run.counters["dsbd_beam_layers"]
            if run.counters.get("dsbd_beam_layers") else None
        ),
        "peak_rss_mib": run.peak_rss_bytes / 2**20 if run.peak_rss_bytes is not None else None,
        "peak_kv_usage": run.peak_kv_usage,
        "peak_kv_blocks": peak_blocks,
        "num_kv_blocks": run.num_kv_blocks,
        "mean_logprob_per_token": _mean([r.mean_logprob for r in reqs]),
        "distinct_1": _mean([distinct_n(r.beams, 1) for r in reqs]),
        "distinct_2": _mean([distinct_n(r.beams, 2) for r in reqs]),
        "mean_beams_returned": sum(len(r.beams) for r in reqs) / len(reqs),
    }


def add_speedups(methods: dict[str, dict], baseline: str) -> None:
    """Set ``speedup_vs_baseline`` = baseline wall time / method wall time on every ok method."""
    base = methods.get(baseline, {})
    base_wall = base.get("wall_s") if base.get("status") == "ok" else None
    for summary in methods.values():
        if summary.get("status") == "ok":
            summary["speedup_vs_baseline"] = base_wall / summary["wall_s"] if base_wall else None
