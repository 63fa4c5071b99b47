"""The runner's decisions carried out (a part of :class:`~vllm_dsbd.engine.scheduler.DSBDScheduler`).

``update_from_output`` hands each group the runner's decision for its step
(beam step, draft layer, verification); the group returns its effects (forks,
frees, extensions, path requests), which are carried out here in order. A DSBD
iteration starts (its depth chosen by ``auto_depth``) after each verification;
a finished group's best ``n`` hypotheses go out under the user request ids,
with DSBD's counters in vLLM's spec-decode stats.
"""

from __future__ import annotations

import math

import numpy as np
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request, RequestStatus

from vllm_dsbd.algorithm.depth import Batch
from vllm_dsbd.engine import forest_draft, metrics
from vllm_dsbd.engine.beam_group import BeamGroup, BeamParams, Hypothesis
from vllm_dsbd.engine.group_effects import Extend, Fork, Free, PathRequest, StepEffects
from vllm_dsbd.engine.protocol import GroupTiming, StepPlan


class CommitMixin:
    """Decisions applied to groups and their effects carried out; mixed into ``DSBDScheduler``."""

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
                if group is None:  # aborted while the step ran
                    continue
                decision = _decision(result, "decisions", step.group_id)
                if group.speculative:  # an iteration without draft layers
                    drafted = None if step.draft_next is None else decision.next_layers
                    timing = result.timings.get(step.group_id)
                    if timing is not None and step.draft_from and min(step.draft_from) == 0:
                        timing = GroupTiming(timing.decide_seconds)  # the prompt's head KV: no forest's cost
                    self._commit_iteration(group, group.apply, decision, [], [], [len(decision.beams)], 0,
                                           freed, group_outputs, timing, drafted)
                else:
                    self._carry_out(group, group.apply(decision), freed, group_outputs)
            for step in plan.verify_steps:
                group = self.groups.get(step.group_id)
                if group is not None:
                    decision = _decision(result, "verify_decisions", step.group_id)
                    self._commit_iteration(group, group.apply_verify, decision, decision.num_proposed,
                                           decision.num_accepted, decision.widths, decision.num_passed,
                                           freed, group_outputs, result.timings.get(step.group_id),
                                           decision.next_layers)
        if freed:
            self.running = remove_all(self.running, freed)

    def _commit_iteration(self, group: BeamGroup, apply, decision, proposed: list[int], accepted: list[int],
                          widths: list[int], num_passed: int, freed: set[Request],
                          group_outputs: dict[int, list[EngineCoreOutput]], timing: GroupTiming | None = None,
                          drafted: list | None = None) -> None:
        """A verified DSBD iteration (``apply``: the group's commit of ``decision``); the next one starts.
        ``timing``: the runner's time deciding it (and drafting the next one inside that step), which
        auto_depth costs on its own, not as the target step's. ``drafted``: the next iteration's layers drawn
        in that step (``engine.forest_draft``; empty: it chose to draw none); None: not drawn there."""
        num_layers, width = len(group.layers), len(group.beams)
        own_tokens = self._step_tokens_of([pr.request for pr in group.path_requests])
        for pr in group.path_requests:  # the target computed every path up to its root's end
            pr.request.num_computed_tokens = pr.request.num_tokens
        self._observe(proposed, accepted, widths, num_layers)
        self._depth.observe_iteration(_depth_key(group), group.group_id, num_layers, num_passed)
        self._carry_out(group, apply(decision), freed, group_outputs)
        if timing is not None:
            self._group_seconds += timing.decide_seconds + timing.draft_seconds
            self._depth.observe_decision(width, sum(proposed), timing.decide_seconds)
            if drafted:
                self._depth.observe_in_step(timing.draft_rows, timing.draft_seconds)
        if group.group_id in self.groups:
            for b in group.beams:
                b.request.dsbd_target = b.request.num_computed_tokens
            self._start_iteration(group, freed, rewind=False, own_tokens=own_tokens, drafted=drafted)

    def _observe(self, proposed: list[int], accepted: list[int], widths: list[int], num_draft_layers: int) -> None:
        """DSBD in vLLM's spec-decode counters: a draft = one iteration (one target forward of the
        group's forest), draft tokens = draft nodes proposed, accepted tokens = draft nodes accepted,
        per position i = nodes accepted at depth i + 1 (``proposed`` / ``accepted``: per verified layer);
        plus the beam layers produced, their ``widths`` and the draft layers built (γ of the iteration;
        vllm_dsbd.engine.metrics)."""
        if self._spec_stats is None:
            self._spec_stats = metrics.new_stats(self._num_draft_layers)
        stats = self._spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += sum(proposed)
        stats.num_accepted_tokens += sum(accepted)
        for depth, (p, a) in enumerate(zip(proposed, accepted)):
            stats.num_draft_tokens_per_pos[depth] += p
            stats.num_accepted_tokens_per_pos[depth] += a
        metrics.observe_layers(stats, widths, num_draft_layers)

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

    def _start_iteration(self, group: BeamGroup, freed: set[Request], rewind: bool = True,
                         own_tokens: int | None = None, drafted: list | None = None) -> None:
        """The beams' KV is complete up to their last token (``rewind``: up to the end; the last token
        is recomputed with the forest): the next DSBD iteration starts. ``own_tokens``: the group's tokens
        in the step just run (default: its beams'). ``drafted``: its draft layers, drawn by the runner in
        the step just run (``engine.forest_draft``): the forest's paths are set up at once; empty after a
        step that drew none (with auto_depth, γ 0 may have been chosen for it), None after any other step."""
        if drafted:
            for b in group.beams:  # the runner wrote the head's KV of the verified tokens (forest_draft)
                b.request.dsbd_draft = b.request.dsbd_target
            self._carry_out(group, group.start_iteration(len(drafted)), freed, {})
            self._carry_out(group, group.apply_drafted(drafted), freed, {})
            return
        if own_tokens is None:
            own_tokens = self._step_tokens_of(group.requests())
        for b in group.beams:
            r = b.request
            if rewind:
                r.num_computed_tokens = r.num_tokens - 1
                r.dsbd_target, r.dsbd_draft = r.num_computed_tokens, 0
            r.dsbd_draft = min(getattr(r, "dsbd_draft", None) or 0, r.dsbd_target)
        depth = None
        if group.params.auto_depth and drafted is not None and group.draft_in_step and group.draft_next == 0:
            depth = 0  # chosen when its verify step was planned (_in_step_depth)
        elif group.params.auto_depth:
            draft_lag = sum(b.request.num_tokens - b.request.dsbd_draft for b in group.beams)
            depth = self._depth.choose(_depth_key(group), group.group_id, group.max_draft_layers,
                                       len(group.beams), draft_lag, batch=self._batch_of(group, own_tokens))
        self._carry_out(group, group.start_iteration(depth), freed, {})

    def _in_step_depth(self, group: BeamGroup) -> int:
        """auto_depth with ``draft_in_step``: γ of the group's next iteration, chosen one iteration ahead, as
        its verify step (or beam step) is planned, since the runner draws those layers in that step. Its
        width: the beams' now, but W after the first iteration (its one root becomes up to W beams). Its lag:
        the tokens whose head KV the drawing first computes (the chains: after a verify step about one per
        beam, after a run of beam steps every token since); the prompt, whose head KV is computed once
        whatever the depth, counts as one token a beam, as its timing is left out of the fit."""
        width = len(group.beams) if group.num_generated else group.params.beam_width
        lag = sum(r.num_tokens - r.dsbd_draft if getattr(r, "dsbd_draft", None) else 1
                  for r in (b.request for b in group.beams))
        return self._depth.choose(_depth_key(group), group.group_id, group.max_draft_layers, width, lag,
                                  batch=self._batch_of(group, self._step_tokens_of(group.requests())), in_step=True)

    def _step_tokens_of(self, requests) -> int:
        return sum(self._step_tokens.get(r.request_id, 0) for r in requests)

    def _batch_of(self, group: BeamGroup, own_tokens: int) -> Batch:
        """What the group's next iteration shares its steps with (auto_depth): the other admitted groups
        and plain requests, the other tokens of the target step just run, the other groups drafting (in
        their iteration just verified). Counted once per step, not once per group, and only what is still
        there: the tokens of finished or freed requests (a group that just ended) run no more."""
        if self._batch_view is None:
            admitted = list(self._admitted_groups())
            plain = sum(1 for r in self.running  # beams freed in this commit are still listed, finished
                        if r.request_id not in self._beam_group and not r.is_finished())
            drafting = {g.group_id for g in admitted if g.in_iteration and g.num_draft_layers > 0}
            tokens = sum(n for rid, n in self._step_tokens.items() if rid in self.requests)
            self._batch_view = (len(admitted) + plain, drafting, tokens)
        streams, drafting, tokens = self._batch_view
        return Batch(streams=max(streams, 1), drafting=1 + len(drafting - {group.group_id}),
                     other_tokens=max(0, tokens - own_tokens))

    def _start_without_prefill(self, group: BeamGroup) -> None:
        """auto_depth: a group whose first iteration gets depth 0 starts it at once, so the target step
        that computes its prompt also takes its first beam step (else a prefill step computes the prompt
        and samples nothing, and the first iteration recomputes its last token with the forest). With
        ``draft_in_step`` and a prompt of at most ``forest_draft.MAX_CHAIN`` tokens it always does: that beam
        step also computes the head's KV of the prompt and draws the second iteration's forest, where draft
        steps would have to catch the head up on the prompt first."""
        root = group.beams[0].request
        in_step = group.draft_in_step and root.num_tokens - 1 <= forest_draft.MAX_CHAIN
        if not in_step and self._depth.choose(_depth_key(group), group.group_id, group.max_draft_layers, 1,
                                              root.num_tokens, probe=False, batch=self._batch_of(group, 0)):
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
                    self._hold_shared(op.request, op.tokens, root.dsbd_target)
                op.request.spec_token_ids = list(op.spec_tokens)

    def _hold_shared(self, request: Request, tokens: list[int], frontier: int) -> None:
        """A path that shares its first nodes with an earlier path (``engine.shared_rows``): its fork of the
        root gets the path's tokens through its first own node, and holds the root's last token and the
        shared nodes as computed (the runner writes their K/V to its slots in the verify step, from the rows
        of the path that computes them). A fork that recomputes its KV (no free block) computes them too."""
        if not tokens:
            return
        request.append_output_token_ids(tokens)
        if request.num_computed_tokens == frontier and request.dsbd_target == frontier:
            request.num_computed_tokens = request.dsbd_target = frontier + len(tokens)

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
        self._batch_view = None  # the group's tokens no longer count (_batch_of)
        self._forgotten_groups.append(group.group_id)
        self._depth.forget(group.group_id)
        if group.group_id in self._admission:
            self._admission.remove(group.group_id)
        return released


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
