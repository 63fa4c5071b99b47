"""The runner's side of one beam step: next beams of each group from the target logits.

Pure torch plus ``vllm_dsbd.algorithm`` (no vLLM), so it is unit-tested
without an engine. For each group (a :class:`~vllm_dsbd.engine.protocol.GroupStep`):

- ``temperature == 0``: vLLM 0.32.0's beam-search step
  (:func:`vllm_dsbd.algorithm.beam_search_step`) on the raw log-probs; EOS
  candidates among each beam's top ``2W`` become finished hypotheses (so do
  stop-token candidates, ``GroupDecoding.stop_token_ids``).
- ``temperature > 0``: beam sampling (docs/algorithm.md): ``W`` draws with
  replacement from the joint ``P(b, v) ∝ exp(S_b) softmax(logits_b / T)(v)``
  with top-k/top-p on the joint; draws of EOS (unless ``ignore_eos``) or of a
  stop token finish, and so do draws that complete a stop string
  (``engine.stops``: the group's ``stop`` checked on its beams' ``tails``).

Each group draws from its own generator seeded from ``(seed, step)``, so
every tensor-parallel rank decides identically and a group's result does not
depend on the rest of the batch.

:func:`row_tokens` says which token each beam's row continues with: the
first child of a parent continues the parent's request (``BeamGroup.apply``
uses the same rule), other rows get none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from vllm_dsbd.algorithm import beam_search_step, finishing_tokens, joint_probs, sample_joint, tempered_logprobs
from vllm_dsbd.algorithm.joint import CandidateFinishes
from vllm_dsbd.engine import streams
from vllm_dsbd.engine.protocol import BeamChoice, GroupDecision, GroupDecoding, GroupStep
from vllm_dsbd.engine.stops import StopCheckers
from vllm_dsbd.engine.verify_step import token_logprobs


def group_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one group's beam step; the same on every rank (:mod:`.streams`)."""
    return streams.generator(seed, step, streams.BEAM_STEP_SALT, device)


def decide(logits: Tensor, row_of: Mapping[str, int], groups: Sequence[GroupStep],
           stops: StopCheckers | None = None) -> dict[str, GroupDecision]:
    """Next beams of every group, decided together: groups of one *bucket* (same width, temperature, EOS and
    stop tokens) share one ``[G, B, V]`` table read from the logits with one indexed copy (a group with fewer
    live beams is padded with invalid slots), one search or sampling call, and one pass naming the choices.

    logits: [num_rows, V] next-token logits of this step's rows (any float dtype, any device: every tensor
    made here is on it). row_of: internal request id -> row of ``logits``. stops: the stop-string
    checkers (needed by groups with stop strings).
    """
    buckets: dict[tuple, list[GroupStep]] = {}
    for g in groups:
        key = (g.beam_width, g.temperature, g.eos_token_id, tuple(g.stop_token_ids))
        buckets.setdefault(key, []).append(g)
    out = {}
    for members in buckets.values():
        out.update(_decide_bucket(logits, row_of, members, stops))
    return out


def _decide_bucket(logits: Tensor, row_of: Mapping[str, int], members: list[GroupStep],
                   stops: StopCheckers | None) -> dict[str, GroupDecision]:
    first, device = members[0], logits.device
    num_beams = max(len(g.req_ids) for g in members)
    rows = [[row_of[r] for r in g.req_ids] for g in members]
    padded = [r + [r[0]] * (num_beams - len(r)) for r in rows]  # a padded slot reads its group's first row
    table = logits.index_select(0, torch.tensor(padded, device=device).flatten()).float()
    table = table.view(len(members), num_beams, -1)  # [G, B, V]
    valid = torch.tensor([[b < len(r) for b in range(num_beams)] for r in rows], device=device)
    scores = torch.tensor([list(g.scores) + [0.0] * (num_beams - len(g.scores)) for g in members],
                          dtype=torch.float64, device=device)
    ignore_eos = torch.tensor([g.ignore_eos for g in members], device=device)
    finishes = _bucket_finishes(members, stops)
    asked = [g.num_logprobs for g in members]
    if first.temperature == 0:
        raw = torch.log_softmax(table, dim=-1)
        step = beam_search_step(
            raw, scores, valid, torch.tensor([g.seq_len for g in members], device=device), first.beam_width,
            first.eos_token_id, ignore_eos,
            torch.tensor([g.length_penalty for g in members], dtype=torch.float64, device=device),
            first.stop_token_ids, finishes)
        beams = _choices(raw, step.parents, step.tokens, step.cum_logprobs, step.valid, asked)
        finished = _choices(raw, step.finished_parents, step.finished_tokens, step.finished_cum_logprobs,
                            step.finished_valid, asked)
    else:
        tempered = tempered_logprobs(table, first.temperature)  # [G, B, V]
        vocab = tempered.shape[-1]
        probs = joint_probs(scores, valid, tempered, torch.tensor([g.top_k for g in members], device=device),
                            torch.tensor([g.top_p for g in members], device=device))  # [G, B*V]
        draws = sample_joint(probs, first.beam_width, [group_generator(g.seed, g.step, device) for g in members])
        parents, tokens = draws // vocab, draws % vocab  # [G, W]
        new_scores = scores.gather(1, parents) + tempered.flatten(1).gather(1, draws).double()
        ends, _ = finishing_tokens(tokens, first.eos_token_id, ignore_eos[:, None], first.stop_token_ids)
        if finishes is not None:
            ends = ends | finishes(parents, tokens)
        raw = tempered if first.temperature == 1 else torch.log_softmax(table, dim=-1)  # log softmax(x / 1) is it
        beams = _choices(raw, parents, tokens, new_scores, ~ends, asked)
        finished = _choices(raw, parents, tokens, new_scores, ends, asked)
    return {g.group_id: GroupDecision(g.group_id, b, f) for g, b, f in zip(members, beams, finished)}


def beam_finishes(g: GroupDecoding, stops: StopCheckers | None) -> CandidateFinishes | None:
    """``(beam, token) -> completes a stop string`` over the tails of ``g``'s beams (a slot past them, padding:
    never); None without stop strings."""
    if not g.stop:
        return None
    if stops is None:
        raise RuntimeError(f"beam group {g.group_id} has stop strings but the runner has no stop checkers")
    checker = stops.get(g.stop)

    def finishes(beams: Tensor, tokens: Tensor) -> Tensor:
        flags = [b < len(g.tails) and checker.completes(g.tails[b], t)
                 for b, t in zip(beams.flatten().tolist(), tokens.flatten().tolist())]
        return torch.tensor(flags, dtype=torch.bool, device=tokens.device).reshape(tokens.shape)

    return finishes


def _bucket_finishes(members: list[GroupStep], stops: StopCheckers | None) -> CandidateFinishes | None:
    """A bucket's ``(beam, token) -> finishes`` ([G, ...] each): group k's stop strings on row k; None when no
    group of the bucket has stop strings."""
    checks = [beam_finishes(g, stops) for g in members]
    if all(c is None for c in checks):
        return None

    def finishes(beams: Tensor, tokens: Tensor) -> Tensor:
        return torch.stack([torch.zeros_like(t, dtype=torch.bool) if c is None else c(b, t)
                            for c, b, t in zip(checks, beams, tokens)])

    return finishes


def row_tokens(decision: GroupDecision, num_beams: int) -> list[int | None]:
    """[B] the token each beam's request continues with (its first child's), None if it has no child."""
    tokens: list[int | None] = [None] * num_beams
    for choice in decision.beams:
        if tokens[choice.parent] is None:
            tokens[choice.parent] = choice.token
    return tokens


def _choices(raw: Tensor, parents: Tensor, tokens: Tensor, scores: Tensor, keep: Tensor,
             asked: list[int]) -> list[list[BeamChoice]]:
    """Per group, BeamChoices for its kept entries; raw: [G, B, V] untempered log-probs of the beams,
    parents / tokens / scores / keep: [G, N]; asked: each group's ``num_logprobs``. Every group's choices
    are read together (``verify_step.token_logprobs``)."""
    out: list[list[BeamChoice]] = [[] for _ in asked]
    group, entry = keep.nonzero(as_tuple=True)
    if group.numel() == 0:
        return out
    parents, tokens, scores = parents[group, entry], tokens[group, entry], scores[group, entry]
    groups = group.tolist()
    logprobs = token_logprobs(raw.reshape(-1, raw.shape[-1]), group * raw.shape[1] + parents, tokens,
                              [asked[k] for k in groups])
    for k, p, t, s, lp in zip(groups, parents.tolist(), tokens.tolist(), scores.tolist(), logprobs):
        out[k].append(BeamChoice(p, t, s, lp))
    return out
