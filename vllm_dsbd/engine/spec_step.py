"""The runner's side of DSBD: draft layers and forest verification from logits.

Pure torch plus ``vllm_dsbd.algorithm`` (no vLLM), unit-tested with toy
models. One DSBD iteration of a group (docs/algorithm.md) runs as:

- draft layer ``i`` (:func:`draft_layer`): the draft model's logits at
  every parent node of layer ``i-1`` give the draft joint ``Q_i`` over
  (parent slot, token); ``W`` nodes are drawn from it with replacement
  (``T > 0``) or taken by the draft's beam search (``T = 0``). ``Q_i`` stays
  in the runner (:class:`DraftStore`) until the iteration is verified;
- verification (``engine.verify_step``, every group of the step together): the
  target's logits at every node of every root-to-leaf path (one target forward)
  give ``p(. | node)``; then ``algorithm.verify_forest`` (layer-by-layer
  acceptance with residuals and the width rule) or
  ``algorithm.verify_forest_greedy`` (lossless beam search).

Layouts (``algorithm.forest``): a layer has ``W`` slots; layer 0 holds the
live beams; node id of (layer ``i``, slot ``j``) is ``j`` for ``i = 0`` and
``W + (i-1) W + j`` otherwise; flattened joint index = ``slot * V + token``.
Randomness comes from generators seeded from (seed, iteration, purpose), the
same on every tensor-parallel rank (:mod:`.streams`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from vllm_dsbd.algorithm import beam_search_step, joint_probs, sample_joint, tempered_logprobs
from vllm_dsbd.engine.protocol import DraftDecision, DraftStep, VerifyStep
from vllm_dsbd.engine.streams import generator


class DraftStore:
    """The draft joints ``Q_i`` of each group's current iteration, kept until it is verified: each [W*V], or
    [W*K] over the columns of a support (:func:`draft_layer`)."""

    def __init__(self) -> None:
        # group -> (iteration, layer -> (joint, support or None))
        self._joints: dict[str, tuple[int, dict[int, tuple[Tensor, Tensor | None]]]] = {}

    def put(self, group_id: str, step: int, layer: int, joint: Tensor, support: Tensor | None = None) -> None:
        """Keep layer ``layer``'s joint of iteration ``step``. Layer 1 starts the iteration's entry afresh: an
        iteration drafts from its first layer on, and one restarted after a preemption (its KV lost, the same
        ``step``) may draft fewer layers than before, whose stale joints must not reach its verification."""
        current = self._joints.get(group_id)
        if current is None or current[0] != step or layer == 1:
            current = (step, {})
            self._joints[group_id] = current
        current[1][layer] = joint, support

    def take(self, group_id: str, step: int, num_layers: int) -> tuple[Tensor, Tensor | None]:
        """The joints of layers 1..num_layers of iteration ``step`` ([num_layers, W*V], or [num_layers, W*K]
        over the support) and their support (None: all V); forgets the group."""
        step_stored, joints = self._joints.pop(group_id)
        if step_stored != step or sorted(joints) != list(range(1, num_layers + 1)):
            raise RuntimeError(f"group {group_id}: draft joints of iteration {step_stored} layers {sorted(joints)}, "
                               f"verifying iteration {step} with {num_layers} layers")
        layers = [joints[i] for i in range(1, num_layers + 1)]
        support = layers[0][1]
        if any((s is None) != (support is None) or (s is not None and not torch.equal(s, support))
               for _, s in layers):
            raise RuntimeError(f"group {group_id}: the draft layers of iteration {step} have different supports")
        return torch.stack([joint for joint, _ in layers]), support

    def forget(self, group_ids) -> None:
        for gid in group_ids:
            self._joints.pop(gid, None)

    def __len__(self) -> int:
        return len(self._joints)


def draft_layer(logits: Tensor, row_of: Mapping[str, int], ds: DraftStep, support: Tensor | None = None,
                vocab_size: int | None = None) -> tuple[DraftDecision, Tensor | None]:
    """One group's draft layer: :func:`draft_layers` with the rows of ``ds.req_ids`` in ``row_of``."""
    return draft_layers(logits, [[row_of[r] for r in ds.req_ids]], [ds], support, vocab_size)[0]


def draft_layers(logits: Tensor, rows: Sequence[Sequence[int]], steps: Sequence[DraftStep],
                 support: Tensor | None = None, vocab_size: int | None = None
                 ) -> list[tuple[DraftDecision, Tensor | None]]:
    """Every group's draft layer ``ds.layer`` in one pass per kind: the W nodes of each and, for ``T > 0``,
    the joint ``Q`` they were drawn from (the draft's logits tempered by ``T * ds.draft_temperature_scale``).
    At T 0: the W best of beam score + the draft's log-probs at temperature ``ds.draft_temperature_scale``,
    by vLLM's beam-search rule. Groups of the same kind and width are decided together; each group's draws
    come from its own generator (seed, iteration, layer), so they do not depend on the groups beside it (a
    top-k / top-p group's joint only to the rounding of its renormalisation, whose path ``restrict_joint``
    chooses per pass).

    logits: [num_rows, V] draft logits of this step's rows; rows[g]: the rows of ``steps[g]``'s parent nodes
    (its ``slots``, in order). support: the ascending token ids the draft can propose (every other logit is
    -inf: an EAGLE-3 head's draft vocabulary, ``draft_vocab_size``), or None for all V. The draw (T > 0) and
    the search (T 0) run over those columns only: they choose what the same over all V does (the other
    tokens have probability 0, and the column order keeps the token order that ties and top-k follow), at a
    fraction of the cost. vocab_size: V, given when ``logits`` hold only the support's columns ([num_rows,
    K]: a head's ``eagle3.draft_vocabulary_logits``). Each Q is [W*V] float32, or with a support [W*K]
    over its columns (0 on every other token; ``verify_forest``'s ``draft_support`` verifies on those
    columns, :func:`expand_joint` makes the [W*V] one).
    """
    if vocab_size is not None and support is None:
        raise ValueError("draft_layer: logits over the support's columns only need the support")
    buckets: dict[tuple, list[int]] = {}
    for g, ds in enumerate(steps):
        # restricted groups apart: restricting any row renormalises every row of the pass (rounding)
        key = (True, ds.beam_width, ds.top_k > 0 or ds.top_p < 1) if ds.temperature > 0 else (
            False, ds.beam_width, ds.eos_token_id, tuple(ds.stop_token_ids))
        buckets.setdefault(key, []).append(g)
    out: list = [None] * len(steps)
    for key, members in buckets.items():
        draw = _sampled_layers if key[0] else _searched_layers
        for g, result in zip(members, draw(logits, [rows[g] for g in members], [steps[g] for g in members],
                                           support, vocab_size)):
            out[g] = result
    return out


def _parents(logits: Tensor, rows: Sequence[Sequence[int]], steps: Sequence[DraftStep], temperatures: list[float],
             support: Tensor | None, vocab_size: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """The groups' parent nodes as [G, W] slots: (valid, scores float64, log-probs [G, W, C] tempered by each
    group's temperature, over the support's columns when there is one: :func:`draft_layers`' ``logits`` as
    they are when they hold only those columns (``vocab_size`` given), else the support's columns of them)."""
    device, width = logits.device, steps[0].beam_width  # every tensor below on the logits' device
    flat = [r for group in rows for r in group]
    parent_logits = logits.index_select(0, torch.tensor(flat, device=device)).float()  # [P, C]
    if support is not None and vocab_size is None:
        parent_logits = parent_logits[:, support]
    group_of = torch.tensor([g for g, group in enumerate(rows) for _ in group], device=device)
    slot_of = torch.tensor([s for ds in steps for s in ds.slots], device=device)
    per_row = torch.tensor([temperatures[g] for g, group in enumerate(rows) for _ in group], device=device)
    valid = torch.zeros((len(steps), width), dtype=torch.bool, device=device)
    valid[group_of, slot_of] = True
    scores = torch.full((len(steps), width), float("-inf"), dtype=torch.float64, device=device)
    scores[group_of, slot_of] = torch.tensor([x for ds in steps for x in ds.scores], dtype=torch.float64,
                                             device=device)
    lp = torch.zeros((len(steps), width, parent_logits.shape[-1]), device=device)
    lp[group_of, slot_of] = tempered_logprobs(parent_logits, per_row[:, None])
    return valid, scores, lp


def _sampled_layers(logits, rows, steps, support, vocab_size) -> list[tuple[DraftDecision, Tensor]]:
    """T > 0, groups of one width: W nodes each drawn i.i.d. from the draft joint (with replacement)."""
    device, width = logits.device, steps[0].beam_width
    valid, scores, lp = _parents(logits, rows, steps, [ds.temperature * ds.draft_temperature_scale for ds in steps],
                                 support, vocab_size)
    q = joint_probs(scores, valid, lp, torch.tensor([ds.top_k for ds in steps], device=device),
                    torch.tensor([ds.top_p for ds in steps], device=device))  # [G, W*C]
    draws = sample_joint(q, width, [generator(ds.seed, ds.step, ds.layer, device) for ds in steps])  # [G, W]
    parents, columns_drawn = draws // lp.shape[-1], draws % lp.shape[-1]
    new_scores = scores.gather(1, parents) + lp[torch.arange(len(steps), device=device)[:, None], parents,
                                                columns_drawn].double()
    tokens = columns_drawn if support is None else support[columns_drawn]  # token ids
    parents, tokens, new_scores = parents.tolist(), tokens.tolist(), new_scores.tolist()  # one transfer each
    return [(DraftDecision(ds.group_id, parents[g], tokens[g], new_scores[g]), q[g]) for g, ds in enumerate(steps)]


def _searched_layers(logits, rows, steps, support, vocab_size) -> list[tuple[DraftDecision, None]]:
    """T 0, groups of one width, EOS and stop tokens: the W best candidates each by vLLM's beam-search rule,
    the draft ranked at its ``draft_temperature_scale`` (over the support's columns when there is one)."""
    device, width, first = logits.device, steps[0].beam_width, steps[0]
    valid, scores, lp = _parents(logits, rows, steps, [ds.draft_temperature_scale for ds in steps], support,
                                 vocab_size)
    step = beam_search_step(lp, scores, valid, torch.tensor([ds.seq_len for ds in steps], device=device), width,
                            first.eos_token_id, torch.tensor([ds.ignore_eos for ds in steps], device=device),
                            torch.tensor([ds.length_penalty for ds in steps], dtype=torch.float64, device=device),
                            first.stop_token_ids, token_ids=support)
    keep, parents, tokens, cums = (t.tolist() for t in (step.valid, step.parents, step.tokens, step.cum_logprobs))
    return [(DraftDecision(ds.group_id, [p for p, k in zip(parents[g], keep[g]) if k],
                           [t for t, k in zip(tokens[g], keep[g]) if k], [c for c, k in zip(cums[g], keep[g]) if k]),
             None) for g, ds in enumerate(steps)]


def expand_joint(joint: Tensor, support: Tensor, width: int, vocab_size: int) -> Tensor:
    """A joint over a support's columns ([W*K], :func:`draft_layer`) over the whole vocabulary: [W*V], 0 on
    every token outside the support."""
    full = joint.new_zeros((width, vocab_size))
    full[:, support] = joint.view(width, -1)
    return full.view(-1)


def proposable_tokens(support: Tensor | None, vocab_size: int) -> Tensor | None:
    """The ``support`` to give :func:`draft_layer`: the draft's proposable token ids when they are at most half
    the vocabulary (below that, sampling over all V costs about as much), else None."""
    return support if support is not None and 0 < support.numel() <= vocab_size // 2 else None


def check_support(logits: Tensor, support: Tensor) -> None:
    """Raise unless every finite logit column of ``logits`` [P, V] is in ``support``: a draw over the support
    only would otherwise drop tokens the draft proposes (checked once per engine, on its first draft layer)."""
    outside = torch.isfinite(logits).any(0)
    outside[support.to(outside.device)] = False
    if bool(outside.any()):
        raise RuntimeError(f"the draft gives finite logits to {int(outside.sum())} tokens outside its draft "
                           f"vocabulary of {support.numel()} (e.g. token {int(outside.nonzero()[0, 0])})")


def shared_node_rows(verify_steps: Sequence[VerifyStep], row_start: Mapping[str, int], num_rows: int) -> Tensor | None:
    """Per logits row, the row whose logits it may take: itself, or an earlier row of the same forest node.

    Root-to-leaf paths repeat the nodes they share (a root with several children is on several paths),
    and ``verify_step`` reads each node's logits from the first path through it, so the target's head
    needs only those rows. row_start: the first logits row of each path request (its rows follow the
    path's nodes, root first). Returns [num_rows] int64, or None when no row repeats a node.

    Example (W 2, one layer): paths ((0, 2), (0, 3), (1,)) on rows 0-1, 2-3, 4 -> [0, 1, 0, 3, 4]:
    row 2 (root 0 again, on the second path) takes row 0's logits.
    """
    source = torch.arange(num_rows)
    shared = False
    for vs in verify_steps:
        first_row: dict[int, int] = {}
        for k, (rid, path) in enumerate(zip(vs.path_req_ids, vs.paths)):
            skip = vs.skip(k)  # rows from the path's first own node (``VerifyStep.shared``): none repeats
            for offset, node in enumerate(path[skip:]):
                row = row_start[rid] + offset
                if node in first_row:
                    source[row], shared = first_row[node], True
                else:
                    first_row[node] = row
    return source if shared else None
