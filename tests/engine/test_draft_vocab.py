"""``draft_vocab_size`` in a real engine: the draft's head computes only the kept token ids, and DSBD stays
lossless (T = 0 equals vLLM's built-in beam search). Exactness at T > 0 with a restricted draft is checked
on toy models (tests/unit/test_spec_iterations.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from beam_checks import PROMPTS, beam_search, start_spec_llm  # tests/engine/beam_checks.py

pytestmark = pytest.mark.engine

KEEP = 1000  # of the tiny models' 49,152 token ids (SmolLM2's tokenizer: its special tokens are ids 0-16)
PICKLE = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc with a function (the probe below)


@pytest.fixture
def reduced_llm(engine_pool, tiny_eos_target, tiny_pair):
    return engine_pool.get("reduced_llm", lambda: start_spec_llm(tiny_eos_target, tiny_pair.draft, PICKLE,
                                                                 knobs={"draft_vocab_size": KEEP}))


def _draft_logits(worker) -> dict:
    """Runs in the worker: the draft's logits on fixed hidden states, and the full head's for comparison."""
    model = worker.model_runner.drafter.model
    weight = model.lm_head.weight
    hidden = torch.randn((3, weight.shape[1]), generator=torch.Generator().manual_seed(0))
    logits = model.compute_logits(hidden)
    full = hidden @ weight[:logits.shape[-1]].T
    finite = torch.isfinite(logits).all(0)
    return {"finite_ids": finite.nonzero().flatten().tolist(), "vocab": logits.shape[-1],
            "support": worker.model_runner._dsbd_support.tolist(),
            "max_diff": float((logits[:, finite] - full[:, finite]).abs().max())}


def test_the_draft_head_computes_only_the_kept_ids(reduced_llm, monkeypatch):
    import cloudpickle

    monkeypatch.setenv(*next(iter(PICKLE.items())))
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test module
    probe = reduced_llm.collective_rpc(_draft_logits)[0]
    assert probe["vocab"] == 49152
    assert probe["finite_ids"] == list(range(KEEP))  # the special tokens are among the lowest ids here
    assert probe["support"] == probe["finite_ids"]  # T > 0 draws run over these columns (spec_step.draft_layer)
    assert probe["max_diff"] < 1e-4


@pytest.mark.parametrize("width", [2, 4])
def test_lossless_speculative_beam_search_with_a_reduced_draft_head(reduced_llm, tiny_eos_llm, width):
    want = beam_search(tiny_eos_llm, PROMPTS, width, 10)
    got = beam_search(reduced_llm, PROMPTS, width, 10)
    for w, g in zip(want, got):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx([s.cum_logprob for s in w.sequences], abs=1e-3)


def test_a_request_cannot_change_the_draft_vocabulary(reduced_llm):
    from vllm import SamplingParams

    params = SamplingParams(n=2, max_tokens=4, extra_args={"beam_width": 2, "draft_vocab_size": 500})
    with pytest.raises(ValueError, match=r"\['draft_vocab_size'\] are engine-wide"):
        reduced_llm.generate([PROMPTS[0]], params, use_tqdm=False)
