"""Admission and preemption of beam groups (a part of :class:`~vllm_dsbd.engine.scheduler.DSBDScheduler`).

A waiting group is admitted, FIFO, when its ``W`` (with speculation ``W (γ + 3)``)
request slots and the KV blocks its beams may still claim are free; its root
(the prompt) then joins vLLM's waiting queue. Preemption is group-atomic: when
vLLM preempts one beam, the group's other beams follow at the next step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from vllm.v1.core.sched.utils import remove_all
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.request import Request, RequestStatus

from vllm_dsbd.engine.beam_group import BeamGroup, request_slots


class AdmissionMixin:
    """Group admission and group-atomic preemption; mixed into ``DSBDScheduler`` (uses its state)."""

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
            for uid in group.user_request_ids:  # vLLM counts a preemption by its user request's event
                user = self.requests.get(uid)
                if user is not None and self.log_stats:
                    user.record_event(EngineCoreEventType.PREEMPTED, now)
        self.running = remove_all(self.running, set(victims) | released)
        for request in victims:
            self._preempt_request(request, now)
        self._preempted_groups.clear()

    def _admitted_groups(self) -> Iterable[BeamGroup]:
        pending = set(self._admission)
        return (g for gid, g in self.groups.items() if gid not in pending)

    def _admit_groups(self) -> None:
        """Queue the roots of waiting groups, FIFO, while request slots and KV blocks allow.

        A group reserves the request slots and KV blocks of its deepest
        iteration (prompt blocks shared); a group is always admitted when no
        other group runs, so an oversized one is not starved. An auto_depth group
        is admitted with the deepest γ that fits while leaving room for the beam
        steps of the auto_depth groups waiting behind it (else with the deepest
        that fits at all, 0 at least): under load its policy mostly chooses beam
        steps anyway, and reserving γ for each kept the later ones waiting. The
        auto_depth groups look ahead at their first iteration once all are in:
        groups admitted together share their steps.
        """
        looking_ahead = []
        waiting = [self.groups[gid] for gid in self._admission]
        behind = [sum(self._room(g, 0)[i] for g in waiting if g.params.auto_depth) for i in (0, 1)]
        while self._admission:
            group = self.groups[self._admission[0]]
            if group.params.auto_depth:  # not behind itself
                behind = [b - r for b, r in zip(behind, self._room(group, 0))]
            admitted = list(self._admitted_groups())
            if admitted and not self._fits(group, admitted, behind):
                break
            self._admission.popleft()
            root = group.beams[0].request
            self.requests[root.request_id] = root
            self._enqueue_waiting_request(root)
            if group.speculative and group.params.auto_depth:
                looking_ahead.append(group)
            for uid in group.user_request_ids:
                user = self.requests.get(uid)
                if user is not None and self.log_stats:
                    user.record_event(EngineCoreEventType.SCHEDULED)
        if looking_ahead:
            self._batch_view = None  # (auto_depth) counted again, with every group admitted now
            for group in looking_ahead:
                self._start_without_prefill(group)

    def _fits(self, group: BeamGroup, admitted: list[BeamGroup], behind: list[int]) -> bool:
        """Whether ``group`` fits beside the ``admitted`` groups; an auto_depth group may fit with a lower
        ``depth_cap`` (set: the deepest that leaves ``behind``, the request slots and KV blocks of the beam
        steps of those waiting, free, else the deepest that fits)."""
        num_plain = sum(1 for r in self.running if r.request_id not in self._beam_group)
        free = (self.max_num_running_reqs - num_plain - sum(self._slots(g) for g in admitted),
                self.kv_cache_manager.block_pool.get_num_free_blocks()
                - sum(self._blocks_to_reserve(g) for g in admitted))
        gamma = group.params.num_speculative_tokens
        caps = range(gamma, -1, -1) if group.params.auto_depth else [gamma]
        for room in ((free[0] - behind[0], free[1] - behind[1]), free):
            for cap in caps:
                slots, blocks = self._room(group, cap)
                if slots <= room[0] and blocks <= room[1]:
                    group.depth_cap = cap
                    return True
        return False

    def _room(self, group: BeamGroup, depth_cap: int) -> tuple[int, int]:
        """(request slots, KV blocks) ``group`` reserves with ``depth_cap``."""
        return request_slots(group.params.beam_width, depth_cap), self._blocks_to_reserve(group, depth_cap)

    @staticmethod
    def _slots(group: BeamGroup) -> int:
        return request_slots(group.params.beam_width, group.depth_cap)

    def _blocks_to_reserve(self, group: BeamGroup, depth_cap: int | None = None) -> int:
        """KV blocks a group may still claim: W beams growing to max_tokens, plus a tail copy each
        (with speculation, up to its ``depth_cap``: the blocks of W draft nodes and W (γ + 1) paths besides)."""
        block_size = self.block_size
        remaining = group.params.max_tokens - group.num_generated
        width, gamma = group.params.beam_width, group.depth_cap if depth_cap is None else depth_cap
        blocks = width * (math.ceil(remaining / block_size) + 1)
        if gamma:
            blocks += width * (gamma + 2) * (math.ceil(gamma / block_size) + 1)
        if group.num_generated == 0:
            blocks += math.ceil(group.prompt_len / block_size)
        return blocks
