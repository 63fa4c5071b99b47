"""``logprobs = k`` on beam requests: every returned hypothesis carries, at each position, the chosen
token's raw log-prob and rank and the top-k, equal to what a plain request reports for the same prefix,
and a cumulative log-prob that sums the chosen tokens'."""

from __future__ import annotations

import pytest

from beam_checks import PROMPTS  # tests/engine/beam_checks.py

pytestmark = pytest.mark.engine
K = 3


def _plain_logprobs(llm, prompt_ids: list[int], tokens: list[int]):
    """vLLM's logprobs dict (token id -> Logprob) for each position of ``tokens`` after ``prompt_ids``:
    one plain one-token request per prefix, the token forced by ``allowed_token_ids``."""
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": prompt_ids + tokens[:i]} for i in range(len(tokens))]
    params = [SamplingParams(temperature=0.0, max_tokens=1, logprobs=K, allowed_token_ids=[t]) for t in tokens]
    return [out.outputs[0].logprobs[0] for out in llm.generate(requests, params, use_tqdm=False)]


def _check_against_plain(llm, plain_llm, params):
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    checked = 0
    for out in outs:
        for hyp in out.outputs:
            tokens = list(hyp.token_ids)
            assert len(hyp.logprobs) == len(tokens)
            want = _plain_logprobs(plain_llm, list(out.prompt_token_ids), tokens)
            for token, got, ref in zip(tokens, hyp.logprobs, want):
                top = {t: lp for t, lp in ref.items() if lp.rank <= K}  # vLLM's top-k (the forced token aside)
                assert {t for t, lp in got.items() if lp.rank <= K} == set(top)
                for t, lp in top.items():
                    assert got[t].logprob == pytest.approx(lp.logprob, abs=1e-4)
                    assert got[t].rank == lp.rank
                assert got[token].logprob == pytest.approx(ref[token].logprob, abs=1e-4)  # the chosen token
                assert got[token].rank == ref[token].rank
                checked += 1
            # vLLM sums the chosen tokens' log-probs (benchmarks/lossless.py compares beams by it)
            assert hyp.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(tokens, hyp.logprobs)),
                                                           abs=1e-4)
    assert checked >= 2 * params.n * 3


def test_beam_search_top_k_logprobs_equal_plain_requests(dsbd_tiny_llm):
    from vllm import SamplingParams

    params = SamplingParams(n=3, temperature=0.0, max_tokens=6, logprobs=K, extra_args={"beam_width": 4})
    _check_against_plain(dsbd_tiny_llm, dsbd_tiny_llm, params)


def test_beam_sampling_top_k_logprobs_are_raw_not_tempered(dsbd_tiny_llm):
    from vllm import SamplingParams

    params = SamplingParams(n=2, temperature=0.6, max_tokens=6, seed=4, logprobs=K, extra_args={"beam_width": 3})
    _check_against_plain(dsbd_tiny_llm, dsbd_tiny_llm, params)


def test_dsbd_top_k_logprobs_equal_plain_requests(dsbd_tiny_spec_llm, dsbd_tiny_llm):
    from vllm import SamplingParams

    for temperature in (0.0, 1.0, 0.6):  # 0.6: the raw log-probs come from tempered verification's logits
        params = SamplingParams(n=2, temperature=temperature, max_tokens=7, seed=1, logprobs=K,
                                extra_args={"beam_width": 4, "num_speculative_tokens": 2})
        _check_against_plain(dsbd_tiny_spec_llm, dsbd_tiny_llm, params)
