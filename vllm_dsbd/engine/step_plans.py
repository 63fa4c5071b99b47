"""Each engine step's plan for the runner (a part of :class:`~vllm_dsbd.engine.scheduler.DSBDScheduler`).

After vLLM's ``schedule()``, the groups whose requests were computed up to
their frontier take their step (a beam step, a draft layer, or the
verification of their forest); requests of groups that are not ready are
discarded and rewound. Forks scheduled for the first time go to the workers
as new requests.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from vllm_dsbd.engine import forest_draft
from vllm_dsbd.engine.beam_group import BeamGroup
from vllm_dsbd.engine.protocol import GroupStep, StepPlan


class PlanMixin:
    """Step plans of ready groups; mixed into ``DSBDScheduler`` (uses its state)."""

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
        all its spec tokens (verification; without draft layers, a beam step), or
        whose every beam's prompt / lost KV was recomputed (the iteration starts;
        the last token is recomputed with the forest).
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
                if len(done) == len(group.path_requests) and group.plain_iteration:
                    plan.groups.append(self._beam_step_plan(group))  # no draft layers: a beam step
                elif len(done) == len(group.path_requests):
                    if group.draft_in_step and group.params.auto_depth:
                        group.draft_next = self._in_step_depth(group)
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

    def _beam_step_plan(self, group: BeamGroup) -> GroupStep:
        """An iteration of depth 0, a beam step. With auto_depth and ``draft_in_step`` it also draws the next
        iteration's forest (its γ chosen now), when no beam's head KV misses more than
        ``forest_draft.MAX_CHAIN`` tokens: a shallow iteration does not send the group back to draft steps."""
        if not (group.draft_in_step and group.params.auto_depth):
            return group.plan()
        reach = tuple(getattr(b.request, "dsbd_draft", None) for b in group.beams)
        last = group.prompt_len + group.num_generated - 1  # the beams' last token, which this step computes
        if any(r is None or last - r > forest_draft.MAX_CHAIN for r in reach):
            return group.plan()
        group.draft_next = self._in_step_depth(group)
        return group.plan(draft_from=reach)

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


def _phase(group: BeamGroup) -> str:
    """beam: no speculation; prefill: the target computes the beams' KV; draft / verify: a DSBD iteration."""
    if not group.speculative:
        return "beam"
    if not group.in_iteration:
        return "prefill"
    return "draft" if group.drafting else "verify"
