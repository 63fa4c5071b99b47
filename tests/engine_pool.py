"""The test suite's vLLM engines: at most a few alive at once, each shut down once no later test needs it.

An engine start costs 20-40 s here, so tests share engines; but an idle engine
holds 1-3 GB in its engine-core and worker processes, and seven idle
session-scoped engines once filled the 24 GB machine until Ray's memory
monitor killed the Ray tests' actors in a loop. The pool keeps sharing cheap
and memory bounded:

- every engine fixture asks the pool for its engine by name (the fixture's
  name); a live one is returned, otherwise it is started, after making room;
- the pool knows the run's plan: which engines each test, in run order, asks
  for (``plan``, from the collected tests' fixture names). An engine no later
  test needs is shut down as soon as its last test is over (``at``); when
  room must be made, the live engine needed again furthest ahead goes first
  (without a plan: the least recently used);
- tests that start engines of their own beside the pool's (tensor
  parallelism, Ray, the server) ask for it ``alone`` or ``clear`` the pool.

Engines start in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine
core and its one worker run in the test process) unless the pool is told to
start them as users run vLLM, in processes of their own (``processes``). On the
2-core machine a start in processes of their own took 37-41 s and its shutdown
5.6 s (an engine-core and a worker process, each importing torch and vLLM);
in this process 3-6 s and 1.9 s (docs/testing.md). The server, the demo and
the Ray Data example still run their engines in processes of their own, tensor
parallelism its workers, and so do the engines named in ``processes``.

Shutting down ends the engine core and its worker processes at once rather
than leaving them to the garbage collector. Engine fixtures are
function-scoped lookups: a test never holds an engine the pool has shut down.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import platform
import sys
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

NEVER = float("inf")
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"

# Engine test modules in the order they run, grouped by the engines they share; modules not
# listed run first in collection order (the unit tests), and the ones that start engines of
# their own beside the pool's (tensor parallelism, Ray, the server) run last, each after
# clearing the pool.
MODULE_ORDER = [
    "engine/test_foundation_engine.py", "engine/test_eagle3_heads.py", "engine/test_reference_vs_vllm.py",
    # tiny_llm, target_llm
    "engine/test_draft_engine.py",  # target_llm
    "engine/test_beam_engine.py",  # dsbd_tiny_llm, dsbd_target_llm, target_llm, tiny_eos_llm
    "engine/test_beam_logprobs.py", "engine/test_beam_stop_tokens.py",  # dsbd_tiny_llm, dsbd_tiny_spec_llm
    "engine/test_draft_vocab.py", "engine/test_wide_beams.py", "engine/test_dsbd_eagle3.py",  # tiny_eos_llm, own
    "engine/test_shared_forest_rows.py",  # inproc_in_step_llm, tiny_eos_llm (as test_dsbd_eagle3.py)
    "engine/test_accepted_drafts.py",  # its own soft permutation pair
    "engine/test_preemption.py",  # in_step_llm, dsbd_tiny_spec_llm, own, pressure_spec_llm (and test_fuzz)
    "engine/test_auto_depth.py", "engine/test_bf16.py", "engine/test_dsbd_engine.py", "engine/test_mjsd_engine.py",
    "engine/test_fuzz.py",
    # dsbd_tiny_spec_llm, tiny_eos_llm, dsbd_spec_target_llm, target_llm
    "engine/test_demo.py",  # the demo's own engines, in a subprocess, after the pool is cleared
    "engine/test_examples.py",  # shipped_head_llm (examples/; the served one is in e2e/test_serve.py)
    "engine/test_tensor_parallel.py", "engine/test_ray_executor.py", "engine/test_ray_data_example.py",
    "e2e/test_serve.py",
]


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process's environment (an engine's processes read theirs at start), the previous
    values restored afterwards."""
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


@contextmanager
def engine_processes(own: bool) -> Iterator[None]:
    """Engines started inside run their engine core (and its worker) in processes of their ``own``, or in
    this one; the environment is restored afterwards. An engine core that starts in a process caches
    vLLM's environment variables there (``vllm.envs.enable_envs_cache``: a later engine would take the
    cached mode, whatever the environment says), so the cache is dropped before and after the start."""
    with environment({MULTIPROCESSING: "1" if own else "0"}):
        _drop_envs_cache()
        try:
            yield
        finally:
            _drop_envs_cache()


def _drop_envs_cache() -> None:
    envs = sys.modules.get("vllm.envs")  # no cache where vLLM was never imported
    if envs is not None:
        envs.disable_envs_cache()


# Engines alive in this process (their ids), from every pool.
_IN_THIS_PROCESS: set[int] = set()


def in_this_process(llm: Any) -> bool:
    """Whether ``llm``'s engine core runs in this process (vLLM's ``InprocClient`` holds the core itself)."""
    return hasattr(llm.llm_engine.engine_core, "engine_core")


def shutdown(llm: Any) -> None:
    """End ``llm``'s engine core (and with it its worker processes) now; in this process, without tearing
    down the distributed state that other engines here still use (``_keeping_distributed_state``)."""
    _IN_THIS_PROCESS.discard(id(llm))
    if in_this_process(llm) and _IN_THIS_PROCESS:
        with _keeping_distributed_state():
            llm.llm_engine.engine_core.shutdown()
    else:
        llm.llm_engine.engine_core.shutdown()


# --- the one test-only shim of vLLM here -------------------------------------------------------------------
# Target: vllm.v1.engine.core.cleanup_dist_env_and_memory, as EngineCore.shutdown calls it (vLLM 0.32.0).
# Why: an engine core in this process tears down vLLM's distributed state as it shuts down (its tensor- and
#   pipeline-parallel groups and torch's process group: one of each per process), and another engine alive
#   in this process then fails its next forward ("pipeline model parallel group is not initialized").
# How: while other engines of this process are alive, a shutdown runs with that teardown replaced by nothing;
#   the last one's shutdown tears down as vLLM does.
# Remove when: vLLM keeps distributed state per engine, or the suite no longer runs engines side by side in
#   one process.
# Checked by: tests/test_engine_pool.py (EngineCore.shutdown still calls it) and
#   tests/engine/test_foundation_engine.py (an engine outlives another's shutdown in this process).
@contextmanager
def _keeping_distributed_state() -> Iterator[None]:
    from unittest import mock

    from vllm.v1.engine import core

    with mock.patch.object(core, "cleanup_dist_env_and_memory", lambda *args, **kwargs: None):
        yield


class EnginePool:
    """Named engines, at most ``capacity`` alive; shut down when no later test needs them. Those named in
    ``processes`` start in processes of their own, the others in this process."""

    def __init__(self, capacity: int, processes: frozenset[str] = frozenset()):
        if capacity < 1:
            raise ValueError(f"EnginePool capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.processes = processes
        self._live: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self._plan: list[frozenset[str]] = []
        self._now = 0
        self.starts: Counter[str] = Counter()
        self.start_seconds = 0.0

    def plan(self, uses: list[set[str] | frozenset[str]]) -> None:
        """The names each test asks for, in run order (names that are no engine are ignored)."""
        self._plan = [frozenset(u) for u in uses]

    def at(self, index: int) -> None:
        """Test ``index`` of the plan is next: shut down every engine that neither it nor a later test needs."""
        self._now = index
        self._evict([name for name in self._live if self._next_use(name) == NEVER])

    def get(self, name: str, start: Callable[[], Any], alone: bool = False) -> Any:
        """The live engine ``name``, or a new one from ``start()`` (making room first; with ``alone``, an
        engine that starts processes beyond the usual two, every other engine shut down first)."""
        if name in self._live:
            self._live.move_to_end(name)
            return self._live[name]
        keep = 0 if alone else self.capacity - 1
        while len(self._live) > keep:
            self._evict([self._furthest()])
        began = time.monotonic()
        with engine_processes(name in self.processes):
            llm = start()
        if in_this_process(llm):
            _IN_THIS_PROCESS.add(id(llm))
        self.start_seconds += time.monotonic() - began
        self.starts[name] += 1
        self._live[name] = llm
        return llm

    def live(self) -> list[str]:
        """Names of the live engines, least recently used first."""
        return list(self._live)

    def clear(self) -> None:
        """Shut every engine down (before a test that starts engines of its own)."""
        self._evict(list(self._live))

    def summary(self) -> str:
        total = sum(self.starts.values())
        by_name = ", ".join(f"{name} {n}" for name, n in sorted(self.starts.items()))
        return f"{total} engine starts ({self.start_seconds:.0f} s, at most {self.capacity} alive): {by_name}"

    def _next_use(self, name: str) -> float:
        """Plan index of the next test, from the current one on, that asks for ``name`` (without a plan: now)."""
        if not self._plan:
            return self._now
        return next((i for i in range(self._now, len(self._plan)) if name in self._plan[i]), NEVER)

    def _furthest(self) -> str:
        """The live engine needed again furthest ahead; among equals, the least recently used."""
        return max(self._live, key=lambda name: (self._next_use(name), -list(self._live).index(name)))

    def _evict(self, names: list[str]) -> None:
        for name in names:
            shutdown(self._live.pop(name))
        if names:
            gc.collect()
            _return_freed_memory()


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the kernel. A DSBD worker keeps freed memory in its process's heap
    (``vllm_dsbd.engine.cpu_memory``): one in this process left about 0.9 GB of it there after its shutdown
    (the default target with the shipped head), which this returns."""
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
