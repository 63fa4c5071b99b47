"""Joint beam distributions: one beam step of beam sampling or beam search.

Shapes use ``G`` (beam groups in the batch), ``B`` (beam slots of a group, some
of them unused: ``beam_valid``), ``V`` (vocabulary) and ``N = B * V`` (pairs
``(beam, token)`` flattened beam-major: ``index = beam * V + token``).

Sampling (``T > 0``), per docs/algorithm.md::

    p_T(v | x_b) = softmax(logits_b / T)(v)
    P(b, v)      = exp(S_b) * p_T(v | x_b) / sum_b' exp(S_b')

then ``top_k`` / ``top_p`` restrict the support of the *joint* ``P`` and
renormalise. Decisions:

- top-k is applied first, then top-p on the renormalised top-k set (the
  order vLLM's sampler uses per token). Ties in the sort are broken by the
  flat index, i.e. lower beam slot, then lower token id. ``top_k <= 0`` and
  ``top_p >= 1`` mean "off".
- All maths is float32 (scores may be float64; they enter as differences
  ``S_b - logsumexp(S)``), whatever dtype the logits arrive in.
- A joint probability below ``exp(-87)`` (about 1.6e-38, float32's smallest
  normal numbers) is 0 (:func:`probs_from_logprobs_`): no draw can land on
  such mass (uniforms are multiples of 2^-24), and on x86 CPUs computing it,
  and every later pass over a tensor holding it, is 20-200 times slower.
- Sampling is by inverse CDF (float64 cumulative sum) from uniforms drawn
  with an explicit generator: either one ``torch.Generator`` for the batch or
  one per group (so a group's draws depend only on its own generator, which
  lets tensor-parallel ranks agree and makes per-request seeds reproducible).

Beam search (``T = 0``) is :func:`beam_search_step`: the selection rule of
vLLM 0.32.0's built-in beam search (``entrypoints/generate/beam_search/``),
vectorised over groups. See its docstring for the exact semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Generators = torch.Generator | Sequence[torch.Generator]
"""One generator for the whole batch, or one per group (in group order)."""
CandidateFinishes = Callable[[Tensor, Tensor], Tensor]
"""``(beam, token) -> finishes``: [G, ...] tensors, group first; true where the beam's text with the token
completes a stop string (such a candidate finishes and ranks as EOS does)."""


def tempered_logprobs(logits: Tensor, temperature: float | Tensor) -> Tensor:
    """``log softmax(logits / T)`` in float32.

    logits: [..., V], any float dtype.
    temperature: ``T > 0``; a float or a tensor broadcastable to ``logits[..., :1]``.
    Returns [..., V] float32.
    """
    if isinstance(temperature, (int, float)) and temperature == 1:  # x / 1 is x: a pass over the logits saved
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def joint_logprobs(beam_scores: Tensor, beam_valid: Tensor, token_logprobs: Tensor) -> Tensor:
    """Log of the joint ``P(b, v) ∝ exp(S_b) p(v | x_b)`` over valid beams.

    beam_scores: [G, B] cumulative log-probs ``S_b`` (any float dtype).
    beam_valid: [G, B] bool; invalid slots get probability 0 (their
        ``token_logprobs`` rows may hold anything).
    token_logprobs: [G, B, V] normalised per-beam log-probs.
    Returns [G, B*V] float32; ``-inf`` outside the support. A group with no
    valid beam is all ``-inf``.
    """
    scores = beam_scores.masked_fill(~beam_valid, float("-inf"))
    norm = torch.logsumexp(scores, dim=-1, keepdim=True)
    norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
    beam_logp = (scores - norm).float()  # [G, B]
    joint = beam_logp[:, :, None] + token_logprobs.float()
    invalid = ~beam_valid
    if bool(invalid.any()):  # only those rows: a masked fill would pass over all of them
        joint[invalid] = float("-inf")
    return joint.flatten(1)


def restrict_joint(joint: Tensor, top_k: Tensor | None = None, top_p: Tensor | None = None) -> Tensor:
    """Restrict a joint log-distribution to its top-k, then top-p, support.

    joint: [G, N] normalised log-probs.
    top_k: [G] int (``<= 0``: off) or None. top_p: [G] float (``>= 1``: off) or None.
    Returns [G, N] float32 log-probs, renormalised, ``-inf`` outside the kept set.

    When what a row may keep lies in a small part of it (top-k, or the top entries holding top-p of its mass),
    only that shortlist and its ties are sorted (:func:`_restrict_in_shortlist`); otherwise whole rows are.
    Both keep the same pairs: the first of a stable descending sort (ties: lower flat index first).
    """
    use_k = top_k is not None and bool((top_k > 0).any())
    use_p = top_p is not None and bool((top_p < 1).any())
    if not (use_k or use_p):
        return joint
    num = joint.shape[-1]
    k = torch.full((joint.shape[0],), num, dtype=torch.long, device=joint.device)
    if use_k:
        k = torch.where(top_k > 0, top_k.long(), k).clamp(max=num)
    p = top_p.double() if use_p else None
    restricted = (k < num) if p is None else (k < num) | (p < 1)
    shortlist = _shortlist_lengths(joint, k, p, restricted)
    if shortlist is None:
        return _renormalised(joint.masked_fill(~_keep_in_sorted_row(joint, k, p), float("-inf")))
    return _restrict_in_shortlist(joint, k, p, restricted, *shortlist)


def _renormalised(logp: Tensor) -> Tensor:
    """``logp`` minus each row's logsumexp (rows with no finite entry stay ``-inf``)."""
    norm = torch.logsumexp(logp, dim=-1, keepdim=True)
    return logp - torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))


SHORTLIST_SHARE = 8
"""Rows are restricted by a sort of their shortlists when every shortlist is at most 1/8 of its row."""
TOP_P_SHORTLISTS = (64, 1024)
"""Shortlist lengths tried for rows with top-p and no top-k, shortest first; rows whose top-p needs more are
sorted whole (each try is a top-k pass over the rows: cheap below about 1,000 entries)."""


def _shortlist_lengths(joint: Tensor, k: Tensor, p: Tensor | None,
                       restricted: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """How many of each row's top entries hold all that top-k then top-p may keep: its top-k where top-k is on;
    for top-p alone, top entries holding more than top-p of the row's mass. Returns (lengths [G], the row's
    mass where top-p is alone, else NaN [G] float64, or None if no row has top-p alone), or None when some
    shortlist would be longer than 1/``SHORTLIST_SHARE`` of its row."""
    num = joint.shape[-1]
    length = torch.where(restricted, k, 1)
    alone = restricted & (k >= num)  # top-p without top-k: top-p is a share of the whole row's mass
    whole = None
    if bool(alone.any()):
        rows = joint[alone]
        mass = rows.exp().sum(-1, dtype=torch.float64)
        want = mass * (p[alone] + 1e-6)  # a margin over float rounding: a longer shortlist is still exact
        tries = [n for n in TOP_P_SHORTLISTS if n * SHORTLIST_SHARE <= num]
        holds = (n for n in tries if bool((torch.topk(rows, n, dim=-1).values.double().exp().sum(-1) >= want).all()))
        longest = next(holds, None)
        if longest is None:
            return None
        length[alone] = longest
        whole = torch.full_like(p, float("nan")).masked_scatter(alone, mass)
    if int(length.max()) * SHORTLIST_SHARE > num:
        return None
    return length, whole


def _keep_by_rank(sorted_logp: Tensor, k: Tensor, p: Tensor | None, whole: Tensor | None = None) -> Tensor:
    """[G, M] bool: which of each row's entries, in descending order, top-k then top-p keep. Top-p is a share
    of the mass top-k keeps, or of ``whole`` (a row's mass; NaN: that row's kept mass) where it is given."""
    keep = torch.arange(sorted_logp.shape[-1], device=sorted_logp.device)[None, :] < k[:, None]
    if p is not None:
        probs = sorted_logp.double().exp() * keep
        total = probs.sum(-1)
        if whole is not None:
            total = torch.where(torch.isnan(whole), total, whole)
        probs = probs / total[:, None]
        mass_before = probs.cumsum(-1) - probs
        keep &= mass_before < p[:, None]
    return keep


def _keep_in_sorted_row(joint: Tensor, k: Tensor, p: Tensor | None) -> Tensor:
    """[G, N] bool kept mask from a stable descending sort of every whole row."""
    sorted_logp, order = torch.sort(joint, dim=-1, descending=True, stable=True)
    return torch.zeros_like(sorted_logp, dtype=torch.bool).scatter(-1, order, _keep_by_rank(sorted_logp, k, p))


def _restrict_in_shortlist(joint: Tensor, k: Tensor, p: Tensor | None, restricted: Tensor, length: Tensor,
                           whole: Tensor | None) -> Tensor:
    """:func:`restrict_joint` sorting only each restricted row's shortlist: its finite entries at least its
    ``length``-th largest value (its top ``length`` and every entry tied with the last), gathered in index order,
    so that a stable sort of the shortlist orders ties as a sort of the whole row does. -inf entries weigh
    nothing and are never listed. Rows not ``restricted`` are only renormalised."""
    threshold = torch.topk(joint, int(length.max()), dim=-1).values.gather(-1, (length - 1)[:, None])
    listed = joint >= threshold.clamp(min=torch.finfo(joint.dtype).min)
    listed[~restricted] = False
    rows, cols = listed.nonzero(as_tuple=True)  # row-major: each row's entries in index order
    counts = torch.bincount(rows, minlength=joint.shape[0])
    slot = torch.arange(rows.numel(), device=joint.device) - (counts.cumsum(0) - counts)[rows]
    width = max(int(counts.max()), 1)
    short = joint.new_full((joint.shape[0], width), float("-inf"))
    short[rows, slot] = joint[rows, cols]
    index = torch.zeros_like(short, dtype=torch.long)
    index[rows, slot] = cols
    sorted_logp, order = torch.sort(short, dim=-1, descending=True, stable=True)
    keep = _keep_by_rank(sorted_logp, k, p, whole) & torch.isfinite(sorted_logp)
    kept = _renormalised(sorted_logp.masked_fill(~keep, float("-inf")))
    out = torch.full_like(joint, float("-inf"))
    kept_rows, kept_ranks = keep.nonzero(as_tuple=True)
    out[kept_rows, index[kept_rows, order[kept_rows, kept_ranks]]] = kept[kept_rows, kept_ranks]
    if not bool(restricted.all()):
        out[~restricted] = _renormalised(joint[~restricted])
    return out


LOG_PROB_FLOOR = -87.0
"""Log-probabilities at or below this give probability 0 in :func:`probs_from_logprobs_`."""
PROB_FLOOR = float(torch.tensor(LOG_PROB_FLOOR).exp())
"""``exp(LOG_PROB_FLOOR)`` in float32 (a normal number, about 1.6e-38)."""


def probs_from_logprobs_(logp: Tensor) -> Tensor:
    """``exp(logp)`` in place, 0 wherever that is at most ``PROB_FLOOR`` (``-inf`` included).

    On x86 CPUs ``exp`` of ``-inf`` or of anything whose result is subnormal is 20-200 times slower than
    that of other inputs, and every later op that reads subnormal numbers is slowed alike (microcode
    assists); a joint over W x V pairs holds many. So the inputs are clamped to ``LOG_PROB_FLOOR`` before
    ``exp`` and the clamped entries zeroed after: no subnormal is ever computed. The mass set to 0 is below
    ``V * PROB_FLOOR``, far under float32's resolution of the rows' sums.
    """
    return F.threshold(logp.clamp_(min=LOG_PROB_FLOOR).exp_(), PROB_FLOOR, 0.0, inplace=True)


def joint_probs(
    beam_scores: Tensor,
    beam_valid: Tensor,
    token_logprobs: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
) -> Tensor:
    """The (restricted) joint as probabilities.

    Shapes as :func:`joint_logprobs`; top_k / top_p as :func:`restrict_joint`.
    Returns [G, B*V] float32, rows summing to 1 (0 for groups with no valid beam).
    """
    # in place: restrict_joint returns a new tensor or joint_logprobs' own
    return probs_from_logprobs_(restrict_joint(joint_logprobs(beam_scores, beam_valid, token_logprobs), top_k, top_p))


def uniforms(generator: Generators, num_groups: int, num: int, device: torch.device | str) -> Tensor:
    """[G, num] float32 uniforms in [0, 1): from one generator, or row g from generator[g]."""
    if isinstance(generator, torch.Generator):
        return torch.rand((num_groups, num), generator=generator, device=device)
    if len(generator) != num_groups:
        raise ValueError(f"got {len(generator)} generators for {num_groups} groups; pass one per group or one in all")
    return torch.stack([torch.rand((num,), generator=g, device=device) for g in generator])


CDF_BLOCK = 1024
"""Entries per block of :func:`sample_from_uniforms`' two-level cumulative sum."""


def sample_from_uniforms(probs: Tensor, u: Tensor, block_size: int = CDF_BLOCK) -> Tensor:
    """Inverse-CDF draws: ``out[g, s]`` is a draw from ``probs[g]`` driven by ``u[g, s]``.

    probs: [G, N] non-negative (need not sum to 1). u: [G, S] in [0, 1).
    Returns [G, S] int64 indices with positive probability (rows with no mass
    return ``N - 1``; callers must mask them).

    Two levels, so no pass builds an [N] float64 cumulative sum: the float64
    cumulative sum of the per-block masses (``block_size`` entries each) picks
    the block of ``u * total``, then the cumulative sum inside that block alone
    picks the entry. Worked example (blocks of 2): probs [0, .25 | 0, .5 | .25, 0],
    u .6: block masses [.25, .5, .25], target .6 lands in block 1 (cdf .25 to .75),
    .35 into it: entry 3 (cdf inside the block [0, .5]).
    """
    num_groups, num = probs.shape
    num_samples = u.shape[1]
    num_full, tail = divmod(num, block_size)
    masses = [probs[:, : num_full * block_size].reshape(num_groups, num_full, block_size).sum(-1, dtype=torch.float64)]
    if tail:
        masses.append(probs[:, num_full * block_size:].sum(-1, keepdim=True, dtype=torch.float64))
    block_cdf = torch.cat(masses, -1).cumsum(-1)  # [G, blocks]
    total = block_cdf[:, -1:].contiguous()
    aim = u.double() * total  # [G, S]
    block = torch.searchsorted(block_cdf, aim, right=True)
    block = torch.minimum(block, torch.searchsorted(block_cdf, total, right=False))  # the last block with mass
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)  # [G, S]
    entries = block[:, :, None] * block_size + torch.arange(block_size, device=probs.device)  # [G, S, block_size]
    inside = probs.gather(1, entries.clamp(max=num - 1).flatten(1)).view(num_groups, num_samples, block_size)
    cdf = inside.masked_fill(entries >= num, 0).cumsum(-1, dtype=torch.float64)  # [G, S, block_size]
    pos = torch.searchsorted(cdf, (aim - before)[:, :, None], right=True)
    # rounding may aim past the block's own sum: take its last entry with mass
    pos = torch.minimum(pos, torch.searchsorted(cdf, cdf[:, :, -1:].contiguous(), right=False))
    index = block * block_size + pos[:, :, 0]
    return torch.where(total > 0, index, num - 1)


def sample_joint(probs: Tensor, num_samples: int, generator: Generators) -> Tensor:
    """``num_samples`` independent draws with replacement per group.

    probs: [G, N]. Returns [G, num_samples] int64 flat indices (``beam * V + token``).
    """
    u = uniforms(generator, probs.shape[0], num_samples, probs.device)
    return sample_from_uniforms(probs, u)


@dataclass
class BeamSearchStep:
    """Result of :func:`beam_search_step` (``K = min(2W, V)`` candidates per beam)."""

    parents: Tensor  # [G, W] beam slot of each new beam, best first
    tokens: Tensor  # [G, W]
    cum_logprobs: Tensor  # [G, W] float64
    valid: Tensor  # [G, W] bool; fewer than W when there are fewer candidates
    finished_parents: Tensor  # [G, B*K] beam slot of each EOS candidate, in vLLM's insertion order
    finished_cum_logprobs: Tensor  # [G, B*K] float64
    finished_valid: Tensor  # [G, B*K] bool
    finished_tokens: Tensor  # [G, B*K] the token each finished candidate ends with (EOS or a stop token)
    scores: Tensor | None = None  # [G, W] float64: the new beams' ``beam_search_score`` (the rank's key)


def beam_search_score(cum_logprobs: Tensor, seq_lens: Tensor, ends_with_eos: Tensor, length_penalty: Tensor) -> Tensor:
    """vLLM's ``get_beam_search_score``: ``cum / max(len - ends_with_eos, 1) ** length_penalty``.

    ``seq_lens`` counts prompt and generated tokens. All args broadcast; float64 out.
    """
    seq_lens = (seq_lens - ends_with_eos.long()).clamp_min(1).double()
    return cum_logprobs.double() / seq_lens**length_penalty


def finishing_tokens(tokens: Tensor, eos_token_id: int | None, ignore_eos: Tensor,
                     stop_token_ids: Sequence[int] = ()) -> tuple[Tensor, Tensor]:
    """(finishes, ends_like_eos) of candidate ``tokens``, both shaped like ``tokens``.

    A candidate *finishes* a hypothesis when it is EOS (unless ``ignore_eos``,
    which must broadcast against ``tokens``) or one of ``stop_token_ids``
    (never ignored, as in vLLM). It *ends like EOS* for the length in
    :func:`beam_search_score` when it is EOS or a stop token, ignored or not.
    """
    ends = torch.zeros_like(tokens, dtype=torch.bool) if eos_token_id is None else tokens == eos_token_id
    finishes = ends & ~ignore_eos
    if stop_token_ids:
        stop = torch.isin(tokens, torch.tensor(list(stop_token_ids), device=tokens.device))
        ends, finishes = ends | stop, finishes | stop
    return finishes, ends


def token_finishes(token: int, eos_token_id: int | None, ignore_eos: bool,
                   stop_token_ids: Sequence[int] = ()) -> bool:
    """One token's *finishes* of :func:`finishing_tokens`: EOS (unless ``ignore_eos``) or a stop token.
    Stop strings are the runner's (``engine.stops``): they depend on the text, not on the token alone."""
    return (token == eos_token_id and not ignore_eos) or token in stop_token_ids


def beam_search_step(
    logprobs: Tensor,
    beam_scores: Tensor,
    beam_valid: Tensor,
    seq_lens: Tensor,
    beam_width: int,
    eos_token_id: int | None,
    ignore_eos: Tensor,
    length_penalty: Tensor,
    stop_token_ids: Sequence[int] = (),
    finishes_fn: CandidateFinishes | None = None,
    token_ids: Tensor | None = None,
) -> BeamSearchStep:
    """One step of vLLM 0.32.0's built-in beam search, for many groups at once.

    logprobs: [G, B, V] raw per-token log-probs (``log_softmax(logits)``), or [G, B, C] over the columns
    of ``token_ids`` ([C] ascending token ids, e.g. a draft's vocabulary: every other token's log-prob is
    -inf): the same step at a fraction of the cost, the candidates' tokens given as token ids.
    beam_scores: [G, B] cumulative log-probs (float64 keeps vLLM's Python-float sums).
    beam_valid: [G, B] bool. seq_lens: [G] tokens per beam now (prompt + generated).
    ignore_eos: [G] bool. length_penalty: [G] float.

    Semantics (``offline.py::_beam_search_step``): each beam proposes its top
    ``2W`` tokens (vLLM requests ``logprobs = 2W``); candidates are taken in
    insertion order (beam slot, then descending log-prob, ties by lower token
    id). An EOS candidate becomes a finished hypothesis unless ``ignore_eos``
    (even if it would not rank in the top W); so does a candidate in
    ``stop_token_ids`` (whatever ``ignore_eos``) and one for which
    ``finishes_fn(beam, token)`` ([G, B, K] long each -> bool) is true (stop
    strings); all of them are ranked as EOS is. The other candidates are sorted
    by ``get_beam_search_score`` (stable, descending; ties keep insertion
    order) and the first W are the new beams. The score uses the candidate's
    full length (prompt included, minus one if it ends with EOS), which
    matters for ordering only when ``ignore_eos`` keeps EOS beams alive.
    The top-2W cut uses ``torch.topk`` and then re-sorts ties by token id; a
    tie straddling the 2W boundary may keep a higher token id (as vLLM's own
    top-k does, whose tie order is unspecified).
    """
    num_groups, num_beams, vocab = logprobs.shape
    k = min(2 * beam_width, vocab)
    vals, toks = torch.topk(logprobs.float(), k, dim=-1)  # [G, B, K]
    toks, tie_order = torch.sort(toks, dim=-1)
    vals = vals.gather(-1, tie_order)
    vals, desc = torch.sort(vals, dim=-1, descending=True, stable=True)
    toks = toks.gather(-1, desc)
    if token_ids is not None:  # columns -> token ids; ascending, so the tie order above is the tokens'
        toks = token_ids[toks]

    cum = beam_scores.double()[:, :, None] + vals.double()  # [G, B, K]
    finishes, is_eos = finishing_tokens(toks, eos_token_id, ignore_eos[:, None, None], stop_token_ids)
    if finishes_fn is not None:
        beams = torch.arange(num_beams, device=toks.device)[None, :, None].expand_as(toks)
        extra = finishes_fn(beams, toks)
        finishes, is_eos = finishes | extra, is_eos | extra
    finished = beam_valid[:, :, None] & finishes
    live = beam_valid[:, :, None] & ~finished
    score = beam_search_score(cum, seq_lens[:, None, None] + 1, is_eos, length_penalty.double()[:, None, None])

    flat = (t.reshape(num_groups, num_beams * k) for t in (cum, toks, live, finished, score))
    cum, toks, live, finished, score = flat
    parents = torch.arange(num_beams, device=logprobs.device).repeat_interleave(k).expand(num_groups, -1)
    # Stable sort by score, then stable sort live-first: the order of Python's
    # sorted(..., reverse=True) over the live candidates, dead ones after.
    order = torch.sort(score.masked_fill(~live, float("-inf")), dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, torch.sort((~live).gather(-1, order).to(torch.uint8), dim=-1, stable=True).indices)
    top = order[:, :beam_width]
    pad = beam_width - top.shape[1]
    new_parents, new_tokens, new_cum, new_valid, new_score = (
        t.gather(-1, top) for t in (parents, toks, cum, live, score))
    if pad > 0:  # fewer candidates than W in all (tiny vocabularies)
        new_parents, new_tokens, new_valid = (
            torch.cat([t, t.new_zeros(num_groups, pad)], dim=-1) for t in (new_parents, new_tokens, new_valid)
        )
        new_cum, new_score = (torch.cat([t, t.new_full((num_groups, pad), float("-inf"))], dim=-1)
                              for t in (new_cum, new_score))
    return BeamSearchStep(
        parents=new_parents,
        tokens=new_tokens,
        cum_logprobs=new_cum,
        valid=new_valid,
        finished_parents=parents.clone(),
        finished_cum_logprobs=cum,
        finished_valid=finished,
        finished_tokens=toks,
        scores=new_score,
    )
