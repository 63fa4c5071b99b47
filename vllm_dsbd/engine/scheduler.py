"""DSBDScheduler: vLLM's V1 scheduler with beam groups.

A beam request (``engine.requests``) becomes a :class:`BeamGroup`. Its
beams are *internal* vLLM requests (``"{group}#{k}"``) that live in vLLM's
own running/waiting queues, so the base scheduler does their token budget,
KV allocation, chunked prefill, prefix caching and preemption. What this
class adds:

- **Groups.** ``add_request`` gathers the ``n`` fanned-out user requests of a
  group, then admits the group (slots and KV blocks reserved for ``W`` beams,
  see :meth:`_admit_groups`) by queueing its root beam: the prompt.
- **Group steps.** After the base ``schedule()``, a group whose every live
  beam is computed up to its last token in this step is *ready*: its
  :class:`~vllm_dsbd.engine.protocol.GroupStep` goes to the runner in
  ``SchedulerOutput.dsbd_plan``. Beams of a group that is not ready
  (a beam not scheduled, preempted, or still prefilling) sample nothing and
  their last token is recomputed later, so a group never advances partially.
- **Commit.** ``update_from_output`` hands the runner's decisions to the
  groups and carries out their effects: a fork shares the parent's full KV
  blocks (ref counts) and copies the partial tail block through vLLM's
  copy-on-write path (``kv_cache_block_copies``, run by the worker before the
  next forward); a parent without children is freed. If no block is free for
  the tail copy, the fork recomputes its KV instead (prefix cache).
- **Output.** Internal requests never reach the front-end; when a group
  finishes, the best ``n`` hypotheses go out under the user's request ids.
  Aborting a user request frees all its beams.

Plain requests are scheduled by the base class unchanged. Preemption picks
victims as vLLM does (beams included); the rest of a group one of whose beams
was preempted is preempted at the next step, and its beams are recomputed
before the group moves on.

**DSBD iterations** (``num_speculative_tokens`` > 0). Engine steps are of
two kinds. A *draft step* runs only the draft model, only on the groups that
are drafting: each such group's parent nodes (layer 0: the beams) compute
their next draft distribution; the runner draws the layer's ``W`` nodes, and
the nodes the draft grows further become requests forked from their parents.
A *target step* runs the target on everything else: plain requests, beam
groups without speculation, prompts, and the verification of groups whose
forest is complete, with one request per root-to-leaf path whose draft tokens
are vLLM spec tokens (the target computes every node of every group's forest
in this one forward). Steps are draft steps while any group is drafting.
Every beam request has two KV frontiers, the target's and the draft's (the
same blocks hold both models' layers); ``num_computed_tokens`` is set to the
one the step's model continues from. Prefix caching is off for speculative
engines (a block whose target KV is complete may miss draft KV, and the other
way round).
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Iterable

import numpy as np
from vllm.logger import init_logger
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_dsbd.algorithm.depth import DepthPolicy
from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine import metrics
from vllm_dsbd.engine import requests as beam_requests
from vllm_dsbd.engine.beam_group import (
    BeamGroup, BeamParams, Extend, Fork, Free, Hypothesis, PathRequest, StepEffects, request_slots,
)
from vllm_dsbd.engine.protocol import PLAN_ATTR, RESULT_ATTR, StepPlan

logger = init_logger(__name__)


class DSBDScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = DSBDConfig.from_vllm_config(self.vllm_config)
        if config is None:
            raise RuntimeError("DSBDScheduler needs a DSBD engine (speculative method 'dsbd')")
        self.dsbd_config = config
        self.groups: dict[str, BeamGroup] = {}  # admitted or waiting for admission
        self._admission: deque[str] = deque()  # groups whose root is not queued yet, FIFO
        self._gathering: dict[str, dict[int, Request]] = {}  # group -> output index -> user request
        self._user_group: dict[str, str] = {}  # user request id -> group id
        self._beam_group: dict[str, str] = {}  # internal request id -> group id
        self._unsent: set[str] = set()  # internal requests the workers have not been told about
        self._preempted_groups: set[str] = set()  # groups with a beam preempted since the last step
        self._forgotten_groups: list[str] = []  # gone since the last step (the runner drops their drafts)
        self._draft_participants: list[Request] = []  # requests of the current draft step
        self._beam_ids = itertools.count()
        # vLLM's own draft_model scheduling is not used: no spec-token padding, no lookahead slots
        # (DSBD schedules its drafts and spec tokens itself).
        self.num_spec_tokens = 0
        self.num_lookahead_tokens = 0
        spec = self.vllm_config.speculative_config
        self._num_draft_layers = spec.num_speculative_tokens if spec is not None else 0
        self._spec_stats: SpecDecodingStats | None = None  # this step's, in vLLM's spec-decode counters
        # Seeds of unseeded groups: reproducible for a given engine seed and arrival order.
        self._seeds = random.Random(self.vllm_config.model_config.seed)
        # auto_depth: γ per iteration from the measured cost of this engine's steps (algorithm.depth).
        self._depth = DepthPolicy()
        self._step_timing: tuple[float, bool] | None = None  # (start, draft step) of the step in flight

    # ------------------------------------------------------------------
    # Requests in
    # ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if params is None or not beam_requests.is_beam_request(params):
            return super().add_request(request)
        group_id, index, n = beam_requests.group_of(request.request_id, params.extra_args or {})
        self.requests[request.request_id] = request
        self._user_group[request.request_id] = group_id
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)
        children = self._gathering.setdefault(group_id, {})
        children[index] = request
        if len(children) == n:
            del self._gathering[group_id]
            self._create_group(group_id, [children[k] for k in range(n)])

    def _create_group(self, group_id: str, users: list[Request]) -> None:
        first = users[0]  # vLLM gives child k the seed `seed + k`: child 0 carries the user's
        _, params = beam_requests.beam_params(
            first.sampling_params, self.dsbd_config, prompt_len=first.num_prompt_tokens,
            max_model_len=self.max_model_len, default_seed=self._seeds.getrandbits(62),
        )
        root = self._internal_request(group_id, first, list(first.prompt_token_ids), first._block_hasher)
        group = BeamGroup(group_id, [u.request_id for u in users], first.num_prompt_tokens, params, root)
        self.groups[group_id] = group
        self._admission.append(group_id)

    def _internal_request(self, group_id: str, like: Request, token_ids: list[int], block_hasher) -> Request:
        """An internal beam request with ``token_ids`` as its prompt, registered with the group."""
        request = Request(
            request_id=f"{group_id}#{next(self._beam_ids)}",
            prompt_token_ids=token_ids,
            sampling_params=_internal_params(like.sampling_params),
            pooling_params=None,
            client_index=like.client_index,
            arrival_time=like.arrival_time,
            lora_request=like.lora_request,
            cache_salt=like.cache_salt,
            priority=like.priority,
            block_hasher=block_hasher,
        )
        self._beam_group[request.request_id] = group_id
        return request

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + len(self._admission)

    # ------------------------------------------------------------------
    # Schedule
    # ------------------------------------------------------------------

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        start = time.perf_counter()
        self._preempt_split_groups()
        self._admit_groups()
        drafting = [g for g in self._admitted_groups() if _phase(g) == "draft"]
        # Keep request slots free for the forks of admitted groups.
        reserved = sum(max(0, self._slots(g) - len(g.beams) - len(g.extra_requests()))
                       for g in self._admitted_groups())
        self.max_num_active_reqs -= reserved
        try:
            out = self._schedule_draft(drafting, *args, **kwargs) if drafting else \
                self._schedule_target(*args, **kwargs)
        finally:
            self.max_num_active_reqs += reserved
        self._announce_unsent(out)
        plan = self._plan_draft(out, drafting) if drafting else self._plan_target(out)
        if self._forgotten_groups:
            plan = plan or StepPlan([])
            plan.forget_group_ids, self._forgotten_groups = self._forgotten_groups, []
        if plan is not None:
            setattr(out, PLAN_ATTR, plan)
        self._step_timing = (start, bool(drafting))
        return out

    def _schedule_draft(self, drafting: list[BeamGroup], *args, **kwargs) -> SchedulerOutput:
        """A draft step: only the drafting groups' parent nodes run (the draft model), nothing is admitted."""
        participants = [r for g in drafting for _, r, _ in g.draft_parents()]
        for r in participants:
            r.num_computed_tokens = r.dsbd_draft
        visible = set(participants)
        running, waiting, kv_holding = self.running, self.waiting, self.kv_holding_waiting
        self.running = [r for r in running if r in visible]
        self.waiting, self.kv_holding_waiting = create_request_queue(self.policy), create_request_queue(self.policy)
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            still = set(self.running)
            self.running = [r for r in running if r not in visible or r in still]
            preempted = list(self.waiting) + list(self.kv_holding_waiting)
            self.waiting, self.kv_holding_waiting = waiting, kv_holding
            for r in preempted:
                self._enqueue_waiting_request(r)
        self._draft_participants = participants
        return out

    def _schedule_target(self, *args, **kwargs) -> SchedulerOutput:
        """A target step: everything but drafting runs; speculative groups continue from the target's frontier."""
        for group in self._admitted_groups():
            if not group.speculative or not group.in_iteration:
                continue
            for b in group.beams:
                b.request.num_computed_tokens = b.request.dsbd_target
            for pr in group.path_requests:
                pr.request.num_computed_tokens = pr.request.dsbd_target
                pr.request.spec_token_ids = list(pr.spec_tokens)
        return super().schedule(*args, **kwargs)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        super()._preempt_request(request, timestamp, drop_stale_output)
        group_id = self._beam_group.get(request.request_id)
        if group_id is not None:
            self._preempted_groups.add(group_id)

    def _preempt_split_groups(self) -> None:
        """Preemption is group-atomic: a group one of whose beams vLLM preempted gives up all its KV.

        vLLM preempts one request at a time (it needed blocks); the group's
        other beams are preempted at the start of the next step and all come
        back through the waiting queue (prefix-cache hits on their shared full
        blocks). Otherwise groups each waiting for one preempted beam could
        hold all the KV and never move again.
        """
        if not self._preempted_groups:
            return
        now = time.monotonic()
        victims, released = [], set()
        for gid in self._preempted_groups:
            group = self.groups.get(gid)
            if group is None:
                continue
            if group.speculative:  # the iteration is lost with the KV: drafts and path forks go
                released.update(self._release_beam(r) for r in group.reset_iteration())
                for b in group.beams:
                    b.request.spec_token_ids = []
                    b.request.dsbd_target = b.request.dsbd_draft = None
            victims += [b.request for b in group.beams if b.request.status == RequestStatus.RUNNING]
        self.running = remove_all(self.running, set(victims) | released)
        for request in victims:
            self._preempt_request(request, now)
        self._preempted_groups.clear()

    def _admitted_groups(self) -> Iterable[BeamGroup]:
        pending = set(self._admission)
        return (g for gid, g in self.groups.items() if gid not in pending)

    def _admit_groups(self) -> None:
        """Queue the roots of waiting groups, FIFO, while request slots and KV blocks allow.

        A group reserves ``W`` request slots and the KV blocks its ``W`` beams
        may still need (prompt blocks shared); a group is always admitted when
        no other group runs, so an oversized one is not starved.
        """
        while self._admission:
            group = self.groups[self._admission[0]]
            admitted = list(self._admitted_groups())
            if admitted:
                num_beam_slots = sum(self._slots(g) for g in admitted)
                num_plain = sum(1 for r in self.running if r.request_id not in self._beam_group)
                if num_plain + num_beam_slots + self._slots(group) > self.max_num_running_reqs:
                    return
                free = self.kv_cache_manager.block_pool.get_num_free_blocks()
                if free - sum(self._blocks_to_reserve(g) for g in admitted) < self._blocks_to_reserve(group):
                    return
            self._admission.popleft()
            root = group.beams[0].request
            self.requests[root.request_id] = root
            self._enqueue_waiting_request(root)
            if group.speculative and group.params.auto_depth:
                self._start_without_prefill(group)
            for uid in group.user_request_ids:
                user = self.requests.get(uid)
                if user is not None and self.log_stats:
                    user.record_event(EngineCoreEventType.SCHEDULED)

    @staticmethod
    def _slots(group: BeamGroup) -> int:
        return request_slots(group.params.beam_width, group.params.num_speculative_tokens)

    def _blocks_to_reserve(self, group: BeamGroup) -> int:
        """KV blocks a group may still claim: W beams growing to max_tokens, plus a tail copy each
        (with speculation: the blocks of W draft nodes and W (γ + 1) paths besides)."""
        block_size = self.block_size
        remaining = group.params.max_tokens - group.num_generated
        width, gamma = group.params.beam_width, group.params.num_speculative_tokens
        blocks = width * (math.ceil(remaining / block_size) + 1)
        if gamma:
            blocks += width * (gamma + 2) * (math.ceil(gamma / block_size) + 1)
        if group.num_generated == 0:
            blocks += math.ceil(group.prompt_len / block_size)
        return blocks

    def _announce_unsent(self, out: SchedulerOutput) -> None:
        """Send forks scheduled for the first time as new requests (the base sent them as cached ones)."""
        cached = out.scheduled_cached_reqs
        moved = [i for i, rid in enumerate(cached.req_ids) if rid in self._unsent]
        if not moved:
            return
        for i in moved:
            rid = cached.req_ids[i]
            request = self.requests[rid]
            self._unsent.discard(rid)
            out.scheduled_new_reqs.append(NewRequestData(
                req_id=rid,
                prompt_token_ids=list(request.all_token_ids),
                mm_features=[],
                sampling_params=request.sampling_params,
                pooling_params=None,
                block_ids=self.kv_cache_manager.get_block_ids(rid),
                num_computed_tokens=request.num_computed_tokens - out.num_scheduled_tokens[rid],
                lora_request=request.lora_request,
            ))
        moved_set = set(moved)
        keep = [i for i in range(len(cached.req_ids)) if i not in moved_set]
        moved_ids = {cached.req_ids[i] for i in moved}
        out.scheduled_cached_reqs = CachedRequestData(
            req_ids=[cached.req_ids[i] for i in keep],
            resumed_req_ids=cached.resumed_req_ids - moved_ids,
            new_token_ids=[cached.new_token_ids[i] for i in keep] if cached.new_token_ids else [],
            all_token_ids={k: v for k, v in cached.all_token_ids.items() if k not in moved_ids},
            new_block_ids=[cached.new_block_ids[i] for i in keep],
            num_computed_tokens=[cached.num_computed_tokens[i] for i in keep],
            num_output_tokens=[cached.num_output_tokens[i] for i in keep],
        )

    def _plan_target(self, out: SchedulerOutput) -> StepPlan | None:
        """Ready groups take their step; requests of other groups computed up to their end wait.

        Ready: a beam group (no speculation) whose every beam was computed up to
        its last token; a speculative group whose every path was computed with
        all its spec tokens (verification), or whose every beam's prompt / lost
        KV was recomputed (the iteration starts; the last token is recomputed
        with the forest).
        """
        scheduled, spec = out.num_scheduled_tokens, out.scheduled_spec_decode_tokens
        plan = StepPlan([])
        for group in self._admitted_groups():
            phase = _phase(group)
            if phase == "verify":
                done = [pr.request for pr in group.path_requests if pr.request.request_id in scheduled
                        and len(spec.get(pr.request.request_id, ())) == len(pr.spec_tokens)
                        and pr.request.num_computed_tokens >= pr.request.num_tokens]  # not a prompt chunk
                for pr in group.path_requests:  # a prompt chunk (an iteration started without prefill)
                    r = pr.request
                    if r.request_id in scheduled and r.num_computed_tokens < r.num_tokens:
                        r.dsbd_target = r.num_computed_tokens
                if len(done) == len(group.path_requests):
                    plan.verify_steps.append(group.verify_plan())
                else:
                    plan.discard_req_ids += [r.request_id for r in done]
                continue
            at_frontier = [r for r in group.requests()
                           if r.request_id in scheduled and r.num_computed_tokens == r.num_tokens]
            ready = len(at_frontier) == len(group.beams)
            if phase == "beam" and ready:
                plan.groups.append(group.plan())
            else:  # not ready, or a speculative group whose beams' KV is now complete
                plan.discard_req_ids += [r.request_id for r in at_frontier]
                if ready:
                    plan.started_group_ids.append(group.group_id)
        return plan if plan.groups or plan.verify_steps or plan.discard_req_ids else None

    def _plan_draft(self, out: SchedulerOutput, drafting: list[BeamGroup]) -> StepPlan:
        scheduled = out.num_scheduled_tokens
        plan = StepPlan([], draft=True)
        for group in drafting:
            parents = [r for _, r, _ in group.draft_parents()]
            at_frontier = [r for r in parents if r.request_id in scheduled and r.num_computed_tokens == r.num_tokens]
            if len(at_frontier) == len(parents):
                plan.draft_steps.append(group.draft_plan())
            else:
                plan.discard_req_ids += [r.request_id for r in at_frontier]
        return plan

    # ------------------------------------------------------------------
    # Update
    # ------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        scheduled = scheduler_output.num_scheduled_tokens
        beam_ids = [rid for rid in scheduled if rid in self._beam_group]
        plain_output = scheduler_output
        if beam_ids:
            plain_output = copy.copy(scheduler_output)
            plain_output.num_scheduled_tokens = {k: v for k, v in scheduled.items() if k not in self._beam_group}
            for rid in beam_ids:
                request = self.requests.get(rid)
                if request is not None:
                    request.num_in_flight_tokens -= scheduled[rid]
        group_outputs: dict[int, list[EngineCoreOutput]] = {}
        plan: StepPlan | None = getattr(scheduler_output, PLAN_ATTR, None)
        if plan is not None:
            self._commit_steps(plan, getattr(model_runner_output, RESULT_ATTR, None), group_outputs)
        # The base class makes this step's stats last: after the commits, so KV usage is current.
        outputs = super().update_from_output(plain_output, model_runner_output)
        for client, outs in group_outputs.items():
            outputs.setdefault(client, EngineCoreOutputs()).outputs.extend(outs)
        if self._step_timing is not None:  # this step's cost, schedule to commit, for auto_depth
            start, is_draft = self._step_timing
            self._step_timing = None
            self._depth.observe_step(is_draft, scheduler_output.total_num_scheduled_tokens,
                                     time.perf_counter() - start)
        return outputs

    def _commit_steps(self, plan: StepPlan, result, group_outputs: dict[int, list[EngineCoreOutput]]) -> None:
        freed: set[Request] = set()
        if plan.draft:
            self._commit_draft_step(plan, result, freed)
        else:
            for rid in plan.discard_req_ids:
                self._rewind(rid)
            for gid in plan.started_group_ids:
                if gid in self.groups:
                    self._start_iteration(self.groups[gid], freed)
            for step in plan.groups:
                group = self.groups.get(step.group_id)
                if group is not None:  # else aborted while the step ran
                    self._carry_out(group, group.apply(_decision(result, "decisions", step.group_id)),
                                    freed, group_outputs)
            for step in plan.verify_steps:
                group = self.groups.get(step.group_id)
                if group is not None:
                    for pr in group.path_requests:  # the target computed every path up to its root's end
                        pr.request.num_computed_tokens = pr.request.num_tokens
                    decision = _decision(result, "verify_decisions", step.group_id)
                    self._observe(decision, len(step.draft_parents))
                    self._depth.observe_iteration(_depth_key(group), group.group_id, len(step.draft_parents),
                                                  decision.num_passed)
                    effects = group.apply_verify(decision)
                    self._carry_out(group, effects, freed, group_outputs)
                    if group.group_id in self.groups:
                        for b in group.beams:
                            b.request.dsbd_target = b.request.num_computed_tokens
                        self._start_iteration(group, freed, rewind=False)
        if freed:
            self.running = remove_all(self.running, freed)

    def _observe(self, decision, num_draft_layers: int) -> None:
        """DSBD in vLLM's spec-decode counters: a draft = one iteration (one target forward of the
        group's forest), draft tokens = draft nodes proposed, accepted tokens = draft nodes accepted,
        per position i = nodes accepted at depth i + 1; plus the beam layers produced, their widths and
        the draft layers built (γ of the iteration; vllm_dsbd.engine.metrics)."""
        if self._spec_stats is None:
            self._spec_stats = metrics.new_stats(self._num_draft_layers)
        stats = self._spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += sum(decision.num_proposed)
        stats.num_accepted_tokens += sum(decision.num_accepted)
        for depth, (proposed, accepted) in enumerate(zip(decision.num_proposed, decision.num_accepted)):
            stats.num_draft_tokens_per_pos[depth] += proposed
            stats.num_accepted_tokens_per_pos[depth] += accepted
        metrics.observe_layers(stats, decision.widths, num_draft_layers)

    def make_stats(self, spec_decoding_stats=None, *args, **kwargs):
        stats, self._spec_stats = self._spec_stats, None
        return super().make_stats(stats if stats is not None else spec_decoding_stats, *args, **kwargs)

    def _commit_draft_step(self, plan: StepPlan, result, freed: set[Request]) -> None:
        discard = set(plan.discard_req_ids)
        participants, self._draft_participants = self._draft_participants, []
        for r in participants:  # the draft's frontier moved (all the way, unless its group waits)
            if not r.is_finished():
                r.dsbd_draft = r.num_computed_tokens - (1 if r.request_id in discard else 0)
                r.num_computed_tokens = r.dsbd_draft
        for step in plan.draft_steps:
            group = self.groups.get(step.group_id)
            if group is not None:
                self._carry_out(group, group.apply_draft(_decision(result, "draft_decisions", step.group_id)),
                                freed, {})
        for r in participants:  # beams wait at the target's frontier
            if not r.is_finished() and getattr(r, "dsbd_target", None) is not None:
                r.num_computed_tokens = r.dsbd_target

    def _start_iteration(self, group: BeamGroup, freed: set[Request], rewind: bool = True) -> None:
        """The beams' KV is complete up to their last token (``rewind``: up to the end; the last token
        is recomputed with the forest): the next DSBD iteration starts."""
        for b in group.beams:
            r = b.request
            if rewind:
                r.num_computed_tokens = r.num_tokens - 1
                r.dsbd_target, r.dsbd_draft = r.num_computed_tokens, 0
            r.dsbd_draft = min(getattr(r, "dsbd_draft", None) or 0, r.dsbd_target)
        depth = None
        if group.params.auto_depth:
            draft_lag = sum(b.request.num_tokens - b.request.dsbd_draft for b in group.beams)
            depth = self._depth.choose(_depth_key(group), group.group_id, group.max_draft_layers,
                                       len(group.beams), draft_lag)
        self._carry_out(group, group.start_iteration(depth), freed, {})

    def _start_without_prefill(self, group: BeamGroup) -> None:
        """auto_depth: a group whose first iteration gets depth 0 starts it at once, so the target step
        that computes its prompt also takes its first beam step (else a prefill step computes the prompt
        and samples nothing, and the first iteration recomputes its last token with the forest)."""
        root = group.beams[0].request
        if self._depth.choose(_depth_key(group), group.group_id, group.max_draft_layers, 1, root.num_tokens,
                              probe=False):
            return
        root.dsbd_target = root.dsbd_draft = 0
        self._carry_out(group, group.start_iteration(0), set(), {})

    def _carry_out(self, group: BeamGroup, effects: StepEffects, freed: set[Request],
                   group_outputs: dict[int, list[EngineCoreOutput]]) -> None:
        """The scheduler's part of a group's step, in order (see ``beam_group``)."""
        if group.done:  # its new beams never run: no forks
            freed.update(self._release_beam(op.request) for op in effects.ops if isinstance(op, Free))
            freed.update(self._finish_group(group, group_outputs))
            return
        for op in effects.ops:
            if isinstance(op, Free):
                freed.add(self._release_beam(op.request))
            elif isinstance(op, Fork):
                op.child.request = self._fork(group, op.parent, op.token)
            elif isinstance(op, Extend):
                op.request.append_output_token_ids(op.tokens)
                if op.computed:
                    op.request.num_computed_tokens = op.request.num_tokens
            elif isinstance(op, PathRequest):
                root = op.root
                if op.reuse_root:
                    op.request = root
                else:  # the target's KV of the root, up to its last token, which the path recomputes
                    op.request = self._fork(group, root, None, num_shared=root.dsbd_target)
                op.request.spec_token_ids = list(op.spec_tokens)

    def _rewind(self, rid: str) -> None:
        """A request computed up to its end whose group is not ready: back to its frontier to try again."""
        request = self.requests.get(rid)
        if request is None or request.is_finished():
            return
        target = getattr(request, "dsbd_target", None)
        if target is not None:  # a speculative group's request: back to the target's frontier
            request.num_computed_tokens = target
        else:
            self._recompute_last_token(rid)

    def _recompute_last_token(self, rid: str) -> None:
        request = self.requests.get(rid)
        if request is not None and not request.is_finished() and request.num_computed_tokens > 0:
            request.num_computed_tokens -= 1

    def _fork(self, group: BeamGroup, parent: Request, token: int | None, num_shared: int | None = None) -> Request:
        """A new request: the parent's tokens plus ``token`` (if any), with the parent's KV for the
        first ``num_shared`` tokens (default: all of them, which must be computed)."""
        if num_shared is None:
            num_shared = parent.num_tokens
            if parent.num_computed_tokens != num_shared:
                raise RuntimeError(f"fork of {parent.request_id}: {parent.num_computed_tokens} of "
                                   f"{num_shared} tokens computed")
        tokens = list(parent.all_token_ids) + ([] if token is None else [token])
        child = self._internal_request(group.group_id, parent, tokens, None)
        child._block_hasher = parent._block_hasher
        child.block_hashes = list(parent.block_hashes[: num_shared // self.block_size])
        child.update_block_hashes()
        self.requests[child.request_id] = child
        # The KV frontiers that come with the shared blocks: the target's up to num_shared; the draft's up
        # to the end of the child's last block, since a partial tail block is copied whole, with the draft
        # KV the parent already holds past num_shared (a path request forked at the target's frontier
        # keeps the draft's KV of its root's last token instead of recomputing it).
        reach = -(-num_shared // self.block_size) * self.block_size
        for attr, limit in (("dsbd_target", num_shared), ("dsbd_draft", reach)):
            if getattr(parent, attr, None) is not None:
                setattr(child, attr, min(getattr(parent, attr), limit))
        if self._share_kv(parent, child, num_shared):
            child.num_computed_tokens = num_shared
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
            self._unsent.add(child.request_id)
        else:  # no free block for the tail copy: recompute
            for attr in ("dsbd_target", "dsbd_draft"):
                if getattr(child, attr, None) is not None:
                    setattr(child, attr, 0)
            self.waiting.prepend_request(child)
        return child

    def _share_kv(self, parent: Request, child: Request, num_tokens: int) -> bool:
        """Give ``child`` the parent's KV for its first ``num_tokens`` tokens; False if no block is free."""
        managers = self.kv_cache_manager.coordinator.single_type_managers
        pool = self.kv_cache_manager.block_pool
        need = sum(1 for m in managers if num_tokens % m.block_size)
        if pool.get_num_free_blocks() < need:
            return False
        for mgr in managers:
            blocks = mgr.req_to_blocks[parent.request_id]
            num_full = num_tokens // mgr.block_size
            shared = blocks[:num_full]
            pool.touch(shared)
            child_blocks = list(shared)
            if num_tokens % mgr.block_size:
                source = blocks[num_full]
                (tail,) = pool.get_new_blocks(1)
                # Both ends keep one extra ref until the copy has run (released by the
                # base scheduler after it hands the copy to the workers).
                pool.touch([source])
                tail.ref_cnt += 1
                mgr._pending_cow_copies.append((source, tail))
                child_blocks.append(tail)
            mgr.req_to_blocks[child.request_id] = child_blocks
            mgr.num_cached_block[child.request_id] = min(mgr.num_cached_block.get(parent.request_id, 0), num_full)
        return True

    def _release_beam(self, request: Request) -> Request:
        """Free an internal request's KV and forget it; the caller removes it from ``self.running``."""
        rid = request.request_id
        if request.status != RequestStatus.RUNNING:
            self.waiting.remove_requests([request])
            self.kv_holding_waiting.remove_requests([request])
            self.deferred_waiting.discard(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._inflight_prefills.discard(request)
        self._free_request_blocks(request)
        self.requests.pop(rid, None)
        self._beam_group.pop(rid, None)
        if rid in self._unsent:
            self._unsent.discard(rid)
        else:
            self.finished_req_ids.add(rid)
        return request

    def _finish_group(self, group: BeamGroup, outputs: dict[int, list[EngineCoreOutput]]) -> list[Request]:
        """Emit the best ``n`` hypotheses under the user request ids and free everything.

        A group that ends with fewer than ``n`` hypotheses (possible with a dynamic
        width) finishes its surplus user requests empty, as aborted.
        """
        results = group.results()
        for k, uid in enumerate(group.user_request_ids):
            user = self.requests.get(uid)
            if user is None:
                continue
            hyp = results[k] if k < len(results) else None
            if hyp is None:
                user.status = RequestStatus.FINISHED_ABORTED
            else:
                # A stop string is found again by the front-end's detokenizer, which truncates the text and
                # reports "stop" with the string (engine.stops); it must see every token, so not "stop" here.
                user.status = (RequestStatus.FINISHED_STOPPED if hyp.finish_reason == "stop"
                               else RequestStatus.FINISHED_LENGTH_CAPPED)
            eco = EngineCoreOutput(
                request_id=uid,
                new_token_ids=[] if hyp is None else list(hyp.tokens),
                finish_reason=user.get_finished_reason(),
                stop_reason=_stop_reason(hyp, group.params),
                new_logprobs=None if hyp is None else _logprobs_lists(hyp, user.sampling_params.logprobs),
                events=user.take_events(),
                trace_headers=user.trace_headers,
            )
            outputs.setdefault(user.client_index, []).append(eco)
            self._free_request(user)
            self._user_group.pop(uid, None)
        return self._drop_group(group)

    def _drop_group(self, group: BeamGroup) -> list[Request]:
        requests = [b.request for b in group.beams if b.request is not None] + group.extra_requests()
        released = [self._release_beam(r) for r in requests if r.request_id in self.requests]
        self.groups.pop(group.group_id, None)
        self._forgotten_groups.append(group.group_id)
        self._depth.forget(group.group_id)
        if group.group_id in self._admission:
            self._admission.remove(group.group_id)
        return released

    # ------------------------------------------------------------------
    # Aborts
    # ------------------------------------------------------------------

    def finish_requests(self, request_ids, finished_status: RequestStatus) -> list[Request]:
        if request_ids is None:
            ids = [rid for rid in self.requests if rid not in self._beam_group]
        else:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        group_ids = {self._user_group[rid] for rid in ids if rid in self._user_group}
        plain = [rid for rid in ids if rid not in self._user_group and rid not in self._beam_group]
        finished = super().finish_requests(plain, finished_status) if plain else []
        freed: list[Request] = []
        for gid in group_ids:
            users = [self.requests[u] for u, g in list(self._user_group.items()) if g == gid and u in self.requests]
            for user in users:
                user.status = finished_status
                self._free_request(user)
                self._user_group.pop(user.request_id, None)
            finished.extend(users)
            self._gathering.pop(gid, None)
            if gid in self.groups:
                freed.extend(self._drop_group(self.groups[gid]))
        if freed:
            self.running = remove_all(self.running, set(freed))
        return finished


def _phase(group: BeamGroup) -> str:
    """beam: no speculation; prefill: the target computes the beams' KV; draft / verify: a DSBD iteration."""
    if not group.speculative:
        return "beam"
    if not group.in_iteration:
        return "prefill"
    return "draft" if group.drafting else "verify"


def _depth_key(group: BeamGroup) -> tuple:
    """Groups that decode alike share their acceptance statistics (auto_depth); MJSD's passed prefixes
    follow another rule than DSBD's layers, so its groups never share a DSBD group's statistics."""
    p = group.params
    return group.mjsd, p.temperature == 0, p.width_threshold, p.beam_width, p.memory_efficient, p.top_k, p.top_p


def _decision(result, kind: str, group_id: str):
    decision = None if result is None else getattr(result, kind).get(group_id)
    if decision is None:
        raise RuntimeError(f"the model runner returned no {kind} for beam group {group_id}")
    return decision


def _internal_params(user_params):
    """Sampling params of internal beam requests: greedy and silent (the group decides, not vLLM's sampler)."""
    params = copy.copy(user_params)
    params.n = 1
    params.temperature = 0.0
    params.top_p, params.top_k, params.min_p = 1.0, 0, 0.0
    params.seed = None
    params.logprobs = None
    params.prompt_logprobs = None
    params.stop = []  # the group checks stop strings (BeamParams.stop); vLLM refuses them without detokenize
    params.detokenize = False
    return params


def _stop_reason(hyp: Hypothesis | None, params: BeamParams) -> int | None:
    """The stop token a hypothesis ended with, as vLLM reports it for plain requests (None for EOS)."""
    if hyp is None or hyp.finish_reason != "stop" or hyp.tokens[-1] == params.finishing_token:
        return None
    return hyp.tokens[-1] if hyp.tokens[-1] in params.stop_token_ids else None


def _logprobs_lists(hyp: Hypothesis, num_logprobs: int | None) -> LogprobsLists | None:
    """Per-token logprobs of a hypothesis in vLLM's layout: column 0 the token, then the top-k."""
    if num_logprobs is None or not hyp.tokens:
        return None
    width = num_logprobs + 1
    ids = np.zeros((len(hyp.tokens), width), dtype=np.int64)
    lps = np.full((len(hyp.tokens), width), -math.inf, dtype=np.float32)
    ranks = np.zeros(len(hyp.tokens), dtype=np.int64)
    for i, (token, lp) in enumerate(zip(hyp.tokens, hyp.logprobs)):
        ids[i, 0], lps[i, 0], ranks[i] = token, lp.logprob, lp.rank
        k = min(num_logprobs, len(lp.top_ids))
        ids[i, 1:1 + k] = lp.top_ids[:k]
        lps[i, 1:1 + k] = lp.top_logprobs[:k]
    return LogprobsLists(ids, lps, ranks)
