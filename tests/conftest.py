"""Shared fixtures: prepared models and engines shared across tests.

vLLM engine start costs 20-30 s on the 2-core CI machine, so engines are
session-scoped and reused by every test that can share them.
"""

from __future__ import annotations

import os
import sys
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


@pytest.fixture(scope="session")
def dsbd_tiny_llm(tiny_eos_target):
    """A DSBD beam engine on the EOS-prone tiny target, shared by the session."""
    from vllm import LLM

    llm = LLM(**{**dsbd_engine_kwargs(str(tiny_eos_target)), "max_model_len": 512,
                 "kv_cache_memory_bytes": 256 << 20})
    yield llm
    del llm


@pytest.fixture(scope="session")
def tiny_eos_llm(tiny_eos_target):
    """A plain vLLM engine on the EOS-prone tiny target (vLLM's own beam search is the reference)."""
    llm = _make_llm(str(tiny_eos_target), max_model_len=512, kv_cache_memory_bytes=256 << 20)
    yield llm
    del llm


@pytest.fixture(scope="session")
def dsbd_target_llm(target_path):
    """A DSBD beam engine on the default SmolLM2 target, shared by the session."""
    from vllm import LLM

    llm = LLM(**dsbd_engine_kwargs(str(target_path)))
    yield llm
    del llm


def dsbd_spec_engine_kwargs(model: str, draft: str, num_speculative_tokens: int, **overrides) -> dict:
    """A speculative DSBD engine (W <= 8), stats on."""
    from vllm_dsbd.demo import dsbd_engine_kwargs

    return {**dsbd_engine_kwargs(model, draft, num_speculative_tokens, 8), "disable_log_stats": False, **overrides}


@pytest.fixture(scope="session")
def dsbd_tiny_spec_kwargs(tiny_eos_target, tiny_pair) -> dict:
    """The engine arguments of ``dsbd_tiny_spec_llm``."""
    return dsbd_spec_engine_kwargs(str(tiny_eos_target), str(tiny_pair.draft), 3, max_model_len=512,
                                   kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="session")
def dsbd_tiny_spec_llm(dsbd_tiny_spec_kwargs):
    """DSBD with speculation on the EOS-prone tiny target, drafting with the tiny draft (γ <= 3)."""
    from vllm import LLM

    llm = LLM(**dsbd_tiny_spec_kwargs)
    yield llm
    del llm


@pytest.fixture(scope="session")
def dsbd_spec_target_llm(target_path):
    """DSBD with speculation on the default pair: SmolLM2 drafted by the shipped draft (γ <= 5)."""
    from vllm import LLM

    llm = LLM(**dsbd_spec_engine_kwargs(str(target_path), str(models.prepare().draft), 5))
    yield llm
    del llm


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the Ray tests, shut down at the end of the session.

    4 logical CPUs on the 2-core machine: a TP 2 engine's placement group holds
    2, and Ray Data's engine actors ask for 1 each. Every Ray worker process
    runs ``ray_shim.apply`` (tests/ray_shim.py) at start and finds this
    directory and ``examples/`` on its path.
    """
    import ray

    here = Path(__file__).parent
    examples = str(here.parent / "examples")
    path = os.pathsep.join(p for p in (str(here), examples, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, examples)  # this process imports the examples too
    ray.init(num_cpus=4, object_store_memory=256 << 20, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "ray_shim.apply", "env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()
    sys.path.remove(examples)
