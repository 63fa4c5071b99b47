"""Deterministic mode (T = 0): speculative beam search equals vLLM-semantics beam search token for token."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_dsbd.algorithm import DecodeParams, beam_search, beam_search_step, dsbd_decode
from vllm_dsbd.algorithm.toy import MarkovLM, perturbed_draft, random_markov


def _eos_loving(draft: MarkovLM, eos: int) -> MarkovLM:
    """The draft with EOS pushed near the top in every context."""
    return MarkovLM(draft.table.index_add(1, torch.tensor([eos]), torch.full((draft.table.shape[0], 1), 3.0)),
                    draft.order)


def _random_config(rng: random.Random) -> tuple[MarkovLM, MarkovLM, DecodeParams, list[list[int]]]:
    vocab = rng.choice([5, 8])
    order = rng.choice([1, 2])
    target = random_markov(vocab, order=order, seed=rng.randrange(10**6))
    agreement = rng.choice([0.0, 0.5, 0.9, 1.0])
    draft = target if agreement == 1.0 else perturbed_draft(target, agreement, seed=rng.randrange(10**6))
    eos = rng.choice([None, vocab - 1])
    if eos is not None and rng.random() < 0.5:
        draft = _eos_loving(draft, eos)
    width = rng.choice([1, 2, 3, 4])
    params = DecodeParams(
        beam_width=width, num_speculative_tokens=rng.choice([0, 1, 2, 4]), temperature=0.0,
        max_tokens=rng.choice([1, 2, 3, 6, 9]), eos_token_id=eos, ignore_eos=rng.random() < 0.25,
        length_penalty=rng.choice([0.0, 0.5, 1.0, 1.7]), n=width,
    )
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in range(3)]
    return target, draft, params, prompts


@pytest.mark.parametrize("seed", range(4))
def test_speculative_beam_search_equals_beam_search(seed: int):
    """On random toy pairs, prompts and knobs, T = 0 DSBD returns beam search's hypotheses exactly."""
    rng = random.Random(seed)
    for _ in range(20):
        target, draft, params, prompts = _random_config(rng)
        expected = beam_search(target, prompts, params)
        got = dsbd_decode(target, draft, prompts, params).hypotheses
        for exp_hyps, got_hyps in zip(expected, got):
            assert [h.token_ids for h in got_hyps] == [h.token_ids for h in exp_hyps], params
            assert [h.cum_logprob for h in got_hyps] == pytest.approx([h.cum_logprob for h in exp_hyps], abs=1e-9)


def test_draft_equal_to_target_passes_every_layer():
    """draft == target: every drafted layer passes, so each iteration makes γ + 1 steps."""
    target = random_markov(8, order=2, seed=3)
    params = DecodeParams(beam_width=3, num_speculative_tokens=3, temperature=0.0, max_tokens=10, eos_token_id=None)
    result = dsbd_decode(target, target, [[1, 2], [5]], params)
    assert result.num_passed == [[3, 3, 1], [3, 3, 1]]  # 4 + 4 + 2 = 10 steps


def test_unrelated_draft_still_exact_and_rarely_passes():
    """A draft unrelated to the target costs speed, never correctness."""
    target = random_markov(8, order=1, seed=4)
    draft = perturbed_draft(target, 0.0, seed=5)
    params = DecodeParams(beam_width=4, num_speculative_tokens=4, temperature=0.0, max_tokens=12, eos_token_id=7, n=4)
    prompts = [[0], [3, 4], [6]]
    result = dsbd_decode(target, draft, prompts, params)
    assert [[h.token_ids for h in hs] for hs in result.hypotheses] == \
        [[h.token_ids for h in hs] for hs in beam_search(target, prompts, params)]


def test_max_tokens_one_is_a_single_target_step():
    """max_tokens = 1: no draft layer is used and the result is one beam-search step."""
    target = random_markov(6, order=1, seed=6)
    params = DecodeParams(beam_width=2, num_speculative_tokens=4, temperature=0.0, max_tokens=1, eos_token_id=None, n=2)
    result = dsbd_decode(target, perturbed_draft(target, 0.5), [[2]], params)
    assert result.num_passed == [[0]]
    top2 = torch.log_softmax(target([[2]])[0], -1).topk(2).indices.tolist()
    assert [h.token_ids for h in result.hypotheses[0]] == [(top2[0],), (top2[1],)]


def _table(rows: dict[int, list[float]], vocab: int) -> MarkovLM:
    table = torch.zeros(vocab, vocab)
    for ctx, logits in rows.items():
        table[ctx] = torch.tensor(logits)
    return MarkovLM(table, 1)


def test_beam_search_eos_in_top_2w_finishes_even_outside_top_w():
    """vLLM semantics: an EOS among a beam's top-2W proposals finishes although it is not in the top W."""
    eos = 3
    probs = {0: [0.05, 0.6, 0.05, 0.3], 1: [0.25, 0.25, 0.25, 0.25]}
    model = _table({ctx: torch.tensor(p).log().tolist() for ctx, p in probs.items()}, vocab=4)
    params = DecodeParams(beam_width=1, num_speculative_tokens=2, temperature=0.0, max_tokens=2, eos_token_id=eos,
                          length_penalty=0.0, n=1)
    # step 1 from [0]: proposals 1 (0.6) and EOS (0.3): EOS finishes, beam [0, 1] goes on
    # step 2 from [0, 1]: proposals 0 and 1 (ties: lower ids); beam [0, 1, 0] has cum log(0.6 * 0.25)
    # ranking by cum (length_penalty 0): EOS log 0.3 > log 0.15
    for hyps in (beam_search(model, [[0]], params)[0], dsbd_decode(model, model, [[0]], params).hypotheses[0]):
        assert [h.token_ids for h in hyps] == [(3,)]
        assert hyps[0].cum_logprob == pytest.approx(float(torch.tensor(0.3).log()), abs=1e-6)


def test_beam_search_step_hand_example():
    """Candidates: top-2W per beam (ties by token id), EOS set aside, stable sort by score across beams."""
    logprobs = torch.log(torch.tensor([[[0.4, 0.2, 0.2, 0.2, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]]]))
    step = beam_search_step(logprobs, torch.tensor([[0.0, 0.0]], dtype=torch.float64), torch.tensor([[True, True]]),
                            torch.tensor([3]), beam_width=2, eos_token_id=4, ignore_eos=torch.tensor([False]),
                            length_penalty=torch.tensor([1.0]))
    # beam 0 proposes 0 (0.4), 1, 2, 3 (0.2 ties, lowest ids first: 1, 2, 3 -> top-4 = 0,1,2,3)
    # beam 1 proposes EOS (0.6, finished), then 0, 1, 2 (0.1)
    assert step.parents.tolist() == [[0, 0]] and step.tokens.tolist() == [[0, 1]]
    finished = step.finished_valid[0].nonzero()[:, 0].tolist()
    assert [int(step.finished_parents[0, i]) for i in finished] == [1]
    assert step.finished_cum_logprobs[0, finished[0]].item() == pytest.approx(float(torch.log(torch.tensor(0.6))))
