"""The algorithm's exact references against vLLM's own built-in LLM.beam_search on the tiny target.

`reference.beam_search` (a port of vLLM 0.32.0's semantics) and reference
DSBD at T = 0 (lossless speculative beam search, drafting with the tiny draft)
run over Hugging Face float32 logits of the same checkpoint; vLLM runs its
front-end beam-search loop on the `tiny_llm` engine. The random tiny model
rarely emits EOS, so beams here have equal lengths and the length penalty
does not change rankings; EOS and length-penalty semantics are covered
against the port in tests/unit.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from vllm_dsbd.algorithm.reference import DecodeParams, beam_search, dsbd_decode

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]


def _hf_logits_fn(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def logits_fn(sequences):
        out = torch.empty(len(sequences), model.config.vocab_size)
        by_len = defaultdict(list)
        for i, seq in enumerate(sequences):
            by_len[len(seq)].append(i)
        for rows in by_len.values():
            ids = torch.tensor([sequences[i] for i in rows])
            out[rows] = model(ids).logits[:, -1].float()
        return out

    return logits_fn


@pytest.fixture(scope="module")
def hf_fns(tiny_pair):
    return _hf_logits_fn(tiny_pair.target), _hf_logits_fn(tiny_pair.draft)


@pytest.fixture(scope="module")
def prompt_ids(tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair.target)
    return [tok(p).input_ids for p in PROMPTS]


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (2, 0.5), (4, 1.0), (4, 2.0)])
def test_reference_beam_search_equals_vllm_builtin(tiny_llm, hf_fns, prompt_ids, width, length_penalty):
    from vllm.sampling_params import BeamSearchParams

    max_tokens = 6
    vllm_out = tiny_llm.beam_search(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty),
    )
    params = DecodeParams(
        beam_width=width, temperature=0.0, length_penalty=length_penalty, max_tokens=max_tokens,
        eos_token_id=2, num_speculative_tokens=0,
    )
    ours = beam_search(hf_fns[0], prompt_ids, params)
    spec = dsbd_decode(hf_fns[0], hf_fns[1], prompt_ids, DecodeParams(**{**params.__dict__, "num_speculative_tokens": 3}))
    for ids, v, r, s in zip(prompt_ids, vllm_out, ours, spec.hypotheses):
        vllm_seqs = [list(b.tokens[len(ids):]) for b in v.sequences]
        assert [list(h.token_ids) for h in r] == vllm_seqs
        assert [list(h.token_ids) for h in s[:width]] == vllm_seqs
        assert [h.cum_logprob for h in r] == pytest.approx([b.cum_logprob for b in v.sequences], abs=1e-3)
