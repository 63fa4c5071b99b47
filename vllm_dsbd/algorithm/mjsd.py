"""MJSD: multi-token joint speculative decoding (seed 004, Qin et al., arXiv 2407.09722), plain torch.

One iteration of a request whose text so far is ``x`` (the rule from the
authors' public code; the issue gives it):

1. **Draft.** The draft beam-samples ``K`` beams for ``γ`` steps at the
   request's temperature, top-k and top-p (the joint over beams x vocabulary,
   as DSBD's draft layers: :func:`joint.joint_probs`, ``K`` draws with
   replacement per step, over ``K`` slots); at ``T = 0`` it runs vLLM's beam
   search with ``K`` beams. A draft beam whose token finishes the sequence
   (EOS unless ``ignore_eos``) is not grown further. The *draft path* is the
   draft beam with the highest joint draft log-probability (its cumulative
   tempered draft log-prob) among the last step's beams and the beams that
   finished earlier (ties: the earlier step, then the lower slot).
2. **Verify.** One target forward over the path gives, for every prefix
   length ``l``, ``log P(x_1..x_l) - log Q(x_1..x_l)``: the sums of the
   target's :func:`token_logprobs` at the path's tokens and of the log-probs
   the draft drew them with: at ``T > 0`` each token's parent row of the draft
   step's joint (top-k / top-p on the joint), renormalised
   (:func:`node_conditionals`), so a drawn token never has ``Q = 0``; at
   ``T = 0`` the draft's raw log-probs. The longest ``l`` in ``1..γ`` with that difference ``>= log τ``
   is accepted (the longest, not the first failure; ``l = 0`` if none).
3. **Bonus.** One token is drawn from the target's distribution after
   ``x_1..x_l`` (at ``T = 0`` its argmax; else an inverse-CDF draw,
   :func:`joint.sample_joint`): at least one token per iteration.

Randomness: one ``torch.Generator`` per prompt drives every draw in order,
or ``rng(iteration, salt)`` gives a fresh one per draw (salt: the draft step
``1..γ``, 1000 for the bonus), as the engine seeds its draws.

A path token that finishes the sequence (EOS, unless ``ignore_eos``) ends
the accepted prefix there; no bonus token follows it.

Not lossless: ``τ`` trades likelihood against speed. ``τ = 0`` accepts every
path; with a huge ``τ`` nothing is accepted and every token is the bonus
draw, so the output is distributed as the target's own sampling. At ``T =
0`` the target's probabilities are one-hot and the draft's are taken raw
(untempered, finite), so for ``τ > 0`` only prefixes the target would write
greedily pass and the output is the target's greedy output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_dsbd.algorithm.joint import (
    Generators,
    sample_joint,
    beam_search_step,
    joint_probs,
    probs_from_logprobs_,
    restrict_joint,
    tempered_logprobs,
    token_finishes,
)

LogitsFn = Callable[[list[list[int]]], Tensor]
Rng = Callable[[int, int], torch.Generator]  # (iteration, salt) -> the generator of one draw

BONUS_SALT = 1_000


def token_logprobs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   one_hot_at_zero: bool = True) -> Tensor:
    """The per-token log-distribution a sampled request draws from: [N, V] -> [N, V] float32.

    ``T > 0``: ``log softmax(logits / T)`` restricted to its top-k, then top-p
    set and renormalised. ``T = 0``: one-hot on the argmax (``0`` there,
    ``-inf`` elsewhere; the lowest id on ties), or the raw log-probs with
    ``one_hot_at_zero=False`` (the draft's ``Q`` at ``T = 0``).
    """
    if temperature == 0:
        if not one_hot_at_zero:
            return torch.log_softmax(logits.float(), dim=-1)
        out = torch.full(logits.shape, float("-inf"), device=logits.device)
        return out.scatter(-1, logits.float().argmax(-1, keepdim=True), 0.0)
    rows = logits.shape[0]
    return restrict_joint(tempered_logprobs(logits, temperature),
                          torch.full((rows,), top_k, device=logits.device),
                          torch.full((rows,), top_p, device=logits.device))


def node_conditionals(joint: Tensor, width: int) -> Tensor:
    """``log q(. | node)`` of a draft step that drew its nodes from ``joint`` ([W*V] probabilities over
    (parent slot, token), top-k / top-p applied to the joint): each parent's row of the joint,
    renormalised. A drawn token always has a finite log q (it was in the joint's support); rows of
    slots with no mass are ``-inf``. Returns [W, V] float32."""
    rows = joint.reshape(width, -1).float()
    total = rows.sum(-1, keepdim=True)
    return (rows / torch.where(total > 0, total, torch.ones_like(total))).log()


def node_conditionals_at(joint: Tensor, width: int, parents: Tensor, tokens: Tensor) -> Tensor:
    """:func:`node_conditionals` read at (parent slot, token) pairs only, the same numbers: [N] float32
    ``log q(token | parent)``, with a row sum per pair instead of a log over all ``W * V`` entries (what a
    verification reads of a draft layer: one node per layer of its path)."""
    rows = joint.reshape(width, -1).float()[parents]  # [N, V]
    total = rows.sum(-1, keepdim=True)
    picked = rows.gather(-1, tokens.reshape(-1, 1))
    return (picked / torch.where(total > 0, total, torch.ones_like(total))).log()[:, 0]


def log_tau(tau: float) -> float:
    """log τ in float64 (``-inf`` for τ = 0: every prefix passes), as engine and reference compare it."""
    return float("-inf") if tau == 0 else math.log(tau)


def accepted_length(target_lp: Tensor, draft_lp: Tensor, num_tokens: Tensor, log_tau: Tensor) -> Tensor:
    """The MJSD acceptance rule, batched over requests.

    target_lp, draft_lp: [G, γ] log-probs of the draft path's tokens under the
    target and under the draft (:func:`token_logprobs`). num_tokens: [G] path
    length (positions beyond it are ignored). log_tau: [G] (``-inf``: τ = 0).
    Returns [G] int64: the longest ``l`` in ``1..num_tokens`` with
    ``sum_{i<=l} (target_lp - draft_lp) >= log_tau``, or 0 if there is none.
    """
    gamma = target_lp.shape[-1]
    diff = (target_lp.double() - draft_lp.double()).cumsum(-1)
    lengths = torch.arange(1, gamma + 1, device=target_lp.device)
    ok = (diff >= log_tau.double()[:, None]) & (lengths[None, :] <= num_tokens[:, None])
    return (ok.long() * lengths).max(-1).values if gamma else torch.zeros_like(num_tokens)


@dataclass(frozen=True)
class MJSDParams:
    num_beams: int = 4  # K: draft beams
    num_speculative_tokens: int = 4  # γ: draft steps per iteration
    tau: float = 0.5  # τ >= 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    eos_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [(self.num_beams >= 1, "num_beams (K) must be >= 1"),
                  (self.num_speculative_tokens >= 1, "num_speculative_tokens (γ) must be >= 1"),
                  (self.tau >= 0, "tau must be >= 0"), (self.temperature >= 0, "temperature must be >= 0"),
                  (self.max_tokens >= 1, "max_tokens must be >= 1")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class MJSDResult:
    tokens: list[list[int]]  # per prompt: generated tokens (a final EOS included)
    accepted: list[list[int]] = field(default_factory=list)  # per prompt and iteration: l
    path_lengths: list[list[int]] = field(default_factory=list)  # per prompt and iteration: draft path length


def draft_path(draft_fn: LogitsFn, prefix: list[int], params: MJSDParams, gamma: int,
               rng: Callable[[int], torch.Generator | None]) -> tuple[list[int], list[float]]:
    """Step 1: ``K`` draft beams for ``gamma`` steps over ``K`` slots; the tokens of the best one and the
    log-probs the draft drew them with (``log Q`` per token, see step 2).

    ``rng(step)`` is the generator of draft step ``step`` (1-based).
    """
    width = params.num_beams
    # (slot, tokens, score, log q per token) of the parents
    growing: list[tuple[int, list[int], float, list[float]]] = [(0, [], 0.0, [])]
    best: tuple[float, list[int], list[float]] = (float("-inf"), [], [])
    for step in range(1, gamma + 1):
        if not growing:
            break
        logits = draft_fn([prefix + tokens for _, tokens, _, _ in growing]).float()
        vocab = logits.shape[-1]
        slots = torch.tensor([slot for slot, _, _, _ in growing])
        scores = torch.full((1, width), float("-inf"), dtype=torch.float64)
        scores[0, slots] = torch.tensor([score for _, _, score, _ in growing], dtype=torch.float64)
        valid = torch.zeros((1, width), dtype=torch.bool)
        valid[0, slots] = True
        lp = torch.zeros((width, vocab))
        if params.temperature > 0:
            lp[slots] = tempered_logprobs(logits, params.temperature)
            probs = joint_probs(scores, valid, lp[None], torch.tensor([params.top_k]), torch.tensor([params.top_p]))
            draws = sample_joint(probs, width, rng(step))[0]
            parents, tokens = draws // vocab, draws % vocab
            nodes = list(zip(parents.tolist(), tokens.tolist(), (scores[0, parents] + lp[parents, tokens].double()).tolist()))
            drawn_with = node_conditionals(probs[0], width)
        else:
            lp[slots] = torch.log_softmax(logits, dim=-1)
            res = beam_search_step(lp[None], scores, valid, torch.tensor([len(prefix) + step - 1]), width,
                                   params.eos_token_id, torch.tensor([params.ignore_eos]),
                                   torch.tensor([1.0], dtype=torch.float64))
            keep = res.valid[0]
            nodes = list(zip(res.parents[0][keep].tolist(), res.tokens[0][keep].tolist(),
                             res.cum_logprobs[0][keep].tolist()))
            drawn_with = lp
        by_slot = {slot: (tokens, logq) for slot, tokens, _, logq in growing}
        growing = []
        for slot, (parent, token, score) in enumerate(nodes):
            tokens, logq = by_slot[parent][0] + [token], by_slot[parent][1] + [float(drawn_with[parent, token])]
            if step == gamma or _finishes(token, params):  # a candidate draft path (strictly better only)
                if score > best[0]:
                    best = (score, tokens, logq)
            if step < gamma and not _finishes(token, params):
                growing.append((slot, tokens, score, logq))
    return best[1], best[2]


def mjsd_decode(target_fn: LogitsFn, draft_fn: LogitsFn, prompts: Sequence[Sequence[int]], params: MJSDParams,
                generator: Generators | None = None, rng: Rng | None = None) -> MJSDResult:
    """The exact reference MJSD decoder, one prompt after the other (one generator, one per prompt, or
    ``rng``: a generator per draw, as the engine seeds them)."""
    if params.temperature > 0 and generator is None and rng is None:
        raise ValueError("sampling (temperature > 0) needs a torch.Generator or rng")
    threshold = torch.tensor([log_tau(params.tau)], dtype=torch.float64)
    result = MJSDResult([])
    for index, prompt in enumerate(prompts):
        gen = generator if generator is None or isinstance(generator, torch.Generator) else generator[index]
        out: list[int] = []
        accepted, lengths = [], []
        while len(out) < params.max_tokens and not (out and _finishes(out[-1], params)):
            iteration = len(accepted)

            def draw_rng(salt: int) -> torch.Generator | None:
                return gen if rng is None else rng(iteration, salt)

            prefix = list(prompt) + out
            gamma = min(params.num_speculative_tokens, params.max_tokens - len(out) - 1)
            path, path_logq = draft_path(draft_fn, prefix, params, gamma, draw_rng) if gamma > 0 else ([], [])
            rows = [prefix + path[:j] for j in range(len(path) + 1)]
            target_logits = target_fn(rows)  # [len(path) + 1, V]
            l = 0
            if path:
                ids = torch.tensor(path)[:, None]
                t_lp = token_logprobs(target_logits[:-1], params.temperature, params.top_k, params.top_p)
                l = int(accepted_length(t_lp.gather(1, ids).T, torch.tensor([path_logq]),
                                        torch.tensor([len(path)]), threshold)[0])
            kept = path[:l]
            finished_at = next((i for i, t in enumerate(kept) if _finishes(t, params)), None)
            if finished_at is not None:
                out += kept[: finished_at + 1]
            else:
                out += kept + [_bonus(target_logits[l], params, draw_rng(BONUS_SALT))]
            accepted.append(l)
            lengths.append(len(path))
        result.tokens.append(out)
        result.accepted.append(accepted)
        result.path_lengths.append(lengths)
    return result


def _finishes(token: int, params: MJSDParams) -> bool:
    return token_finishes(token, params.eos_token_id, params.ignore_eos)


def _bonus(logits: Tensor, params: MJSDParams, generator: torch.Generator | None) -> int:
    """Step 3: one token from the target's distribution after the accepted prefix."""
    lp = token_logprobs(logits[None].float(), params.temperature, params.top_k, params.top_p)[0]
    if params.temperature == 0:
        return int(lp.argmax())
    return int(sample_joint(probs_from_logprobs_(lp)[None], 1, generator)[0, 0])  # lp is ours: in place
