"""What the DSBD scheduler and the model runner tell each other each engine step.

The scheduler attaches a :class:`StepPlan` to vLLM's ``SchedulerOutput``
(attribute ``dsbd_plan``); every worker reads it. The runner attaches a
:class:`StepResult` to ``ModelRunnerOutput`` (attribute ``dsbd_result``);
the scheduler reads the output rank's. Both travel pickled inside vLLM's own
messages (probed: extra attributes survive the transport). Keep these types
small, plain and versioned: a change of meaning bumps :data:`PROTOCOL_VERSION`.

Indices: a group's beams are numbered in *beam order* (the order of
``GroupStep.req_ids``); a choice's ``parent`` is such an index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROTOCOL_VERSION = 1

PLAN_ATTR = "dsbd_plan"
RESULT_ATTR = "dsbd_result"


@dataclass(frozen=True)
class GroupStep:
    """One beam step of one group: every live beam's next-token logits are in this step's batch."""

    group_id: str
    req_ids: tuple[str, ...]  # [B] internal requests of the live beams, beam order
    scores: tuple[float, ...]  # [B] cumulative target log-probs S_b (tempered when temperature > 0)
    seq_len: int  # tokens per beam now: prompt + generated (equal for all beams)
    beam_width: int  # W: beams drawn / kept
    temperature: float  # 0: beam search (vLLM's rule); > 0: beam sampling
    top_k: int  # on the joint; 0 = off
    top_p: float  # on the joint; 1 = off
    length_penalty: float
    ignore_eos: bool
    eos_token_id: int | None
    num_logprobs: int  # per chosen token: -1 nothing extra, 0 its own log-prob and rank, k > 0 also the top-k
    seed: int  # with `step`, seeds the group's generator (the same on every tensor-parallel rank)
    step: int


@dataclass
class StepPlan:
    groups: list[GroupStep]
    discard_req_ids: list[str] = field(default_factory=list)
    """Beams computed up to their last token whose group is not complete this
    step: the runner samples nothing for them and the scheduler recomputes
    their last token later."""
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class TokenLogprob:
    """The raw (untempered) log-prob of a chosen token under its parent, as vLLM reports logprobs."""

    logprob: float
    rank: int  # 1 = the parent's most likely token
    top_ids: tuple[int, ...] = ()  # top-k tokens of the parent (k = GroupStep.num_logprobs)
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class BeamChoice:
    parent: int  # beam index of the parent
    token: int
    score: float  # the new cumulative score S (tempered for temperature > 0)
    logprob: TokenLogprob


@dataclass
class GroupDecision:
    group_id: str
    beams: list[BeamChoice]  # the new live beams, in their new beam order
    finished: list[BeamChoice]  # new finished hypotheses (their token ends them: EOS)


@dataclass
class StepResult:
    decisions: dict[str, GroupDecision]
    version: int = PROTOCOL_VERSION
