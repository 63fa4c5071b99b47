"""Where the suite's memory goes: the test process tree's summed RSS, sampled once a second.

conftest hooks this in: ``MemorySampler.start`` at configure time, the
current test's node id on every test, ``report`` in the terminal summary. The
summed RSS of pytest and every process below it (engine cores, workers, the
server, Ray's raylet and actors) counts shared library pages once per process,
so it over-states the true footprint; it is the figure the budget is held to.
The machine's used memory (total - available) is reported beside it.
"""

from __future__ import annotations

import os
import threading

import psutil

# The suite's budget for the summed RSS of its process tree, in GB (10^9 bytes; docs/testing.md).
BUDGET_GB = 14.0
_GB = 1e9


def tree_rss(root: psutil.Process) -> int:
    """Summed RSS of ``root`` and every process below it, in bytes (processes that end meanwhile skipped)."""
    total = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


class MemorySampler:
    """Samples ``tree_rss`` of this process every ``interval`` s; keeps the peak, and each test's peak."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.current_test = "(collection)"
        self.peak = 0
        self.peak_test = ""
        self.machine_peak = 0
        self.per_test: dict[str, int] = {}
        self._stop = threading.Event()
        self._root = psutil.Process(os.getpid())
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> None:
        rss = tree_rss(self._root)
        test = self.current_test
        if rss > self.per_test.get(test, 0):
            self.per_test[test] = rss
        if rss > self.peak:
            self.peak, self.peak_test = rss, test
        vm = psutil.virtual_memory()
        self.machine_peak = max(self.machine_peak, vm.total - vm.available)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def report(self, top: int = 5) -> list[str]:
        verdict = "within" if self.peak <= BUDGET_GB * _GB else "OVER"
        lines = [f"peak memory: {self.peak / _GB:.1f} GB summed RSS of the test process tree "
                 f"({verdict} the {BUDGET_GB:.0f} GB budget), during {self.peak_test}; "
                 f"machine used peak {self.machine_peak / _GB:.1f} GB"]
        worst = sorted(self.per_test.items(), key=lambda kv: -kv[1])[:top]
        lines += [f"  {rss / _GB:5.1f} GB  {test}" for test, rss in worst]
        return lines
