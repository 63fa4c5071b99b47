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

from vllm_dsbd.algorithm.joint import beam_search_score, beam_search_step
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
    prune_floor: Tensor | None = None,
) -> GreedyForestVerification:
    """Lossless speculative beam search: the target's beam search, steps checked against the forest.

    target_logprobs: [G, γ+1, W, V] raw target log-probs at layer-0 nodes
        (the current beams, in their beam order) and at each draft layer's nodes.
    root_scores: [G, W] float64 cumulative log-probs; root_valid: [G, W] bool.
    draft_parents, draft_tokens, draft_exists: [G, γ, W] (drafts of a beam
        search in the draft; parents index layer i-1 nodes).
    num_layers: [G] draft layers usable (<= γ). seq_lens: [G] current beam length
        (prompt + generated). ignore_eos: [G] bool. length_penalty: [G].
    prune_floor: [G] float64, or None (no beam is left out). A score that every hypothesis a left-out
        beam's children could finish must stay strictly below to be irrelevant to the group's results: the
        ``n``-th best score of the hypotheses finished so far (-inf with fewer), +inf when the group's beams
        cannot finish (``ignore_eos`` or no EOS, no stop tokens or strings). See :func:`left_out_bounds`.

    Step ``i`` is :func:`joint.beam_search_step` on the target's beams after
    step ``i-1``. If ``i <= num_layers`` and each new beam equals a draft node
    of layer ``i`` (same parent node, same token), the drafts' target log-probs
    give step ``i+1``; otherwise the iteration ends with step ``i``'s beams.
    Every step's EOS hypotheses are reported, whether or not it passed.

    **The bound** (with ``prune_floor``): a new beam the draft missed may be left out when no child of it
    can matter. Its children score at most its own cumulative log-prob over their length's penalty (log-probs
    are <= 0), so it is left out when (a) that bound is strictly below ``prune_floor`` for its finished
    children, and (b) strictly below the score of the W-th new beam step ``i+1`` makes from the beams kept:
    then none of its live children ranks in step ``i+1``'s top W, and step ``i+1`` is the target's, token for
    token. (b) is known only once step ``i+1`` is computed: if it fails, layer ``i`` did not pass after all, and
    the iteration ends with step ``i``'s beams (step ``i+1``'s hypotheses are dropped).
    """
    num_groups, depth, width_max, _ = target_logprobs.shape
    gamma = depth - 1
    device = target_logprobs.device
    beam_nodes = torch.full((num_groups, gamma, width_max), -1, dtype=torch.long, device=device)
    order = torch.arange(width_max, device=device).expand(num_groups, -1).clone()  # node of the k-th beam
    scores = root_scores.double().clone()
    valid = root_valid.clone()
    active = torch.ones(num_groups, dtype=torch.bool, device=device)
    pending = torch.zeros_like(active)  # passed the last layer by leaving beams out: step i confirms it
    left_out_best = torch.full((num_groups,), float("-inf"), dtype=torch.float64, device=device)
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
        if i >= 2 and prune_floor is not None:  # (b) of a layer passed by leaving beams out; if it fails, the
            # layer did not pass and step i never happened
            confirmed = step.valid.all(-1) & (left_out_best < step.scores.min(-1).values)
            failed = pending & ~confirmed
            num_passed = torch.where(failed, i - 2, num_passed)
            beam_nodes[:, i - 2] = torch.where(failed[:, None], -1, beam_nodes[:, i - 2])
            active = active & ~failed
        fin_parent.append(order.gather(1, step.finished_parents))
        fin_cum.append(step.finished_cum_logprobs)
        fin_valid.append(step.finished_valid & active[:, None])
        fin_token.append(step.finished_tokens)
        new_parent_nodes = order.gather(1, step.parents)  # [G, W]
        if i <= gamma:
            layer = i - 1
            match = (
                draft_exists[:, layer, None, :]
                & (draft_parents[:, layer, None, :] == new_parent_nodes[:, :, None])
                & (draft_tokens[:, layer, None, :] == step.tokens[:, :, None])
            )  # [G, beam k, draft j]
            found = match.any(-1) & step.valid
            left_out = torch.zeros_like(found)
            if prune_floor is not None:
                finished_bound, live_bound = left_out_bounds(step.cum_logprobs, seq_lens + i, length_penalty)
                left_out = step.valid & ~found & (finished_bound < _below(prune_floor)[:, None])
                left_out_best = live_bound.masked_fill(~left_out, float("-inf")).amax(-1)
            passed = active & (num_layers >= i) & found.any(-1) & (found | left_out | ~step.valid).all(-1)
            pending = passed & left_out.any(-1)
        else:
            passed = pending = torch.zeros_like(active)
        ends = (active & ~passed) | pending  # the output is step i's beams (a pending group's, if (b) fails)
        out_parent = torch.where(ends[:, None], new_parent_nodes, out_parent)
        out_token = torch.where(ends[:, None], step.tokens, out_token)
        out_cum = torch.where(ends[:, None], step.cum_logprobs, out_cum)
        out_valid = torch.where(ends[:, None], step.valid, out_valid)
        num_passed = torch.where(passed, i, num_passed)
        if i <= gamma:
            nodes = torch.where(found, match.to(torch.uint8).argmax(-1), -1)
            beam_nodes[:, i - 1] = torch.where(passed[:, None], nodes, -1)
            order = torch.where(passed[:, None], nodes.clamp_min(0), order)
            scores = torch.where(passed[:, None], step.cum_logprobs, scores)
            valid = torch.where(passed[:, None], found, valid)
        active = passed
        if i <= gamma and not bool(active.any()):  # every group ended: the later steps would find nothing
            for rest in (fin_parent, fin_cum, fin_valid, fin_token):
                rest += [torch.zeros_like(rest[-1])] * (gamma + 1 - i)
            break
    return GreedyForestVerification(
        num_passed, out_parent, out_token, out_cum, out_valid, beam_nodes,
        torch.stack(fin_parent, 1), torch.stack(fin_cum, 1), torch.stack(fin_valid, 1), torch.stack(fin_token, 1),
    )


def left_out_bounds(cum_logprobs: Tensor, seq_lens: Tensor, length_penalty: Tensor) -> tuple[Tensor, Tensor]:
    """(finished, live): the best ``beam_search_score`` any finished / live child of beams with these
    cumulative log-probs ([G, W] float64) and length (``seq_lens`` [G], prompt + generated) could have. A
    child adds a log-prob <= 0 to the sum and one token to the length, and the score divides the sum by
    ``max(len, 1) ** length_penalty`` (minus one for a finished child, or for a live EOS child under
    ``ignore_eos``): the same division of a larger sum, computed as the score itself computes it."""
    lengths = (seq_lens + 1)[:, None]
    penalty = length_penalty.double()[:, None]
    finished = beam_search_score(cum_logprobs, lengths, torch.ones_like(cum_logprobs, dtype=torch.bool), penalty)
    plain = beam_search_score(cum_logprobs, lengths, torch.zeros_like(cum_logprobs, dtype=torch.bool), penalty)
    return finished, torch.maximum(finished, plain)


def _below(floor: Tensor) -> Tensor:
    """``floor`` less a relative 1e-9 (the engine ranks hypotheses in Python floats; its power may differ from
    torch's in the last place): leaving out less than allowed is always exact."""
    floor = floor.double()
    return torch.where(floor.isfinite(), floor - 1e-9 * floor.abs(), floor)
