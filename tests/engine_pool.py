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

Shutting down ends the engine core and its worker processes at once rather
than leaving them to the garbage collector. Engine fixtures are
function-scoped lookups: a test never holds an engine the pool has shut down.
"""

from __future__ import annotations

import gc
import time
from collections import Counter, OrderedDict
from typing import Any, Callable

NEVER = float("inf")

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
    "engine/test_auto_depth.py", "engine/test_bf16.py", "engine/test_dsbd_engine.py", "engine/test_mjsd_engine.py",
    "engine/test_fuzz.py",
    # dsbd_tiny_spec_llm, tiny_eos_llm, dsbd_spec_target_llm, target_llm
    "engine/test_demo.py",  # the demo's own engines, in a subprocess, after the pool is cleared
    "engine/test_tensor_parallel.py", "engine/test_ray_executor.py", "engine/test_ray_data_example.py",
    "e2e/test_serve.py",
]


def shutdown(llm: Any) -> None:
    """End ``llm``'s engine core (and with it its worker processes) now."""
    llm.llm_engine.engine_core.shutdown()


class EnginePool:
    """Named engines, at most ``capacity`` alive; shut down when no later test needs them."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"EnginePool capacity must be >= 1, got {capacity}")
        self.capacity = capacity
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
        llm = start()
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
