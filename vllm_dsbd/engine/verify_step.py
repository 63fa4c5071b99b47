"""The verification of every DSBD group of a target step, decided together.

The target computed every node of every verifying group's forest in one forward (``spec_step``). Here the
step's groups are decided in as few calls as their shapes allow, as vLLM's sampler decides a whole batch:

- **pack** (:func:`verify_groups`): groups of one *bucket* (same beam width, mode, ``W_out``, temperature,
  stop tokens and draft support) share one ``[G, γ+1, W, V]`` table of log-probs, filled from the step's
  logits rows with one indexed copy (a group with fewer layers is padded; its extra rows are never read);
- **decide**: one ``algorithm.verify_forest`` (``T > 0``) or ``verify_forest_greedy`` (``T = 0``) call per
  bucket, each group drawing from its own generator (seed, iteration, :data:`~.streams.VERIFY_SALT`), so a
  group's decision never depends on the groups beside it;
- **unpack**: one ``.tolist()`` per result field and bucket, the reported log-probs of every chosen token
  in one gather; then per-group Python only to name the beams and hypotheses (:class:`VerifyDecision`).

Stop strings need text: they are checked per group, for the candidate tokens the batched pass names. MJSD
groups are verified by ``mjsd_step`` (one draft path each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_dsbd.algorithm import tempered_logprobs, token_finishes, verify_forest, verify_forest_greedy
from vllm_dsbd.engine.protocol import TokenLogprob, VerifyChoice, VerifyDecision, VerifyStep, layer_slot, node_id
from vllm_dsbd.engine.stops import StopCheckers
from vllm_dsbd.engine.streams import VERIFY_SALT, generator


CHUNK_BYTES = 16 << 20
"""A bucket is decided in chunks whose residual ladder ([W + 1, G, W x V] float32, the largest buffer) stays
under this: on CPU, larger buffers come from fresh ``mmap`` pages (glibc's threshold is 32 MiB even with
``engine.cpu_memory``), and 16 groups of W 4 at V 49,152 decided at once took 1.6x as long as one at a time;
in chunks of 4, 0.78x (``benchmarks/bench_decisions.py``, fixed width, γ 2)."""

GREEDY_CHUNK_BYTES = 24 << 20
"""At T 0 there is no ladder: the largest buffers are the forest's node logits and their log-softmax
([G, γ + 1, W, V] float32) and a layer's candidate scores ([G, W x V] float64), kept under this (below glibc's
32 MiB threshold). The T 0 verifications of ``bench_decisions`` at 16 groups of W 4, V 49,152, one thread:
γ 1 in one chunk (24 MiB) 0.90x the time of chunks of 4; γ 2 in chunks of 8-11 0.91-0.93x, in one (36 MiB)
1.85x."""


@dataclass
class GroupInput:
    """One group's verification inputs. path_starts: the first row, in the step's logits, of each path of
    ``vs.paths`` (its rows follow the path's nodes from its first own one, ``vs.shared``). draft_joints:
    [layers, W*V] (``T > 0``; None at ``T = 0``), or [layers, W*K] over the columns of ``draft_support``
    (``spec_step.DraftStore``)."""

    vs: VerifyStep
    path_starts: Sequence[int]
    draft_joints: Tensor | None = None
    draft_support: Tensor | None = None


def verify(path_logits: Sequence[Tensor], vs: VerifyStep, draft_joints: Tensor | None,
           stops: StopCheckers | None = None, draft_support: Tensor | None = None) -> VerifyDecision:
    """Verify one group's forest; path_logits: per path of ``vs.paths``, [len(path), V] target logits at its
    nodes (root first). The one-group form of :func:`verify_groups`."""
    starts = [0]
    for rows in path_logits[:-1]:
        starts.append(starts[-1] + rows.shape[0])
    logits = torch.cat(list(path_logits))
    return verify_groups(logits, [GroupInput(vs, starts, draft_joints, draft_support)], stops)[vs.group_id]


def verify_groups(logits: Tensor, groups: Sequence[GroupInput],
                  stops: StopCheckers | None = None) -> dict[str, VerifyDecision]:
    """Every group's :class:`VerifyDecision`, by group id. logits: [rows, V], the target's logits of the step
    (any float dtype, any device: every tensor made here is on that device)."""
    buckets: dict[tuple, list[GroupInput]] = {}
    for g in groups:
        buckets.setdefault(_bucket_key(g), []).append(g)
    decisions: dict[str, VerifyDecision] = {}
    vocab = logits.shape[-1]
    for members in buckets.values():
        size = _chunk_size(members, vocab)
        for k in range(0, len(members), size):
            decisions.update(_verify_bucket(logits, members[k: k + size], stops))
    return decisions


def _chunk_size(members: list[GroupInput], vocab: int) -> int:
    """Groups of one bucket decided in one call: its largest buffer under ``CHUNK_BYTES`` (T > 0: the residual
    ladder) or ``GREEDY_CHUNK_BYTES`` (T 0: the node logits at the bucket's deepest forest, or a layer's
    float64 candidates)."""
    width = members[0].vs.beam_width
    if members[0].vs.temperature > 0:
        return max(1, CHUNK_BYTES // ((width + 1) * width * vocab * 4))
    layers = max(max(len(g.vs.draft_parents) for g in members) + 1, 2)
    return max(1, GREEDY_CHUNK_BYTES // (layers * width * vocab * 4))


def _bucket_key(g: GroupInput) -> tuple:
    vs = g.vs
    if vs.mjsd_tau is not None:
        raise ValueError(f"group {vs.group_id} is MJSD: mjsd_step verifies it")
    if vs.temperature <= 0:
        return ("greedy", vs.beam_width, tuple(vs.stop_token_ids), vs.eos_token_id)
    return ("sample", vs.beam_width, vs.num_out, vs.temperature, tuple(vs.stop_token_ids), vs.eos_token_id,
            None if g.draft_support is None else id(g.draft_support))


def _verify_bucket(logits: Tensor, members: list[GroupInput], stops: StopCheckers | None) -> dict[str, VerifyDecision]:
    first = members[0].vs
    width, device = first.beam_width, logits.device
    depth = max(len(g.vs.draft_parents) for g in members)
    nodes = _node_logits(logits, members, depth)  # [G, γ+1, W, V] float32
    completes = [node_completes(g.vs, stops) for g in members]
    finishes = _bucket_finishes(completes)
    ends_of = [node_token_finishes(g.vs, c) for g, c in zip(members, completes)]
    layers = torch.tensor([len(g.vs.draft_parents) for g in members], device=device)
    parents, tokens, exists = _drafts(members, depth, width, device)
    root_scores = torch.tensor([g.vs.root_scores for g in members], dtype=torch.float64, device=device)
    root_valid = torch.tensor([g.vs.root_valid for g in members], device=device)
    ignore_eos = torch.tensor([g.vs.ignore_eos for g in members], device=device)
    if first.temperature > 0:
        # At T 1 the tempered table is the raw one the chosen tokens' log-probs are read from: made once. Else
        # verification tempers each layer's rows as it reaches them, and only the chosen ones are normalised.
        table = tempered_logprobs(nodes, 1.0) if first.temperature == 1 else nodes
        raw = _RawRows(table, lazy=first.temperature != 1)
        joints = _padded_joints(members, depth, device)
        res = verify_forest(
            table, root_scores, root_valid, joints, parents, tokens, exists, layers,
            torch.tensor([g.vs.width_threshold for g in members], device=device),
            torch.tensor([g.vs.min_width for g in members], device=device), first.num_out,
            [generator(g.vs.seed, g.vs.step, VERIFY_SALT, device) for g in members],
            torch.tensor([g.vs.top_k for g in members], device=device),
            torch.tensor([g.vs.top_p for g in members], device=device),
            first.eos_token_id, ignore_eos, first.stop_token_ids, finishes, members[0].draft_support,
            None if first.temperature == 1 else first.temperature)
        picks = _sampled_picks(res, members, ends_of)
    else:
        table = torch.log_softmax(nodes, dim=-1)
        raw = _RawRows(table)
        res = verify_forest_greedy(
            table, root_scores, root_valid, parents, tokens, exists, layers,
            torch.tensor([g.vs.seq_len for g in members], device=device), width, first.eos_token_id, ignore_eos,
            torch.tensor([g.vs.length_penalty for g in members], dtype=torch.float64, device=device),
            first.stop_token_ids, finishes,
            torch.tensor([g.vs.prune_floor for g in members], dtype=torch.float64, device=device))
        picks = _greedy_picks(res, members)
    reported = _reported_logprobs(raw, members, picks)
    return {g.vs.group_id: pick.decision(g.vs, ends, lps)
            for g, pick, ends, lps in zip(members, picks, ends_of, reported)}


def _node_logits(logits: Tensor, members: list[GroupInput], depth: int) -> Tensor:
    """[G, depth+1, W, V] float32: each group's node logits, read from the first path through the node (an
    alias leaf from its twin's; a path's rows start at its first node no earlier path holds, ``vs.shared``),
    in one indexed copy. A node on no path (an empty root slot, a draft that does not exist, a layer past the
    group's depth) gets its group's first row: verification never reads it."""
    width = members[0].vs.beam_width
    per_group = (depth + 1) * width
    src = []
    for g in members:
        rows = [g.path_starts[0]] * per_group
        seen = set()
        for k, (start, path) in enumerate(zip(g.path_starts, g.vs.paths)):
            skip = g.vs.skip(k)  # the path's rows start at its first own node
            for offset, node in enumerate(path[skip:]):
                if node not in seen:
                    seen.add(node)
                    rows[node] = start + offset
        for leaf, twin in g.vs.aliases:
            rows[leaf] = rows[twin]
        src += rows
    out = logits.index_select(0, torch.tensor(src, device=logits.device))
    return (out if out.dtype == torch.float32 else out.float()).view(len(members), depth + 1, width, -1)


def _drafts(members: list[GroupInput], depth: int, width: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """[G, depth, W] draft parents, tokens and existence flags (padded layers: no draft)."""
    pad = [(0,) * width] * depth
    parents = [list(g.vs.draft_parents) + pad[len(g.vs.draft_parents):] for g in members]
    tokens = [list(g.vs.draft_tokens) + pad[len(g.vs.draft_tokens):] for g in members]
    exists = [list(g.vs.draft_exists) + [(False,) * width] * (depth - len(g.vs.draft_exists)) for g in members]
    shape = (len(members), depth, width)
    return (torch.tensor(parents, dtype=torch.long, device=device).reshape(shape),
            torch.tensor(tokens, dtype=torch.long, device=device).reshape(shape),
            torch.tensor(exists, dtype=torch.bool, device=device).reshape(shape))


def _padded_joints(members: list[GroupInput], depth: int, device) -> Tensor:
    """[G, depth, W*V] (or W*K) draft joints; a group with fewer layers is padded with zeros (never read)."""
    joints = [g.draft_joints for g in members]
    size = next((j.shape[-1] for j in joints if j is not None and j.numel()), 0)
    if len(members) == 1 and joints[0] is not None and joints[0].shape[0] == depth:
        return joints[0][None].to(device)
    out = torch.zeros((len(members), depth, size), device=device)
    for k, j in enumerate(joints):
        if j is not None and j.numel():
            out[k, : j.shape[0]] = j
    return out


def _bucket_finishes(completes: list) -> Callable | None:
    """The bucket's ``verify.NodeFinishes``: group k's stop strings checked by ``completes[k]`` (None: no group
    of the bucket has stop strings)."""
    if all(c is None for c in completes):
        return None

    def finishes(layer: int, groups: Tensor, parents: Tensor, tokens: Tensor) -> Tensor:
        flags = [[completes[k] is not None and completes[k](layer, p, t) for p, t in zip(ps, ts)]
                 for k, ps, ts in zip(groups.tolist(), parents.tolist(), tokens.tolist())]
        return torch.tensor(flags, dtype=torch.bool, device=tokens.device).reshape(tokens.shape)

    return finishes


@dataclass
class _Pick:
    """One group's outcome as Python numbers, before log-probs are attached: ``(parent node, token, score)`` of
    the hypotheses it finished for sure and of its output candidates (at ``T > 0`` those that finish become
    hypotheses too)."""

    num_passed: int
    num_layers: int
    finished: list[tuple[int, int, float]]
    beams: list[tuple[int, int, float]]
    widths: list[int] | None  # T > 0: live accepted drafts of each passed layer; None at T 0 (the target's)
    accepted: list[int]  # accepted drafts per layer (T 0: per passed layer, the target's beams among them)

    def choices(self) -> list[tuple[int, int]]:
        return [(p, t) for p, t, _ in self.finished + self.beams]

    def decision(self, vs: VerifyStep, ends, logprobs: dict) -> VerifyDecision:
        def choice(parent: int, token: int, score: float) -> VerifyChoice:
            return VerifyChoice(parent, token, score, logprobs[(parent, token)])

        proposed = [sum(layer) for layer in vs.draft_exists]
        verified = min(self.num_passed + 1, self.num_layers)
        finished = [choice(*f) for f in self.finished]
        if self.widths is None:  # T 0: a passed layer's accepted nodes are the target's beams among its drafts
            beams = [choice(*b) for b in self.beams]
            accepted = (self.accepted + [0] * verified)[:verified]
            widths = proposed[: self.num_passed] + [len(beams)]  # the target's width, a left-out beam included
        else:
            beams = []
            for c in (choice(*b) for b in self.beams):
                (finished if ends(c.parent, c.token) else beams).append(c)
            accepted, widths = self.accepted[:verified], self.widths + [len(beams)]
        return VerifyDecision(vs.group_id, self.num_passed, beams, finished, proposed[:verified], accepted, widths)


def _sampled_picks(res, members: list[GroupInput], ends_of) -> list[_Pick]:
    width = members[0].vs.beam_width
    num_passed, accepted, node_scores = res.num_passed.tolist(), res.accepted.tolist(), res.node_scores.tolist()
    out_count, out_parent = res.out_count.tolist(), res.out_parent.tolist()
    out_token, out_score = res.out_token.tolist(), res.out_score.tolist()
    picks = []
    for k, g in enumerate(members):
        vs, passed, ends, n = g.vs, num_passed[k], ends_of[k], out_count[k]
        finished, widths = [], []
        for layer in range(passed):  # accepted EOS drafts of passed layers are finished hypotheses
            live = 0
            for slot in range(width):
                if accepted[k][layer][slot]:
                    node = (node_id(layer, vs.draft_parents[layer][slot], width), vs.draft_tokens[layer][slot])
                    if ends(*node):
                        finished.append((*node, node_scores[k][layer][slot]))
                    else:
                        live += 1
            widths.append(live)
        beams = [(node_id(passed, p, width), t, sc)
                 for p, t, sc in zip(out_parent[k][:n], out_token[k][:n], out_score[k][:n])]
        picks.append(_Pick(passed, len(vs.draft_parents), finished, beams, widths,
                           [sum(row) for row in accepted[k]]))
    return picks


def _greedy_picks(res, members: list[GroupInput]) -> list[_Pick]:
    width = members[0].vs.beam_width
    num_passed = res.num_passed.tolist()
    accepted = (res.beam_nodes >= 0).sum(-1).tolist()  # [G, γ]: a layer passed with some beams left out accepts fewer
    f_parent, f_cum = res.finished_parent.tolist(), res.finished_cum_logprob.tolist()
    f_valid, f_token = res.finished_valid.tolist(), res.finished_token.tolist()
    o_parent, o_token = res.out_parent.tolist(), res.out_token.tolist()
    o_cum, o_valid = res.out_cum_logprob.tolist(), res.out_valid.tolist()
    picks = []
    for k, g in enumerate(members):
        passed = num_passed[k]
        finished = [(node_id(i, p, width), t, c)  # step i+1's EOS / stop-token hypotheses: children of layer i
                    for i in range(passed + 1)
                    for p, c, ok, t in zip(f_parent[k][i], f_cum[k][i], f_valid[k][i], f_token[k][i]) if ok]
        beams = [(node_id(passed, p, width), t, c)
                 for p, t, c, ok in zip(o_parent[k], o_token[k], o_cum[k], o_valid[k]) if ok]
        picks.append(_Pick(passed, len(g.vs.draft_parents), finished, beams, None, accepted[k][:passed]))
    return picks


def _reported_logprobs(raw: _RawRows, members: list[GroupInput],
                       picks: list[_Pick]) -> list[dict[tuple[int, int], tuple[TokenLogprob, ...]]]:
    """Per group, per chosen (parent node, token): the raw target log-probs of the tokens from the root down to
    the parent, then of the token (as vLLM reports them), all read in one gather."""
    width = members[0].vs.beam_width
    chains = [(k, parent, token, _chain(g.vs, parent, token, width))
              for k, (g, pick) in enumerate(zip(members, picks)) for parent, token in pick.choices()]
    pairs = sorted({(k, node, tok) for k, _, _, chain in chains for node, tok in chain})
    out: list[dict] = [{} for _ in members]
    if not pairs:
        return out
    index = {pair: i for i, pair in enumerate(pairs)}
    device = raw.table.device
    flat = torch.tensor([k * raw.nodes_per_group + node for k, node, _ in pairs], device=device)
    toks = torch.tensor([tok for _, _, tok in pairs], device=device)
    logprobs = token_logprobs(raw.table.reshape(-1, raw.table.shape[-1]), flat, toks,
                              [members[k].vs.num_logprobs for k, _, _ in pairs], raw.lazy)
    for k, parent, token, chain in chains:
        out[k][(parent, token)] = tuple(logprobs[index[(k, node, tok)]] for node, tok in chain)
    return out


def _chain(vs: VerifyStep, parent_node: int, token: int, width: int) -> tuple[tuple[int, int], ...]:
    """(node, token) from the root down to ``parent_node``, then (parent_node, token)."""
    chain = [(parent_node, token)]
    node = parent_node
    while node >= width:  # walk up to the root
        layer, slot = layer_slot(node, width)
        parent = node_id(layer - 1, vs.draft_parents[layer - 1][slot], width)
        chain.append((parent, vs.draft_tokens[layer - 1][slot]))
        node = parent
    return tuple(reversed(chain))


class _RawRows:
    """The raw (untempered) log-probs of a bucket's nodes: ``table`` [G, γ+1, W, V] is them, or with ``lazy``
    the logits whose ``log_softmax`` only the rows asked for get (``T`` neither 0 nor 1: verification read
    the tempered log-probs; the raw ones are reported for the chosen tokens' few nodes)."""

    def __init__(self, table: Tensor, lazy: bool = False) -> None:
        self.table, self.lazy = table, lazy
        self.nodes_per_group = table.shape[1] * table.shape[2]


def node_completes(vs: VerifyStep, stops: StopCheckers | None):
    """``(layer, slot, token) -> bool``: the token completes a stop string after node (layer, slot)'s text
    (its root's tail, then the draft tokens down to it); None without stop strings."""
    if not vs.stop:
        return None
    if stops is None:
        raise RuntimeError(f"beam group {vs.group_id} has stop strings but the runner has no stop checkers")
    checker = stops.get(vs.stop)

    def completes(layer: int, slot: int, token: int) -> bool:
        below = []
        while layer > 0:
            below.append(vs.draft_tokens[layer - 1][slot])
            slot = vs.draft_parents[layer - 1][slot]
            layer -= 1
        if slot >= len(vs.tails):  # an empty root slot: no text, nothing to finish
            return False
        return checker.completes((*vs.tails[slot], *reversed(below)), token)

    return completes


def node_token_finishes(vs: VerifyStep, completes):
    """``(parent node id, token) -> bool``: the token finishes the sequence after that forest node (EOS
    unless ignore_eos, a stop token, or a stop string it completes; ``completes``: :func:`node_completes`)."""
    def finishes(parent_node: int, token: int) -> bool:
        return (token_finishes(token, vs.eos_token_id, vs.ignore_eos, vs.stop_token_ids)
                or (completes is not None and completes(*layer_slot(parent_node, vs.beam_width), token)))

    return finishes


def token_logprob(row: Tensor, token: int, num_logprobs: int) -> TokenLogprob:
    """``token``'s entry of a raw log-prob row [V], with its rank when log-probs were asked for
    (``num_logprobs`` >= 0; a pass over V, else 0) and, for ``num_logprobs`` > 0, the top-k."""
    lp = float(row[token])
    rank = int((row > row[token]).sum()) + 1 if num_logprobs >= 0 else 0
    top = ((), ())
    if num_logprobs > 0:
        vals, ids = row.topk(num_logprobs)
        top = (tuple(ids.tolist()), tuple(vals.tolist()))
    return TokenLogprob(lp, rank, *top)


def token_logprobs(table: Tensor, flat_rows: Tensor, tokens: Tensor, asked: Sequence[int],
                   lazy: bool = False) -> list[TokenLogprob]:
    """:func:`token_logprob` of many entries at once: entry i is ``tokens[i]`` in row ``flat_rows[i]`` of
    ``table`` [R, V] (raw log-probs; ``lazy``: logits, each row read is log-softmaxed), reported as its
    ``asked[i]`` (a ``num_logprobs``) says. One gather for every entry; the rows are copied, and ranks and
    top-k taken in one pass over them, only when some entry asks for them (or ``lazy``)."""
    most = max(asked, default=-1)
    if most < 0 and not lazy:  # the log-probs alone: no row is copied
        lp, ranks, rows = table.reshape(-1)[flat_rows * table.shape[-1] + tokens].tolist(), None, None
    else:
        rows = table[flat_rows]
        if lazy:
            rows = torch.log_softmax(rows, dim=-1)
        values = rows.gather(1, tokens[:, None])  # [n, 1]
        lp = values[:, 0].tolist()
        ranks = ((rows > values).sum(-1) + 1).tolist() if most >= 0 else None  # a pass over V per entry
    tops = {n: rows.topk(n, dim=-1) for n in set(asked) if n > 0}
    tops = {n: (t.indices.tolist(), t.values.tolist()) for n, t in tops.items()}
    return [TokenLogprob(lp[i], ranks[i] if n >= 0 else 0,
                         *((tuple(tops[n][0][i]), tuple(tops[n][1][i])) if n > 0 else ((), ())))
            for i, n in enumerate(asked)]
