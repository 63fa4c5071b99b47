"""Shared fixtures: prepared models and engines shared across tests.

vLLM engine start costs 20-30 s on the 2-core CI machine, so engines are
session-scoped and reused by every test that can share them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_dsbd import TRACE_REGISTER_ENV, models

# Set before any engine starts: vLLM's spawned processes inherit it, and every
# process in which the plugin registers appends a line to this file.
_TRACE = Path(os.environ.setdefault(
    TRACE_REGISTER_ENV, str(Path(os.environ.get("TMPDIR", "/tmp")) / f"dsbd-register-{os.getpid()}.jsonl")
))


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


@pytest.fixture(scope="session")
def target_llm(target_path):
    """One vLLM engine on the default target, shared by the session."""
    llm = _make_llm(str(target_path))
    yield llm
    del llm


@pytest.fixture(scope="session")
def tiny_llm(tiny_pair):
    """One vLLM engine on the tiny target, shared by the session."""
    llm = _make_llm(str(tiny_pair.target), max_model_len=512, kv_cache_memory_bytes=256 << 20)
    yield llm
    del llm
