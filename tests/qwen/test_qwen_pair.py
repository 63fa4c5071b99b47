"""The Qwen2.5-Coder pair in vLLM: both models load and write code, speculation is exact (slow: `make test-qwen`).

Needs the prepared pair (`vllm-dsbd models prepare --pair qwen2.5-coder`; `make test-qwen` does it).
Starting an engine on the 1.5B target takes about a minute on 2 cores and holds its 6 GB of float32
weights, so each engine starts once per module, in a fixture that runs everything the tests need
from it and shuts it down before the next one starts (one engine at a time fits in memory).

References, as in tests/engine/test_dsbd_engine.py: vLLM's own greedy decoding and vLLM's own
built-in ``LLM.beam_search`` (its front-end loop) on a plain engine on the target.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from beam_checks import beam_search, engine_metric  # noqa: E402  (tests/engine/beam_checks.py)

from vllm_dsbd import models, pairs  # noqa: E402

pytestmark = pytest.mark.qwen

PAIR = "qwen2.5-coder"
CODE_TASK = "Write a Python function `is_prime(n)` that returns True when n is a prime number."
TASKS = [  # the exactness checks: 2 short chat prompts
    "Write a Python one-liner that reverses a string s.",
    "What does the SQL keyword DISTINCT do?",
]
WIDTH, MAX_TOKENS, CODE_TOKENS = 4, 10, 64


@pytest.fixture(scope="module")
def pair() -> models.PreparedModels:
    return pairs.pair_paths(PAIR)  # a clear error naming the prepare command if not prepared


@contextmanager
def _engine(kwargs: dict):
    from vllm import LLM

    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def _chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def _greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams

    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)


@pytest.fixture(scope="module")
def target_run(pair):
    """A plain engine on the 1.5B target: the chat prompts, greedy outputs, vLLM's built-in beam search."""
    from vllm_dsbd.demo import engine_kwargs

    with _engine(engine_kwargs(str(pair.target))) as llm:
        tok = llm.get_tokenizer()
        prompts = [_chat(tok, t) for t in TASKS]
        return SimpleNamespace(
            chat_template=tok.chat_template,
            code_prompt=_chat(tok, CODE_TASK),
            code=_greedy(llm, [_chat(tok, CODE_TASK)], CODE_TOKENS)[0].outputs[0].text,
            prompts=prompts,
            greedy=[list(o.outputs[0].token_ids) for o in _greedy(llm, prompts, MAX_TOKENS)],
            beams=beam_search(llm, prompts, WIDTH, MAX_TOKENS),
        )


@pytest.fixture(scope="module")
def draft_run(pair, target_run):
    """A plain engine on the 0.5B draft: greedy on the coding prompt."""
    from vllm_dsbd.demo import engine_kwargs

    with _engine(engine_kwargs(str(pair.draft))) as llm:
        return SimpleNamespace(code=_greedy(llm, [target_run.code_prompt], CODE_TOKENS)[0].outputs[0].text)


@pytest.fixture(scope="module")
def draft_model_run(pair, target_run):
    """vLLM's own speculative decoding (method draft_model, γ 3) on the pair: greedy on the chat prompts."""
    from vllm_dsbd.demo import engine_kwargs

    kwargs = {**engine_kwargs(str(pair.target)), "disable_log_stats": False,
              "speculative_config": {"method": "draft_model", "model": str(pair.draft), "num_speculative_tokens": 3}}
    with _engine(kwargs) as llm:
        greedy = [list(o.outputs[0].token_ids) for o in _greedy(llm, target_run.prompts, MAX_TOKENS)]
        return SimpleNamespace(greedy=greedy, accepted=engine_metric(llm, "vllm:spec_decode_num_accepted_tokens"))


@pytest.fixture(scope="module")
def dsbd_run(pair, target_run):
    """DSBD drafting with the 0.5B (γ 1, W 4) on the 1.5B: ``llm.beam_search`` (in-engine) on the chat prompts."""
    from vllm_dsbd.demo import dsbd_engine_kwargs

    kwargs = {**dsbd_engine_kwargs(str(pair.target), str(pair.draft), num_speculative_tokens=1,
                                   max_beam_width=WIDTH), "disable_log_stats": False}
    with _engine(kwargs) as llm:
        beams = beam_search(llm, target_run.prompts, WIDTH, MAX_TOKENS)
        return SimpleNamespace(beams=beams, accepted=engine_metric(llm, "vllm:spec_decode_num_accepted_tokens"))


def test_the_prepared_pair_is_qwen2_coder_1_5b_and_0_5b_with_one_tokenizer(pair):
    from transformers import AutoConfig, AutoTokenizer

    target, draft = AutoConfig.from_pretrained(pair.target), AutoConfig.from_pretrained(pair.draft)
    assert target.model_type == draft.model_type == "qwen2"
    assert (target.num_hidden_layers, target.hidden_size) == (28, 1536)
    assert (draft.num_hidden_layers, draft.hidden_size) == (24, 896)
    assert target.vocab_size == draft.vocab_size == 151936
    assert not hasattr(target, "quantization_config") and not hasattr(draft, "quantization_config")
    assert AutoTokenizer.from_pretrained(pair.target).get_vocab() == AutoTokenizer.from_pretrained(pair.draft).get_vocab()
    assert models.is_complete(pair.target) and models.is_complete(pair.draft)


def test_vllm_loads_the_target_with_qwens_chat_template(target_run):
    assert "<|im_start|>" in target_run.chat_template
    assert target_run.prompts[0].rstrip().endswith("<|im_start|>assistant")
    assert "<|im_start|>user\n" + TASKS[0] + "<|im_end|>" in target_run.prompts[0]


def test_target_greedy_writes_code(target_run):
    assert "def is_prime(n" in target_run.code, target_run.code


def test_vllm_loads_the_draft_and_it_writes_code(draft_run):
    assert "def is_prime(n" in draft_run.code, draft_run.code


def test_vllm_draft_model_speculation_equals_target_greedy(draft_model_run, target_run):
    assert draft_model_run.greedy == target_run.greedy
    assert draft_model_run.accepted > 0, "the draft never agreed with the target"


def test_dsbd_beam_search_equals_vllm_builtin_beam_search(dsbd_run, target_run):
    """T = 0, W 4, γ 1: DSBD's in-engine beam search is vLLM's built-in beam search token for token."""
    for want, got in zip(target_run.beams, dsbd_run.beams, strict=True):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        assert [s.cum_logprob for s in got.sequences] == pytest.approx(
            [s.cum_logprob for s in want.sequences], abs=1e-3)
    assert dsbd_run.accepted > 0, "no draft node was ever accepted"
