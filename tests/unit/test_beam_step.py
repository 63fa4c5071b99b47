"""The runner's beam step: decisions from logits, against the exact references."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from vllm_dsbd.algorithm.reference import DecodeParams, beam_search
from vllm_dsbd.algorithm.toy import MarkovLM, random_markov
from vllm_dsbd.engine.beam_group import BeamGroup, BeamParams
from vllm_dsbd.engine.group_effects import Extend, Fork
from vllm_dsbd.engine.beam_step import decide, row_tokens
from vllm_dsbd.engine.protocol import BeamChoice, GroupDecision, GroupStep, TokenLogprob

from exact_dist import chi2_pvalue, exact_beam_sampling


def eos_prone_model(vocab: int, seed: int, eos: int = 0, bias: float = 1.5) -> MarkovLM:
    model = random_markov(vocab, order=2, seed=seed)
    table = model.table.clone()
    table[:, eos] += bias
    return MarkovLM(table, model.order)


def step(**kw) -> GroupStep:
    base = dict(group_id="g", req_ids=("r0",), scores=(0.0,), seq_len=3, beam_width=2, temperature=0.0,
                top_k=0, top_p=1.0, length_penalty=1.0, ignore_eos=False, eos_token_id=None, num_logprobs=-1,
                seed=0, step=0)
    return GroupStep(**{**base, **kw})


def test_row_tokens_first_child_continues():
    choices = [BeamChoice(p, t, 0.0, TokenLogprob(0.0, 1)) for p, t in [(1, 7), (1, 8), (0, 9)]]
    assert row_tokens(GroupDecision("g", choices, []), 3) == [9, 7, None]


def test_search_step_reports_token_logprob_rank_and_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    d = decide(logits, {"r0": 0}, [step(num_logprobs=2, beam_width=2)])["g"]
    lp = torch.log_softmax(logits[0], -1)
    assert [(c.parent, c.token) for c in d.beams] == [(0, 1), (0, 3)]
    assert d.beams[1].logprob.logprob == pytest.approx(lp[3].item())
    assert d.beams[1].logprob.rank == 2
    assert d.beams[1].logprob.top_ids == (1, 3)
    assert d.beams[0].score == pytest.approx(lp[1].item())


def test_search_step_turns_eos_candidates_into_finished_hypotheses():
    logits = torch.tensor([[0.0, 3.0, 2.5, 2.0]])
    d = decide(logits, {"r0": 0}, [step(eos_token_id=2, beam_width=2)])["g"]
    assert [c.token for c in d.beams] == [1, 3]
    assert [(c.parent, c.token) for c in d.finished] == [(0, 2)]


def _decode_with_engine_steps(model, prompt, params: BeamParams, rows_per_call=None, stops=None):
    """Drive BeamGroup + decide() like the engine does, with logits from a toy model."""
    group = BeamGroup("g", ["u"], len(prompt), params, root_request=_Req("b0"))
    seqs = {"b0": list(prompt)}
    counter = iter(range(1, 10_000))
    while not group.done:
        plan = group.plan()
        logits = model([seqs[r] for r in plan.req_ids])
        decision = decide(logits, {r: i for i, r in enumerate(plan.req_ids)}, [plan], stops)["g"]
        effects = group.apply(decision)
        for op in effects.ops:
            if isinstance(op, Fork):
                rid = f"b{next(counter)}"
                op.child.request = _Req(rid)
                seqs[rid] = seqs[op.parent.request_id] + [op.token]
            elif isinstance(op, Extend):
                seqs[op.request.request_id] += op.tokens
    return group.results()


class _Req:
    def __init__(self, rid):
        self.request_id = rid


@pytest.mark.parametrize("width, length_penalty, seed", [(1, 1.0, 0), (2, 0.5, 1), (3, 1.0, 2), (4, 2.0, 3)])
def test_engine_style_beam_search_equals_vllm_semantics_reference(width, length_penalty, seed):
    """BeamGroup + decide at T = 0, with EOS, equals the port of vLLM's beam search token for token."""
    model = eos_prone_model(vocab=7, seed=seed)
    prompt = [1, 3]
    ref = beam_search(model, [prompt], DecodeParams(beam_width=width, temperature=0.0, max_tokens=6,
                                                    length_penalty=length_penalty, eos_token_id=0,
                                                    num_speculative_tokens=0))[0]
    ours = _decode_with_engine_steps(model, prompt, BeamParams(
        beam_width=width, n=width, temperature=0.0, top_k=0, top_p=1.0, length_penalty=length_penalty,
        max_tokens=6, ignore_eos=False, eos_token_id=0, num_logprobs=-1, seed=0))
    assert [h.tokens for h in ours] == [h.token_ids for h in ref]
    assert [h.cum_score for h in ours] == pytest.approx([h.cum_logprob for h in ref], abs=1e-9)


def test_engine_style_beam_sampling_is_distributed_as_exact_beam_sampling():
    """BeamGroup + decide at T > 0 (top-k on the joint) against exact enumeration; 4,000 seeds."""
    model = random_markov(4, order=2, seed=5)
    prompt, width, max_tokens = [1], 2, 3
    expected = exact_beam_sampling(model, tuple(prompt), width, max_tokens, temperature=0.8, top_k=5)
    samples = []
    for seed in range(4000):
        hyps = _decode_with_engine_steps(model, prompt, BeamParams(
            beam_width=width, n=width, temperature=0.8, top_k=5, top_p=1.0, length_penalty=1.0,
            max_tokens=max_tokens, ignore_eos=True, eos_token_id=None, num_logprobs=-1, seed=seed))
        samples.append(tuple(sorted(h.tokens for h in hyps)))
    assert chi2_pvalue(samples, expected) > 1e-3
    # Power: the same samples against beam sampling with uniform parent weights are rejected.
    wrong = exact_beam_sampling(model, tuple(prompt), width, max_tokens, temperature=0.8, top_k=5,
                                uniform_parents=True)
    assert chi2_pvalue(samples, wrong) < 1e-3
    assert len(Counter(samples)) > 10


def _mixed_groups(temperature: float) -> list[GroupStep]:
    """Five groups of one bucket (W 3): 1 to 3 live beams (so the shared table pads), every kind of log-prob
    report, top-k / top-p, ignore_eos, stop strings on two of them, each its own seed and step."""
    kinds = [dict(num_logprobs=-1), dict(num_logprobs=0, top_k=4), dict(num_logprobs=2, ignore_eos=True),
             dict(num_logprobs=-1, top_p=0.8, stop=("ab",)), dict(num_logprobs=1, stop=("ca",))]
    groups = []
    for k, (num_beams, kind) in enumerate(zip([1, 3, 2, 3, 2], kinds)):
        tails = tuple((b % 3, (b + k) % 4) for b in range(num_beams)) if "stop" in kind else ()
        groups.append(step(group_id=f"g{k}", req_ids=tuple(f"g{k}b{b}" for b in range(num_beams)),
                           scores=tuple(-0.3 * (b + 1) - 0.1 * k for b in range(num_beams)), beam_width=3,
                           temperature=temperature, eos_token_id=0, seq_len=4 + k, length_penalty=0.5 * (k % 3 + 1),
                           seed=11 + k, step=k, tails=tails, **kind))
    return groups


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_a_steps_groups_decided_together_equal_each_decided_alone(temperature):
    """decide() takes a step's groups in one batched pass (a shared [G, B, V] table, padded where a group has
    fewer live beams): each group's decision is the one it gets alone, log-probs, ranks, top-k, finished
    hypotheses and stop strings included, with outcomes that differ between groups (so a shared draw or a
    padded slot read as a beam would show)."""
    from vllm_dsbd.engine.stops import StopCheckers

    stops = StopCheckers(lambda: lambda tokens: "".join("abcx"[t % 4] for t in tokens))
    groups = _mixed_groups(temperature)
    row_of = {r: i for i, r in enumerate(r for g in groups for r in g.req_ids)}
    logits = 2 * torch.randn(len(row_of), 12, generator=torch.Generator().manual_seed(3))
    logits[:, 0] += 2.5  # EOS among every beam's top candidates: finished hypotheses at every width
    together = decide(logits, row_of, groups, stops)
    alone = {g.group_id: decide(logits, row_of, [g], stops)[g.group_id] for g in groups}
    assert together == alone
    assert sum(bool(d.finished) for d in alone.values()) >= 3
    assert len({tuple((c.parent, c.token) for c in d.beams) for d in alone.values()}) > 1
    assert any(c.logprob.top_ids for d in alone.values() for c in d.beams)
