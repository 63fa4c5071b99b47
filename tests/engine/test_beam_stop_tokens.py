"""``stop_token_ids`` on beam requests in the engine: hypotheses finish at a stop token exactly as at EOS;
T 0 equals the reference beam search extended with the same rule, speculative = non-speculative."""

from __future__ import annotations

from collections import Counter

import pytest

from beam_checks import EOS, PROMPTS, _hf_logits_fn  # tests/engine/beam_checks.py
from vllm_dsbd.algorithm.reference import DecodeParams, beam_search

pytestmark = pytest.mark.engine
WIDTH, MAX_TOKENS = 4, 8


def _frequent_inner_token(llm) -> int:
    """A token that beam search without stop tokens produces inside its hypotheses (not EOS)."""
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(n=WIDTH, temperature=0.0, max_tokens=MAX_TOKENS,
                                                extra_args={"beam_width": WIDTH}), use_tqdm=False)
    counts = Counter(t for o in outs for c in o.outputs for t in c.token_ids[:-1] if t != EOS)
    return counts.most_common(1)[0][0]


@pytest.fixture
def stop(dsbd_tiny_llm) -> int:
    return _frequent_inner_token(dsbd_tiny_llm)


def _search(llm, stop: int, **knobs):
    from vllm import SamplingParams

    params = SamplingParams(n=WIDTH, temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                            extra_args={"beam_width": WIDTH, **knobs})
    return llm.generate(PROMPTS, params, use_tqdm=False)


def test_stop_token_beam_search_equals_the_extended_reference(dsbd_tiny_llm, tiny_eos_target, stop):
    outs = _search(dsbd_tiny_llm, stop)
    fn = _hf_logits_fn(str(tiny_eos_target))
    params = DecodeParams(beam_width=WIDTH, temperature=0.0, max_tokens=MAX_TOKENS, eos_token_id=EOS,
                          stop_token_ids=(stop,), num_speculative_tokens=0)
    ended = 0
    for out in outs:
        ref = beam_search(fn, [list(out.prompt_token_ids)], params)[0]
        assert [tuple(c.token_ids) for c in out.outputs] == [h.token_ids for h in ref]
        for c in out.outputs:
            assert stop not in c.token_ids[:-1]
            if c.token_ids[-1] == stop:
                ended += 1
                assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert ended > 0  # some hypotheses did end at the stop token


def test_speculative_stop_token_beam_search_equals_non_speculative(dsbd_tiny_spec_llm, dsbd_tiny_llm, stop):
    want = _search(dsbd_tiny_llm, stop)
    for gamma in (1, 3):
        got = _search(dsbd_tiny_spec_llm, stop, num_speculative_tokens=gamma)
        assert [[tuple(c.token_ids) for c in o.outputs] for o in got] == \
            [[tuple(c.token_ids) for c in o.outputs] for o in want]


def test_stop_tokens_end_sampled_hypotheses_too_and_ignore_eos_does_not_cancel_them(dsbd_tiny_spec_llm, stop):
    from vllm import SamplingParams

    # top_k 2 keeps the (random-weight) tiny model's draws among tokens beam search also writes
    for gamma in (0, 2):
        params = SamplingParams(n=WIDTH, temperature=1.0, top_k=2, max_tokens=MAX_TOKENS, seed=2, ignore_eos=True,
                                stop_token_ids=[stop], extra_args={"beam_width": WIDTH,
                                                                   "num_speculative_tokens": gamma})
        outs = dsbd_tiny_spec_llm.generate(PROMPTS * 4, params, use_tqdm=False)
        hyps = [c for o in outs for c in o.outputs]
        assert all(stop not in c.token_ids[:-1] for c in hyps)
        assert any(c.token_ids[-1] == stop and c.finish_reason == "stop" for c in hyps)
        assert all(len(c.token_ids) == MAX_TOKENS for c in hyps if c.token_ids[-1] != stop)


@pytest.fixture
def stop_string(dsbd_tiny_llm) -> str:
    """A two-character string that beam search without stops writes inside its hypotheses."""
    from vllm import SamplingParams

    outs = dsbd_tiny_llm.generate(PROMPTS, SamplingParams(n=WIDTH, temperature=0.0, max_tokens=MAX_TOKENS,
                                                          extra_args={"beam_width": WIDTH}), use_tqdm=False)
    counts = Counter(c.text[i:i + 2] for o in outs for c in o.outputs for i in range(1, len(c.text) - 2)
                     if c.text[i:i + 2].strip() == c.text[i:i + 2])
    return counts.most_common(1)[0][0]


def _search_stop_string(llm, stop: str, include: bool = False, **knobs):
    from vllm import SamplingParams

    params = SamplingParams(n=WIDTH, temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop],
                            include_stop_str_in_output=include, extra_args={"beam_width": WIDTH, **knobs})
    return llm.generate(PROMPTS, params, use_tqdm=False)


def test_stop_string_beam_search_equals_the_extended_reference(dsbd_tiny_llm, tiny_eos_target, stop_string):
    """T 0: hypotheses end where their generated text first holds the stop string (the reference checks
    whole texts); the text is cut before it (or after it with include_stop_str_in_output); "stop"."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_eos_target))

    def completes(generated, token):
        return stop_string in tokenizer.decode([*generated, token], skip_special_tokens=True)

    params = DecodeParams(beam_width=WIDTH, temperature=0.0, max_tokens=MAX_TOKENS, eos_token_id=EOS,
                          stop_fn=completes, num_speculative_tokens=0)
    fn = _hf_logits_fn(str(tiny_eos_target))
    cut = _search_stop_string(dsbd_tiny_llm, stop_string)
    kept = _search_stop_string(dsbd_tiny_llm, stop_string, include=True)
    ended = 0
    for out, out_kept in zip(cut, kept):
        ref = beam_search(fn, [list(out.prompt_token_ids)], params)[0]
        assert [tuple(c.token_ids) for c in out.outputs] == [h.token_ids for h in ref]
        for c, k in zip(out.outputs, out_kept.outputs):
            full = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            if stop_string in full:
                ended += 1
                assert (c.finish_reason, c.stop_reason) == ("stop", stop_string)
                assert c.text == full[:full.index(stop_string)]
                assert k.text == full[:full.index(stop_string) + len(stop_string)]
                assert stop_string not in tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
    assert ended > 0


def test_speculative_stop_string_beam_search_equals_non_speculative(dsbd_tiny_spec_llm, dsbd_tiny_llm,
                                                                    stop_string):
    want = _search_stop_string(dsbd_tiny_llm, stop_string)
    for gamma in (1, 3):
        got = _search_stop_string(dsbd_tiny_spec_llm, stop_string, num_speculative_tokens=gamma)
        assert [[(tuple(c.token_ids), c.text) for c in o.outputs] for o in got] == \
            [[(tuple(c.token_ids), c.text) for c in o.outputs] for o in want]
