"""The suite's engine pool keeps at most ``capacity`` engines alive and shuts the least recently used down;
every engine test module has a place in the suite's order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_pool import MODULE_ORDER, MULTIPROCESSING, EnginePool  # tests/engine_pool.py


class FakeCore:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def shutdown(self) -> None:
        self.log.append(self.name)


class FakeEngine:
    def __init__(self, log: list[str], name: str):
        self.llm_engine = type("E", (), {"engine_core": FakeCore(log, name)})()


def _pool(capacity: int):
    log: list[str] = []
    pool = EnginePool(capacity)
    return pool, log, lambda name: pool.get(name, lambda: FakeEngine(log, name))


def test_a_live_engine_is_reused_and_the_least_recently_used_is_shut_down_first():
    pool, shut, get = _pool(2)
    a = get("a")
    get("b")
    assert get("a") is a  # reused, and now the most recently used
    get("c")  # evicts b, not a
    assert shut == ["b"] and pool.live() == ["a", "c"]
    get("b")  # started again; a is now the least recently used
    assert shut == ["b", "a"] and pool.live() == ["c", "b"]
    assert pool.starts == {"a": 1, "b": 2, "c": 1}


def test_with_a_plan_an_engine_goes_after_its_last_test_and_the_one_needed_furthest_ahead_makes_room():
    pool, shut, get = _pool(2)
    pool.plan([{"a"}, {"b"}, {"c", "x"}, {"b"}, {"a"}, {"c"}])
    pool.at(0), get("a")
    pool.at(1), get("b")
    pool.at(2), get("c")  # a (next at 4) goes, not b (next at 3), though b was used more recently
    assert shut == ["a"] and pool.live() == ["b", "c"]
    pool.at(3), get("b")
    pool.at(4), get("a")  # b is not needed again: gone at test 4's start, so a starts without evicting c
    assert shut == ["a", "b"] and pool.live() == ["c", "a"]
    pool.at(5)
    assert pool.live() == ["c"] and shut == ["a", "b", "a"]


def test_alone_and_clear_shut_every_other_engine_down():
    pool, shut, get = _pool(3)
    get("a"), get("b")
    pool.get("big", lambda: FakeEngine(shut, "big"), alone=True)
    assert sorted(shut) == ["a", "b"] and pool.live() == ["big"]
    pool.clear()
    assert pool.live() == [] and shut[-1] == "big"


def test_engines_start_in_this_process_unless_named_and_the_environment_is_restored(monkeypatch):
    monkeypatch.setenv(MULTIPROCESSING, "user's value")
    pool, seen = EnginePool(3, processes=frozenset({"own"})), {}

    def start(name):
        seen[name] = os.environ[MULTIPROCESSING]
        if name == "broken":
            raise RuntimeError("engine failed to start")
        return FakeEngine([], name)

    for name in ("own", "here"):
        pool.get(name, lambda: start(name))
    with pytest.raises(RuntimeError, match="failed to start"):
        pool.get("broken", lambda: start("broken"))
    assert seen == {"own": "1", "here": "0", "broken": "0"}
    assert os.environ[MULTIPROCESSING] == "user's value"
    monkeypatch.delenv(MULTIPROCESSING)
    pool.get("later", lambda: start("later"))
    assert MULTIPROCESSING not in os.environ


def test_an_engine_takes_its_mode_though_an_engine_before_it_cached_vllms_environment(monkeypatch):
    """An engine core that starts in this process caches vLLM's environment there: before the pool set
    each engine's mode, every engine of the suite after the first one in this process started in this
    process too, whatever the environment said."""
    from vllm import envs

    pool, seen = EnginePool(3, processes=frozenset({"own", "own too"})), {}

    def start(name):
        seen[name] = envs.VLLM_ENABLE_V1_MULTIPROCESSING
        envs.enable_envs_cache()  # as EngineCore.__init__ does
        return FakeEngine([], name)

    monkeypatch.setenv(MULTIPROCESSING, "0")
    envs.enable_envs_cache()  # an engine a test started in this process, outside the pool
    try:
        for name in ("own", "here", "own too"):
            pool.get(name, lambda: start(name))
    finally:
        envs.disable_envs_cache()
    assert seen == {"own": True, "here": False, "own too": True}


def test_vllms_engine_core_still_tears_down_the_distributed_state_where_the_pool_keeps_it():
    """The pool's shim (tests/engine_pool.py) replaces ``cleanup_dist_env_and_memory`` in vLLM's engine-core
    module while other engines of the process are alive: EngineCore.shutdown must still call it by that name."""
    from vllm.v1.engine import core

    assert "cleanup_dist_env_and_memory" in core.EngineCore.shutdown.__code__.co_names
    assert core.cleanup_dist_env_and_memory.__module__ == "vllm.distributed.parallel_state"


def test_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        EnginePool(0)


def test_every_engine_test_module_has_a_place_in_the_suite_order():
    here = Path(__file__).parent
    engine_modules = {p.relative_to(here).as_posix() for d in ("engine", "e2e") for p in (here / d).glob("test_*.py")}
    assert engine_modules == set(MODULE_ORDER)
    # those that start engines of their own beside the pool's come last
    assert MODULE_ORDER[-4:] == ["engine/test_tensor_parallel.py", "engine/test_ray_executor.py",
                                          "engine/test_ray_data_example.py", "e2e/test_serve.py"]
