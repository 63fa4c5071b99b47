"""Shared fixtures: prepared models, and engines shared across tests through a bounded pool.

vLLM engine start costs 20-40 s on the 2-core CI machine, so tests share
engines; an idle engine holds 1-3 GB, so at most ``POOL_CAPACITY`` are alive
at once (``engine_pool.py``) and the test modules run in an order that keeps
tests of the same engines together (``MODULE_ORDER``). Every test has a
timeout, and the run ends with the peak memory of its process tree
(``suite_budget.py``). Budgets: docs/testing.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from engine_pool import MODULE_ORDER, EnginePool  # tests/engine_pool.py
from suite_budget import MemorySampler  # tests/suite_budget.py

from vllm_dsbd import TRACE_REGISTER_ENV, models, pairs

# Set before any engine starts: vLLM's spawned processes inherit it, and every
# process in which the plugin registers appends a line to this file.
_TRACE = Path(os.environ.setdefault(
    TRACE_REGISTER_ENV, str(Path(os.environ.get("TMPDIR", "/tmp")) / f"dsbd-register-{os.getpid()}.jsonl")
))


# --- suite order, timeouts, memory --------------------------------------------------------------

# Pooled engines alive at once. Each engine's processes hold about 2-2.5 GB summed RSS here (tiny or
# default target alike: mostly torch and vLLM themselves), the pytest process 1.5-3 GB. With 4 the suite
# peaked at 14.0 GB (5 engine starts fewer, about a minute and a half): too close to the budget.
POOL_CAPACITY = 3
# Pooled engines that start as users run vLLM, their engine core and worker in processes of their own; the
# others start in this process, about 35 s sooner each (tests/engine_pool.py). The register test and the
# in-engine beam search on the default target run on it.
PROCESS_ENGINES = frozenset({"dsbd_target_llm"})

# pytest-timeout limits (s): covers a test's setup too, so an engine start is inside the limit.
TIMEOUT_S = 300
ENGINE_TIMEOUT_S = 900

_SAMPLER = MemorySampler()
_POOL = EnginePool(POOL_CAPACITY, processes=PROCESS_ENGINES)
_RUN_INDEX: dict[str, int] = {}  # node id -> place in the run (the pool's plan)


def _module_rank(item) -> int:
    rel = Path(str(item.fspath)).relative_to(Path(__file__).parent).as_posix()
    return MODULE_ORDER.index(rel) + 1 if rel in MODULE_ORDER else 0


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: collection order within a module and among the unlisted
    for item in items:
        if item.get_closest_marker("timeout") is None:
            slow = item.get_closest_marker("engine") or item.get_closest_marker("e2e") or \
                item.get_closest_marker("qwen")
            item.add_marker(pytest.mark.timeout(ENGINE_TIMEOUT_S if slow else TIMEOUT_S))


def pytest_collection_finish(session):
    """The engine pool learns which engines each test asks for, in run order."""
    _POOL.plan([set(item.fixturenames) for item in session.items])
    _RUN_INDEX.update((item.nodeid, i) for i, item in enumerate(session.items))


def pytest_sessionstart(session):
    _SAMPLER.start()


def pytest_runtest_logstart(nodeid, location):
    _SAMPLER.current_test = nodeid
    if nodeid in _RUN_INDEX:
        _POOL.at(_RUN_INDEX[nodeid])


def pytest_terminal_summary(terminalreporter):
    _SAMPLER.stop()
    _SAMPLER.sample()
    terminalreporter.section("memory and engines")
    for line in _SAMPLER.report():
        terminalreporter.write_line(line)
    if _POOL.starts:
        terminalreporter.write_line(_POOL.summary())


@pytest.fixture(scope="session")
def engine_pool():
    """The suite's engine pool; every engine left in it is shut down at the end of the session."""
    yield _POOL
    _POOL.clear()


@pytest.fixture(scope="session")
def register_trace() -> Path:
    return _TRACE


@pytest.fixture(scope="session")
def target_path() -> Path:
    """The default SmolLM2 target, built once into the model cache."""
    return models.prepare_target()


@pytest.fixture(scope="session")
def tiny_pair() -> models.PreparedModels:
    """Tiny random-weight target (2 layers, hidden 64) and draft (1 layer, hidden 32)."""
    return models.build_tiny_pair(models.cache_root() / "tiny", seed=0)


def _make_llm(model: str, **overrides):
    from vllm import LLM

    from vllm_dsbd.demo import engine_kwargs

    kwargs = engine_kwargs(model)
    kwargs.update(overrides)
    return LLM(**kwargs)


@pytest.fixture
def target_llm(engine_pool, target_path):
    """A vLLM engine on the default target (pooled)."""
    return engine_pool.get("target_llm", lambda: _make_llm(str(target_path)))


@pytest.fixture
def tiny_llm(engine_pool, tiny_pair):
    """A vLLM engine on the tiny target (pooled)."""
    return engine_pool.get("tiny_llm", lambda: _make_llm(str(tiny_pair.target), max_model_len=512,
                                                         kv_cache_memory_bytes=256 << 20))


@pytest.fixture(scope="session")
def tiny_eos_target(tiny_pair) -> Path:
    """The tiny target with its (tied) EOS embedding row tripled: EOS is among a beam's top 8 ~9 % of the time."""
    return _eos_prone_copy(tiny_pair.target, models.cache_root() / "tiny" / "tiny-target-eos3", scale=3.0)


def _eos_prone_copy(base: Path, out_dir: Path, scale: float) -> Path:
    """A copy of a tied-embedding checkpoint with its EOS embedding row (so its EOS logit) scaled."""
    source = {"base": base.name, "base_manifest": models._sha256(base / models.MANIFEST), "eos_scale": scale}

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            model.get_input_embeddings().weight[tok.eos_token_id] *= scale
        model.save_pretrained(out)
        tok.save_pretrained(out)

    return models._build_atomically(out_dir, source, build)


def dsbd_engine_kwargs(model: str, **overrides) -> dict:
    """A DSBD engine without a draft (in-engine beam decoding, W <= 8), stats on for KV-usage checks."""
    from vllm_dsbd.demo import beam_engine_kwargs

    return {**beam_engine_kwargs(model, 8), "disable_log_stats": False, **overrides}


@pytest.fixture
def dsbd_tiny_llm(engine_pool, tiny_eos_target):
    """A DSBD beam engine on the EOS-prone tiny target (pooled)."""
    from vllm import LLM

    return engine_pool.get("dsbd_tiny_llm", lambda: LLM(**{
        **dsbd_engine_kwargs(str(tiny_eos_target)), "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20}))


@pytest.fixture
def tiny_eos_llm(engine_pool, tiny_eos_target):
    """A plain vLLM engine on the EOS-prone tiny target (vLLM's own beam search is the reference; pooled)."""
    return engine_pool.get("tiny_eos_llm", lambda: _make_llm(str(tiny_eos_target), max_model_len=512,
                                                             kv_cache_memory_bytes=256 << 20))


@pytest.fixture
def dsbd_target_llm(engine_pool, target_path):
    """A DSBD beam engine on the default SmolLM2 target (pooled)."""
    from vllm import LLM

    return engine_pool.get("dsbd_target_llm", lambda: LLM(**dsbd_engine_kwargs(str(target_path))))


def dsbd_spec_engine_kwargs(model: str, draft: str, num_speculative_tokens: int, **overrides) -> dict:
    """A speculative DSBD engine (W <= 8), stats on."""
    from vllm_dsbd.demo import dsbd_engine_kwargs

    return {**dsbd_engine_kwargs(model, draft, num_speculative_tokens, 8), "disable_log_stats": False, **overrides}


@pytest.fixture(scope="session")
def dsbd_tiny_spec_kwargs(tiny_eos_target, tiny_pair) -> dict:
    """The engine arguments of ``dsbd_tiny_spec_llm``."""
    return dsbd_spec_engine_kwargs(str(tiny_eos_target), str(tiny_pair.draft), 3, max_model_len=512,
                                   kv_cache_memory_bytes=256 << 20)


@pytest.fixture
def dsbd_tiny_spec_llm(engine_pool, dsbd_tiny_spec_kwargs):
    """DSBD with speculation on the EOS-prone tiny target, drafting with the tiny draft (γ <= 3; pooled)."""
    from vllm import LLM

    return engine_pool.get("dsbd_tiny_spec_llm", lambda: LLM(**dsbd_tiny_spec_kwargs))


@pytest.fixture
def dsbd_spec_target_llm(engine_pool, target_path):
    """DSBD with speculation on the default pair: SmolLM2 drafted by the shipped draft (γ <= 5; pooled)."""
    from vllm import LLM

    return engine_pool.get("dsbd_spec_target_llm", lambda: LLM(**dsbd_spec_engine_kwargs(
        str(target_path), str(pairs.prepare().draft), 5)))


@pytest.fixture
def shipped_head_llm(engine_pool, target_path):
    """DSBD with speculation on the default target, drafted by the shipped EAGLE-3 head (γ <= 3; pooled)."""
    from vllm import LLM

    from vllm_dsbd import models

    return engine_pool.get("shipped_head_llm", lambda: LLM(**dsbd_spec_engine_kwargs(
        str(target_path), str(models.default_head_path()), 3)))


# The Ray cluster's memory resource: what actors that declare ``memory=`` may reserve in all.
RAY_MEMORY = 6 << 30


@pytest.fixture(scope="module")
def ray_cluster(engine_pool):
    """A local Ray cluster for one Ray test module, started on a machine with no pooled engine alive and
    shut down when the module ends.

    4 logical CPUs on the 2-core machine: a TP 2 engine's placement group holds
    2, and Ray Data's engine actors ask for 1 each. A fixed memory budget
    (``RAY_MEMORY``), from which the Ray Data test's actors reserve their share. Every Ray worker process
    runs ``ray_shim.apply`` (tests/ray_shim.py) at start and finds this
    directory and ``examples/`` on its path.
    """
    import ray

    engine_pool.clear()
    here = Path(__file__).parent
    examples = str(here.parent / "examples")
    path = os.pathsep.join(p for p in (str(here), examples, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, examples)  # this process imports the examples too
    ray.init(num_cpus=4, object_store_memory=256 << 20, _memory=RAY_MEMORY, include_dashboard=False,
             log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "ray_shim.apply", "env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()
    sys.path.remove(examples)
