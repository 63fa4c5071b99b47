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

PROTOCOL_VERSION = 12

PLAN_ATTR = "dsbd_plan"
RESULT_ATTR = "dsbd_result"


def node_id(layer: int, slot: int, width: int) -> int:
    """A forest node's id: the roots (layer 0) are 0..W-1, draft layer ``l`` >= 1 holds W*l..W*l+W-1."""
    return slot if layer == 0 else width + (layer - 1) * width + slot


def layer_slot(node: int, width: int) -> tuple[int, int]:
    """(layer, slot) of a node id (layer 0: the roots); the inverse of :func:`node_id`."""
    if node < width:
        return 0, node
    layer, slot = divmod(node - width, width)
    return layer + 1, slot


def shared_prefixes(paths) -> list[int]:
    """Per path (node ids, root first): how many of its leading nodes an earlier path holds. Paths of one
    forest share prefixes only (a root, then the nodes down to where they part); a path whose root no earlier
    path has shares 0."""
    seen: set[int] = set()
    out = []
    for path in paths:
        k = 0
        while k < len(path) and path[k] in seen:
            k += 1
        out.append(k)
        seen.update(path)
    return out


def first_path_through(paths, aliases, node: int) -> int:
    """The first of ``paths`` (node ids, root first) through ``node``, or through its twin (``aliases``:
    leaf -> twin; a leaf drawn twice continues on its twin's path): its request carries the node's children."""
    node = dict(aliases).get(node, node)
    return next(k for k, path in enumerate(paths) if node in path)


@dataclass(frozen=True)
class GroupDecoding:
    """How a group decodes: what every step of a group (beam, draft, verify) carries."""

    group_id: str
    beam_width: int  # W: beams drawn / kept
    temperature: float  # 0: beam search (vLLM's rule); > 0: beam sampling
    top_k: int  # on the joint; 0 = off
    top_p: float  # on the joint; 1 = off
    length_penalty: float
    ignore_eos: bool
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...] = field(default=(), kw_only=True)  # finish like EOS, even with ignore_eos
    stop: tuple[str, ...] = field(default=(), kw_only=True)  # stop strings (engine.stops): finish like EOS
    tails: tuple[tuple[int, ...], ...] = field(default=(), kw_only=True)
    """With ``stop``: the last generated tokens (engine.stops.tail_length) of each beam (GroupStep,
    VerifyStep: of each root slot) or of each parent node (DraftStep: unused)."""
    seed: int  # with `step`, seeds the group's generator (the same on every tensor-parallel rank)
    step: int  # the group's beam step (GroupStep) or DSBD iteration (DraftStep, VerifyStep)
    draft_temperature_scale: float = field(default=1.0, kw_only=True)  # the draft's temperature is T * this (T 0: this)


@dataclass(frozen=True)
class GroupStep(GroupDecoding):
    """One beam step of one group: every live beam's next-token logits are in this step's batch."""

    req_ids: tuple[str, ...]  # [B] internal requests of the live beams, beam order
    scores: tuple[float, ...]  # [B] cumulative target log-probs S_b (tempered when temperature > 0)
    seq_len: int  # tokens per beam now: prompt + generated (equal for all beams)
    num_logprobs: int  # per chosen token: -1 nothing extra, 0 its own log-prob and rank, k > 0 also the top-k
    draft_next: int | None = None
    """An iteration of depth 0 (auto_depth with ``draft_in_step``): γ of the next iteration, whose layers the
    runner draws right after this beam step (``engine.forest_draft``), cut to ``max_tokens_left``; 0: chosen
    to be a beam step again. None: the next iteration is chosen after the step, as with draft steps."""
    max_tokens_left: int = 0  # max_tokens - generated before this step (with draft_next)
    draft_from: tuple[int, ...] = ()  # [B] with draft_next: where each beam's head KV ends (a position)


@dataclass(frozen=True)
class DraftStep(GroupDecoding):
    """Draft layer ``layer`` of one DSBD iteration: the draft model ran on every parent node in this step.

    Parent nodes are the slots of layer ``layer - 1`` (layer 0: the live
    beams) that can have children; slots are numbered ``0..W-1``.
    """

    layer: int  # i, 1-based
    req_ids: tuple[str, ...]  # [P] requests of the parent nodes, slot order
    slots: tuple[int, ...]  # [P] slot of each parent in its layer
    scores: tuple[float, ...]  # [P] path scores: target S of the beam + draft log-probs below it
    seq_len: int  # tokens per parent node now (prompt + generated + layer - 1)
    mjsd: bool = False  # an MJSD group: the runner keeps the layer's per-node draft log-probs, not the joint


@dataclass(frozen=True)
class VerifyStep(GroupDecoding):
    """The verification of one DSBD iteration: the target ran on every root-to-leaf path in this step.

    Node ids follow ``algorithm.forest``: roots (the beams, padded to W
    slots) are ``0..W-1``, draft node (layer i, slot j) is ``W + (i-1)*W + j``.
    Path request k computed the target at every node of ``paths[k]`` from ``shared[k]`` on (its first
    ``shared[k]`` nodes, computed by an earlier path, it holds as computed tokens: ``engine.shared_rows``);
    a node of ``aliases`` is computed as its twin.
    """

    path_req_ids: tuple[str, ...]  # [num_paths]
    paths: tuple[tuple[int, ...], ...]  # node ids of each path, root first
    root_scores: tuple[float, ...]  # [W] S of the beams (-inf for empty slots)
    root_valid: tuple[bool, ...]  # [W]
    draft_parents: tuple[tuple[int, ...], ...]  # [layers][W] parent slot in the layer above
    draft_tokens: tuple[tuple[int, ...], ...]  # [layers][W]
    draft_exists: tuple[tuple[bool, ...], ...]  # [layers][W]
    seq_len: int  # tokens per beam (prompt + generated)
    num_out: int  # W_out: 1 in memory-efficient mode
    width_threshold: float  # >= 1: fixed width
    min_width: int
    num_logprobs: int
    aliases: tuple[tuple[int, int], ...] = ()
    """(leaf, its twin): a leaf with the same parent and token as an earlier leaf of its layer is on no
    path; the target computed it once, on the twin's path (``BeamGroup._set_up_paths``)."""
    mjsd_tau: float | None = None
    """MJSD (``engine.mjsd_step``): ``paths`` is the one draft path to verify, with this τ; None: DSBD."""
    draft_next: int = 0
    """γ of the next iteration, drafted by the runner right after this verification (an EAGLE-3 head with
    ``draft_in_step``; ``engine.forest_draft``), cut to ``max_tokens_left``; 0: by draft steps, as before."""
    max_tokens_left: int = 0  # max_tokens - generated before this iteration (with draft_next)
    shared: tuple[int, ...] = ()
    """Per path: its leading nodes that an earlier path's request computes (``shared_prefixes``); its
    logits rows start at node ``shared[k]``. Empty: every path computes all its nodes."""
    prune_floor: float = float("-inf")
    """T 0: ``algorithm.verify_forest_greedy``'s ``prune_floor``, the score below which a beam's finished
    hypotheses cannot reach the group's results (``BeamGroup.prune_floor``); -inf leaves out no beam that could
    finish one."""

    def skip(self, path: int) -> int:
        """The leading nodes of ``paths[path]`` that its request holds as computed (no logits row)."""
        return self.shared[path] if self.shared else 0

    def path_tokens(self, path: int, depth: int) -> list[int]:
        """The draft tokens of ``paths[path]`` at layers 1..depth (the tokens it verified up to that depth)."""
        return [self.draft_tokens[layer - 1][slot]
                for layer, slot in (layer_slot(n, self.beam_width) for n in self.paths[path][1:depth + 1])]


@dataclass
class StepPlan:
    groups: list[GroupStep]
    discard_req_ids: list[str] = field(default_factory=list)
    """Beams computed up to their last token whose group is not complete this
    step: the runner samples nothing for them and the scheduler recomputes
    their last token later."""
    draft: bool = False
    """A draft step: the runner runs the draft model (not the target) on every scheduled request."""
    draft_steps: list[DraftStep] = field(default_factory=list)
    verify_steps: list[VerifyStep] = field(default_factory=list)
    forget_group_ids: list[str] = field(default_factory=list)
    """Groups gone since the last step: the runner drops their stored draft distributions."""
    started_group_ids: list[str] = field(default_factory=list)
    """Scheduler bookkeeping (the runner ignores it): speculative groups whose beams' KV became complete."""
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class TokenLogprob:
    """The raw (untempered) log-prob of a chosen token under its parent, as vLLM reports logprobs."""

    logprob: float
    rank: int  # 1 = the parent's most likely token; 0 when the request asked for no log-probs (not computed)
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
    next_layers: list[DraftDecision] = field(default_factory=list)
    """With ``GroupStep.draft_next``: the next iteration's draft layers, drawn from the new beams."""


@dataclass
class DraftDecision:
    """The W draft nodes of a layer, in draw order (T = 0: best first, possibly fewer)."""

    group_id: str
    parents: list[int]  # slot of each node's parent in the layer above
    tokens: list[int]
    scores: list[float]  # path scores for the next layer's joint


@dataclass(frozen=True)
class VerifyChoice:
    parent: int  # node id of the parent (in layer num_passed)
    token: int
    score: float  # cumulative target score S of the new beam
    logprobs: tuple[TokenLogprob, ...]  # raw target log-probs of the parent's path tokens, then of `token`


@dataclass
class VerifyDecision:
    group_id: str
    num_passed: int  # draft layers passed; the new beams are children of layer num_passed
    beams: list[VerifyChoice]  # the new live beams, in their new beam order
    finished: list[VerifyChoice]  # new finished hypotheses (ending in EOS)
    num_proposed: list[int]  # [layers] draft nodes per verified layer
    num_accepted: list[int]  # [layers] accepted draft nodes per verified layer
    widths: list[int]  # [num_passed + 1] live beams (not finished) at each layer produced; at most W
    next_layers: list[DraftDecision] = field(default_factory=list)
    """With ``VerifyStep.draft_next``: the next iteration's draft layers, drawn from the new beams."""


@dataclass
class GroupTiming:
    """The runner's own time on one group in a target step (auto_depth costs each on its own)."""

    decide_seconds: float = 0.0  # deciding its iteration: the verification, or its share of the beam steps
    draft_seconds: float = 0.0  # drawing ``next_layers`` of its decision (draft_in_step)
    draft_rows: int = 0  # the head's rows in that drawing: the chains' tokens (its KV catching up), then the nodes


@dataclass
class StepResult:
    decisions: dict[str, GroupDecision]
    draft_decisions: dict[str, DraftDecision] = field(default_factory=dict)
    verify_decisions: dict[str, VerifyDecision] = field(default_factory=dict)
    timings: dict[str, GroupTiming] = field(default_factory=dict)
    """Per group of a target step. Measured on each rank, so not decisions: left out of the decisions' digest."""
    version: int = PROTOCOL_VERSION
