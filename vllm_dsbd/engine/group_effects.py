"""What a beam group's commits return to the scheduler (``BeamGroup.apply``, ``apply_draft``, ``apply_verify``):
an ordered list of operations on the internal vLLM requests, and the beams and draft nodes that forks create.
Plain records (no torch, no vLLM); the requests are opaque (anything with a ``request_id``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_dsbd.engine.protocol import TokenLogprob


@dataclass
class Beam:
    request: Any  # the internal vLLM request; None until the scheduler creates it (forks)
    tokens: list[int]  # generated tokens
    score: float  # cumulative target log-prob S (tempered when temperature > 0)
    logprobs: list[TokenLogprob]


@dataclass
class Extend:
    request: Any
    tokens: list[int]  # to append to the request
    computed: bool = False  # the target has already computed these tokens (accepted drafts)


@dataclass
class PathRequest:
    """Set up a root-to-leaf path for verification: ``root``'s tokens with ``spec_tokens`` to verify."""

    root: Any
    spec_tokens: list[int]
    reuse_root: bool  # the root's request is the path's (else a fork of it, set by the scheduler)
    request: Any = None
    # a fork's first tokens after the root's: the path's nodes below the root that an earlier path computes,
    # then its first own node (engine.shared_rows); the fork holds the shared ones as computed
    tokens: list[int] = field(default_factory=list)


@dataclass
class DraftNode:
    parent: int  # slot in the layer above
    token: int
    score: float  # path score: the beam's target score plus the draft log-probs below it
    request: Any = None  # while the draft runs on this node


@dataclass
class Free:
    request: Any


@dataclass
class Fork:
    parent: Any  # request to fork from, as it is now
    token: int  # the child's own new token
    child: Beam | DraftNode  # its `request` is set by the scheduler


Op = Fork | Extend | Free | PathRequest


@dataclass
class StepEffects:
    ops: list[Op] = field(default_factory=list)

    @property
    def forks(self) -> list[Fork]:
        return [op for op in self.ops if isinstance(op, Fork)]

    @property
    def frees(self) -> list[Any]:
        return [op.request for op in self.ops if isinstance(op, Free)]
