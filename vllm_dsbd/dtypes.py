"""The dtype to run models in on this machine: bfloat16 where the hardware computes it natively, else float32.

vLLM's own ``--dtype auto`` turns a float32 checkpoint into bfloat16 on every
x86 CPU, with or without native bf16 instructions; without them bf16 is
slower than float32 (docs/dtype.md). The demo, the examples
and the benchmarks therefore pick the dtype from the CPU's flags
(:func:`machine_dtype`) and say which they picked and why; ``vllm-dsbd dtype``
prints it for shell commands (``vllm-dsbd serve T --dtype "$(vllm-dsbd dtype)"``).
Tests that check exactness pass ``float32`` themselves.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

#: /proc/cpuinfo flags of x86 CPUs that compute bf16 natively (AVX-512 BF16, AMX).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")

#: What a ``--dtype`` option of the demo and the benchmarks takes ("auto": :func:`machine_dtype`).
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    """"float32" or "bfloat16": what to pass as vLLM's ``dtype``."""
    reason: str
    """Why, in words (printed by the demo, recorded in benchmark JSON)."""

    def as_dict(self) -> dict[str, str]:
        return {"dtype": self.dtype, "dtype_reason": self.reason}


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The native-bf16 flags (:data:`BF16_CPU_FLAGS`) the CPU lists; ``cpuinfo``: /proc/cpuinfo's text."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[-1].split())
    return [f for f in BF16_CPU_FLAGS if f in flags]


def machine_dtype(cpuinfo: str | None = None, gpu_bf16: bool | None = None) -> DtypeChoice:
    """bfloat16 on a GPU that supports it or a CPU with native bf16, float32 elsewhere.

    ``gpu_bf16``: whether a CUDA GPU with bf16 is present (None: ask torch); ``cpuinfo`` as in
    :func:`cpu_bf16_flags`.
    """
    if gpu_bf16 is None:
        import torch

        gpu_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if gpu_bf16:
        return DtypeChoice("bfloat16", "the GPU computes bf16 natively")
    flags = cpu_bf16_flags(cpuinfo)
    if flags:
        return DtypeChoice("bfloat16", f"this CPU computes bf16 natively ({', '.join(flags)})")
    return DtypeChoice("float32", f"this CPU has no native bf16 ({' / '.join(BF16_CPU_FLAGS)}), "
                                  "where float32 is faster")


def resolve_dtype(requested: str, option: str = "--dtype") -> DtypeChoice:
    """``requested`` (one of :data:`DTYPE_CHOICES`) as a choice: "auto" is :func:`machine_dtype`."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"{option}={requested!r} is invalid; allowed: {', '.join(DTYPE_CHOICES)} "
                         "(auto: bfloat16 where the CPU computes it natively, else float32).")
    if requested == "auto":
        return machine_dtype()
    return DtypeChoice(requested, f"asked for ({option} {requested})")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` (default auto) of the demo and the benchmarks; read it with :func:`resolve_dtype`."""
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="the models' dtype; auto (default): bfloat16 where the CPU computes it natively "
                             f"({' or '.join(BF16_CPU_FLAGS)}), else float32")
