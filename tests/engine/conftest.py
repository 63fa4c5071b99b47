"""Engines shared by the engine tests of more than one module (pooled: tests/engine_pool.py)."""

from __future__ import annotations

import pytest
from beam_checks import start_permutation_llm, start_spec_llm  # tests/engine/beam_checks.py

from benchmarks.fuzz import PRESSURE_KV_BYTES


@pytest.fixture
def permutation_llm(engine_pool, tiny_pair, tmp_path_factory):
    """A DSBD engine on a bigram target (next token = a permutation of the current one) with a head that
    predicts it from the feature of the position before (as EAGLE-3 lays out its inputs), drafting in draft
    steps (``draft_in_step`` false)."""
    return engine_pool.get("permutation_llm", lambda: start_permutation_llm(
        tiny_pair.target, tmp_path_factory.mktemp("permutation"), knobs={"draft_in_step": False}))


@pytest.fixture
def permutation_in_step_llm(engine_pool, tiny_pair, tmp_path_factory):
    """As ``permutation_llm``, with ``draft_in_step``."""
    return engine_pool.get("permutation_in_step_llm", lambda: start_permutation_llm(
        tiny_pair.target, tmp_path_factory.mktemp("permutation-in-step"), knobs={"draft_in_step": True}))


@pytest.fixture(scope="session")
def heads(tmp_path_factory, tiny_eos_target):
    """Random heads for the EOS-prone tiny target, one per checkpoint layout (a 1,024-token draft vocabulary)."""
    from eagle3_heads import LAYOUTS, write_tiny_head  # tests/eagle3_heads.py

    root = tmp_path_factory.mktemp("eagle3-heads")
    return {layout: write_tiny_head(tiny_eos_target, root / layout, layout) for layout in LAYOUTS}


@pytest.fixture
def in_step_llm(engine_pool, tiny_eos_target, heads):
    """A head-drafted DSBD engine with ``draft_in_step``: the next forest is drawn inside each verify step."""
    return engine_pool.get("in_step_llm", lambda: start_spec_llm(tiny_eos_target, heads["speculators"], {},
                                                                 knobs={"draft_in_step": True}))


@pytest.fixture
def inproc_in_step_llm(engine_pool, tiny_eos_target, heads):
    """As ``in_step_llm``, its engine core in this process, so a test can reach its scheduler and runner."""
    return engine_pool.get("inproc_in_step_llm", lambda: start_spec_llm(
        tiny_eos_target, heads["speculators"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, knobs={"draft_in_step": True}))


TIGHT_KV = 60 * 32 * 768
"""About 60 KV blocks of 32 tokens (768 B a token for the tiny target and its draft together): a few beam
groups at once, which growing plain requests beside them make vLLM preempt."""


@pytest.fixture
def tight_spec_llm(engine_pool, dsbd_tiny_spec_kwargs):
    """``dsbd_tiny_spec_llm`` (the tiny draft model, draft steps) with a KV cache a third of the batch fills."""
    from vllm import LLM

    return engine_pool.get("tight_spec_llm", lambda: LLM(**{**dsbd_tiny_spec_kwargs, "kv_cache_memory_bytes": TIGHT_KV}))


@pytest.fixture
def pressure_spec_llm(engine_pool, dsbd_tiny_spec_kwargs):
    """``dsbd_tiny_spec_llm`` (the tiny draft model, draft steps) with the fuzzing's KV cache of 36 blocks: three
    growing plain requests beside a wide group fill it."""
    from vllm import LLM

    return engine_pool.get("pressure_spec_llm", lambda: LLM(**{**dsbd_tiny_spec_kwargs,
                                                                "kv_cache_memory_bytes": PRESSURE_KV_BYTES}))


@pytest.fixture
def tight_in_step_llm(engine_pool, tiny_eos_target, heads):
    """``in_step_llm`` (a random head drafting inside the verify step) with a tight KV cache."""
    return engine_pool.get("tight_in_step_llm", lambda: start_spec_llm(
        tiny_eos_target, heads["speculators"], {}, knobs={"draft_in_step": True}, kv_cache_memory_bytes=TIGHT_KV))


@pytest.fixture
def self_draft_llm(engine_pool, tiny_eos_target):
    """The draft is the target itself; the engine core runs in this process (its scheduler is inspected, and
    planted bugs reach its runner)."""
    return engine_pool.get("self_draft_llm", lambda: start_spec_llm(
        tiny_eos_target, tiny_eos_target, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
