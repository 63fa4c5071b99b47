"""Exact references and a complete reference DSBD decoder over logits functions.

A *logits function* maps token sequences to next-token logits:
``logits_fn(sequences: list[list[int]]) -> Tensor[num_seqs, V]``. Everything
here is slow, plain Python around the batched maths of ``joint``/``verify``;
it defines what the engine must reproduce.

- :func:`beam_sampling` — docs/algorithm.md's beam sampling (``T > 0``): each step
  draws ``W`` beams with replacement from the (top-k/top-p restricted) joint.
- :func:`beam_search` — vLLM 0.32.0's built-in ``LLM.beam_search`` (``T = 0``),
  a line-by-line port of ``entrypoints/generate/beam_search/offline.py``.
- :func:`dsbd_decode` — DSBD over a target and a draft, for a batch of prompts
  at once: draft beam sampling (``T > 0``) or draft beam search (``T = 0``)
  over ``γ`` layers, :func:`verify.verify_forest` /
  :func:`verify_greedy.verify_forest_greedy`, finishing.

Finishing (all three): a beam that emits EOS (unless ``ignore_eos``) or one of
``stop_token_ids`` (whatever ``ignore_eos``) becomes a finished hypothesis;
the others go on until ``max_tokens`` generated tokens or until no live beam
is left. There is no early stop (vLLM's built-in beam
search has none). The result is every finished hypothesis followed by the
live beams at the end, sorted by vLLM's ``get_beam_search_score``
(``cum_logprob / max(len, 1) ** length_penalty`` with ``len`` counting prompt
and generated tokens, minus one if the last is EOS or a stop token; docs/algorithm.md says
"generated tokens", we follow vLLM so deterministic outputs match it), stable
(ties keep that order), truncated to ``n`` (vLLM returns ``beam_width``).
``cum_logprob`` is the sum of the tempered log-probs ``log p_T`` for ``T > 0``
and of the raw log-probs for ``T = 0``.

Draft parent weights (``T > 0``): the draft joint of layer 1 weighs the input
beams by their target scores; deeper layers add the draft's own tempered
log-probs. The same ``top_k``/``top_p`` apply to the draft joint. Memory-efficient
mode outputs one beam per iteration (``W_out = 1``).

The decoders learn the vocabulary size by calling both logits functions on
the first prompt and refuse a draft whose vocabulary differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_dsbd.algorithm.joint import (
    Generators,
    beam_search_step,
    finishing_tokens,
    joint_probs,
    sample_joint,
    tempered_logprobs,
)
from vllm_dsbd.algorithm.verify import verify_forest
from vllm_dsbd.algorithm.verify_greedy import verify_forest_greedy

LogitsFn = Callable[[list[list[int]]], Tensor]


@dataclass(frozen=True)
class DecodeParams:
    """Knobs, named as in docs/algorithm.md. ``temperature == 0``: deterministic beam search."""

    beam_width: int = 4
    num_speculative_tokens: int = 4
    width_threshold: float = 0.7
    fixed_width: bool = False
    min_width: int = 1
    memory_efficient: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    length_penalty: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that finish a hypothesis like EOS does (ranked alike), even with ``ignore_eos``."""
    stop_fn: Callable[[Sequence[int], int], bool] | None = None
    """``(generated tokens, token) -> bool``: the token completes a stop string (the hypothesis then
    finishes and ranks as with EOS). The draft does not consult it: only the target's decisions do."""
    n: int | None = None
    """Hypotheses returned per prompt; None returns all (finished ones and the final live beams)."""

    def __post_init__(self) -> None:
        checks = [
            (self.beam_width >= 1, "beam_width must be >= 1"),
            (self.num_speculative_tokens >= 0, "num_speculative_tokens must be >= 0"),
            (0 < self.width_threshold <= 1, "width_threshold must be in (0, 1]"),
            (1 <= self.min_width <= self.beam_width, "min_width must be in 1..beam_width"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.n is None or 1 <= self.n <= self.beam_width, "n must be in 1..beam_width, or None"),
            (self.temperature > 0 or (self.top_k == 0 and self.top_p == 1),
             "top_k/top_p apply to sampling (temperature > 0) only"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def num_out(self) -> int:
        """``W_out``: beams carried between iterations."""
        return 1 if self.memory_efficient else self.beam_width

    @property
    def threshold(self) -> float:
        """τ as used by the width rule (1.0 for fixed width)."""
        return 1.0 if self.fixed_width else self.width_threshold


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens (with the final EOS, if any)
    cum_logprob: float
    score: float  # length-normalised, vLLM's get_beam_search_score


@dataclass
class DecodeResult:
    hypotheses: list[list[Hypothesis]]  # per prompt, best first
    num_passed: list[list[int]]  # per prompt, draft layers passed in each iteration
    widths: list[list[list[int]]]  # per prompt and iteration, w_i of each verified layer (T > 0)


@dataclass
class _Group:
    prompt: list[int]
    live: list[tuple[list[int], float]]  # (prompt + generated tokens, cum log-prob)
    finished: list[tuple[list[int], float]] = field(default_factory=list)
    num_generated: int = 0
    num_passed: list[int] = field(default_factory=list)
    widths: list[list[int]] = field(default_factory=list)


def _score(tokens: Sequence[int], cum: float, params: DecodeParams, finished: bool = False) -> float:
    """vLLM's score; a finished hypothesis (EOS, stop token, stop string) and a live beam ending in EOS
    (``ignore_eos``) do not count their last token."""
    seq_len = len(tokens) - (1 if finished or tokens[-1] == params.eos_token_id else 0)
    return cum / (max(seq_len, 1) ** params.length_penalty)


def _ranked(prompt: Sequence[int], finished: list[tuple[list[int], float]], live: list[tuple[list[int], float]],
            params: DecodeParams) -> list[Hypothesis]:
    hyps = [(seq, cum, _score(seq, cum, params, True)) for seq, cum in finished]
    hyps += [(seq, cum, _score(seq, cum, params)) for seq, cum in live]
    ranked = sorted(hyps, key=lambda h: h[2], reverse=True)
    if params.n is not None:
        ranked = ranked[: params.n]
    return [Hypothesis(tuple(seq[len(prompt):]), cum, score) for seq, cum, score in ranked]


def _finishes(token: int, params: DecodeParams, generated: Sequence[int] = ()) -> bool:
    """EOS (unless ignore_eos), a stop token, or a token that completes a stop string after ``generated``."""
    return ((token == params.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids
            or (params.stop_fn is not None and params.stop_fn(generated, token)))


def _vocab_size(target_fn: LogitsFn, draft_fn: LogitsFn | None, prompt: Sequence[int]) -> int:
    vocab = target_fn([list(prompt)]).shape[-1]
    if draft_fn is not None:
        draft_vocab = draft_fn([list(prompt)]).shape[-1]
        if draft_vocab != vocab:
            raise ValueError(
                f"draft vocabulary size {draft_vocab} differs from the target's {vocab}: "
                "DSBD needs a draft with the target's tokenizer and vocabulary"
            )
    return vocab


def beam_sampling(logits_fn: LogitsFn, prompts: Sequence[Sequence[int]], params: DecodeParams,
                  generator: torch.Generator) -> list[list[Hypothesis]]:
    """Exact beam sampling (``T > 0``), one prompt after the other."""
    if params.temperature <= 0:
        raise ValueError("beam_sampling needs temperature > 0; use beam_search for temperature 0")
    width = params.beam_width
    top_k = torch.tensor([params.top_k])
    top_p = torch.tensor([params.top_p])
    results = []
    for prompt in prompts:
        live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
        finished: list[tuple[list[int], float]] = []
        for _ in range(params.max_tokens):
            if not live:
                break
            logprobs = tempered_logprobs(logits_fn([seq for seq, _ in live]), params.temperature)  # [B, V]
            vocab = logprobs.shape[-1]
            scores = torch.tensor([[cum for _, cum in live]], dtype=torch.float64)
            probs = joint_probs(scores, torch.ones_like(scores, dtype=torch.bool), logprobs[None], top_k, top_p)[0]
            new_live = []
            for index in torch.multinomial(probs, width, replacement=True, generator=generator).tolist():
                beam, token = divmod(index, vocab)
                seq, cum = live[beam]
                item = (seq + [token], cum + logprobs[beam, token].item())
                (finished if _finishes(token, params, seq[len(prompt):]) else new_live).append(item)
            live = new_live
        results.append(_ranked(prompt, finished, live, params))
    return results


def beam_search(logits_fn: LogitsFn, prompts: Sequence[Sequence[int]], params: DecodeParams) -> list[list[Hypothesis]]:
    """vLLM 0.32.0 ``LLM.beam_search`` semantics (``BeamSearchOfflineMixin``), per prompt.

    Each step: every beam proposes its top-2W tokens by raw log-prob (ties:
    lower token id); EOS proposals finish (unless ``ignore_eos``); the rest are
    sorted by score (stable, descending) and the first W are the new beams.
    After ``max_tokens`` steps the finished and live beams are ranked together.
    ``params.n`` defaults to ``beam_width`` here, as in vLLM.
    """
    width = params.beam_width
    results = []
    for prompt in prompts:
        beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
        completed: list[tuple[list[int], float]] = []
        for _ in range(params.max_tokens):
            if not beams:
                break
            rows = torch.log_softmax(logits_fn([seq for seq, _ in beams]).float(), dim=-1).tolist()
            candidates = []
            for (seq, cum), row in zip(beams, rows):
                for token in sorted(range(len(row)), key=lambda t: (-row[t], t))[: 2 * width]:
                    item = (seq + [token], cum + row[token])
                    (completed if _finishes(token, params, seq[len(prompt):]) else candidates).append(item)
            candidates.sort(key=lambda h: _score(h[0], h[1], params), reverse=True)
            beams = candidates[:width]
        ranked = _ranked(prompt, completed, beams, params)
        results.append(ranked[:width])
    return results


def dsbd_decode(target_fn: LogitsFn, draft_fn: LogitsFn | None, prompts: Sequence[Sequence[int]],
                params: DecodeParams, generator: Generators | None = None) -> DecodeResult:
    """Reference DSBD for a batch of prompts (the batch is verified together, as in the engine).

    ``temperature > 0``: DSBD beam sampling (needs ``generator``: one, or one
    per prompt). ``temperature == 0``: lossless speculative beam search, equal
    to :func:`beam_search` token for token. ``num_speculative_tokens == 0``
    needs no draft: one target step per iteration.
    """
    if params.temperature > 0 and generator is None:
        raise ValueError("sampling (temperature > 0) needs a torch.Generator")
    if params.num_speculative_tokens > 0 and draft_fn is None:
        raise ValueError("num_speculative_tokens > 0 needs a draft logits function")
    if not prompts:
        return DecodeResult([], [], [])
    vocab = _vocab_size(target_fn, draft_fn if params.num_speculative_tokens else None, prompts[0])
    groups = [_Group(list(p), [(list(p), 0.0)]) for p in prompts]
    per_group_gens = None if generator is None or isinstance(generator, torch.Generator) else list(generator)
    while True:
        active = [a for a, g in enumerate(groups) if g.live and g.num_generated < params.max_tokens]
        if not active:
            break
        batch = [groups[a] for a in active]
        if params.temperature > 0:
            gens = generator if per_group_gens is None else [per_group_gens[a] for a in active]
            _sampling_iteration(target_fn, draft_fn, batch, params, vocab, gens)
        else:
            _greedy_iteration(target_fn, draft_fn, batch, params, vocab)
    return DecodeResult(
        hypotheses=[_ranked(g.prompt, g.finished, g.live, params) for g in groups],
        num_passed=[g.num_passed for g in groups],
        widths=[g.widths for g in groups],
    )


@dataclass
class _Roots:
    seqs: list[list[list[int] | None]]  # [G][W]
    scores: Tensor  # [G, W] float64
    valid: Tensor  # [G, W] bool
    num_layers: Tensor  # [G] draft layers this iteration (max_tokens boundary)


def _roots(batch: list[_Group], params: DecodeParams) -> _Roots:
    width = params.beam_width
    pad = [width - len(g.live) for g in batch]
    return _Roots(
        seqs=[[seq for seq, _ in g.live] + [None] * k for g, k in zip(batch, pad)],
        scores=torch.tensor([[cum for _, cum in g.live] + [float("-inf")] * k for g, k in zip(batch, pad)],
                            dtype=torch.float64),
        valid=torch.tensor([[True] * len(g.live) + [False] * k for g, k in zip(batch, pad)]),
        num_layers=torch.tensor([min(params.num_speculative_tokens, params.max_tokens - g.num_generated - 1)
                                 for g in batch]),
    )


def _node_logprobs(fn: LogitsFn, layer_seqs: list[list[list[list[int] | None]]], mask: Tensor, vocab: int,
                   temperature: float) -> Tensor:
    """Per-node log-probs of ``fn``: [G, L, W, V] for ``layer_seqs`` [L][G][W] where ``mask`` [G, L, W].

    Tempered for ``temperature > 0``, raw for 0; unmasked nodes get zeros.
    """
    num_groups, num_layers, width = mask.shape
    where = mask.nonzero().tolist()
    out = torch.zeros((num_groups, num_layers, width, vocab))
    if not where:
        return out
    logits = fn([layer_seqs[layer][g][j] for g, layer, j in where])
    if logits.shape[-1] != vocab:
        raise ValueError(f"logits function returned vocabulary size {logits.shape[-1]}, expected {vocab}")
    out[mask] = tempered_logprobs(logits, temperature if temperature > 0 else 1.0)
    return out


def _extend(prev: list[list[list[int] | None]], parents: Tensor, tokens: Tensor,
            exists: Tensor) -> list[list[list[int] | None]]:
    """Sequences of a new layer's nodes [G][W] from the previous layer's."""
    return [[prev[g][p] + [t] if e else None for p, t, e in zip(par, tok, ex)]
            for g, (par, tok, ex) in enumerate(zip(parents.tolist(), tokens.tolist(), exists.tolist()))]


def _continues(tokens: Tensor, params: DecodeParams) -> Tensor:
    """[...] bool: the draft grows a node with this token (not a finishing EOS or stop token; the draft
    does not look for stop strings, as in the engine)."""
    finishes, _ = finishing_tokens(tokens, params.eos_token_id, torch.tensor(params.ignore_eos),
                                   params.stop_token_ids)
    return ~finishes


def _node_finishes(batch: list[_Group], layer_seqs: list[list[list[list[int] | None]]], params: DecodeParams):
    """The :data:`verify.NodeFinishes` of ``params.stop_fn`` over the nodes' sequences (None without one)."""
    if params.stop_fn is None:
        return None

    def finishes(layer: int, groups: Tensor, parents: Tensor, tokens: Tensor) -> Tensor:
        out = []
        for g, row_parents, row_tokens in zip(groups.tolist(), parents.tolist(), tokens.tolist()):
            seqs, prompt_len = layer_seqs[layer][g], len(batch[g].prompt)
            out.append([seqs[p] is not None and params.stop_fn(seqs[p][prompt_len:], t)
                        for p, t in zip(row_parents, row_tokens)])
        return torch.tensor(out, dtype=torch.bool).reshape(tokens.shape)

    return finishes


def _sampling_iteration(target_fn: LogitsFn, draft_fn: LogitsFn | None, batch: list[_Group],
                        params: DecodeParams, vocab: int, generator: Generators) -> None:
    num_groups, width, gamma = len(batch), params.beam_width, params.num_speculative_tokens
    roots = _roots(batch, params)
    top_k = torch.full((num_groups,), params.top_k)
    top_p = torch.full((num_groups,), params.top_p)
    draft_joints = torch.zeros((num_groups, gamma, width * vocab))
    draft_parents = torch.zeros((num_groups, gamma, width), dtype=torch.long)
    draft_tokens = torch.zeros_like(draft_parents)
    draft_exists = torch.zeros((num_groups, gamma, width), dtype=torch.bool)
    layer_seqs = [roots.seqs]
    parent_ok = [roots.valid]  # per layer: nodes that can be parents
    draft_scores = roots.scores
    for i in range(1, gamma + 1):
        need = parent_ok[-1] & (roots.num_layers >= i)[:, None]
        has = need.any(-1)
        q_lp = _node_logprobs(draft_fn, [layer_seqs[-1]], need[:, None], vocab, params.temperature)[:, 0]
        q = joint_probs(draft_scores, need, q_lp, top_k, top_p)  # [G, W*V]
        index = torch.zeros((num_groups, width), dtype=torch.long)
        rows = has.nonzero()[:, 0]
        if rows.numel():
            gens = generator if isinstance(generator, torch.Generator) else [generator[r] for r in rows.tolist()]
            index[rows] = sample_joint(q[rows], width, gens)
        parents, tokens = index // vocab, index % vocab
        exists = has[:, None].expand(-1, width)
        draft_joints[:, i - 1], draft_parents[:, i - 1], draft_tokens[:, i - 1] = q, parents, tokens
        draft_exists[:, i - 1] = exists
        step_lp = q_lp.gather(1, parents[:, :, None].expand(-1, -1, vocab)).gather(2, tokens[:, :, None])[:, :, 0]
        draft_scores = torch.where(exists, draft_scores.gather(1, parents) + step_lp.double(), float("-inf"))
        layer_seqs.append(_extend(layer_seqs[-1], parents, tokens, exists))
        parent_ok.append(exists & _continues(tokens, params))

    target_lp = _node_logprobs(target_fn, layer_seqs, torch.stack(parent_ok, 1), vocab, params.temperature)
    res = verify_forest(
        target_lp, roots.scores, roots.valid, draft_joints, draft_parents, draft_tokens, draft_exists,
        roots.num_layers, torch.full((num_groups,), params.threshold), params.min_width, params.num_out,
        generator, top_k, top_p, params.eos_token_id, torch.full((num_groups,), params.ignore_eos),
        params.stop_token_ids, _node_finishes(batch, layer_seqs, params),
    )

    num_passed, widths, accepted = res.num_passed.tolist(), res.widths.tolist(), res.accepted.tolist()
    node_scores, d_tokens = res.node_scores.tolist(), draft_tokens.tolist()
    out_parent, out_token, out_score = res.out_parent.tolist(), res.out_token.tolist(), res.out_score.tolist()
    out_count, num_layers = res.out_count.tolist(), roots.num_layers.tolist()
    for a, g in enumerate(batch):
        passed = num_passed[a]
        prompt_len = len(g.prompt)
        for layer in range(passed):  # accepted finishing drafts of passed layers are finished
            for j in range(width):
                seq = layer_seqs[layer + 1][a][j]
                if accepted[a][layer][j] and _finishes(d_tokens[a][layer][j], params, seq[prompt_len:-1]):
                    g.finished.append((seq, node_scores[a][layer][j]))
        live = []
        for s in range(out_count[a]):
            parent = layer_seqs[passed][a][out_parent[a][s]]
            seq = parent + [out_token[a][s]]
            finishes = _finishes(out_token[a][s], params, parent[prompt_len:])
            (g.finished if finishes else live).append((seq, out_score[a][s]))
        g.live = live
        g.num_generated += passed + 1
        g.num_passed.append(passed)
        g.widths.append(widths[a][: min(passed + 1, num_layers[a])])


def _prune_floor(g: _Group, params: DecodeParams) -> float:
    """``verify_forest_greedy``'s ``prune_floor``: +inf when no hypothesis can finish; else the ``n``-th best
    finished score so far (-inf with fewer, or when every hypothesis is returned)."""
    if not ((params.eos_token_id is not None and not params.ignore_eos) or params.stop_token_ids
            or params.stop_fn is not None):
        return float("inf")
    scores = sorted((_score(seq, cum, params, True) for seq, cum in g.finished), reverse=True)
    return scores[params.n - 1] if params.n is not None and len(scores) >= params.n else float("-inf")


def _greedy_iteration(target_fn: LogitsFn, draft_fn: LogitsFn | None, batch: list[_Group],
                      params: DecodeParams, vocab: int) -> None:
    num_groups, width, gamma = len(batch), params.beam_width, params.num_speculative_tokens
    roots = _roots(batch, params)
    ignore_eos = torch.full((num_groups,), params.ignore_eos)
    length_penalty = torch.full((num_groups,), params.length_penalty, dtype=torch.float64)
    seq_lens = torch.tensor([len(g.live[0][0]) for g in batch])
    draft_parents = torch.zeros((num_groups, gamma, width), dtype=torch.long)
    draft_tokens = torch.zeros_like(draft_parents)
    draft_exists = torch.zeros((num_groups, gamma, width), dtype=torch.bool)
    layer_seqs = [roots.seqs]
    node_ok = [roots.valid]
    draft_scores = roots.scores
    for i in range(1, gamma + 1):
        need = node_ok[-1] & (roots.num_layers >= i)[:, None]
        q_lp = _node_logprobs(draft_fn, [layer_seqs[-1]], need[:, None], vocab, 0.0)[:, 0]
        step = beam_search_step(q_lp, draft_scores, need, seq_lens + i - 1, width, params.eos_token_id,
                                ignore_eos, length_penalty, params.stop_token_ids)
        exists = step.valid & need.any(-1)[:, None]
        draft_parents[:, i - 1], draft_tokens[:, i - 1], draft_exists[:, i - 1] = step.parents, step.tokens, exists
        draft_scores = step.cum_logprobs
        layer_seqs.append(_extend(layer_seqs[-1], step.parents, step.tokens, exists))
        node_ok.append(exists)

    target_lp = _node_logprobs(target_fn, layer_seqs, torch.stack(node_ok, 1), vocab, 0.0)
    res = verify_forest_greedy(target_lp, roots.scores, roots.valid, draft_parents, draft_tokens, draft_exists,
                               roots.num_layers, seq_lens, width, params.eos_token_id, ignore_eos, length_penalty,
                               params.stop_token_ids, _node_finishes(batch, layer_seqs, params),
                               torch.tensor([_prune_floor(g, params) for g in batch], dtype=torch.float64))

    num_passed = res.num_passed.tolist()
    fin_parent, fin_cum = res.finished_parent.tolist(), res.finished_cum_logprob.tolist()
    fin_valid, fin_token = res.finished_valid.tolist(), res.finished_token.tolist()
    out_parent, out_token, out_cum, out_valid = (
        res.out_parent.tolist(), res.out_token.tolist(), res.out_cum_logprob.tolist(), res.out_valid.tolist())
    for a, g in enumerate(batch):
        passed = num_passed[a]
        for step_i in range(passed + 1):  # every step's EOS / stop-token hypotheses, in vLLM's order
            for p, cum, ok, t in zip(fin_parent[a][step_i], fin_cum[a][step_i], fin_valid[a][step_i],
                                     fin_token[a][step_i]):
                if ok:
                    g.finished.append((layer_seqs[step_i][a][p] + [t], cum))
        g.live = [(layer_seqs[passed][a][p] + [t], cum)
                  for p, t, cum, ok in zip(out_parent[a], out_token[a], out_cum[a], out_valid[a]) if ok]
        g.num_generated += passed + 1
        g.num_passed.append(passed)
