"""Drafting the next DSBD iteration inside the step that decides the current one (the engine-wide knob
``draft_in_step``).

With an EAGLE-3 head, the runner draws the next iteration's γ draft layers right after it verified the
current one, in the same worker step, so an iteration costs one engine step instead of γ + 1. With
``auto_depth``, an iteration of depth 0 (a beam step) draws the next one's layers the same way, so a
shallow iteration never sends the group back to draft steps. The head runs on *forest rows*
(``engine.forest_attention``), each reading the paged head KV of its beam's context:

- layer 1: per *chain* (a verified path that a new beam continues, or a beam step's parent beam), the
  tokens whose head KV is still missing (a verify step: the root's last token, then the accepted draft
  tokens; a beam step: the parent's tokens from where its head KV ends, ``GroupStep.draft_from``), each fed
  the target's feature of the token before it, their head KV also written to the chain request's slots
  (the next iteration's context); then each new beam's last token (the one the step drew), whose
  ancestors are its chain's rows;
- layer k: each draft node of layer k - 1 that does not finish, fed the head's own output at its parent,
  its ancestors the rows above it;
- each layer's W nodes are drawn by ``spec_step.draft_layer`` with the seed of the next iteration's draft
  step (``step + 1``, the same layer numbers), and the joints go to the runner's ``DraftStore``.

An MJSD group (one beam, K = W draft beams, ``engine.mjsd_step``) is drafted the same way after its
verification: its root's score is 0 (MJSD scores a draft path by its draft log-probs alone) and the store
keeps what its verification reads of each layer (``mjsd_step.kept_draft``), as its draft steps do.

A memory-efficient group's verification keeps one beam, so its next forest grows from that beam alone.

The scheduler then sets up the paths of the next forest at once (``BeamGroup.apply_drafted``). A request's
first iteration drafts in draft steps, which also compute the head KV of its prompt, unless it is an
``auto_depth`` request whose prompt fits ``MAX_CHAIN``: its first iteration is a beam step whose chain is the
prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vllm_dsbd.algorithm import token_finishes
from vllm_dsbd.engine import eagle3, forest_attention, mjsd_step, spec_step
from vllm_dsbd.engine.protocol import (DraftDecision, DraftStep, GroupDecision, GroupDecoding, GroupStep,
                                       VerifyDecision, VerifyStep, first_path_through)

MAX_CHAIN = 256
"""A beam step draws the next forest only when each beam's head KV misses at most this many tokens (the
scheduler checks): a few after an iteration of depth 0, the whole prompt at a group's first beam step."""


@dataclass
class Chain:
    """Tokens of one request whose head KV the drafting step computes (and writes), before the new beams."""

    index: int  # the request's row in the runner's input batch
    start: int  # position of the first token; the head's paged KV is read below it
    tokens: list[int]


def num_layers(draft_next: int, max_tokens_left: int, num_passed: int, has_beams: bool) -> int:
    """γ of the next iteration: ``draft_next``, cut so no draft reaches beyond max_tokens
    (``BeamGroup.max_draft_layers`` after the commit of ``num_passed`` draft layers and one token)."""
    left = max_tokens_left - (num_passed + 1)
    return max(0, min(draft_next, left - 1)) if has_beams else 0


def draft(runner, vs: VerifyStep, decision: VerifyDecision) -> tuple[list[DraftDecision], int]:
    """The next iteration's draft layers for one verified group (see the module docstring), and the head rows
    computed drawing them."""
    layers = num_layers(vs.draft_next, vs.max_tokens_left, decision.num_passed, bool(decision.beams))
    if layers == 0:
        return [], 0
    batch = runner.input_batch
    depth, root_len = decision.num_passed, vs.seq_len  # the roots' last tokens are at root_len - 1
    mjsd = vs.mjsd_tau is not None
    chains: dict[int, Chain] = {}
    beams = []
    for c in decision.beams:
        path = first_path_through(vs.paths, vs.aliases, c.parent)
        if path not in chains:
            index = batch.req_id_to_index[vs.path_req_ids[path]]
            verified = [int(batch.token_ids_cpu[index, root_len - 1])] + vs.path_tokens(path, depth)
            chains[path] = Chain(index, root_len - 1, verified)
        beams.append((chains[path], c.token, 0.0 if mjsd else c.score))  # MJSD scores a draft path by log Q
    return _draw(runner, vs, layers, beams, mjsd)


def draft_after_beam_step(runner, step: GroupStep, decision: GroupDecision) -> tuple[list[DraftDecision], int]:
    """The next iteration's draft layers for one group's beam step (``GroupStep.draft_next``): the chains are
    the parent beams, from where their head KV ends to their last token (which the target just computed);
    and the head rows computed drawing them."""
    layers = num_layers(step.draft_next or 0, step.max_tokens_left, 0, bool(decision.beams))
    if layers == 0:
        return [], 0
    batch = runner.input_batch
    chains: dict[int, Chain] = {}
    beams = []
    for c in decision.beams:
        if c.parent not in chains:
            index = batch.req_id_to_index[step.req_ids[c.parent]]
            start = min(step.draft_from[c.parent], step.seq_len - 1)
            chains[c.parent] = Chain(index, start, [int(t) for t in batch.token_ids_cpu[index, start:step.seq_len]])
        beams.append((chains[c.parent], c.token, c.score))
    return _draw(runner, step, layers, beams)


def _draw(runner, group: GroupDecoding, layers: int, beams: list[tuple[Chain, int, float]],
          mjsd: bool = False) -> tuple[list[DraftDecision], int]:
    """Draft layers 1..``layers`` from new beams (their chain, their last token, their score), as the next
    iteration's draft steps would draw them (``mjsd``: an MJSD group's, ``mjsd_step.kept_draft``); and the
    head rows computed (every layer's call)."""
    batch = runner.input_batch
    table = batch.block_table[runner._dsbd_features_gid]
    size = table.block_size

    def slot(blocks, pos: int) -> int:
        return int(blocks[pos // size]) * size + pos % size if pos >= 0 else -1

    rows = forest_attention.ForestRows([], [], [], forest_attention.ScratchKV(), slots=[])
    tokens, positions, feature_slots, last_rows, chain_rows = [], [], [], [], {}

    def add(token: int, pos: int, blocks, context: int, paged: bool, ancestors: list[int]) -> int:
        tokens.append(token)
        positions.append(pos)
        feature_slots.append(slot(blocks, pos - 1))
        rows.block_tables.append(blocks)
        rows.context_lens.append(context)
        rows.ancestors.append(ancestors)
        rows.slots.append(slot(blocks, pos) if paged else -1)
        return len(tokens) - 1

    for chain, token, _ in beams:
        if id(chain) not in chain_rows:  # one block table per chain: forest attention reads its context once
            blocks, ids = table.block_table.cpu[chain.index], []
            for j, t in enumerate(chain.tokens):
                ids.append(add(t, chain.start + j, blocks, chain.start, True, list(ids)))
            chain_rows[id(chain)] = blocks, ids
        blocks, ids = chain_rows[id(chain)]
        last_rows.append(add(token, chain.start + len(chain.tokens), blocks, chain.start, False, list(ids)))
    first = positions[last_rows[0]]  # every new beam's last token sits at the same position
    features = runner._dsbd_features.read(torch.tensor(feature_slots, device=runner._dsbd_features.features.device))
    scores = [score for _, _, score in beams]
    slots = list(range(len(last_rows)))
    # At T > 0 a head's draw needs only its draft vocabulary's columns: no scatter of its logits into all V.
    order = runner._dsbd_head_order if group.temperature > 0 else None
    vocab = runner.model_config.get_vocab_size() if order is not None else None
    # every decoding field of the group, as the next iteration's draft steps would carry it
    decoding = {f.name: getattr(group, f.name) for f in dataclasses.fields(GroupDecoding)}
    decoding.update(step=group.step + 1, tails=())
    out, num_rows = [], 0
    for layer in range(1, layers + 1):
        num_rows += len(tokens)
        logits, own = _forward(runner, tokens, positions, features, rows, last_rows, order)
        ds = DraftStep(**decoding, layer=layer, req_ids=tuple(str(s) for s in slots), slots=tuple(slots),
                       scores=tuple(scores), seq_len=first + layer, mjsd=mjsd)
        support = runner._dsbd_support if order is not None else runner._draft_support(logits)
        row_of = {str(s): r for r, s in enumerate(slots)}
        chosen, joint = spec_step.draft_layer(logits, row_of, ds, support, vocab)
        joint, support = mjsd_step.kept_draft(logits, row_of, ds, joint, support, runner.model_config.get_vocab_size())
        if joint is not None:
            runner._dsbd_drafts.put(group.group_id, group.step + 1, layer, joint, support)
        out.append(chosen)
        grow = [j for j, t in enumerate(chosen.tokens)
                if not token_finishes(t, group.eos_token_id, group.ignore_eos, group.stop_token_ids)]
        if layer == layers or not grow:
            break
        row_of_slot = {s: last_rows[r] for r, s in enumerate(slots)}  # a node's parent: its row in this call
        parents = [row_of_slot[chosen.parents[j]] for j in grow]
        tokens = [chosen.tokens[j] for j in grow]
        positions = [first + layer] * len(grow)
        features = own[torch.tensor(parents, device=own.device)]
        rows = forest_attention.ForestRows(
            [rows.block_tables[r] for r in parents], [rows.context_lens[r] for r in parents],
            [rows.ancestors[r] + [rows.row_ids[r]] for r in parents], rows.scratch)
        last_rows = list(range(len(grow)))
        scores, slots = [chosen.scores[j] for j in grow], grow
    return out, num_rows


def _forward(runner, tokens: list[int], positions: list[int], features: torch.Tensor,
             rows: forest_attention.ForestRows, logit_rows: list[int],
             order: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits at ``logit_rows`` ([len, V], or [len, K] over its draft vocabulary when ``order`` is
    given: ``eagle3.draft_vocabulary_logits``) and its own features at every forest row."""
    head = runner.drafter.model
    device = features.device
    normed, own = forest_attention.head_forward(
        head, runner._dsbd_forest_layers, runner.vllm_config, torch.tensor(tokens, device=device),
        torch.tensor(positions, device=device), features, rows)
    normed = normed[torch.tensor(logit_rows, device=device)]
    if order is not None:
        return eagle3.draft_vocabulary_logits(head, normed, order), own
    return head.compute_logits(normed), own
