"""The fuzz run's requests over HTTP: ``vllm-dsbd serve``'s completions API, concurrent, with disconnects.

See :mod:`benchmarks.fuzz`. A request is sent as a user would send it: the
options as completion fields, the knobs as ``vllm_xargs``, beam search as
``use_beam_search``; an abort is a client that hangs up early.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.fuzz_requests import PROMPTS, Completion, Result, Spec
from benchmarks.soak import _free_port, server_metrics

#: Seconds before a client hangs up, for ``Spec.abort_after`` 1 and 3.
HANG_UP_S = {1: 0.05, 3: 0.3}


def request_body(spec: Spec, model: str) -> dict:
    """The completions request for ``spec``."""
    body = {"model": model, "prompt": spec.prompt, "return_token_ids": True}
    for name, value in spec.options.items():
        if name == "detokenize":
            continue  # not in the completions API (the text is always detokenized)
        if name == "logit_bias":
            value = {str(k): v for k, v in value.items()}
        body[name] = value
    if spec.kind == "beam_search":
        body["use_beam_search"] = True
    if spec.knobs:
        body["vllm_xargs"] = spec.knobs
    return body


class Served:
    """A running server and the fuzz transport interface: ``run``, ``alive``, ``kv_usage``."""

    def __init__(self, url: str, model: str, model_path: str, max_model_len: int, proc=None):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.url, self.model, self.proc, self.max_model_len = url, model, proc, max_model_len
        self.eos, self.tokenize = tokenizer.eos_token_id, tokenizer.encode

    @classmethod
    def start(cls, engine_kwargs: dict, log: Path) -> Served:
        """``vllm-dsbd serve`` with ``engine_kwargs`` (as ``LLM(...)`` takes them) on a free loopback port."""
        port = _free_port()
        cmd = [sys.executable, "-m", "vllm_dsbd.cli", "serve", engine_kwargs["model"], "--served-model-name", "fuzz",
               "--speculative-config", json.dumps(engine_kwargs["speculative_config"]),
               "--host", "127.0.0.1", "--port", str(port)]
        for name in ("dtype", "max_model_len", "seed", "kv_cache_memory_bytes", "block_size"):
            cmd += [f"--{name.replace('_', '-')}", str(engine_kwargs[name])]
        cmd += ["--enforce-eager"]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while not _healthy(url):
            if proc.poll() is not None or time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"server did not start (exit {proc.poll()}); see {log}")
            time.sleep(1)
        return cls(url, "fuzz", engine_kwargs["model"], engine_kwargs["max_model_len"], proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def prompt_len(self, prompt: str) -> int:
        return len(self.tokenize(prompt))

    def _one(self, spec: Spec) -> Result:
        import httpx

        timeout = HANG_UP_S.get(spec.abort_after, 600.0)
        try:
            r = httpx.post(f"{self.url}/v1/completions", json=request_body(spec, self.model), timeout=timeout)
        except httpx.TimeoutException:
            return Result("aborted")
        except httpx.HTTPError as e:
            return Result("failed", message=f"{type(e).__name__}: {e}")
        if r.status_code == 400:
            return Result("refused", message=r.text)
        if r.status_code != 200:
            return Result("failed", message=f"HTTP {r.status_code}: {r.text}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        return Result("answered", [
            Completion(c.get("token_ids") or [], None if spec.options.get("detokenize") is False else c["text"],
                       c["finish_reason"], c.get("stop_reason"), (c.get("logprobs") or {}).get("tokens"))
            for c in choices])

    def run(self, batch: list[Spec]) -> list[Result]:
        if not batch:
            return []
        with ThreadPoolExecutor(len(batch)) as pool:
            return list(pool.map(self._one, batch))

    def alive(self) -> bool:
        """The server answers /health and a one-token request (which also flushes its stats)."""
        if not _healthy(self.url):
            return False
        body = {"model": self.model, "prompt": PROMPTS[0], "max_tokens": 1}
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status == 200
        except OSError:
            return False

    def kv_usage(self) -> float:
        """``vllm:kv_cache_usage_perc``, read until it settles (hung-up requests are freed asynchronously)."""
        for _ in range(20):
            usage = server_metrics(self.url)["vllm:kv_cache_usage_perc"]
            if usage == 0.0:
                return usage
            time.sleep(0.5)
            self.alive()
        return usage


    def preemptions(self) -> float:
        """Requests vLLM preempted since the server started (``vllm:num_preemptions``)."""
        return server_metrics(self.url)["vllm:num_preemptions_total"]

    def held_groups(self) -> int:
        """Not visible through HTTP: the offline transport checks the runner's draft store."""
        return 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False
