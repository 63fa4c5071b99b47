"""What the benchmark scripts share: prompts, the engine mode flag, and output."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Callable


def add_prompt_args(parser: argparse.ArgumentParser, max_tokens: int = 64, num_prompts: int = 4) -> None:
    """``--target``, ``--max-tokens``, ``--num-prompts``, ``--prompts-file``, ``--seed``."""
    parser.add_argument("--target", default=None, help="target checkpoint (default: the prepared SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--prompts-file", default="benchmarks/prompts/prompts.json")
    parser.add_argument("--seed", type=int, default=0)


def add_enforce_eager_argument(parser: argparse.ArgumentParser) -> None:
    """``--enforce-eager``: vLLM's engines run eager; without it, vLLM's default compiled mode (as users get it)."""
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run vLLM's engines eager (default: vLLM's default compiled mode)")


def add_omp_bind_argument(parser: argparse.ArgumentParser) -> None:
    """``--omp-bind``: the cores of vLLM's CPU worker (``VLLM_CPU_OMP_THREADS_BIND``), see ``apply_omp_bind``."""
    parser.add_argument("--omp-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND for the engine (e.g. 0-1: the worker on both cores of a "
                             "2-core machine, faster for large batches; default: the environment's, else vLLM's auto)")


def apply_omp_bind(args: argparse.Namespace) -> str:
    """Set ``--omp-bind`` for the engine about to start; the binding in force, recorded with each result."""
    if args.omp_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")


def write_result(result: dict, out: Path, name: str, plot: Callable[[dict, Path], None]) -> None:
    """``out/name.json`` and ``out/name.png``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / f"{name}.png")
