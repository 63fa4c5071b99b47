"""Soak a served speculative DSBD engine: concurrent mixed clients with disconnects, bounded in time.

    .venv/bin/python -m benchmarks.soak                                  # 64 clients, 10 minutes, default pair
    .venv/bin/python -m benchmarks.soak --clients 16 --minutes 2 --out /tmp/soak

Starts ``vllm-dsbd serve`` on the default pair (DSBD drafting with the
shipped draft; loopback only, a free port) and runs ``--clients`` concurrent
clients for ``--minutes`` (and at most ``--max-requests``). Each request is,
at random (seeded): in-engine beam search (``use_beam_search``), beam
sampling (``vllm_xargs`` beam_width, T 1, γ 0), DSBD beam search or
sampling (speculative), DSBD beam search with stop strings, a stop token
and top-2 log-probs, MJSD with a stop string and top-2 log-probs,
``use_beam_search`` with stop strings and a stop token, or a plain sampled
request; a fraction of them
(``--disconnect``) is abandoned by its client after a random short wait,
closing the connection mid-request. Afterwards the server must be idle with
no KV in use. Reports requests served, errors (anything but HTTP 200 on a
request the client waited for: must be 0), disconnects, p50/p99 latency per
kind, ``vllm:kv_cache_usage_perc`` and running/waiting requests at the end,
and the server's memory (its process tree's RSS) over time.

Writes ``soak.json`` and ``soak.png`` into ``--out``. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.harness import percentile
from benchmarks.machine import machine_facts
from vllm_dsbd import pairs

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Write a haiku about rain.",
           "List three prime numbers:", "Explain what a beam search is in one sentence."]
KINDS = {  # name: the completion request's extra fields
    "beam-search": {"use_beam_search": True, "n": 4, "temperature": 0.0},
    "beam-sampling": {"n": 2, "temperature": 1.0, "vllm_xargs": {"beam_width": 4, "num_speculative_tokens": 0}},
    "dsbd-search": {"n": 2, "temperature": 0.0, "vllm_xargs": {"beam_width": 4}},
    "dsbd-sampling": {"n": 1, "temperature": 1.0, "vllm_xargs": {"beam_width": 4, "width_threshold": 0.7}},
    "beam-stop-logprobs": {"n": 2, "temperature": 0.0, "stop": ["."], "stop_token_ids": [13], "logprobs": 2,
                           "vllm_xargs": {"beam_width": 4}},
    "mjsd-stop-logprobs": {"n": 1, "temperature": 0.0, "stop": ["."], "logprobs": 2,
                           "vllm_xargs": {"decoder": "mjsd", "beam_width": 4}},
    "beam-search-stop": {"use_beam_search": True, "n": 3, "temperature": 0.0, "stop": [".", "\n"],
                         "stop_token_ids": [13]},
    "plain": {"temperature": 1.0},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: str, draft: str, gamma: int, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm_dsbd.cli", "serve", target, "--served-model-name", "soak",
           "--speculative-method", "dsbd",
           "--speculative-config", json.dumps({"model": draft, "num_speculative_tokens": gamma, "beam_width": 4}),
           "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--seed", "0",
           "--kv-cache-memory-bytes", str(1 << 30), "--block-size", "32", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    deadline = time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            stop_server(proc)
            raise RuntimeError(f"server did not start (exit {proc.poll()}); see {log}")
        time.sleep(1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def server_metrics(url: str) -> dict[str, float]:
    """The unlabelled sums of the gauges the soak checks, read from ``/metrics``."""
    wanted = {"vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:num_preemptions_total"}
    values = dict.fromkeys(wanted, 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in wanted:
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


async def _client(index: int, url: str, args, deadline: float, budget: list[int], records: list[dict]) -> None:
    import httpx

    rng = random.Random(args.seed * 1000 + index)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as http:
        while time.time() < deadline and budget[0] > 0:
            budget[0] -= 1
            kind = rng.choice(list(KINDS))
            body = {"model": "soak", "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, args.max_tokens),
                    "seed": rng.randrange(1 << 30), **KINDS[kind]}
            disconnect_after = rng.uniform(0.05, 2.0) if rng.random() < args.disconnect else None
            start = time.perf_counter()
            record = {"client": index, "kind": kind, "start": time.time()}
            try:
                request = http.post("/v1/completions", json=body)
                response = await (asyncio.wait_for(request, disconnect_after) if disconnect_after else request)
                record["status"] = response.status_code
                if response.status_code != 200:
                    record["error"] = response.text[:300]
                else:
                    choices = response.json()["choices"]
                    if len(choices) != body.get("n", 1):
                        record["error"] = f"{len(choices)} choices for n={body.get('n', 1)}"
            except asyncio.TimeoutError:
                record["status"] = "disconnected"
            except Exception as e:  # counted as an error of the server or the transport
                record["status"], record["error"] = "exception", f"{type(e).__name__}: {e}"
            record["latency_s"] = time.perf_counter() - start
            records.append(record)


async def _soak(url: str, args, proc: subprocess.Popen) -> tuple[list[dict], list[tuple[float, float]]]:
    import psutil

    deadline = time.time() + 60 * args.minutes
    records: list[dict] = []
    memory: list[tuple[float, float]] = []
    server = psutil.Process(proc.pid)

    async def sample_memory() -> None:
        t0 = time.time()
        while time.time() < deadline + 5:
            rss = server.memory_info().rss + sum(c.memory_info().rss for c in server.children(recursive=True))
            memory.append((time.time() - t0, rss / 2**20))
            await asyncio.sleep(args.memory_interval)

    budget = [args.max_requests]
    sampler = asyncio.create_task(sample_memory())
    await asyncio.gather(*(_client(i, url, args, deadline, budget, records) for i in range(args.clients)))
    sampler.cancel()
    return records, memory


def run(args: argparse.Namespace) -> dict:
    pair = pairs.pair_paths(args.pair)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(str(pair.target), str(pair.draft), args.gamma, port, out / "server.log")
    try:
        records, memory = asyncio.run(_soak(url, args, proc))
        time.sleep(5)  # let aborts of the last disconnects land and the stats refresh
        final = server_metrics(url)
        healthy = urllib.request.urlopen(f"{url}/health", timeout=10).status == 200
    finally:
        stop_server(proc)
    waited = [r for r in records if r["status"] != "disconnected"]
    errors = [r for r in waited if r["status"] != 200 or "error" in r]
    by_kind = {}
    for kind in KINDS:
        lat = [r["latency_s"] for r in waited if r["kind"] == kind and r not in errors]
        by_kind[kind] = {"served": len(lat), "latency_p50_s": percentile(lat, 50) if lat else None,
                         "latency_p99_s": percentile(lat, 99) if lat else None}
    all_lat = [r["latency_s"] for r in waited if r not in errors]
    return {
        "benchmark": "soak",
        "settings": {"pair": args.pair, "clients": args.clients, "minutes": args.minutes,
                     "max_requests": args.max_requests, "max_tokens": args.max_tokens, "gamma": args.gamma,
                     "disconnect_fraction": args.disconnect, "seed": args.seed, "kinds": KINDS},
        "machine": machine_facts(),
        "requests_sent": len(records), "served": len(waited) - len(errors), "errors": len(errors),
        "error_samples": errors[:10], "disconnected": len(records) - len(waited),
        "latency_p50_s": percentile(all_lat, 50) if all_lat else None,
        "latency_p99_s": percentile(all_lat, 99) if all_lat else None,
        "by_kind": by_kind, "final_metrics": final, "healthy_at_end": healthy,
        "memory_mib": memory, "peak_memory_mib": max((m for _, m in memory), default=None),
        "memory_growth_mib": _growth(memory),
    }


def _growth(memory: list[tuple[float, float]]) -> float | None:
    """Server RSS over the last minute minus over the second minute (after the first requests warmed it up)."""
    second = [m for t, m in memory if 60 <= t < 120]
    last = [m for t, m in memory if t >= memory[-1][0] - 60] if memory else []
    return sum(last) / len(last) - sum(second) / len(second) if second and last else None


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    if result["memory_mib"]:
        ax.plot(*zip(*result["memory_mib"]))
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS (MiB, process tree)")
    s = result["settings"]
    ax.set_title(f"soak: {s['clients']} clients, {s['minutes']} min, {result['served']} served, "
                 f"{result['errors']} errors, {result['disconnected']} disconnects | {result['machine']['cpu']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="default")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=5000, help="upper bound on requests sent")
    p.add_argument("--max-tokens", type=int, default=24, help="each request asks for 4..this many tokens")
    p.add_argument("--gamma", type=int, default=2, help="the engine's draft layers")
    p.add_argument("--disconnect", type=float, default=0.15, help="fraction of requests abandoned mid-way")
    p.add_argument("--memory-interval", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/soak")
    args = p.parse_args()
    result = run(args)
    out = Path(args.out)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("memory_mib", "machine", "settings")}, indent=1))
    ok = result["errors"] == 0 and result["final_metrics"]["vllm:kv_cache_usage_perc"] == 0.0 \
        and result["final_metrics"]["vllm:num_requests_running"] == 0 and result["healthy_at_end"]
    print("soak passed" if ok else "soak FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
