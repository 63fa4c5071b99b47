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
  ancestors are its chain's rows. That last row's K/V is kept (:class:`KeptHeadKV`): the next iteration's
  chain starts with the same token, and writes the kept K/V to its slot instead of computing it again;
- layer k: each draft node of layer k - 1 that does not finish, fed the head's own output at its parent,
  its ancestors the rows above it;
- each layer's W nodes are drawn by ``spec_step.draft_layers`` with the seed of the next iteration's draft
  step (``step + 1``, the same layer numbers), and the joints go to the runner's ``DraftStore``.

Every group drafting in the step does so together (:func:`draw`): the runner gathers one :class:`Job` per
group (:func:`job` after a verification, :func:`job_after_beam_step` after a beam step), and each layer of
all of them is one head forward over every group's forest rows (forest attention keeps each row to its own
context and ancestors), then one ``spec_step.draft_layers`` call per kind. A group's draws use its own seed,
so they do not depend on which groups share the step.

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
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_dsbd.algorithm import token_finishes
from vllm_dsbd.engine import eagle3, forest_attention, mjsd_step, spec_step
from vllm_dsbd.engine.protocol import (DraftDecision, DraftStep, GroupDecision, GroupDecoding, GroupStep,
                                       VerifyDecision, VerifyStep, first_path_through)

MAX_CHAIN = 256
"""A beam step draws the next forest only when each beam's head KV misses at most this many tokens (the
scheduler checks): a few after an iteration of depth 0, the whole prompt at a group's first beam step."""


@dataclass
class Chain:
    """Tokens of one request whose head KV the drafting step computes (and writes), before the new beams; and
    ``kept``: the head's K/V of position ``start - 1`` per head layer, which the step before computed
    (:class:`KeptHeadKV`) and this step writes to the request's slot before any row reads its context."""

    index: int  # the request's row in the runner's input batch
    start: int  # position of the first token; the head's paged KV is read below it
    tokens: list[int]
    kept: dict[str, tuple[Tensor, Tensor]] | None = None


KeptRow = tuple[int, int, dict[str, tuple[Tensor, Tensor]]]  # position, token, layer -> (key, value)


class KeptHeadKV:
    """The head's K/V of each new beam's last token, as the drawing step computed it (a forest row written to no
    paged slot: sibling beams share one request until the scheduler forks them), kept for the next iteration,
    whose chain would otherwise compute the same row again (same token, position, feature and context): that
    iteration writes it to the beam's slot instead. Per group, one iteration's beams, by beam slot."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[int, dict[int, KeptRow]]] = {}  # group -> (iteration, beam slot -> row)

    def put(self, group_id: str, step: int, rows: dict[int, KeptRow]) -> None:
        self._kept[group_id] = step, rows

    def take(self, group_id: str, step: int, slot: int, position: int,
             token: int) -> dict[str, tuple[Tensor, Tensor]] | None:
        """Beam ``slot``'s K/V of iteration ``step`` if kept for this position and token (else None)."""
        kept_step, rows = self._kept.get(group_id, (None, {}))
        row = rows.get(slot) if kept_step == step else None
        return row[2] if row is not None and row[:2] == (position, token) else None

    def forget(self, group_ids) -> None:
        for gid in group_ids:
            self._kept.pop(gid, None)


def _chain(runner, group_id: str, step: int, slot: int, index: int, start: int, tokens: list[int]) -> Chain:
    """Beam ``slot``'s chain from ``start``; one token shorter when the step before kept the head's K/V of
    its first token (:class:`KeptHeadKV`)."""
    kept = runner._dsbd_head_kv.take(group_id, step, slot, start, tokens[0])
    return Chain(index, start, tokens) if kept is None else Chain(index, start + 1, tokens[1:], kept)


def num_layers(draft_next: int, max_tokens_left: int, num_passed: int, has_beams: bool) -> int:
    """γ of the next iteration: ``draft_next``, cut so no draft reaches beyond max_tokens
    (``BeamGroup.max_draft_layers`` after the commit of ``num_passed`` draft layers and one token)."""
    left = max_tokens_left - (num_passed + 1)
    return max(0, min(draft_next, left - 1)) if has_beams else 0


@dataclass
class Job:
    """One group's drafting in this step: the next iteration's ``layers`` draft layers from its new beams
    (their chain, their last token, their score); :func:`draw` fills ``decisions`` and ``rows``."""

    group: GroupDecoding
    layers: int
    beams: list[tuple[Chain, int, float]]
    mjsd: bool = False  # an MJSD group's layers (``mjsd_step.kept_draft``)
    decisions: list[DraftDecision] = field(default_factory=list)
    rows: int = 0  # the head rows computed for this group, every layer's


def job(runner, vs: VerifyStep, decision: VerifyDecision) -> Job | None:
    """The next iteration's drafting for one verified group (see the module docstring); None: no layer."""
    layers = num_layers(vs.draft_next, vs.max_tokens_left, decision.num_passed, bool(decision.beams))
    if layers == 0:
        return None
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
            chains[path] = _chain(runner, vs.group_id, vs.step, vs.paths[path][0], index, root_len - 1, verified)
        beams.append((chains[path], c.token, 0.0 if mjsd else c.score))  # MJSD scores a draft path by log Q
    return Job(vs, layers, beams, mjsd)


def job_after_beam_step(runner, step: GroupStep, decision: GroupDecision) -> Job | None:
    """The next iteration's drafting for one group's beam step (``GroupStep.draft_next``): the chains are the
    parent beams, from where their head KV ends to their last token (which the target just computed); None:
    no layer."""
    layers = num_layers(step.draft_next or 0, step.max_tokens_left, 0, bool(decision.beams))
    if layers == 0:
        return None
    batch = runner.input_batch
    chains: dict[int, Chain] = {}
    beams = []
    for c in decision.beams:
        if c.parent not in chains:
            index = batch.req_id_to_index[step.req_ids[c.parent]]
            start = min(step.draft_from[c.parent], step.seq_len - 1)
            tokens = [int(t) for t in batch.token_ids_cpu[index, start:step.seq_len]]
            chains[c.parent] = _chain(runner, step.group_id, step.step, c.parent, index, start, tokens)
        beams.append((chains[c.parent], c.token, c.score))
    return Job(step, layers, beams)


@dataclass
class _Part:
    """One job's rows in one head call: its new nodes' rows (``last``), their layer slots and scores."""

    job: Job
    last: list[int]
    slots: list[int]
    scores: list[float]
    first: int  # position of every new beam's last token (layer k's nodes sit at first + k)
    start: int  # the job's first row in the call


def draw(runner, jobs: list[Job]) -> None:
    """Draft layers 1..``job.layers`` of every job, as the next iteration's draft steps would draw them: each
    layer of every job in **one** head forward over all their forest rows (groups attend to their own
    contexts and ancestors only; each group's draws use its own seed, so they do not depend on which groups
    share the step), then each group's layer drawn from its rows' logits."""
    table = runner.input_batch.block_table[runner._dsbd_features_gid]
    size = table.block_size

    def slot(blocks, pos: int) -> int:
        return int(blocks[pos // size]) * size + pos % size if pos >= 0 else -1

    rows = forest_attention.ForestRows([], [], [], forest_attention.ScratchKV(), slots=[])
    tokens, positions, feature_slots, parts = [], [], [], []

    def add(token: int, pos: int, blocks, context: int, paged: bool, ancestors: list[int]) -> int:
        tokens.append(token)
        positions.append(pos)
        feature_slots.append(slot(blocks, pos - 1))
        rows.block_tables.append(blocks)
        rows.context_lens.append(context)
        rows.ancestors.append(ancestors)
        rows.slots.append(slot(blocks, pos) if paged else -1)
        return len(tokens) - 1

    preset: list[tuple[int, dict[str, tuple[Tensor, Tensor]]]] = []  # (slot, kept K/V): written first
    for job in jobs:
        start, chain_rows, last = len(tokens), {}, []
        for chain, token, _ in job.beams:
            if id(chain) not in chain_rows:  # one block table per chain: forest attention reads its context once
                blocks, ids = table.block_table.cpu[chain.index], []
                if chain.kept is not None:
                    preset.append((slot(blocks, chain.start - 1), chain.kept))
                for j, t in enumerate(chain.tokens):
                    ids.append(add(t, chain.start + j, blocks, chain.start, True, list(ids)))
                chain_rows[id(chain)] = blocks, ids
            blocks, ids = chain_rows[id(chain)]
            last.append(add(token, chain.start + len(chain.tokens), blocks, chain.start, False, list(ids)))
        parts.append(_Part(job, last, list(range(len(last))), [score for _, _, score in job.beams],
                           positions[last[0]], start))
    features = runner._dsbd_features.read(torch.tensor(feature_slots, device=runner._dsbd_features.features.device))
    if preset:
        rows.preset = {name: (torch.stack([kv[name][0] for _, kv in preset]),
                              torch.stack([kv[name][1] for _, kv in preset]),
                              torch.tensor([s for s, _ in preset], device=features.device))
                       for name in runner._dsbd_forest_layers}
    layer = 1
    while parts:
        # the dtypes of vLLM's input buffers, which the head's compiled graph was traced with (head_forward)
        normed, own = forest_attention.head_forward(
            runner.drafter.model, runner._dsbd_forest_layers, runner.vllm_config,
            torch.tensor(tokens, dtype=runner.input_ids.gpu.dtype, device=features.device),
            torch.tensor(positions, dtype=runner.positions.dtype, device=features.device), features, rows)
        if layer == 1:
            _keep_last_rows(runner, rows, parts)
        ends = [p.start for p in parts[1:]] + [len(tokens)]
        for part, end in zip(parts, ends):
            part.job.rows += end - part.start
        growing = [(part, grow) for part, grow in zip(parts, _draw_layer(runner, normed, parts, layer))
                   if grow and layer < part.job.layers]
        # the next layer: each growing node of this one, fed the head's own output at its parent
        parents, next_rows, next_parts = [], forest_attention.ForestRows([], [], [], rows.scratch), []
        tokens, positions = [], []
        for part, grow in growing:
            row_of_slot = {s: part.last[r] for r, s in enumerate(part.slots)}  # a node's parent: its row here
            chosen = part.job.decisions[-1]
            start = len(tokens)
            for j in grow:
                r = row_of_slot[chosen.parents[j]]
                parents.append(r)
                tokens.append(chosen.tokens[j])
                positions.append(part.first + layer)
                next_rows.block_tables.append(rows.block_tables[r])
                next_rows.context_lens.append(rows.context_lens[r])
                next_rows.ancestors.append(rows.ancestors[r] + [rows.row_ids[r]])
            next_parts.append(_Part(part.job, list(range(start, len(tokens))), grow,
                                    [chosen.scores[j] for j in grow], part.first, start))
        if parents:
            features = own[torch.tensor(parents, device=own.device)]
        rows, parts, layer = next_rows, next_parts, layer + 1


def _keep_last_rows(runner, rows: forest_attention.ForestRows, parts: list[_Part]) -> None:
    """Keep each job's new beams' K/V of their last token (layer 1's ``last`` rows) for the next iteration
    (:class:`KeptHeadKV`): beam k of the decision is the next iteration's beam slot k."""
    scratch = rows.scratch
    for part in parts:
        group = part.job.group
        runner._dsbd_head_kv.put(group.group_id, group.step + 1, {
            k: (part.first, part.job.beams[k][1],
                {name: (scratch.keys[name][rows.row_ids[r]].clone(), scratch.values[name][rows.row_ids[r]].clone())
                 for name in runner._dsbd_forest_layers})
            for k, r in enumerate(part.last)})


def _draw_layer(runner, normed: torch.Tensor, parts: list[_Part], layer: int) -> list[list[int]]:
    """Draft layer ``layer`` of every part from the head's output at its new nodes' rows: one head-logits
    call and one ``spec_step.draft_layers`` call per kind (:func:`_on_columns`: over the head's draft
    vocabulary, [n, K] from ``eagle3.draft_vocabulary_logits``, no scatter into all V; else over all V);
    each layer's joint kept in the runner's ``DraftStore`` and its decision appended to ``job.decisions``.
    Returns, per part, the slots of its nodes that do not finish."""
    head, vocab = runner.drafter.model, runner.model_config.get_vocab_size()
    grows: list[list[int]] = [[] for _ in parts]
    for columns in (True, False):
        picked = [k for k, p in enumerate(parts) if _on_columns(runner, p.job) == columns]
        if not picked:
            continue
        index = torch.tensor([r for k in picked for r in parts[k].last], device=normed.device)
        if columns:
            logits = eagle3.draft_vocabulary_logits(head, normed[index], runner._dsbd_head_order)
        else:
            logits = head.compute_logits(normed[index])
        support = runner._dsbd_support if columns else runner._draft_support(logits)
        starts = [0]
        for k in picked:
            starts.append(starts[-1] + len(parts[k].last))
        steps = [_draft_step(parts[k], layer) for k in picked]
        rows = [list(range(start, start + len(parts[k].last))) for k, start in zip(picked, starts)]
        drawn = spec_step.draft_layers(logits, rows, steps, support, vocab if columns else None)
        for k, ds, part_rows, (chosen, joint) in zip(picked, steps, rows, drawn):
            group = parts[k].job.group
            row_of = {r_id: r for r_id, r in zip(ds.req_ids, part_rows)}
            joint, kept_support = mjsd_step.kept_draft(logits, row_of, ds, joint, support, vocab)
            if joint is not None:
                runner._dsbd_drafts.put(group.group_id, group.step + 1, layer, joint, kept_support)
            parts[k].job.decisions.append(chosen)
            grows[k] = [j for j, t in enumerate(chosen.tokens)
                        if not token_finishes(t, group.eos_token_id, group.ignore_eos, group.stop_token_ids)]
    return grows


def _draft_step(part: _Part, layer: int) -> DraftStep:
    """The draft step that would draw this part's layer ``layer`` in the next iteration: the group's decoding
    fields, the next iteration's seed (``step + 1``), the part's slots and scores."""
    group = part.job.group
    decoding = {f.name: getattr(group, f.name) for f in dataclasses.fields(GroupDecoding)}
    decoding.update(step=group.step + 1, tails=())
    return DraftStep(**decoding, layer=layer, req_ids=tuple(str(s) for s in part.slots), slots=tuple(part.slots),
                     scores=tuple(part.scores), seq_len=part.first + layer, mjsd=part.job.mjsd)


def _on_columns(runner, job: Job) -> bool:
    """Whether a job's layers are drawn on the head's draft-vocabulary columns: with a head whose draft
    vocabulary is a small part of V (``runner._dsbd_head_order``), except an MJSD group at T 0, which keeps
    the draft's log-probs over all V (``mjsd_step.kept_draft``)."""
    return runner._dsbd_head_order is not None and (job.group.temperature > 0 or not job.mjsd)
