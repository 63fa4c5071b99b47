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
An iteration without draft layers (``auto_depth`` choosing γ 0) is the
group's beam step in a target step (``BeamGroup.plain_iteration``).
Every beam request has two KV frontiers, the target's and the draft's (the
same blocks hold both models' layers); ``num_computed_tokens`` is set to the
one the step's model continues from. Prefix caching is off for speculative
engines (a block whose target KV is complete may miss draft KV, and the other
way round).
"""

from __future__ import annotations

import copy
import itertools
import random
import time
from collections import deque

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_dsbd.algorithm.depth import DepthPolicy
from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine import requests as beam_requests
from vllm_dsbd.engine.beam_group import BeamGroup
from vllm_dsbd.engine.beam_kv import BeamKVMixin
from vllm_dsbd.engine.group_admission import AdmissionMixin
from vllm_dsbd.engine.group_commit import CommitMixin
from vllm_dsbd.engine.protocol import PLAN_ATTR, RESULT_ATTR, StepPlan
from vllm_dsbd.engine.step_plans import PlanMixin, _phase

logger = init_logger(__name__)


class DSBDScheduler(AdmissionMixin, PlanMixin, CommitMixin, BeamKVMixin, Scheduler):
    """The DSBD scheduler. Its parts, one responsibility a file: requests in, scheduling and aborts
    (here); admission and preemption (``group_admission``); each step's plan for the runner
    (``step_plans``); the runner's decisions carried out and results out (``group_commit``); internal
    requests' forks and KV (``beam_kv``)."""

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
        self._scheduled_now: set[str] = set()  # requests of the step being committed (never preempted there)
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
        # (start, kind) of the step in flight; kind: "draft", "target", or "prompt" (a target step computing
        # prompt tokens: not fitted, see _target_kind)
        self._step_timing: tuple[float, str] | None = None
        self._group_seconds = 0.0  # of that step, the runner's verifying and in-step drafting (costed on their own)
        self._step_tokens: dict[str, int] = {}  # tokens per request of the last target step with groups
        self._batch_view: tuple[int, set[str], int] | None = None  # that step's streams, drafting groups, tokens

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
        config, params = beam_requests.beam_params(
            first.sampling_params, self.dsbd_config, prompt_len=first.num_prompt_tokens,
            max_model_len=self.max_model_len, default_seed=self._seeds.getrandbits(62),
        )
        root = self._internal_request(group_id, first, list(first.prompt_token_ids), first._block_hasher)
        group = BeamGroup(group_id, [u.request_id for u in users], first.num_prompt_tokens, params, root)
        group.draft_in_step = config.draft_in_step and params.num_speculative_tokens > 0
        group.share_path_rows = current_platform.is_cpu()  # engine.shared_rows: where a forest row costs
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
        self._step_timing = (start, "draft" if drafting else self._target_kind(out))
        return out

    def _target_kind(self, out: SchedulerOutput) -> str:
        """"prompt" when the target step computes some prompt tokens (a user's, or a group's), else "target".

        auto_depth fits the target step's cost on decoding steps only: a prompt's tokens cost far less each
        (one request's causal block, where a decoding step runs many short queries each reading its whole
        KV), so one prefill of a few hundred tokens would flatten the fitted cost per token, and the policy
        would take a forest's tokens for nearly free."""
        return "prompt" if any(self._computes_prompt(rid, n) for rid, n in out.num_scheduled_tokens.items()) \
            else "target"

    def _computes_prompt(self, request_id: str, num_tokens: int) -> bool:
        """Whether a request's ``num_tokens`` in the step just scheduled include prompt tokens (a user's, or its
        group's)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        group = self.groups.get(self._beam_group.get(request_id))
        prompt_len = group.prompt_len if group is not None else request.num_prompt_tokens
        return request.num_computed_tokens - num_tokens < prompt_len  # vLLM advanced it by the step's tokens

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
        if plan is not None and not plan.draft:  # the target step's tokens per request, for auto_depth: a
            # request that computed its prompt counts the one token it decodes next (the prompt is not computed
            # again; under load the others' prompts made every forest look nearly free)
            self._step_tokens = {rid: 1 if self._computes_prompt(rid, n) else n for rid, n in scheduled.items()}
            self._batch_view = None
        if plan is not None:
            self._scheduled_now = set(scheduled)
            try:
                self._commit_steps(plan, getattr(model_runner_output, RESULT_ATTR, None), group_outputs)
            finally:
                self._scheduled_now = set()
        # The base class makes this step's stats last: after the commits, so KV usage is current.
        outputs = super().update_from_output(plain_output, model_runner_output)
        for client, outs in group_outputs.items():
            outputs.setdefault(client, EngineCoreOutputs()).outputs.extend(outs)
        groups_own, self._group_seconds = self._group_seconds, 0.0  # never carried into a later step
        if self._step_timing is not None:  # this step's cost, schedule to commit, for auto_depth
            start, kind = self._step_timing
            self._step_timing = None
            seconds = time.perf_counter() - start - groups_own  # the target step's own
            if kind != "prompt":
                self._depth.observe_step(kind == "draft", scheduler_output.total_num_scheduled_tokens, seconds)
        return outputs

    def make_stats(self, spec_decoding_stats=None, *args, **kwargs):
        stats, self._spec_stats = self._spec_stats, None
        return super().make_stats(stats if stats is not None else spec_decoding_stats, *args, **kwargs)

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
    params.stop = []  # the group checks stop strings (BeamParams.stop); vLLM refuses them without detokenize
    params.detokenize = False
    return params



