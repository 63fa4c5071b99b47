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
from vllm_dsbd.engine.protocol import BeamChoice, GroupDecision, GroupDecoding, GroupStep, TokenLogprob
from vllm_dsbd.engine.stops import StopCheckers


def group_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one group's beam step; the same on every rank (:mod:`.streams`)."""
    return streams.generator(seed, step, streams.BEAM_STEP_SALT, device)


def decide(logits: Tensor, row_of: Mapping[str, int], groups: Sequence[GroupStep],
           stops: StopCheckers | None = None) -> dict[str, GroupDecision]:
    """Next beams of every group.

    logits: [num_rows, V] next-token logits of this step's rows (any float dtype).
    row_of: internal request id -> row of ``logits``. stops: the stop-string
    checkers (needed by groups with stop strings).
    """
    out = {}
    for g in groups:
        rows = torch.tensor([row_of[r] for r in g.req_ids], device=logits.device)
        group_logits = logits.index_select(0, rows).float()  # [B, V]
        finishes = beam_finishes(g, stops)
        if g.temperature == 0:
            out[g.group_id] = _search_step(group_logits, g, finishes)
        else:
            out[g.group_id] = _sampling_step(group_logits, g, finishes)
    return out


def beam_finishes(g: GroupDecoding, stops: StopCheckers | None) -> CandidateFinishes | None:
    """``(beam, token) -> completes a stop string`` over the tails of ``g``'s beams; None without stop strings."""
    if not g.stop:
        return None
    if stops is None:
        raise RuntimeError(f"beam group {g.group_id} has stop strings but the runner has no stop checkers")
    checker = stops.get(g.stop)

    def finishes(beams: Tensor, tokens: Tensor) -> Tensor:
        flags = [checker.completes(g.tails[b], t) for b, t in zip(beams.flatten().tolist(), tokens.flatten().tolist())]
        return torch.tensor(flags, dtype=torch.bool, device=tokens.device).reshape(tokens.shape)

    return finishes


def row_tokens(decision: GroupDecision, num_beams: int) -> list[int | None]:
    """[B] the token each beam's request continues with (its first child's), None if it has no child."""
    tokens: list[int | None] = [None] * num_beams
    for choice in decision.beams:
        if tokens[choice.parent] is None:
            tokens[choice.parent] = choice.token
    return tokens


def _search_step(logits: Tensor, g: GroupStep, finishes: CandidateFinishes | None) -> GroupDecision:
    raw = torch.log_softmax(logits, dim=-1)  # [B, V]
    num_beams, device = raw.shape[0], logits.device
    step = beam_search_step(
        raw[None],
        torch.tensor([g.scores], dtype=torch.float64, device=device),
        torch.ones((1, num_beams), dtype=torch.bool, device=device),
        torch.tensor([g.seq_len], device=device),
        g.beam_width,
        g.eos_token_id,
        torch.tensor([g.ignore_eos], device=device),
        torch.tensor([g.length_penalty], dtype=torch.float64, device=device),
        g.stop_token_ids,
        finishes,
    )
    beams = _choices(raw, step.parents[0], step.tokens[0], step.cum_logprobs[0], step.valid[0], g.num_logprobs)
    finished = _choices(raw, step.finished_parents[0], step.finished_tokens[0], step.finished_cum_logprobs[0],
                        step.finished_valid[0], g.num_logprobs)
    return GroupDecision(g.group_id, beams, finished)


def _sampling_step(logits: Tensor, g: GroupStep, finishes: CandidateFinishes | None) -> GroupDecision:
    tempered = tempered_logprobs(logits, g.temperature)  # [B, V]
    (num_beams, vocab), device = tempered.shape, logits.device
    scores = torch.tensor([g.scores], dtype=torch.float64, device=device)
    probs = joint_probs(scores, torch.ones((1, num_beams), dtype=torch.bool, device=device), tempered[None],
                        torch.tensor([g.top_k], device=device), torch.tensor([g.top_p], device=device))  # [1, B*V]
    draws = sample_joint(probs, g.beam_width, group_generator(g.seed, g.step, logits.device))[0]  # [W]
    parents, tokens = draws // vocab, draws % vocab
    new_scores = scores[0, parents] + tempered[parents, tokens].double()
    ends, _ = finishing_tokens(tokens, g.eos_token_id, torch.tensor(g.ignore_eos, device=device), g.stop_token_ids)
    if finishes is not None:
        ends = ends | finishes(parents[None], tokens[None])[0]
    raw = torch.log_softmax(logits, dim=-1)
    beams = _choices(raw, parents, tokens, new_scores, ~ends, g.num_logprobs)
    finished = _choices(raw, parents, tokens, new_scores, ends, g.num_logprobs)
    return GroupDecision(g.group_id, beams, finished)


def _choices(raw: Tensor, parents: Tensor, tokens: Tensor, scores: Tensor, keep: Tensor,
             num_logprobs: int) -> list[BeamChoice]:
    """BeamChoices for the kept entries; raw: [B, V] untempered log-probs of the parents."""
    idx = keep.nonzero()[:, 0]
    if idx.numel() == 0:
        return []
    parents, tokens, scores = parents[idx], tokens[idx], scores[idx]
    rows = raw[parents]  # [K, V]
    token_lp = rows.gather(1, tokens[:, None])[:, 0]  # [K]
    # ranks only when log-probs were asked for (a pass over V per choice; 0 otherwise, as token_logprob)
    ranks = (rows > token_lp[:, None]).sum(-1) + 1 if num_logprobs >= 0 else torch.zeros_like(tokens)
    top_ids = top_lps = None
    if num_logprobs > 0:
        top_lps, top_ids = rows.topk(num_logprobs, dim=-1)
        top_ids, top_lps = top_ids.tolist(), top_lps.tolist()
    out = []
    for k, (p, t, s, lp, rank) in enumerate(zip(parents.tolist(), tokens.tolist(), scores.tolist(),
                                                token_lp.tolist(), ranks.tolist())):
        extra = (tuple(top_ids[k]), tuple(top_lps[k])) if top_ids is not None else ((), ())
        out.append(BeamChoice(p, t, s, TokenLogprob(lp, rank, *extra)))
    return out
