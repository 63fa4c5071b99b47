"""bf16 engines and the draft's own dtype (``draft_dtype``), on the tiny pair.

A bf16 target rounds its logits to bf16, and a verify forward computes a node's
logits with other shapes than a beam step, so T 0 DSBD in bf16 is compared with
in-engine beam search in bf16 on the same engine (the same rounding everywhere
but there). On the tiny pair they are equal token for token (asserted; the
measurement on the real pairs is ``benchmarks/lossless.py``, docs/dtype.md).
A draft in another dtype than the target changes only the draft's proposals, so
a float32 target with a bf16 draft stays token for token the float32 search.
The exactness tests elsewhere stay in float32.
"""

from __future__ import annotations

import pytest
from beam_checks import start_spec_llm  # tests/engine/beam_checks.py

pytestmark = pytest.mark.engine

# Prompts the tiny models have not seen in the other tests (random weights: any text works).
PROMPTS = [f"{subject} {verb}" for subject in ("The river", "A small robot", "My neighbour's dog", "def parse(x):")
           for verb in ("is", "went", "said that")]


@pytest.fixture
def bf16_spec_llm(engine_pool, tiny_eos_target, tiny_pair):
    """A speculative DSBD engine (γ <= 3, W <= 8) whose target and draft run in bf16."""
    return engine_pool.get("bf16_spec_llm", lambda: start_spec_llm(tiny_eos_target, tiny_pair.draft, {},
                                                                   dtype="bfloat16"))


@pytest.fixture
def bf16_draft_llm(engine_pool, tiny_eos_target, tiny_pair):
    """A float32 target drafting with its draft in bf16 (``draft_dtype``)."""
    return engine_pool.get("bf16_draft_llm", lambda: start_spec_llm(tiny_eos_target, tiny_pair.draft, {},
                                                                    knobs={"draft_dtype": "bfloat16"}))


def _t0_beams(llm, width, gamma, max_tokens=16):
    from vllm import SamplingParams

    params = SamplingParams(n=width, temperature=0.0, max_tokens=max_tokens,
                            extra_args={"beam_width": width, "num_speculative_tokens": gamma})
    return [[(list(c.token_ids), c.cumulative_logprob) for c in r.outputs]
            for r in llm.generate(PROMPTS, params, use_tqdm=False)]


def _assert_same_search(want, got):
    for w, g in zip(want, got, strict=True):
        assert [tokens for tokens, _ in g] == [tokens for tokens, _ in w]
        assert [score for _, score in g] == pytest.approx([score for _, score in w], abs=1e-3)


def test_a_bf16_engine_runs_target_and_draft_in_bf16(bf16_spec_llm):
    (dtypes,) = bf16_spec_llm.collective_rpc("dsbd_model_dtypes")
    assert dtypes == {"target": {"weights": "torch.bfloat16", "kv_cache": "torch.bfloat16"},
                      "draft": {"weights": "torch.bfloat16", "kv_cache": "torch.bfloat16"}}


@pytest.mark.parametrize("width, gamma", [(2, 1), (4, 3), (8, 2)])
def test_bf16_dsbd_beam_search_equals_bf16_in_engine_beam_search(bf16_spec_llm, width, gamma):
    want = _t0_beams(bf16_spec_llm, width, 0)
    got = _t0_beams(bf16_spec_llm, width, gamma)
    _assert_same_search(want, got)
    assert any(len(tokens) > 1 for beams in got for tokens, _ in beams)  # a search, not EOS at once


def test_a_draft_in_bf16_beside_a_float32_target(bf16_draft_llm, dsbd_tiny_spec_llm):
    (dtypes,) = bf16_draft_llm.collective_rpc("dsbd_model_dtypes")
    assert dtypes == {"target": {"weights": "torch.float32", "kv_cache": "torch.float32"},
                      "draft": {"weights": "torch.bfloat16", "kv_cache": "torch.bfloat16"}}
    want = _t0_beams(dsbd_tiny_spec_llm, 4, 0)  # the float32 engine's in-engine beam search
    _assert_same_search(want, _t0_beams(bf16_draft_llm, 4, 3))


def test_a_request_cannot_change_the_draft_dtype(bf16_draft_llm):
    from vllm import SamplingParams

    params = SamplingParams(n=2, max_tokens=4, extra_args={"beam_width": 2, "draft_dtype": "float32"})
    with pytest.raises(ValueError, match=r"\['draft_dtype'\] are engine-wide"):
        bf16_draft_llm.generate([PROMPTS[0]], params, use_tqdm=False)
