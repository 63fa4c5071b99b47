"""Internal beam requests and their KV (a part of :class:`~vllm_dsbd.engine.scheduler.DSBDScheduler`).

A fork shares its parent's full KV blocks (ref counts) and gets a copy of
the partial tail block through vLLM's copy-on-write path; without a free block
it recomputes instead. A node of a speculative iteration cannot recompute (draft
steps run only the nodes that hold their KV): its fork first preempts, as vLLM
preempts for a running request, plain requests and beams without speculation
that the step did not run, the lowest priority first; failing that, its group is
preempted and runs the iteration again once it is back. A released beam frees its
blocks at once. A request
whose group is not ready goes back to its frontier (the target's, with
speculation) to try again.
"""

from __future__ import annotations

import time

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request, RequestStatus

from vllm_dsbd.engine.beam_group import BeamGroup


class BeamKVMixin:
    """Forks, releases and rewinds of internal requests; mixed into ``DSBDScheduler`` (uses its state)."""

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
        speculative = group.speculative
        if self._share_kv(parent, child, num_shared) or (speculative and self._make_room(parent, child, num_shared)):
            child.num_computed_tokens = num_shared
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
            self._unsent.add(child.request_id)
        else:  # no free block for the tail copy: recompute
            for attr in ("dsbd_target", "dsbd_draft"):
                if getattr(child, attr, None) is not None:
                    setattr(child, attr, 0)
            self.waiting.prepend_request(child)
            if speculative:  # released with the iteration when the group is preempted, at the next step
                self._preempted_groups.add(group.group_id)
        return child

    def _make_room(self, parent: Request, child: Request, num_tokens: int) -> bool:
        """A speculative iteration's fork found no free block: preempt requests that the step just run did
        not schedule, plain ones and beams of groups without speculation (a group follows whole at the next
        step), the lowest priority first as vLLM picks, until the fork shares ``parent``'s KV."""
        while True:
            victims = [r for r in self.running if r.status == RequestStatus.RUNNING
                       and r.request_id not in self._scheduled_now and not self._speculating(r)]
            if not victims:
                return False
            victim = max(victims, key=lambda r: (r.priority, r.arrival_time)) \
                if self.policy == SchedulingPolicy.PRIORITY else victims[-1]
            self.running.remove(victim)
            self._preempt_request(victim, time.monotonic())
            if self._share_kv(parent, child, num_tokens):
                return True

    def _speculating(self, request: Request) -> bool:
        group = self.groups.get(self._beam_group.get(request.request_id))
        return group is not None and group.speculative

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
