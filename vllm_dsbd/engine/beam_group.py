"""A beam group: everything one user request owns inside the engine (no torch, no vLLM).

Each live beam is an internal vLLM request (kept opaque here: anything with a
``request_id``) whose tokens are the prompt followed by the beam's generated
tokens. One beam step turns the live beams into new ones, each a child
``(parent beam, token)``. :meth:`BeamGroup.apply` commits a step and says what
the scheduler must do with the internal requests:

- the *first* child of a parent (in the new beam order) continues the parent's
  request: its token is appended;
- every further child is a *fork*: a new request with the parent's tokens
  plus its own token, sharing the parent's KV blocks;
- a parent without children is freed.

The effects are an ordered list of operations for the scheduler: a fork
copies the parent's tokens as they are when it is carried out, so it comes
before the parent's own new token is appended.

Worked example (W = 3): beams ``[a, b, c]``, new beams ``[(a, 5), (c, 7),
(a, 9)]`` -> fork of ``a`` with 9 (new beam 2), ``a`` continues with 5 (new
beam 0), ``c`` continues with 7 (new beam 1), ``b`` is freed.

A DSBD iteration (``apply_verify``) commits several tokens at once: the new
beams are children of draft nodes at depth ``k``; each is continued from the
request of a root-to-leaf path through its parent node, which first takes
the ``k`` accepted path tokens, then the forks of its other children, then
its own new token.

Finishing and ranking follow vLLM 0.32.0's built-in beam search: a hypothesis
ending in EOS (unless ``ignore_eos``) or in a stop token finishes; the group ends after
``max_tokens`` steps or when no live beam is left; finished and live
hypotheses are ranked together by ``cum / max(len, 1) ** length_penalty``
(``len`` = prompt + generated tokens, minus one for a final EOS or stop token), stable, and
the best ``n`` are returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_dsbd.algorithm import token_finishes
from vllm_dsbd.engine.protocol import (
    DraftDecision,
    DraftStep,
    GroupDecision,
    GroupStep,
    TokenLogprob,
    VerifyDecision,
    VerifyStep,
    first_path_through,
    layer_slot,
    node_id,
    shared_prefixes,
)
from vllm_dsbd.engine.group_effects import Beam, DraftNode, Extend, Fork, Free, Op, PathRequest, StepEffects
from vllm_dsbd.engine.stops import tail_length


def request_slots(width: int, gamma: int) -> int:
    """Request slots a beam group may hold at once: W beams; with speculation (depth γ) W draft nodes
    and up to W (γ + 1) verification paths besides."""
    return width if gamma == 0 else width * (gamma + 3)


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
    num_speculative_tokens: int = 0  # γ: draft layers per iteration (0: one target step per token)
    width_threshold: float = 1.0  # τ (>= 1: fixed width)
    min_width: int = 1
    memory_efficient: bool = False
    auto_depth: bool = False  # γ of each iteration chosen by the scheduler (algorithm.depth), at most num_speculative_tokens
    stop_token_ids: tuple[int, ...] = ()  # SamplingParams.stop_token_ids: finish like EOS, even with ignore_eos
    stop: tuple[str, ...] = ()  # SamplingParams.stop: a beam whose generated text reaches one finishes like EOS
    mjsd_tau: float | None = None  # MJSD (algorithm.mjsd): one sequence, K = beam_width draft beams; None: DSBD
    draft_temperature_scale: float = 1.0  # the draft's temperature is temperature * this (T 0: this)

    @property
    def finishing_token(self) -> int | None:
        return None if self.ignore_eos else self.eos_token_id


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated tokens, a final EOS included
    cum_score: float
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str  # "stop" (EOS, a stop token), "stop_string" or "length"
    score: float  # length-normalised (vLLM's get_beam_search_score)


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
        # The DSBD iteration in progress (speculative groups only).
        self.in_iteration = False  # False: the beams' KV is being (re)computed by the target first
        self.num_draft_layers = 0  # γ of this iteration
        self.layers: list[list[DraftNode]] = []
        self.paths: list[tuple[int, ...]] = []  # node ids, root first
        self.aliases: dict[int, int] = {}  # leaf -> its twin (same parent and token), which has the path
        self.path_requests: list[PathRequest] = []
        self.draft_in_step = False  # set by the scheduler: the runner drafts the next forest while verifying
        self.share_path_rows = False  # set by the scheduler: a path holds the nodes an earlier one computes
        self.path_skips: list[int] = []  # per path: its leading nodes an earlier path computes
        self.draft_next = params.num_speculative_tokens  # γ it drafts there (auto_depth: chosen per iteration)
        # The deepest iteration its admission reserved request slots and KV blocks for: γ, or less for an
        # auto_depth group admitted when γ's did not fit (engine.group_admission).
        self.depth_cap = params.num_speculative_tokens

    @property
    def speculative(self) -> bool:
        return self.params.num_speculative_tokens > 0

    @property
    def mjsd(self) -> bool:
        return self.params.mjsd_tau is not None

    # ------------------------------------------------------------------
    # DSBD iterations: draft layers 1..γ, then one verification
    # ------------------------------------------------------------------

    @property
    def max_draft_layers(self) -> int:
        """The most draft layers the next iteration may have: γ (or the group's ``depth_cap``), cut so that
        no draft reaches beyond max_tokens (verification adds a token of its own)."""
        remaining = self.params.max_tokens - self.num_generated
        return max(0, min(self.depth_cap, remaining - 1))

    def start_iteration(self, num_draft_layers: int | None = None) -> StepEffects:
        """Begin an iteration with ``num_draft_layers`` (default and upper bound: ``max_draft_layers``).
        Without draft layers the paths (the beams alone) are set up at once: a plain beam step."""
        most = self.max_draft_layers
        self.num_draft_layers = most if num_draft_layers is None else max(0, min(num_draft_layers, most))
        self.layers, self.paths, self.path_requests, self.aliases = [], [], [], {}
        self.in_iteration = True
        return StepEffects(self._set_up_paths() if self.num_draft_layers == 0 else [])

    def extra_requests(self) -> list[Any]:
        """Requests of the iteration in progress other than the beams' own: draft nodes, path forks."""
        nodes = [n.request for layer in self.layers for n in layer if n.request is not None]
        return nodes + [pr.request for pr in self.path_requests if not pr.reuse_root and pr.request is not None]

    def reset_iteration(self) -> list[Any]:
        """Abandon the iteration in progress (the beams' KV was lost); returns the requests to free."""
        extra = self.extra_requests()
        self._end_iteration()
        return extra

    def _end_iteration(self) -> None:
        self.in_iteration = False
        self.num_draft_layers, self.layers, self.paths, self.path_requests, self.aliases = 0, [], [], [], {}

    @property
    def plain_iteration(self) -> bool:
        """An iteration without draft layers that is exactly one beam step (its paths are the beams): the
        runner decides it as a beam step (``plan``, ``apply``). Not MJSD (one path, its own rule) and not
        memory-efficient (a verification outputs one beam there)."""
        return (self.in_iteration and self.num_draft_layers == 0 and not self.mjsd
                and not self.params.memory_efficient)

    @property
    def drafting(self) -> bool:
        return len(self.layers) < self.num_draft_layers

    def _finishes(self, token: int) -> bool:
        p = self.params
        return token_finishes(token, p.eos_token_id, p.ignore_eos, p.stop_token_ids)

    def draft_parents(self) -> list[tuple[int, Any, float]]:
        """(slot, request, path score) of the nodes the next draft layer grows from."""
        if not self.layers:  # MJSD scores a draft path by its draft log-probs alone: log Q
            return [(slot, b.request, 0.0 if self.mjsd else b.score) for slot, b in enumerate(self.beams)]
        return [(slot, n.request, n.score) for slot, n in enumerate(self.layers[-1]) if n.request is not None]

    def draft_plan(self) -> DraftStep:
        parents = self.draft_parents()
        return DraftStep(
            **self.decoding(), layer=len(self.layers) + 1,
            req_ids=tuple(r.request_id for _, r, _ in parents), slots=tuple(s for s, _, _ in parents),
            scores=tuple(score for _, _, score in parents),
            seq_len=self.prompt_len + self.num_generated + len(self.layers), mjsd=self.mjsd,
        )

    def apply_draft(self, decision: DraftDecision) -> StepEffects:
        """Commit a draft layer: its nodes that the draft will grow get requests (forks of their parents);
        the previous layer's node requests are freed. After the last layer, the paths are set up."""
        parents = self.draft_parents()
        by_slot = {slot: request for slot, request, _ in parents}
        layer = len(self.layers) + 1
        effects = StepEffects()
        nodes = []
        for parent, token, score in zip(decision.parents, decision.tokens, decision.scores):
            node = DraftNode(parent, token, score)
            if layer < self.num_draft_layers and not self._finishes(token):
                effects.ops.append(Fork(by_slot[parent], token, node))  # the draft grows this node next
            nodes.append(node)
        if self.layers:
            effects.ops += [Free(r) for _, r, _ in parents]
        self.layers.append(nodes)
        if not any(isinstance(op, Fork) for op in effects.ops):
            self.num_draft_layers = len(self.layers)  # every node finished: the forest ends here
        if not self.drafting:
            effects.ops += self._set_up_paths()
        return effects

    def apply_drafted(self, decisions: list[DraftDecision]) -> StepEffects:
        """Commit the layers the runner drew inside the verify step (``engine.forest_draft``): no node requests;
        the forest ends with them, and its paths are set up at once."""
        if not 0 < len(decisions) <= self.num_draft_layers or self.layers:
            raise RuntimeError(f"beam group {self.group_id}: {len(decisions)} drafted layers for an iteration of "
                               f"{self.num_draft_layers} with {len(self.layers)} drafted")
        self.layers = [[DraftNode(*node) for node in zip(d.parents, d.tokens, d.scores)] for d in decisions]
        self.num_draft_layers = len(self.layers)
        return StepEffects(self._set_up_paths())

    def _forest(self) -> tuple[list[list[int]], list[list[int]], list[list[bool]]]:
        width = self.params.beam_width
        parents = [[0] * width for _ in self.layers]
        tokens = [[0] * width for _ in self.layers]
        exists = [[False] * width for _ in self.layers]
        for i, nodes in enumerate(self.layers):
            for j, n in enumerate(nodes):
                parents[i][j], tokens[i][j], exists[i][j] = n.parent, n.token, True
        return parents, tokens, exists

    def _set_up_paths(self) -> list[Op]:
        """Root-to-leaf paths of the forest (``algorithm.forest`` order): one request each (MJSD: one path)."""
        if self.mjsd:
            path = self._mjsd_path()
            self.paths, self.aliases, self.path_skips = [path], {}, [0]
            self.path_requests = [PathRequest(self.beams[0].request, self.node_path(path[-1])[1], reuse_root=True)]
            return list(self.path_requests)
        if not self.layers:  # no draft layer (a plain beam step): each beam alone is a path, its root slot's id
            self.paths, self.aliases = [(slot,) for slot in range(len(self.beams))], {}
            self.path_skips = [0] * len(self.paths)
            self.path_requests = [PathRequest(beam.request, [], reuse_root=True) for beam in self.beams]
            return list(self.path_requests)
        from vllm_dsbd.algorithm.forest import build_forest, root_to_leaf_paths
        import torch

        width = self.params.beam_width
        parents, tokens, exists = self._forest()
        num_layers = len(self.layers)
        forest = build_forest(
            width,
            torch.tensor(parents, dtype=torch.long).reshape(num_layers, width),
            torch.tensor(tokens, dtype=torch.long).reshape(num_layers, width),
            torch.tensor(exists, dtype=torch.bool).reshape(num_layers, width),
            root_exists=torch.tensor([slot < len(self.beams) for slot in range(width)]),
        )
        paths = root_to_leaf_paths(forest)
        flat, cu = paths.path_nodes.tolist(), paths.cu_num_positions.tolist()
        node_tokens = forest.tokens.tolist()
        # A leaf drawn twice (same parent node, same token: beam sampling draws with replacement) has the
        # same target distribution as its twin: only the first one gets a path (fewer verified tokens).
        self.paths, self.aliases, twins = [], {}, {}
        for k in range(paths.num_paths):
            path = tuple(flat[cu[k]:cu[k + 1]])
            leaf = path[-1]
            key = (path[-2], node_tokens[leaf]) if len(path) > 1 else None
            if key is not None and key in twins:
                self.aliases[leaf] = twins[key]
                continue
            if key is not None:
                twins[key] = leaf
            self.paths.append(path)
        self.path_skips = shared_prefixes(self.paths) if self.share_path_rows else [0] * len(self.paths)
        used_roots: set[int] = set()
        self.path_requests = []
        for path, skip in zip(self.paths, self.path_skips):  # skip 0: the first path from its root
            tokens = [node_tokens[n] for n in path[1:]]
            self.path_requests.append(PathRequest(self.beams[path[0]].request, tokens[skip:],
                                                  reuse_root=path[0] not in used_roots, tokens=tokens[:skip]))
            used_roots.add(path[0])
        return list(self.path_requests)

    def _mjsd_path(self) -> tuple[int, ...]:
        """MJSD verifies one path: to the draft beam with the highest joint draft log-prob (ties: the
        earlier layer, then the lower slot). The candidates are the last layer's nodes and the nodes that
        finished the sequence earlier (EOS, a stop token): the draft beams the draft did not grow."""
        width = self.params.beam_width
        best, best_score = 0, float("-inf")  # no draft layer: the root alone
        for i, nodes in enumerate(self.layers):
            for j, n in enumerate(nodes):
                if (i == len(self.layers) - 1 or self._finishes(n.token)) and n.score > best_score:
                    best, best_score = node_id(i + 1, j, width), n.score
        path = []
        node = best
        while node >= width:
            path.append(node)
            layer, slot = layer_slot(node, width)
            node = node_id(layer - 1, self.layers[layer - 1][slot].parent, width)
        return (node, *reversed(path))

    def verify_plan(self) -> VerifyStep:
        p = self.params
        width = p.beam_width
        parents, tokens, exists = self._forest()
        num_roots = len(self.beams)
        return VerifyStep(
            **self.decoding(),
            path_req_ids=tuple(pr.request.request_id for pr in self.path_requests),
            paths=tuple(self.paths), shared=tuple(self.path_skips) if any(self.path_skips) else (),
            root_scores=tuple(b.score for b in self.beams) + (float("-inf"),) * (width - num_roots),
            root_valid=(True,) * num_roots + (False,) * (width - num_roots),
            draft_parents=tuple(map(tuple, parents)), draft_tokens=tuple(map(tuple, tokens)),
            draft_exists=tuple(map(tuple, exists)), aliases=tuple(self.aliases.items()),
            seq_len=self.prompt_len + self.num_generated, num_out=1 if p.memory_efficient else width,
            width_threshold=1.0 if p.temperature == 0 else p.width_threshold, min_width=p.min_width,
            num_logprobs=p.num_logprobs, tails=self.tails(self.beams), mjsd_tau=p.mjsd_tau,
            draft_next=self.draft_next if self.draft_in_step else 0,
            max_tokens_left=p.max_tokens - self.num_generated,
            prune_floor=self.prune_floor() if p.temperature == 0 else float("-inf"),
        )

    def prune_floor(self) -> float:
        """The score a hypothesis must beat to reach the results: the ``n``-th best finished so far (-inf with
        fewer); +inf when no beam can finish (``ignore_eos`` or no EOS, no stop tokens or strings). At T 0 a
        target beam the draft missed may be left out if nothing it could finish scores above it."""
        p = self.params
        if p.finishing_token is None and not p.stop_token_ids and not p.stop:
            return float("inf")
        if len(self.finished) < p.n:
            return float("-inf")
        return sorted((h.score for h in self.finished), reverse=True)[p.n - 1]

    def node_path(self, node: int) -> tuple[int, list[int]]:
        """(root slot, tokens from the root to ``node``) of a forest node id."""
        width = self.params.beam_width
        tokens = []
        while node >= width:
            layer, slot = layer_slot(node, width)
            n = self.layers[layer - 1][slot]
            tokens.append(n.token)
            node = node_id(layer - 1, n.parent, width)
        return node, tokens[::-1]

    def path_of_node(self, node: int) -> int:
        """The first path through ``node`` (or through its twin): its request carries the node's children."""
        return first_path_through(self.paths, self.aliases, node)

    def apply_verify(self, decision: VerifyDecision) -> StepEffects:
        """Commit a verified iteration: new beams, finished hypotheses, and what happens to the path requests."""
        if self.done:
            raise RuntimeError(f"beam group {self.group_id} is finished; it takes no more steps")
        for c in decision.finished:
            root, tokens = self.node_path(c.parent)
            beam = self.beams[root]
            self.finished.append(self._hypothesis(beam.tokens + tokens + [c.token], c.score,
                                                  beam.logprobs + list(c.logprobs), self._finish_reason(c.token)))
        children: dict[int, list[int]] = {}
        for k, c in enumerate(decision.beams):  # a leaf and its twin continue on the same request
            children.setdefault(self.aliases.get(c.parent, c.parent), []).append(k)
        effects = StepEffects()
        new_beams: list[Beam | None] = [None] * len(decision.beams)
        kept: set[int] = set()
        for parent, kids in children.items():
            root, tokens = self.node_path(parent)
            path = self.path_of_node(parent)
            kept.add(path)
            request = self.path_requests[path].request
            base = self.beams[root]
            new = tokens[self.path_skips[path]:]  # the path's request holds its shared nodes already
            if new:
                effects.ops.append(Extend(request, list(new), computed=True))
            for k in kids[1:]:
                c = decision.beams[k]
                child = Beam(None, base.tokens + tokens + [c.token], c.score, base.logprobs + list(c.logprobs))
                effects.ops.append(Fork(request, c.token, child))
                new_beams[k] = child
            c = decision.beams[kids[0]]
            effects.ops.append(Extend(request, [c.token]))
            new_beams[kids[0]] = Beam(request, base.tokens + tokens + [c.token], c.score,
                                      base.logprobs + list(c.logprobs))
        effects.ops += [Free(pr.request) for k, pr in enumerate(self.path_requests) if k not in kept]
        self.beams = new_beams  # type: ignore[assignment]
        self.num_generated += decision.num_passed + 1
        self.step += 1
        self._end_iteration()
        return effects

    @property
    def done(self) -> bool:
        return not self.beams or self.num_generated >= self.params.max_tokens

    def requests(self) -> list[Any]:
        return [b.request for b in self.beams]

    def decoding(self) -> dict[str, Any]:
        """The :class:`GroupDecoding` fields of this group's next step."""
        p = self.params
        return dict(group_id=self.group_id, beam_width=p.beam_width, temperature=p.temperature, top_k=p.top_k,
                    top_p=p.top_p, length_penalty=p.length_penalty, ignore_eos=p.ignore_eos,
                    eos_token_id=p.eos_token_id, stop_token_ids=p.stop_token_ids, seed=p.seed, step=self.step,
                    stop=p.stop, draft_temperature_scale=p.draft_temperature_scale)

    def tails(self, beams: list[Beam]) -> tuple[tuple[int, ...], ...]:
        """The last generated tokens of ``beams`` the runner needs to check stop strings (none without)."""
        if not self.params.stop:
            return ()
        keep = tail_length(self.params.stop)
        return tuple(tuple(b.tokens[-keep:]) for b in beams)

    def plan(self, draft_from: tuple[int, ...] | None = None) -> GroupStep:
        """The group's beam step. ``draft_from`` (where each beam's head KV ends): the runner also draws the
        next iteration's :attr:`draft_next` layers in this step (``engine.forest_draft``)."""
        return GroupStep(
            **self.decoding(),
            req_ids=tuple(b.request.request_id for b in self.beams),
            scores=tuple(b.score for b in self.beams),
            seq_len=self.prompt_len + self.num_generated,
            num_logprobs=self.params.num_logprobs,
            tails=self.tails(self.beams),
            draft_next=None if draft_from is None else self.draft_next,
            max_tokens_left=self.params.max_tokens - self.num_generated,
            draft_from=draft_from or (),
        )

    def apply(self, decision: GroupDecision) -> StepEffects:
        """Commit one beam step (see the module docstring); it ends a :attr:`plain_iteration`."""
        if self.done:
            raise RuntimeError(f"beam group {self.group_id} is finished; it takes no more steps")
        beams = self.beams
        for choice in decision.finished:
            parent = beams[choice.parent]
            self.finished.append(self._hypothesis(parent.tokens + [choice.token], choice.score,
                                                  parent.logprobs + [choice.logprob], self._finish_reason(choice.token)))
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
                effects.ops.append(Free(parent.request))
                continue
            for k in kids[1:]:
                c = decision.beams[k]
                child = Beam(None, parent.tokens + [c.token], c.score, parent.logprobs + [c.logprob])
                effects.ops.append(Fork(parent.request, c.token, child))
                new_beams[k] = child
            c = decision.beams[kids[0]]
            parent.tokens.append(c.token)
            parent.score = c.score
            parent.logprobs.append(c.logprob)
            effects.ops.append(Extend(parent.request, [c.token]))
            new_beams[kids[0]] = parent
        self.beams = new_beams  # type: ignore[assignment]
        self.num_generated += 1
        self.step += 1
        if self.in_iteration:
            self._end_iteration()
        return effects

    def _finish_reason(self, token: int) -> str:
        """"stop" for EOS or a stop token; "stop_string" for a token that completed a stop string."""
        return "stop" if self._finishes(token) else "stop_string"

    def _hypothesis(self, tokens: list[int], cum: float, logprobs: list[TokenLogprob], reason: str) -> Hypothesis:
        length = self.prompt_len + len(tokens)
        if tokens and (reason != "length" or tokens[-1] == self.params.eos_token_id):
            length -= 1  # a finished hypothesis, or a live beam ending in EOS (ignore_eos), as vLLM scores
        score = cum / (max(length, 1) ** self.params.length_penalty)
        return Hypothesis(tuple(tokens), cum, tuple(logprobs), reason, score)

    def results(self) -> list[Hypothesis]:
        """The best ``n`` hypotheses, best first: finished ones, then the live beams, ranked together."""
        live = [self._hypothesis(b.tokens, b.score, b.logprobs, "length") for b in self.beams]
        ranked = sorted(self.finished + live, key=lambda h: h.score, reverse=True)
        return ranked[: self.params.n]
