"""Verification of a draft forest against the target: layers, residuals, width.

Notation (docs/algorithm.md, "One DSBD iteration"): at layer ``i`` of a group,
``P`` is the target joint over the *valid* parents of the layer (the input
beams at layer 1, the accepted non-EOS drafts of layer ``i-1`` after that)
times the vocabulary, ``Q`` the draft joint the layer's ``W`` drafts were
drawn from (over all draft parents), and ``Q' = Q`` restricted to the valid
parents, *not* renormalised. Flattened pairs: ``index = parent * V + token``.

One *slot* of a layer is a chain over the drafts, in draw order, with a
current target distribution ``R`` (``R = P`` when the slot starts)::

    draft j with a valid parent: accept with probability min(1, R(j) / Q'(j))
    draft j with an invalid parent: reject
    on rejection: R <- norm(max(R - Q', 0))        (also after invalid parents)
    on acceptance: the slot's outcome is draft j; the next slot starts, R <- P

A slot's outcome is exactly a draw from ``P`` (accept mass ``min(R, Q')``,
reject mass ``sum max(R - Q', 0)``, residual ``max(R - Q', 0) / that``), so the
slots of a layer are i.i.d. ``P``. The layer stops after ``w_i`` acceptances
(*passes*: the accepted drafts are the valid parents of layer ``i+1``);
otherwise it *fails* and outputs its slots: the accepted drafts, then one draw
from the current ``R``, then fresh draws from ``P``, ``W_out`` in all (when
more than ``W_out`` drafts were accepted, the first ``W_out``). If every
layer passes, ``W_out`` beams are drawn from the target joint over the
children of the last layer (the *bonus* layer).

Decisions where docs/algorithm.md leaves room:

- ``R`` is updated after *every* rejection, including a draft whose parent is
  invalid (its rejection mass is part of ``1 - sum min(R, Q')``; skipping the
  update would bias the slot).
- If a residual has zero mass (rejection had probability zero up to rounding)
  ``R`` is kept.
- ``R`` after ``r`` rejections since the last acceptance is always ``R_r`` of
  the layer's *residual ladder* (``R_0 = P``, ``R_{r+1} = norm(max(R_r - Q',
  0))``), so each layer computes the ladder once (``W`` residuals, shared with
  the width DP; with fixed width only the levels some group reaches) and a
  group's chain state is the integer ``r``. Memory: one ``(W + 1) x G x W x V``
  float buffer per :func:`verify_forest` call (``W x (K + 1)`` for a draft of K
  columns: :mod:`.draft_columns`, whose outside draws take ``W_out`` more
  uniforms of a group that has one).
- Width: ``K`` is the number of acceptances among all ``W`` drafts of a layer
  (the layer passes iff ``K >= w_i``). ``w_i = max{k <= W : Pr(K >= k) >= τ}``
  then ``max(w_i, min_width)``; ``τ >= 1`` means fixed width ``w_i = W``
  (never decided by the rounding of ``Pr(K = W)``). The DP runs in float64.
- Accepted drafts whose token is EOS (unless ``ignore_eos``) are finished
  hypotheses and not parents of the next layer. A passing layer whose
  accepted drafts are all EOS ends the group's iteration with no live output.
- Memory-efficient mode is ``num_out = 1``; layers inside the iteration still
  keep up to ``W`` beams.
- Randomness: per verified layer a group uses ``W + W_out`` uniforms (one per
  draft, one per output slot), per bonus layer ``W_out``. With one generator
  per group, a group's results do not depend on the rest of the batch.

Deterministic mode (``T = 0``) is :func:`.verify_greedy.verify_forest_greedy`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_dsbd.algorithm.draft_columns import DraftColumns
from vllm_dsbd.algorithm.joint import (
    Generators,
    finishing_tokens,
    joint_probs,
    sample_from_uniforms,
    tempered_logprobs,
    uniforms,
)


def restrict_to_parents(draft_joint: Tensor, parent_valid: Tensor) -> Tensor:
    """``Q'``: the draft joint with invalid parents zeroed, not renormalised.

    draft_joint: [G, B*V]. parent_valid: [G, B] bool. Returns [G, B*V].
    """
    num_groups, num_beams = parent_valid.shape
    q = draft_joint.reshape(num_groups, num_beams, -1) * parent_valid[:, :, None]
    return q.reshape(num_groups, -1)


def _residual(current: Tensor, restricted_draft: Tensor, out: Tensor) -> Tensor:
    """Write ``norm(max(R - Q', 0))`` into ``out`` (``R`` where that has no mass); return the mass [G].

    current, restricted_draft, out: [G, N].
    """
    torch.sub(current, restricted_draft, out=out).clamp_(min=0)
    mass = out.sum(-1, keepdim=True)
    out.div_(mass.clamp_min(torch.finfo(out.dtype).tiny))
    empty = mass[:, 0] <= 0
    if bool(empty.any()):
        out[empty] = current[empty]
    return mass[:, 0]


def residual_ladder(target: Tensor, restricted_draft: Tensor, depth: int,
                    out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The layer's residuals ``R_0 = P``, ``R_{r+1} = norm(max(R_r - Q', 0))`` and acceptance rates.

    target, restricted_draft: [G, N]. out: optional [depth + 1, G, N] buffer to
    fill (reusing one across layers saves the allocation's page faults on CPU).
    Returns ``ladder`` [depth + 1, G, N] and ``alpha`` [G, depth] float64 with
    ``α_r = sum min(R_r, Q') = 1 - sum max(R_r - Q', 0)``. After ``r``
    rejections since the last acceptance a slot's current target is ``R_r``, so
    one ladder per layer serves every draft and the width DP.
    """
    ladder = target.new_empty((depth + 1, *target.shape)) if out is None else out
    ladder[0] = target
    masses = [_residual(ladder[r], restricted_draft, ladder[r + 1]) for r in range(depth)]
    if not masses:
        return ladder, target.new_zeros((target.shape[0], 0), dtype=torch.float64)
    return ladder, (1 - torch.stack(masses, -1).double()).clamp(0, 1)


def _fill_ladder(ladder: Tensor, levels: int, upto: int, target: Tensor, restricted_draft: Tensor) -> int:
    """Compute ladder levels ``levels..upto`` in place (``ladder`` [W + 1, G, N]); return the levels filled."""
    if levels == 0:
        ladder[0] = target
        levels = 1
    while levels <= upto:
        _residual(ladder[levels - 1], restricted_draft, ladder[levels])
        levels += 1
    return levels


def _next_rejections(rejections: int, accepted: bool) -> int:
    """Rejections since the last acceptance, after one more draft: 0 after an acceptance (R <- P), else +1."""
    return 0 if accepted else rejections + 1


NodeFinishes = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""``(layer, groups, parents, tokens) -> finishes``: groups [R] (batch rows), parents [R, N] slots of nodes
in ``layer`` (0: the input beams), tokens [R, N]; true where the parent's text with the token completes a
stop string (the child finishes as EOS does)."""


def _next_parents(accepted: Tensor, tokens: Tensor, eos_token_id: int | None, ignore_eos: Tensor,
                  stop_token_ids: Sequence[int] = (), stop_strings: Tensor | None = None) -> Tensor:
    """Valid parents of the next layer: accepted drafts that did not finish (EOS, a stop token, a stop
    string where ``stop_strings`` [G, W] says so). [G, W] bool."""
    finishes, _ = finishing_tokens(tokens, eos_token_id, ignore_eos[:, None], stop_token_ids)
    if stop_strings is not None:
        finishes = finishes | stop_strings
    return accepted & ~finishes


def acceptance_count_distribution(alpha: Tensor) -> Tensor:
    """Distribution of ``K``, the acceptances among a layer's ``W`` drafts.

    alpha: [G, W] ``α_r`` of :func:`residual_ladder`: a draft seen after ``r``
    rejections since the last acceptance is accepted with probability ``α_r``.
    Returns [G, W + 1] float64, ``out[g, k] = Pr(K = k)``.

    DP over ``r``: from state ``r`` a draft is accepted (-> state 0, ``K + 1``)
    or rejected (-> ``r + 1``).
    """
    num_groups, num_drafts = alpha.shape
    alpha = alpha.double()
    # state[g, r, k]: Pr(r rejections since the last acceptance, k acceptances)
    state = torch.zeros((num_groups, num_drafts + 1, num_drafts + 1), dtype=torch.float64, device=alpha.device)
    state[:, 0, 0] = 1.0
    for _ in range(num_drafts):
        head = state[:, :num_drafts, :]  # states r < num_drafts can still see a draft
        accept = (head * alpha[:, :, None]).sum(1)  # [G, k]
        reject = head * (1 - alpha)[:, :, None]
        state = torch.zeros_like(state)
        state[:, 0, 1:] = accept[:, :-1]
        state[:, 1:, :] = reject
    return state.sum(1)


def choose_width(count_distribution: Tensor, width_threshold: Tensor, min_width: Tensor | int) -> Tensor:
    """The width rule ``w = max{k <= W : Pr(K >= k) >= τ}``, at least ``min_width``.

    count_distribution: [G, W+1] ``Pr(K = k)``. width_threshold: [G] τ
    (``>= 1``: fixed width W). min_width: [G] or int. Returns [G] int64.
    """
    max_width = count_distribution.shape[-1] - 1
    tail = count_distribution.flip(-1).cumsum(-1).flip(-1)  # Pr(K >= k)
    ks = torch.arange(max_width + 1, device=tail.device)
    ok = tail >= width_threshold.double()[:, None]
    ok[:, 0] = True
    width = (ok * ks).amax(-1)
    width = torch.where(width_threshold >= 1, max_width, width)
    return torch.maximum(width, torch.as_tensor(min_width, device=width.device)).clamp(max=max_width)


@dataclass
class LayerVerification:
    """Result of :func:`verify_layer`. Slots are in outcome order (first slot first)."""

    accepted: Tensor  # [G, W] bool: draft j accepted
    passed: Tensor  # [G] bool: `width` drafts accepted
    out_index: Tensor  # [G, W] flat pair index of each slot outcome (valid for s < out_count)
    out_draft: Tensor  # [G, W] draft j behind each accepted slot, -1 for residual/fresh draws
    out_count: Tensor  # [G] `width` when passed, else `num_out`


def verify_layer(
    target: Tensor,
    draft_joint: Tensor,
    parent_valid: Tensor,
    draft_index: Tensor,
    draft_exists: Tensor,
    width: Tensor,
    num_out: int,
    generator: Generators,
    ladder: Tensor | None = None,
    ladder_levels: int = 0,
    restricted: Tensor | None = None,
) -> LayerVerification:
    """Accept drafts of one layer for many groups (see the module docstring).

    target: [G, N] ``P`` over valid parents (zero rows on invalid ones).
    draft_joint: [G, N] ``Q``, the distribution the drafts were drawn from.
    parent_valid: [G, B] bool, ``N = B * V``.
    draft_index: [G, W] flat pair index of draft j. draft_exists: [G, W] bool.
    width: [G] ``w_i`` in 1..W. num_out: ``W_out`` (<= W), slots output on failure.
    ladder: optional [W + 1, G, N] buffer for the :func:`residual_ladder` of ``P`` and
        ``Q'``, its first ``ladder_levels`` levels already computed; the others are
        computed when some group first needs them (a layer that accepts early
        computes few residuals).
    restricted: ``Q'`` (:func:`restrict_to_parents`) when the caller has it.
    """
    num_groups, num_drafts = draft_index.shape
    device = target.device
    if not 1 <= num_out <= num_drafts:
        raise ValueError(f"num_out={num_out} must be in 1..{num_drafts} (the number of drafts per layer)")
    vocab = target.shape[-1] // parent_valid.shape[-1]
    if restricted is None:
        restricted = restrict_to_parents(draft_joint, parent_valid)
    if ladder is None:
        ladder = target.new_empty((num_drafts + 1, *target.shape))
    levels = _fill_ladder(ladder, ladder_levels, 0, target, restricted)
    u = uniforms(generator, num_groups, num_drafts + num_out, device)

    # The chains run on Python numbers: each draft's u * Q'(x) (a float32 product, as the rule compares it),
    # and R_r(x) of ladder level r, gathered the first time a chain reaches level r. Python floats hold
    # float32 values exactly, so every comparison is the float32 one.
    q = restricted.gather(1, draft_index)
    scaled = (u[:, :num_drafts] * q).tolist()
    can_accept = (parent_valid.gather(1, draft_index // vocab) & draft_exists & (q > 0)).tolist()
    at_drafts: list[list[list[float]]] = []  # at_drafts[r][g][j] = R_r(draft j of group g)

    def residual_at_drafts(r: int) -> list[list[float]]:
        nonlocal levels
        while len(at_drafts) <= r:
            levels = _fill_ladder(ladder, levels, len(at_drafts), target, restricted)
            at_drafts.append(ladder[len(at_drafts)].gather(1, draft_index).tolist())
        return at_drafts[r]

    drafts, widths = draft_index.tolist(), width.tolist()
    chains = [_chain(can_accept[g], scaled[g], drafts[g], widths[g], lambda r, g=g: residual_at_drafts(r)[g])
              for g in range(num_groups)]
    accepted_rows, index_rows, draft_rows, counts, last_rejections = zip(*chains)
    accepted = torch.tensor(accepted_rows, dtype=torch.bool, device=device)
    out_index = torch.tensor(index_rows, dtype=torch.long, device=device)
    out_draft = torch.tensor(draft_rows, dtype=torch.long, device=device)
    count = torch.tensor(counts, dtype=torch.long, device=device)
    rejections = torch.tensor(last_rejections, dtype=torch.long, device=device)

    passed = count >= width
    if bool(passed.all()):
        return LayerVerification(accepted, passed, out_index, out_draft, width.clone())
    failed = (~passed).nonzero()[:, 0]
    count, rejections = count[failed], rejections[failed]
    _fill_ladder(ladder, levels, int(rejections.max()), target, restricted)
    u_out = u[failed, num_drafts:]
    slots = torch.arange(num_out, device=device)[None, :]
    # slot `count` is a draw from the current residual, later slots fresh draws from P (only where some exist)
    fresh = torch.zeros_like(u_out, dtype=torch.long)
    if bool((count < num_out).any()):
        fresh = sample_from_uniforms(_residuals(ladder, rejections, failed), u_out)  # [F, W_out]
    if bool((count + 1 < num_out).any()):
        fresh = torch.where(slots == count[:, None], fresh, sample_from_uniforms(_rows(target, failed), u_out))
    earlier = slots < count[:, None]
    out_index[failed, :num_out] = torch.where(earlier, out_index[failed, :num_out], fresh)
    out_draft[failed, :num_out] = torch.where(earlier, out_draft[failed, :num_out], -1)
    out_count = torch.where(passed, width, num_out)
    return LayerVerification(accepted, passed, out_index, out_draft, out_count)


def _chain(can_accept: list[bool], scaled: list[float], drafts: list[int], width: int,
           residual: Callable[[int], list[float]]) -> tuple[list, list, list, int, int]:
    """One group's slots over its drafts in draw order (the module docstring): draft j is accepted when it
    may be (``can_accept``) and ``u_j Q'(x_j)`` (``scaled``) is below ``R_r(x_j)``, r the rejections since the
    last acceptance (``residual(r)``: ``R_r`` at the group's drafts); the chain stops after ``width``
    acceptances. Returns (accepted per draft, the accepted
    pair indices and draft numbers in slot order, padded with 0 and -1, the acceptances, the final r)."""
    num_drafts = len(drafts)
    accepted, index, draft = [False] * num_drafts, [0] * num_drafts, [-1] * num_drafts
    count = rejections = 0
    for j in range(num_drafts):
        if count >= width:
            break
        acc = can_accept[j] and scaled[j] < residual(rejections)[j]
        if acc:
            accepted[j], index[count], draft[count] = True, drafts[j], j
            count += 1
        rejections = _next_rejections(rejections, acc)
    return accepted, index, draft, count, rejections


def _rows(values: Tensor, rows: Tensor) -> Tensor:
    """``values[rows]``: a view, not a copy, when ``rows`` is every row in order (one group, most often)."""
    if rows.numel() == values.shape[0] and bool((rows == torch.arange(rows.numel(), device=rows.device)).all()):
        return values
    return values[rows]


def _residuals(ladder: Tensor, levels: Tensor, rows: Tensor) -> Tensor:
    """``ladder[levels[k], rows[k]]`` for each k: [K, N] (a view for one row)."""
    if rows.numel() == 1:
        return ladder[int(levels[0]), int(rows[0])][None]
    return ladder[levels, rows]


def _child_scores(parent_scores: Tensor, logprobs: Tensor, index: Tensor) -> Tensor:
    """Target scores ``S_parent + log p_T(token | parent)`` of flat pairs ``index`` [g, S], float64.

    parent_scores: [g, W] float64. logprobs: [g, W, V]. Only the pairs asked for are computed.
    """
    vocab = logprobs.shape[-1]
    return parent_scores.gather(1, index // vocab) + logprobs.flatten(1).gather(1, index).double()


@dataclass
class ForestVerification:
    """Result of :func:`verify_forest` for G groups (sampling mode).

    Output beams live at depth ``out_depth = num_passed + 1`` (1-based layer;
    ``num_layers + 1`` is the bonus layer): beam s is ``(parent node of layer
    out_depth - 1, token)``; layer 0 nodes are the input beams.
    """

    num_passed: Tensor  # [G] layers passed
    widths: Tensor  # [G, γ] w_i of each verified layer, 0 where not verified
    accepted: Tensor  # [G, γ, W] bool: draft node accepted (passed layers and the failing one)
    node_scores: Tensor  # [G, γ, W] float64 target score of draft nodes (meaningful for accepted ones)
    out_parent: Tensor  # [G, W] node index in layer out_depth - 1
    out_token: Tensor  # [G, W]
    out_score: Tensor  # [G, W] float64 target cumulative score (tempered log-probs)
    out_draft: Tensor  # [G, W] draft slot of layer out_depth the beam is, or -1
    out_count: Tensor  # [G] output beams (W_out; 0 if no live parent remained)

    @property
    def out_depth(self) -> Tensor:  # [G]
        return self.num_passed + 1

    @classmethod
    def _empty(cls, num_groups: int, gamma: int, width: int, device: torch.device) -> ForestVerification:
        def full(shape, value, dtype=torch.long):
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(
            num_passed=full((num_groups,), 0), widths=full((num_groups, gamma), 0),
            accepted=full((num_groups, gamma, width), False, torch.bool),
            node_scores=full((num_groups, gamma, width), float("-inf"), torch.float64),
            out_parent=full((num_groups, width), 0), out_token=full((num_groups, width), 0),
            out_score=full((num_groups, width), float("-inf"), torch.float64),
            out_draft=full((num_groups, width), -1), out_count=full((num_groups,), 0),
        )

    def _store_outputs(self, rows: Tensor, index: Tensor, scores: Tensor, drafts: Tensor | None,
                       vocab: int) -> None:
        """Output pairs of groups ``rows``: flat ``index`` [g, W_out] and their target ``scores``."""
        num_out = index.shape[1]
        self.out_parent[rows, :num_out] = index // vocab
        self.out_token[rows, :num_out] = index % vocab
        self.out_score[rows, :num_out] = scores
        self.out_draft[rows, :num_out] = -1 if drafts is None else drafts
        self.out_count[rows] = num_out


def verify_forest(
    target_logprobs: Tensor,
    root_scores: Tensor,
    root_valid: Tensor,
    draft_joints: Tensor,
    draft_parents: Tensor,
    draft_tokens: Tensor,
    draft_exists: Tensor,
    num_layers: Tensor,
    width_threshold: Tensor,
    min_width: Tensor | int,
    num_out: int,
    generator: Generators,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    eos_token_id: int | None = None,
    ignore_eos: Tensor | None = None,
    stop_token_ids: Sequence[int] = (),
    finishes_fn: NodeFinishes | None = None,
    draft_support: Tensor | None = None,
    temperature: float | None = None,
) -> ForestVerification:
    """Verify one DSBD iteration of many groups (sampling mode, ``T > 0``).

    target_logprobs: [G, γ+1, W, V] tempered target log-probs ``log p_T(· | node)``
        of layer-0 nodes (input beams, padded to W) and of each draft layer's nodes.
        Rows of nodes that are never valid parents may hold anything.
    root_scores: [G, W] cumulative scores of the input beams. root_valid: [G, W] bool.
    draft_joints: [G, γ, W*V] ``Q_i`` each layer was drawn from (parents = layer i-1 nodes); with
        ``draft_support`` ([K] ascending token ids the draft proposes, K < V), [G, γ, W*K] over those
        columns only, and each layer is verified on them (:mod:`.draft_columns`).
    draft_parents, draft_tokens: [G, γ, W] parent slot in layer i-1 and token of draft j.
    draft_exists: [G, γ, W] bool. num_layers: [G] draft layers to verify (<= γ).
    width_threshold: [G] τ (>= 1: fixed width). min_width: [G] or int (>= 1).
    num_out: W_out. generator: one, or one per group. top_k, top_p, ignore_eos: [G] or None.
    temperature: given, ``target_logprobs`` holds the target's logits and a layer's rows are tempered
    (``tempered_logprobs``) only when the layer is reached: a forest that fails early never normalises the
    rows of its deeper nodes.
    """
    num_groups, depth, width, vocab = target_logprobs.shape
    device = target_logprobs.device
    if int(torch.as_tensor(min_width).min()) < 1:
        raise ValueError("min_width must be >= 1: a layer that keeps no beam would end the group")
    if ignore_eos is None:
        ignore_eos = torch.zeros(num_groups, dtype=torch.bool, device=device)
    min_width = torch.as_tensor(min_width, device=device).expand(num_groups)
    out = ForestVerification._empty(num_groups, depth - 1, width, device)
    columns = None if draft_support is None else DraftColumns(draft_support, vocab, width)
    ladder_buffer = None  # [W + 1, G, W*V] (W*(K+1) over the draft's columns), allocated at the first verified layer

    parent_valid = root_valid.clone()  # [G, W] valid parents of the current layer
    parent_scores = root_scores.double().clone()  # [G, W]
    active = parent_valid.any(-1)  # groups still inside their iteration
    for i in range(1, depth + 1):
        rows = active.nonzero()[:, 0]
        if rows.numel() == 0:
            break
        lp = _rows(target_logprobs[:, i - 1], rows)  # [g, W, V] at the parents
        if temperature is not None:
            lp = tempered_logprobs(lp, temperature)
        scores = parent_scores[rows]
        target = joint_probs(scores, parent_valid[rows], lp, _select(top_k, rows), _select(top_p, rows))

        bonus = num_layers[rows] == i - 1  # every draft layer passed: draw from the children
        if bool(bonus.any()):
            b = bonus.nonzero()[:, 0]
            index = sample_from_uniforms(_rows(target, b), uniforms(_generators(generator, rows[b]),
                                                                    b.numel(), num_out, device))
            out._store_outputs(rows[b], index, _child_scores(scores[b], _rows(lp, b), index), None, vocab)
            active[rows[b]] = False
        check = (~bonus).nonzero()[:, 0]
        if check.numel() == 0:
            continue
        rows, target, lp, scores = rows[check], _rows(target, check), _rows(lp, check), scores[check]
        layer = i - 1
        valid = parent_valid[rows]
        draft_index = draft_parents[rows, layer] * vocab + draft_tokens[rows, layer]  # [g, W]
        q, layer_index = draft_joints[rows, layer], draft_index
        if columns is not None:  # P and Q over the draft's columns, and each parent's mass outside them
            target, outside = columns.target(target)
            q, layer_index = columns.draft(q), columns.index(draft_index)
        restricted = restrict_to_parents(q, valid)
        if ladder_buffer is None:
            ladder_buffer = target.new_empty((width + 1, num_groups, target.shape[-1]))
        ladder, levels = ladder_buffer[:, : rows.numel()], 0
        if bool((width_threshold[rows] >= 1).all()):
            layer_width = torch.full((rows.numel(),), width, dtype=torch.long, device=device)
        else:  # the width DP needs every level
            _, alpha = residual_ladder(target, restricted, width, ladder)
            levels = width + 1
            layer_width = choose_width(acceptance_count_distribution(alpha), width_threshold[rows], min_width[rows])
        res = verify_layer(target, q, valid, layer_index, draft_exists[rows, layer], layer_width, num_out,
                           _generators(generator, rows), ladder, levels, restricted)
        out.widths[rows, layer] = layer_width
        out.accepted[rows, layer] = res.accepted
        out.node_scores[rows, layer] = _child_scores(scores, lp, draft_index)

        failed = ~res.passed
        out_index = res.out_index[:, :num_out]
        if columns is not None:
            out_index = columns.flat(out_index, outside, lambda groups, n, rows=rows: uniforms(
                _generators(generator, rows[groups]), groups.numel(), n, device))
        out._store_outputs(rows[failed], out_index[failed], _child_scores(scores, lp, out_index)[failed],
                           res.out_draft[failed, :num_out], vocab)
        out.num_passed[rows[failed]] = i - 1
        active[rows[failed]] = False
        passed = rows[res.passed]
        out.num_passed[passed] = i
        stop_strings = None if finishes_fn is None else finishes_fn(
            layer, passed, draft_parents[passed, layer], draft_tokens[passed, layer])
        parent_valid[passed] = _next_parents(res.accepted[res.passed], draft_tokens[passed, layer], eos_token_id,
                                             ignore_eos[passed], stop_token_ids, stop_strings)
        parent_scores[passed] = out.node_scores[passed, layer]
        active[passed] = parent_valid[passed].any(-1)
    return out


def _select(values: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if values is None else values[rows]


def _generators(generator: Generators, rows: Tensor) -> Generators:
    """The generators of groups ``rows`` (one shared generator stays shared)."""
    if isinstance(generator, torch.Generator):
        return generator
    return [generator[r] for r in rows.tolist()]
