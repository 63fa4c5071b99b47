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
victims as vLLM does (beams included); a preempted beam is recomputed from
its tokens before its group moves on.
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
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine import requests as beam_requests
from vllm_dsbd.engine.beam_group import BeamGroup, Hypothesis
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
        self._beam_ids = itertools.count()
        # Seeds of unseeded groups: reproducible for a given engine seed and arrival order.
        self._seeds = random.Random(self.vllm_config.model_config.seed)

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
        self._preempt_split_groups()
        self._admit_groups()
        # Keep request slots free for the forks of admitted groups (up to W beams each).
        reserved = sum(g.params.beam_width - len(g.beams) for g in self._admitted_groups())
        self.max_num_active_reqs -= reserved
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.max_num_active_reqs += reserved
        self._announce_unsent(out)
        plan = self._plan(out)
        if plan is not None:
            setattr(out, PLAN_ATTR, plan)
        return out

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
        victims = [r for gid in self._preempted_groups if gid in self.groups
                   for r in self.groups[gid].requests() if r.status == RequestStatus.RUNNING]
        self.running = remove_all(self.running, set(victims))
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
                num_beam_slots = sum(g.params.beam_width for g in admitted)
                num_plain = sum(1 for r in self.running if r.request_id not in self._beam_group)
                if num_plain + num_beam_slots + group.params.beam_width > self.max_num_running_reqs:
                    return
                free = self.kv_cache_manager.block_pool.get_num_free_blocks()
                if free - sum(self._blocks_to_reserve(g) for g in admitted) < self._blocks_to_reserve(group):
                    return
            self._admission.popleft()
            root = group.beams[0].request
            self.requests[root.request_id] = root
            self._enqueue_waiting_request(root)
            for uid in group.user_request_ids:
                user = self.requests.get(uid)
                if user is not None and self.log_stats:
                    user.record_event(EngineCoreEventType.SCHEDULED)

    def _blocks_to_reserve(self, group: BeamGroup) -> int:
        """KV blocks a group may still claim: W beams growing to max_tokens, plus a tail copy each."""
        block_size = self.block_size
        remaining = group.params.max_tokens - group.num_generated
        blocks = group.params.beam_width * (math.ceil(remaining / block_size) + 1)
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

    def _plan(self, out: SchedulerOutput) -> StepPlan | None:
        """Ready groups take their step; beams of other groups computed up to their last token wait."""
        scheduled = out.num_scheduled_tokens
        steps, discard = [], []
        for group in self._admitted_groups():
            at_frontier = [r for r in group.requests()
                           if r.request_id in scheduled and r.num_computed_tokens == r.num_tokens]
            if len(at_frontier) == len(group.beams):
                steps.append(group.plan())
            else:
                discard.extend(r.request_id for r in at_frontier)
        if not steps and not discard:
            return None
        return StepPlan(steps, discard)

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
        return outputs

    def _commit_steps(self, plan: StepPlan, result, group_outputs: dict[int, list[EngineCoreOutput]]) -> None:
        for rid in plan.discard_req_ids:
            self._recompute_last_token(rid)
        freed: set[Request] = set()
        for step in plan.groups:
            group = self.groups.get(step.group_id)
            if group is None:  # aborted while the step ran
                continue
            decision = None if result is None else result.decisions.get(step.group_id)
            if decision is None:
                raise RuntimeError(f"the model runner returned no beam decision for group {step.group_id}")
            effects = group.apply(decision)
            for request in effects.frees:
                freed.add(self._release_beam(request))
            if group.done:  # its new beams never run: no forks
                freed.update(self._finish_group(group, group_outputs))
                continue
            for fork in effects.forks:
                fork.child.request = self._fork(group, fork.parent, fork.child.tokens[-1])
            for request, token in effects.continues:
                request.append_output_token_ids(token)
        if freed:
            self.running = remove_all(self.running, freed)

    def _recompute_last_token(self, rid: str) -> None:
        request = self.requests.get(rid)
        if request is not None and not request.is_finished() and request.num_computed_tokens > 0:
            request.num_computed_tokens -= 1

    def _fork(self, group: BeamGroup, parent: Request, token: int) -> Request:
        """A new beam request: the parent's tokens plus ``token``, sharing the parent's KV."""
        num_tokens = parent.num_tokens
        if parent.num_computed_tokens != num_tokens:
            raise RuntimeError(f"fork of {parent.request_id}: {parent.num_computed_tokens} of "
                               f"{num_tokens} tokens computed")
        child = self._internal_request(group.group_id, parent, list(parent.all_token_ids) + [token], None)
        child._block_hasher = parent._block_hasher
        child.block_hashes = list(parent.block_hashes)  # full blocks inside the shared prefix
        child.update_block_hashes()
        self.requests[child.request_id] = child
        if self._share_kv(parent, child, num_tokens):
            child.num_computed_tokens = num_tokens
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
            self._unsent.add(child.request_id)
        else:  # no free block for the tail copy: recompute (full blocks come from the prefix cache)
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
        """Emit the best ``n`` hypotheses under the user request ids and free everything."""
        for uid, hyp in zip(group.user_request_ids, group.results()):
            user = self.requests.get(uid)
            if user is None:
                continue
            user.status = (RequestStatus.FINISHED_STOPPED if hyp.finish_reason == "stop"
                           else RequestStatus.FINISHED_LENGTH_CAPPED)
            eco = EngineCoreOutput(
                request_id=uid,
                new_token_ids=list(hyp.tokens),
                finish_reason=user.get_finished_reason(),
                new_logprobs=_logprobs_lists(hyp, user.sampling_params.logprobs),
                events=user.take_events(),
                trace_headers=user.trace_headers,
            )
            outputs.setdefault(user.client_index, []).append(eco)
            self._free_request(user)
            self._user_group.pop(uid, None)
        return self._drop_group(group)

    def _drop_group(self, group: BeamGroup) -> list[Request]:
        released = [self._release_beam(b.request) for b in group.beams if b.request is not None]
        self.groups.pop(group.group_id, None)
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


def _internal_params(user_params):
    """Sampling params of internal beam requests: greedy and silent (the group decides, not vLLM's sampler)."""
    params = copy.copy(user_params)
    params.n = 1
    params.temperature = 0.0
    params.top_p, params.top_k, params.min_p = 1.0, 0, 0.0
    params.seed = None
    params.logprobs = None
    params.prompt_logprobs = None
    params.detokenize = False
    return params


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
