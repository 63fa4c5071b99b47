"""A beam group: everything one user request owns inside the engine (no torch, no vLLM).

Each live beam is an internal vLLM request (kept opaque here: anything with a
``request_id``) whose tokens are the prompt followed by the beam's generated
tokens. One beam step turns the live beams into new ones, each a child
``(parent beam, token)``. :meth:`BeamGroup.apply` commits a step and says what
the scheduler must do with the internal requests:

- the *first* child of a parent (in the new beam order) continues the parent's
  request: one token is appended;
- every further child is a *fork*: a new request with the parent's tokens
  plus its own token, sharing the parent's KV blocks;
- a parent without children is freed.

Forks are listed before the continuations, and the scheduler must fork before
it appends the continuing child's token (a fork copies the parent's tokens).

Worked example (W = 3): beams ``[a, b, c]``, new beams ``[(a, 5), (c, 7),
(a, 9)]`` -> ``a`` continues with 5 (new beam 0), ``c`` continues with 7
(new beam 1), fork of ``a`` with 9 (new beam 2), ``b`` is freed.

Finishing and ranking follow vLLM 0.32.0's built-in beam search: a hypothesis
ending in EOS (unless ``ignore_eos``) finishes; the group ends after
``max_tokens`` steps or when no live beam is left; finished and live
hypotheses are ranked together by ``cum / max(len, 1) ** length_penalty``
(``len`` = prompt + generated tokens, minus one for a final EOS), stable, and
the best ``n`` are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_dsbd.engine.protocol import GroupDecision, GroupStep, TokenLogprob


@dataclass(frozen=True)
class BeamParams:
    """Decoding parameters of one user request, validated (see ``engine.requests``)."""

    beam_width: int
    n: int
    temperature: float
    top_k: int
    top_p: float
    length_penalty: float
    max_tokens: int  # effective: also capped by max_model_len - prompt_len
    ignore_eos: bool
    eos_token_id: int | None  # the tokenizer's EOS (used for scoring even with ignore_eos, as vLLM does)
    num_logprobs: int  # -1: none requested; 0: the token's own; k: top-k too
    seed: int

    @property
    def finishing_token(self) -> int | None:
        return None if self.ignore_eos else self.eos_token_id


@dataclass
class Beam:
    request: Any  # the internal vLLM request; None until the scheduler creates it (forks)
    tokens: list[int]  # generated tokens
    score: float  # cumulative target log-prob S (tempered when temperature > 0)
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated tokens, a final EOS included
    cum_score: float
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str  # "stop" (EOS) or "length"
    score: float  # length-normalised (vLLM's get_beam_search_score)


@dataclass
class Fork:
    parent: Any  # request to fork from (before its continuing child's token is appended)
    child: Beam  # child.request is set by the scheduler


@dataclass
class StepEffects:
    forks: list[Fork] = field(default_factory=list)
    continues: list[tuple[Any, int]] = field(default_factory=list)  # (request, token to append)
    frees: list[Any] = field(default_factory=list)


class BeamGroup:
    def __init__(self, group_id: str, user_request_ids: list[str], prompt_len: int, params: BeamParams,
                 root_request: Any) -> None:
        self.group_id = group_id
        self.user_request_ids = user_request_ids  # child index order: hypothesis k goes to id k
        self.prompt_len = prompt_len
        self.params = params
        self.beams: list[Beam] = [Beam(root_request, [], 0.0, [])]
        self.finished: list[Hypothesis] = []
        self.num_generated = 0
        self.step = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.num_generated >= self.params.max_tokens

    def requests(self) -> list[Any]:
        return [b.request for b in self.beams]

    def plan(self) -> GroupStep:
        p = self.params
        return GroupStep(
            group_id=self.group_id,
            req_ids=tuple(b.request.request_id for b in self.beams),
            scores=tuple(b.score for b in self.beams),
            seq_len=self.prompt_len + self.num_generated,
            beam_width=p.beam_width,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            length_penalty=p.length_penalty,
            ignore_eos=p.ignore_eos,
            eos_token_id=p.eos_token_id,
            num_logprobs=p.num_logprobs,
            seed=p.seed,
            step=self.step,
        )

    def apply(self, decision: GroupDecision) -> StepEffects:
        """Commit one beam step (see the module docstring)."""
        if self.done:
            raise RuntimeError(f"beam group {self.group_id} is finished; it takes no more steps")
        beams = self.beams
        for choice in decision.finished:
            parent = beams[choice.parent]
            self.finished.append(self._hypothesis(parent.tokens + [choice.token], choice.score,
                                                  parent.logprobs + [choice.logprob], "stop"))
        children: dict[int, list[int]] = {}
        for k, choice in enumerate(decision.beams):
            if not 0 <= choice.parent < len(beams):
                raise ValueError(f"beam group {self.group_id}: parent {choice.parent} out of range")
            children.setdefault(choice.parent, []).append(k)

        effects = StepEffects()
        new_beams: list[Beam | None] = [None] * len(decision.beams)
        for index, parent in enumerate(beams):
            kids = children.get(index)
            if not kids:
                effects.frees.append(parent.request)
                continue
            for k in kids[1:]:
                c = decision.beams[k]
                child = Beam(None, parent.tokens + [c.token], c.score, parent.logprobs + [c.logprob])
                effects.forks.append(Fork(parent.request, child))
                new_beams[k] = child
            c = decision.beams[kids[0]]
            parent.tokens.append(c.token)
            parent.score = c.score
            parent.logprobs.append(c.logprob)
            effects.continues.append((parent.request, c.token))
            new_beams[kids[0]] = parent
        self.beams = new_beams  # type: ignore[assignment]
        self.num_generated += 1
        self.step += 1
        return effects

    def _hypothesis(self, tokens: list[int], cum: float, logprobs: list[TokenLogprob], reason: str) -> Hypothesis:
        length = self.prompt_len + len(tokens)
        if tokens and tokens[-1] == self.params.eos_token_id:
            length -= 1
        score = cum / (max(length, 1) ** self.params.length_penalty)
        return Hypothesis(tuple(tokens), cum, tuple(logprobs), reason, score)

    def results(self) -> list[Hypothesis]:
        """The best ``n`` hypotheses, best first: finished ones, then the live beams, ranked together."""
        live = [self._hypothesis(b.tokens, b.score, b.logprobs, "length") for b in self.beams]
        ranked = sorted(self.finished + live, key=lambda h: h.score, reverse=True)
        return ranked[: self.params.n]
