"""Lossless speculative beam search: deterministic (``T = 0``) verification of a draft forest.

At each layer the target's own beam-search step (``joint.beam_search_step``,
vLLM's rule) is computed from the parents' target log-probs; the layer
passes iff every new beam is a draft node of that layer (same parent, same
token). The output is therefore the target's beam search, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_dsbd.algorithm.joint import beam_search_step
from vllm_dsbd.algorithm.verify import NodeFinishes


@dataclass
class GreedyForestVerification:
    """Result of :func:`verify_forest_greedy` (deterministic mode).

    Step ``i`` (1-based) of the iteration computes the target's beams at depth
    ``i``; steps ``1..num_passed + 1`` happened. The output beams are those of
    step ``num_passed + 1``, best first, as ``(node of layer num_passed, token)``.
    """

    num_passed: Tensor  # [G]
    out_parent: Tensor  # [G, W]
    out_token: Tensor  # [G, W]
    out_cum_logprob: Tensor  # [G, W] float64
    out_valid: Tensor  # [G, W] bool
    beam_nodes: Tensor  # [G, γ, W] draft node of the target's k-th beam after each passed layer, -1 if none
    finished_parent: Tensor  # [G, γ+1, F] EOS hypotheses of each step: parent node of layer i-1
    finished_cum_logprob: Tensor  # [G, γ+1, F] float64
    finished_valid: Tensor  # [G, γ+1, F] bool, in vLLM's insertion order
    finished_token: Tensor  # [G, γ+1, F] the token each hypothesis ends with (EOS or a stop token)


def _candidates_of(finishes_fn: NodeFinishes | None, layer: int, order: Tensor):
    """``finishes_fn`` for a beam-search step whose beam k is node ``order[:, k]`` of ``layer``."""
    if finishes_fn is None:
        return None
    groups = torch.arange(order.shape[0], device=order.device)

    def finishes(beams: Tensor, tokens: Tensor) -> Tensor:  # [G, B, K]
        slots = order.gather(1, beams.reshape(beams.shape[0], -1)).reshape(beams.shape)
        flat = finishes_fn(layer, groups, slots.reshape(slots.shape[0], -1), tokens.reshape(tokens.shape[0], -1))
        return flat.reshape(tokens.shape)

    return finishes


def verify_forest_greedy(
    target_logprobs: Tensor,
    root_scores: Tensor,
    root_valid: Tensor,
    draft_parents: Tensor,
    draft_tokens: Tensor,
    draft_exists: Tensor,
    num_layers: Tensor,
    seq_lens: Tensor,
    beam_width: int,
    eos_token_id: int | None,
    ignore_eos: Tensor,
    length_penalty: Tensor,
    stop_token_ids: Sequence[int] = (),
    finishes_fn: NodeFinishes | None = None,
) -> GreedyForestVerification:
    """Lossless speculative beam search: the target's beam search, steps checked against the forest.

    target_logprobs: [G, γ+1, W, V] raw target log-probs at layer-0 nodes
        (the current beams, in their beam order) and at each draft layer's nodes.
    root_scores: [G, W] float64 cumulative log-probs; root_valid: [G, W] bool.
    draft_parents, draft_tokens, draft_exists: [G, γ, W] (drafts of a beam
        search in the draft; parents index layer i-1 nodes).
    num_layers: [G] draft layers usable (<= γ). seq_lens: [G] current beam length
        (prompt + generated). ignore_eos: [G] bool. length_penalty: [G].

    Step ``i`` is :func:`joint.beam_search_step` on the target's beams after
    step ``i-1``. If ``i <= num_layers`` and each new beam equals a draft node
    of layer ``i`` (same parent node, same token), the drafts' target log-probs
    give step ``i+1``; otherwise the iteration ends with step ``i``'s beams.
    Every step's EOS hypotheses are reported, whether or not it passed.
    """
    num_groups, depth, width_max, _ = target_logprobs.shape
    gamma = depth - 1
    device = target_logprobs.device
    beam_nodes = torch.full((num_groups, gamma, width_max), -1, dtype=torch.long, device=device)
    order = torch.arange(width_max, device=device).expand(num_groups, -1).clone()  # node of the k-th beam
    scores = root_scores.double().clone()
    valid = root_valid.clone()
    active = torch.ones(num_groups, dtype=torch.bool, device=device)
    num_passed = torch.zeros(num_groups, dtype=torch.long, device=device)
    out_parent = torch.zeros((num_groups, width_max), dtype=torch.long, device=device)
    out_token = torch.zeros_like(out_parent)
    out_cum = torch.full((num_groups, width_max), float("-inf"), dtype=torch.float64, device=device)
    out_valid = torch.zeros((num_groups, width_max), dtype=torch.bool, device=device)
    fin_parent, fin_cum, fin_valid, fin_token = [], [], [], []
    groups = torch.arange(num_groups, device=device)[:, None]
    for i in range(1, gamma + 2):
        # the k-th beam's rows (row indexing copies whole rows; step 1's beams are the roots, in order)
        lp = target_logprobs[:, 0] if i == 1 else target_logprobs[:, i - 1][groups, order]
        step = beam_search_step(lp, scores, valid & active[:, None], seq_lens + i - 1, beam_width,
                                eos_token_id, ignore_eos, length_penalty, stop_token_ids,
                                _candidates_of(finishes_fn, i - 1, order))
        fin_parent.append(order.gather(1, step.finished_parents))
        fin_cum.append(step.finished_cum_logprobs)
        fin_valid.append(step.finished_valid)
        fin_token.append(step.finished_tokens)
        new_parent_nodes = order.gather(1, step.parents)  # [G, W]
        if i <= gamma:
            layer = i - 1
            match = (
                draft_exists[:, layer, None, :]
                & (draft_parents[:, layer, None, :] == new_parent_nodes[:, :, None])
                & (draft_tokens[:, layer, None, :] == step.tokens[:, :, None])
            )  # [G, beam k, draft j]
            found = match.any(-1)
            passed = active & (num_layers >= i) & step.valid.any(-1) & (found | ~step.valid).all(-1)
        else:
            passed = torch.zeros_like(active)
        ending = active & ~passed
        out_parent = torch.where(ending[:, None], new_parent_nodes, out_parent)
        out_token = torch.where(ending[:, None], step.tokens, out_token)
        out_cum = torch.where(ending[:, None], step.cum_logprobs, out_cum)
        out_valid = torch.where(ending[:, None], step.valid, out_valid)
        num_passed = torch.where(passed, i, num_passed)
        if i <= gamma:
            nodes = torch.where(step.valid, match.to(torch.uint8).argmax(-1), -1)
            beam_nodes[:, i - 1] = torch.where(passed[:, None], nodes, -1)
            order = torch.where(passed[:, None], nodes.clamp_min(0), order)
            scores = torch.where(passed[:, None], step.cum_logprobs, scores)
            valid = torch.where(passed[:, None], step.valid, valid)
        active = passed
        if i <= gamma and not bool(active.any()):  # every group ended: the later steps would find nothing
            for rest in (fin_parent, fin_cum, fin_valid, fin_token):
                rest += [torch.zeros_like(rest[-1])] * (gamma + 1 - i)
            break
    return GreedyForestVerification(
        num_passed, out_parent, out_token, out_cum, out_valid, beam_nodes,
        torch.stack(fin_parent, 1), torch.stack(fin_cum, 1), torch.stack(fin_valid, 1), torch.stack(fin_token, 1),
    )
