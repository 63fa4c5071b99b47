"""The runner's side of MJSD (``algorithm.mjsd``): one draft path verified by its joint likelihood.

An MJSD group is a beam group with one beam and ``K = beam_width`` draft
slots. Its draft layers are DSBD's (``spec_step.draft_layers``: K draft beams
drawn from the joint over (slot, token), or the draft's beam search at
``T = 0``); the runner keeps what gives each layer's per-node draft
distribution ``log q(. | node)``, the one each node's token was drawn from
(:func:`kept_draft`: at ``T > 0`` the joint, whose parent row renormalised is
read at the path's nodes only; at ``T = 0`` the raw log-probs). The scheduler's group
picks the draft beam with the highest joint draft log-prob and sets up one
path request for it; the target's forward over that path gives, here
(:func:`verify`), the accepted prefix (the longest with ``log P - log Q >=
log τ``) and one token drawn from the target after it.

Pure torch plus ``vllm_dsbd.algorithm`` (no vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from vllm_dsbd.algorithm import probs_from_logprobs_, sample_joint
from vllm_dsbd.algorithm.mjsd import accepted_length, log_tau, node_conditionals_at, token_logprobs
from vllm_dsbd.engine.protocol import DraftStep, VerifyChoice, VerifyDecision, VerifyStep, layer_slot
from vllm_dsbd.engine.spec_step import expand_joint
from vllm_dsbd.engine.streams import VERIFY_SALT, generator
from vllm_dsbd.engine.verify_step import node_completes, node_token_finishes, token_logprob
from vllm_dsbd.engine.stops import StopCheckers


def greedy_node_logprobs(logits: Tensor, row_of: Mapping[str, int], ds: DraftStep) -> Tensor:
    """[W*V] float32: the draft's raw ``log q(. | node)`` of every parent node of a ``T = 0`` draft layer (its
    beam search), by slot (0 at slots without a parent)."""
    device = logits.device
    rows = torch.tensor([row_of[r] for r in ds.req_ids], device=device)
    parent_logits = logits.index_select(0, rows).float()
    out = torch.zeros((ds.beam_width, parent_logits.shape[-1]), device=device)
    out[torch.tensor(ds.slots, device=device)] = torch.log_softmax(parent_logits, dim=-1)
    return out.reshape(-1)


def kept_draft(logits: Tensor, row_of: Mapping[str, int], ds: DraftStep, joint: Tensor | None,
               support: Tensor | None, vocab_size: int) -> tuple[Tensor | None, Tensor | None]:
    """What the runner keeps of a draft layer until its verification (``DraftStore``), and over which
    support: the joint the layer drew from (``T > 0``; ``spec_step.draft_layers``'s, over ``support``'s columns
    when it has one; an MJSD verification reads its nodes' conditionals from it, over all ``vocab_size``
    tokens), or at ``T = 0`` an MJSD group's :func:`greedy_node_logprobs` (a DSBD group's: nothing). The same
    in draft steps and in the verify step before them (``engine.forest_draft``)."""
    if not ds.mjsd:
        return joint, support
    if joint is None:
        return greedy_node_logprobs(logits, row_of, ds), None
    return (joint, None) if support is None else (expand_joint(joint, support, ds.beam_width, vocab_size), None)


def verify(path_logits: Sequence[Tensor], vs: VerifyStep, drafts: Tensor,
           stops: StopCheckers | None = None) -> VerifyDecision:
    """Verify an MJSD group's draft path.

    path_logits: one [len(path), V] tensor, the target's logits at the path's nodes (root first).
    drafts: [layers, W*V], :func:`kept_draft` of each draft layer: at ``T > 0`` the joint it drew from
    (``log q(token | parent)``: ``algorithm.mjsd.node_conditionals_at``), at ``T = 0`` the raw log-probs.
    """
    (path,) = vs.paths
    width = vs.beam_width
    logits = path_logits[0].float()
    vocab, device = logits.shape[-1], logits.device
    slots = [layer_slot(n, width) for n in path[1:]]  # (layer, slot) of each path node; layer l is draft row l - 1
    tokens = [vs.draft_tokens[layer - 1][slot] for layer, slot in slots]

    def draft_logprob(layer: int, parent: int, token: int) -> float:  # log q(token | parent) of that layer
        if vs.temperature > 0:
            return float(node_conditionals_at(drafts[layer - 1], width, torch.tensor([parent], device=device),
                                              torch.tensor([token], device=device))[0])
        return float(drafts[layer - 1].view(width, vocab)[parent, token])

    q = torch.tensor([draft_logprob(layer, vs.draft_parents[layer - 1][slot], t)
                      for (layer, slot), t in zip(slots, tokens)], dtype=torch.float64, device=device)
    target = token_logprobs(logits, vs.temperature, vs.top_k, vs.top_p)  # [len(path), V]
    p = target[torch.arange(len(tokens), device=device), torch.tensor(tokens, dtype=torch.long, device=device)]
    threshold = torch.tensor([log_tau(vs.mjsd_tau)], dtype=torch.float64, device=device)
    accepted = int(accepted_length(p.double()[None], q[None], torch.tensor([len(tokens)], device=device),
                                   threshold)[0])

    raw = torch.log_softmax(logits, dim=-1)
    finishes = node_token_finishes(vs, node_completes(vs, stops))

    def ends(depth: int, token: int) -> bool:  # the token after the path's node at `depth` finishes
        return finishes(path[depth], token)

    def choice(depth: int, token: int) -> VerifyChoice:
        chain = [*zip(range(depth), tokens[:depth]), (depth, token)]
        logprobs = tuple(token_logprob(raw[d], t, vs.num_logprobs) for d, t in chain)
        score = vs.root_scores[0] + sum(lp.logprob for lp in logprobs)
        return VerifyChoice(path[depth], token, score, logprobs)

    finished_at = next((d for d in range(accepted) if ends(d, tokens[d])), None)
    if finished_at is not None:  # an accepted token ends the sequence: no bonus token
        passed, last = finished_at, choice(finished_at, tokens[finished_at])
    else:
        passed = accepted
        if vs.temperature == 0:
            bonus = int(target[passed].argmax())
        else:
            probs = probs_from_logprobs_(target[passed].clone())  # a copy: the choice reads target's row
            bonus = int(sample_joint(probs[None], 1, generator(vs.seed, vs.step, VERIFY_SALT, device))[0, 0])
        last = choice(passed, bonus)
    finished = [last] if ends(passed, last.token) else []
    beams = [] if finished else [last]
    # metrics: every path token was proposed (one node per layer), the first `passed` were accepted
    proposed, accepted_nodes = [1] * len(tokens), [1 if d < passed else 0 for d in range(len(tokens))]
    return VerifyDecision(vs.group_id, passed, beams, finished, proposed, accepted_nodes, [1] * passed + [len(beams)])

