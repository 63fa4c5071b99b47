"""The DSBD model runner: vLLM's V1 runner that takes each ready beam group's step.

The scheduler's :class:`~vllm_dsbd.engine.protocol.StepPlan` arrives with
``SchedulerOutput``. The forward pass is vLLM's own (input preparation,
paged attention, logits); the runner then decides, from the logits, per
group (``engine.beam_step`` and ``engine.spec_step``):

- a beam step (no speculation): the next beams;
- a draft layer (a *draft step*: ``plan.draft``; the draft model replaces the
  target for the whole forward — its layers share the target's KV-cache group,
  so vLLM's attention metadata already covers them): the layer's W draft nodes,
  drawn from the draft joint ``Q``, which stays here until verification;
- a verification (a target step in which the group's root-to-leaf paths
  carry spec tokens, so the logits hold the target's distribution at every
  node): accepted nodes and the new beams.

It rewrites each group row's sampled tokens to what the row's request
continues with (one token; for a verified path, the accepted path tokens and
the new token) or discards them (the row's request is freed, forked from, or
waits). The decisions go back in ``ModelRunnerOutput.dsbd_result``. vLLM's
own drafter (``draft_model``) never proposes: DSBD drafts through its draft
steps.

Every tensor-parallel rank runs the same decisions (same logits, same
per-group generators); only the output rank's result is read, but each rank
feeds its own decisions back as its next input tokens, so ranks must agree:
:meth:`DSBDModelRunnerMixin.dsbd_decisions_digest` (a running hash of every
decision since :meth:`~DSBDModelRunnerMixin.dsbd_record_decisions` turned it
on; off by default: it pickles every step's decisions, work a served engine
need not do) lets a caller check that they do.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import pickle
import time

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine import (beam_step, cpu_memory, draft_head, eagle3, forest_attention, forest_draft, mjsd_step,
                              shared_rows, spec_step, verify_step)
from vllm_dsbd.engine.protocol import (PLAN_ATTR, RESULT_ATTR, GroupTiming, StepPlan, StepResult, first_path_through,
                                       layer_slot)
from vllm_dsbd.engine.stops import StopCheckers

logger = init_logger(__name__)


class DSBDModelRunnerMixin:
    """Mixed into vLLM's CPU or GPU (V1) model runner."""

    _dsbd_plan: StepPlan | None = None
    _dsbd_result: StepResult | None = None
    _dsbd_scheduler_output = None
    _dsbd_head = False  # the draft is an EAGLE-3 head (engine.eagle3)
    _dsbd_features: eagle3.FeatureCache | None = None
    _dsbd_features_gid = 0  # the KV-cache group of the target's (and the head's) layers
    _dsbd_support = None  # the draft's proposable token ids, when few (spec_step.proposable_tokens)
    _dsbd_support_checked = False
    _dsbd_head_order = None  # with a head and a support: eagle3.draft_vocabulary_order, for in-step drafting
    _dsbd_forest_layers: list[str] = []  # the head's attention layers, with draft_in_step (engine.forest_draft)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._dsbd_drafts = spec_step.DraftStore()
        self._dsbd_head_kv = forest_draft.KeptHeadKV()  # the head's K/V of the beams' last tokens (draft_in_step)
        self._dsbd_shared = shared_rows.SharedRows()  # forest nodes on several paths, computed once (CPU)
        self._dsbd_shared_groups: set[int] = set()  # the KV-cache groups of the target's layers
        self._dsbd_digest = None  # a hashlib.sha256 once dsbd_record_decisions turns recording on
        self._dsbd_profile = StepProfile()
        self._dsbd_stops = StopCheckers(self._dsbd_decode)
        if hasattr(self, "drafter"):
            head = eagle3.head_architecture(self.speculative_config.draft_model_config.hf_config) is not None
            self._dsbd_head = head
            # vLLM asks the proposer whether its model returns (hidden, aux) tuples by method
            # name; "dsbd" runs a plain causal LM like "draft_model", or an EAGLE-3 head.
            self.drafter.model_returns_tuple = lambda: head
            if head:  # the target exports its aux hidden states (set up by vLLM's load_model) ...
                self.use_aux_hidden_state_outputs = True
                self.drafter.pass_hidden_states_to_model = True  # ... and the head's dummy runs get features
        config = self._dsbd_config = DSBDConfig.from_vllm_config(self.vllm_config)
        # an EAGLE-3 head on a CPU engine (checked with the engine config: patches.engine_config)
        self._dsbd_in_step = self._dsbd_head and config is not None and config.draft_in_step

    def _dsbd_decode(self):
        """The target tokenizer's decode, loaded on the first beam request with stop strings."""
        from vllm.tokenizers import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(self.model_config)
        return lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)

    def _dsbd_special_ids(self) -> set[int]:
        """The target tokenizer's special and added token ids, and the EOS ids of the model's config."""
        from vllm.tokenizers import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(self.model_config)
        ids = set(getattr(tokenizer, "all_special_ids", ()))
        ids |= set(getattr(tokenizer, "added_tokens_decoder", {}))
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        return ids

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        drafter = getattr(self, "drafter", None)
        config = self._dsbd_config
        vocab = self.model_config.get_vocab_size()
        if drafter is not None and config is not None and config.draft_vocab_size:
            ids = draft_head.reduced_vocab_ids(vocab, config.draft_vocab_size, self._dsbd_special_ids())
            draft_head.install_reduced_head(drafter.model, ids)
            self._dsbd_support = spec_step.proposable_tokens(ids.to(self.device), vocab)
        if self._dsbd_head:
            eagle3.share_target_embeddings(drafter.model, self.get_model())
            self._dsbd_support = spec_step.proposable_tokens(eagle3.draft_vocabulary(drafter.model), vocab)
            if self._dsbd_support is not None:
                self._dsbd_head_order = eagle3.draft_vocabulary_order(drafter.model)
        if self._dsbd_in_step:
            self._dsbd_forest_layers = forest_attention.install(drafter.model)
        self.model.compute_logits = self._shared_node_logits(self.model.compute_logits)
        models = [self.model] + ([drafter.model] if drafter is not None else [])
        for model in models:  # the logits are part of the forward in the step profile
            model.compute_logits = self._dsbd_profile.timed_forward(model.compute_logits)
        # Objects the loading left in reference cycles go now, not while vLLM compiles: a oneDNN GEMM handler
        # collected during tracing fails in its __del__ (a long traceback at engine start, nothing broken).
        gc.collect()

    def _draft_support(self, logits):
        """The draft's proposable tokens for ``spec_step.draft_layers`` (None: all), checked against the draft's
        logits on the first draft layer of the engine."""
        support = self._dsbd_support
        if support is not None and not self._dsbd_support_checked:
            spec_step.check_support(logits, support)
            self._dsbd_support_checked = True
        return support

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if self._dsbd_head:
            gid = self._dsbd_features_gid = max(getattr(self.drafter, "kv_cache_gid", 0), 0)
            block_size = kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size
            self._dsbd_features = eagle3.FeatureCache(
                kv_cache_config.num_blocks, block_size, self.drafter.model.config.hidden_size,
                self.drafter.model.model.embed_tokens.weight.dtype, self.device)
            logger.info("DSBD: EAGLE-3 feature cache, %d slots, %.1f MiB", self._dsbd_features.features.shape[0],
                        self._dsbd_features.nbytes / 2**20)
        if current_platform.is_cpu():  # BeamGroup.share_path_rows is the scheduler's side of it
            self._dsbd_shared_groups = shared_rows.attach(self, kv_cache_config)

    def _shared_node_logits(self, compute_logits):
        """The target's head runs once per forest node of a verify step, not once per path through it
        (``spec_step.shared_node_rows``); the repeated rows get copies of the node's logits."""

        def compute(hidden_states):  # [num_rows, hidden]: the logits rows of every scheduled request
            plan, sched = self._dsbd_plan, self._dsbd_scheduler_output
            source = None
            if plan is not None and plan.verify_steps and sched is not None:
                spec = sched.scheduled_spec_decode_tokens
                counts = [len(spec.get(rid, ())) + 1 for rid in self.input_batch.req_ids]
                if sum(counts) == hidden_states.shape[0]:
                    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
                    row_start = {rid: int(s) for rid, s in zip(self.input_batch.req_ids, starts)}
                    source = spec_step.shared_node_rows(plan.verify_steps, row_start, hidden_states.shape[0])
            if source is None:
                return compute_logits(hidden_states)
            rows, inverse = torch.unique(source, return_inverse=True)
            logits = compute_logits(hidden_states[rows.to(hidden_states.device)])
            return None if logits is None else logits[inverse.to(logits.device)]

        return compute

    def _model_forward(self, *args, **kwargs):
        forward = super()._model_forward
        if self._dsbd_features is not None:
            forward = self._head_forward if self._dsbd_plan is not None and self._dsbd_plan.draft \
                else self._target_forward_with_features
        plan = self._dsbd_plan
        if plan is not None and plan.verify_steps and not plan.draft:
            self._dsbd_shared.now = shared_rows.copies_for(self, plan.verify_steps)
        try:
            return self._dsbd_profile.timed_forward(forward)(*args, **kwargs)
        finally:
            self._dsbd_shared.now = None

    def _dsbd_slots(self):
        """This step's rows: their number (unpadded), KV slots and block table of the head's KV-cache group."""
        num_rows = self._dsbd_scheduler_output.total_num_scheduled_tokens
        table = self.input_batch.block_table[self._dsbd_features_gid]
        return num_rows, table.slot_mapping.gpu[:num_rows], table

    def _target_forward_with_features(self, *args, **kwargs):
        """A target forward that also stores the head's input feature, fc(aux hidden states), at each row's slot."""
        _, aux = output = super()._model_forward(*args, **kwargs)
        num_rows, slots, _ = self._dsbd_slots()
        stacked = torch.cat([a[:num_rows] for a in aux], dim=-1).to(self._dsbd_features.features.dtype)
        features = self.drafter.model.combine_hidden_states(stacked)
        self._dsbd_features.write(slots, features)
        copies = self._dsbd_shared.now  # shared forest rows: their features at the later paths' slots too
        if copies is not None:
            self._dsbd_features.write(copies.slots[self._dsbd_features_gid], features[copies.rows])
        return output

    def _head_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                      **model_kwargs):
        """A draft step of an EAGLE-3 head: the row at position p reads the feature of p - 1 of its request
        (its KV goes to the row's slot); each request whose last token ran stores the head's own feature
        there (its children read it)."""
        num_rows, slots, table = self._dsbd_slots()
        req_indices = self.req_indices.gpu[:num_rows]
        prev = eagle3.previous_slots(positions[:num_rows], req_indices, table.block_table.gpu, table.block_size)
        padded = positions.shape[0]
        if padded > num_rows:
            prev = torch.cat([prev, prev.new_full((padded - num_rows,), -1)])
        normed, own = self.drafter.model(input_ids=input_ids, positions=positions,
                                         hidden_states=self._dsbd_features.read(prev), inputs_embeds=None)
        num_reqs = self.input_batch.num_reqs
        scheduled = self.num_scheduled_tokens.np[:num_reqs]
        ends = self.input_batch.num_computed_tokens_cpu[:num_reqs] + scheduled
        last = np.cumsum(scheduled) - 1
        done = torch.from_numpy(last[ends >= self.input_batch.num_tokens_no_spec[:num_reqs]]).to(slots.device)
        self._dsbd_features.write(slots[done], own[done])
        return normed, None

    def execute_model(self, scheduler_output, *args, **kwargs):
        plan = self._dsbd_plan = getattr(scheduler_output, PLAN_ATTR, None)
        if plan is not None:  # here, not in _sample: a step with no scheduled token returns before sampling
            self._dsbd_drafts.forget(plan.forget_group_ids)
            self._dsbd_head_kv.forget(plan.forget_group_ids)
        self._dsbd_scheduler_output = scheduler_output
        self._dsbd_result = None
        if self._dsbd_features is not None:  # forks copy their tail block's features as vLLM copies its KV
            self._dsbd_features.copy_blocks(scheduler_output.kv_cache_block_copies)
        self._dsbd_profile.start(plan, scheduler_output.total_num_scheduled_tokens)
        if plan is None or not plan.draft:
            return super().execute_model(scheduler_output, *args, **kwargs)
        target = self.model
        self.model = self.drafter.model  # a draft step: the draft model runs (and gives the logits)
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            self.model = target

    def propose_draft_token_ids(self, *args, **kwargs):
        return None  # vLLM's draft_model proposer is not used: DSBD drafts in its own steps

    def take_draft_token_ids(self):
        return None

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None or logits is None:
            sampler_output = super()._sample(logits, spec_decode_metadata)
        else:
            sampler_output = self._sample_last_rows(logits, spec_decode_metadata)
        plan, self._dsbd_plan = self._dsbd_plan, None
        if plan is None or logits is None:
            return sampler_output
        req_index = self.input_batch.req_id_to_index
        num_reqs = self.input_batch.num_reqs
        # logits rows of request i: [start[i], start[i] + count[i]); count = spec tokens + 1
        if spec_decode_metadata is None:
            count = np.ones(num_reqs, dtype=np.int64)
        else:
            count = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64) + 1
        start = np.concatenate([[0], np.cumsum(count)[:-1]])
        last_row = {rid: int(start[i] + count[i] - 1) for rid, i in req_index.items()}
        decide_start = time.perf_counter()
        sampled = sampler_output.sampled_token_ids  # [num_reqs, max spec tokens + 1]
        discard = self.discard_request_mask.np
        result = StepResult({})

        if plan.draft:  # every group's draft layer decided together
            support = self._draft_support(logits)
            drawn = spec_step.draft_layers(logits, [[last_row[r] for r in ds.req_ids] for ds in plan.draft_steps],
                                           plan.draft_steps, support)
            for ds, (decision, joint) in zip(plan.draft_steps, drawn):
                joint, kept = mjsd_step.kept_draft(logits, last_row, ds, joint, support, logits.shape[-1])
                if joint is not None:
                    self._dsbd_drafts.put(ds.group_id, ds.step, ds.layer, joint, kept)
                result.draft_decisions[ds.group_id] = decision
                for rid in ds.req_ids:  # parent nodes keep their tokens; children are forks
                    discard[req_index[rid]] = True
        else:
            deciding = time.perf_counter()
            result.decisions = beam_step.decide(logits, last_row, plan.groups, self._dsbd_stops)
            share = (time.perf_counter() - deciding) / max(len(plan.groups), 1)  # decided together
            result.timings = {step.group_id: GroupTiming(share) for step in plan.groups}
            drafting = []  # the next iterations' forests, in this step (engine.forest_draft)
            for step in plan.groups:
                decision = result.decisions[step.group_id]
                tokens = beam_step.row_tokens(decision, len(step.req_ids))
                for rid, token in zip(step.req_ids, tokens):
                    _set_row(sampled, discard, req_index[rid], None if token is None else [token])
                if step.draft_next:
                    drafting.append((decision, forest_draft.job_after_beam_step(self, step, decision)))
            self._verify(logits, plan, req_index, start, count, result)
            for vs in plan.verify_steps:
                decision = result.verify_decisions[vs.group_id]
                if vs.draft_next:
                    drafting.append((decision, forest_draft.job(self, vs, decision)))
                for rid, tokens in zip(vs.path_req_ids, _path_row_tokens(vs, decision)):
                    _set_row(sampled, discard, req_index[rid], tokens)
            self._draw_forests(drafting, result)
        for rid in plan.discard_req_ids:
            i = req_index.get(rid)
            if i is not None:
                discard[i] = True
        self._dsbd_result = result
        if self._dsbd_digest is not None:
            self._dsbd_digest.update(pickle.dumps(dataclasses.replace(result, timings={})))
        self._dsbd_profile.decided(time.perf_counter() - decide_start,
                                   sum(t.draft_seconds for t in result.timings.values()))
        return sampler_output

    def _draw_forests(self, drafting: list, result: StepResult) -> None:
        """The next iteration's draft layers of every (decision, ``forest_draft.Job`` or None) in one batched
        drawing; each group's timing gets its head rows and the drawing's time in proportion to them (what
        auto_depth's per-row cost of in-step drafting reads)."""
        jobs = [job for _, job in drafting if job is not None]
        if not jobs:
            return
        began = time.perf_counter()
        forest_draft.draw(self, jobs)
        per_row = (time.perf_counter() - began) / max(sum(job.rows for job in jobs), 1)  # drawn together
        for decision, job in drafting:
            if job is not None:
                decision.next_layers = job.decisions
                timing = result.timings[decision.group_id]
                timing.draft_rows, timing.draft_seconds = job.rows, per_row * job.rows

    def _verify(self, logits, plan: StepPlan, req_index, start, count, result: StepResult) -> None:
        """Every verify step's decision: the DSBD groups in one batched pass (``engine.verify_step``), each MJSD
        group on its own; each group's timing is its share of the pass."""
        inputs, mjsd = [], []
        for vs in plan.verify_steps:
            joints, support = None, None
            if vs.temperature > 0 or vs.mjsd_tau is not None:
                num_layers = len(vs.draft_parents)
                joints, support = (self._dsbd_drafts.take(vs.group_id, vs.step, num_layers) if num_layers
                                   else (logits.new_zeros((0, vs.beam_width * logits.shape[-1]), dtype=torch.float32), None))
            if vs.mjsd_tau is None:
                inputs.append(verify_step.GroupInput(vs, [int(start[req_index[r]]) for r in vs.path_req_ids],
                                                     joints, support))
            else:
                mjsd.append((vs, joints))
        if inputs:
            verifying = time.perf_counter()
            result.verify_decisions.update(verify_step.verify_groups(logits, inputs, self._dsbd_stops))
            share = (time.perf_counter() - verifying) / len(inputs)  # decided together
            result.timings.update({g.vs.group_id: GroupTiming(share) for g in inputs})
        for vs, joints in mjsd:  # an MJSD group's draft layers were kept over the whole vocabulary
            verifying = time.perf_counter()
            path_logits = [logits[start[i]:start[i] + count[i]] for i in (req_index[r] for r in vs.path_req_ids)]
            result.verify_decisions[vs.group_id] = mjsd_step.verify(path_logits, vs, joints, self._dsbd_stops)
            result.timings[vs.group_id] = GroupTiming(time.perf_counter() - verifying)

    def _sample_last_rows(self, logits, metadata):
        """vLLM's sampler on each request's last logits row, laid out as the rejection sampler's output.

        Only verification paths carry draft tokens, and their rows are decided by DSBD or MJSD (``_sample``
        overwrites them); every other request has one row. vLLM's rejection sampler is not run: it
        would reject nothing DSBD keeps, and on CPU it breaks (vLLM 0.32's CPU ``expand_kernel`` writes
        an int64 copy of its int32/float output, so top-k and temperature per draft token are
        uninitialised memory: the worker died on any top-k request beside a verify step, or with no
        draft token at all, ``k.max()`` of an empty tensor).
        """
        from vllm.v1.outputs import LogprobsTensors, SamplerOutput
        from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

        self.input_batch.update_async_output_token_ids()
        out = self.sampler(logits=logits[metadata.bonus_logits_indices],
                           sampling_metadata=self.input_batch.sampling_metadata)
        num_reqs, width = out.sampled_token_ids.shape[0], metadata.max_spec_len + 1
        tokens = out.sampled_token_ids.new_full((num_reqs, width), PLACEHOLDER_TOKEN_ID)
        tokens[:, :1] = out.sampled_token_ids
        lp = out.logprobs_tensors
        if lp is not None:  # one row per (request, position), as parse_output filters them

            def widen(t):
                wide = t.new_zeros((num_reqs * width, *t.shape[1:]))
                wide[::width] = t
                return wide

            lp = LogprobsTensors(widen(lp.logprob_token_ids), widen(lp.logprobs), widen(lp.selected_token_ranks))
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=lp)

    def dsbd_record_decisions(self) -> str:
        """Start hashing every decision this runner makes (again from nothing if it already was); returns
        the digest of no decisions. Off until called: the hash is for tests and checks, not for serving."""
        self._dsbd_digest = hashlib.sha256()
        return self._dsbd_digest.hexdigest()

    def dsbd_decisions_digest(self) -> str | None:
        """A hash of every decision since :meth:`dsbd_record_decisions` (equal on all tensor-parallel ranks);
        None while recording is off. (Not an error: a worker that raises in ``collective_rpc`` leaves the other
        ranks' replies queued in vLLM's multiprocessing executor, where the next call would read them.)"""
        return None if self._dsbd_digest is None else self._dsbd_digest.hexdigest()

    def dsbd_held_state(self) -> dict[str, int]:
        """What this runner holds across steps for beam groups: groups with stored draft joints, and cached
        stop-string checkers (bounded: :data:`stops.MAX_CHECKERS`). Both fall back once groups finish."""
        return {"draft_store_groups": len(self._dsbd_drafts), "stop_checkers": len(self._dsbd_stops)}

    def dsbd_model_dtypes(self) -> dict[str, dict[str, str]]:
        """Per model ("target", and "draft" on a speculative engine): the dtype of its weights and of its
        attention layers' KV cache, as loaded in this worker."""
        models = {"target": self.model}
        if getattr(self, "drafter", None) is not None:
            models["draft"] = self.drafter.model
        kv: dict[str, set[str]] = {}
        for name, layer in self.compilation_config.static_forward_context.items():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, torch.Tensor) and cache.numel():
                kv.setdefault("draft" if name.startswith("draft_model.") else "target", set()).add(str(cache.dtype))
        return {name: {"weights": str(next(model.parameters()).dtype),
                       "kv_cache": ",".join(sorted(kv.get(name, ())))} for name, model in models.items()}

    def dsbd_step_profile(self) -> dict[str, dict[str, float]]:
        """Per step kind: steps, tokens, seconds of the worker's step, of model forwards (logits included)
        and of DSBD's decisions, since the engine started (see :class:`StepProfile`)."""
        return self._dsbd_profile.totals()

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        result, self._dsbd_result = self._dsbd_result, None
        if result is not None:
            setattr(output, RESULT_ATTR, result)
        self._dsbd_profile.finish()
        return output


class StepProfile:
    """Where the worker's time goes, per step kind: ``draft`` (a draft layer), ``verify`` (a target step
    verifying at least one forest), ``beam`` (a target step with beam steps), ``other`` (plain requests,
    prompts). A step is timed from ``execute_model`` to the end of ``sample_tokens``; ``forward`` is
    the model's forward and logits, ``decide`` DSBD's decisions from the logits (beam steps, draft
    layers, verification), ``draft`` the part of ``decide`` that drew next forests inside the step
    (``draft_in_step``). A few ``perf_counter`` calls per step."""

    FIELDS = ("steps", "tokens", "step_s", "forward_s", "decide_s", "draft_s")

    def __init__(self) -> None:
        self._totals: dict[str, list[float]] = {}
        self._current: list | None = None  # [kind, tokens, start, forward_s, decide_s, draft_s]

    def start(self, plan: StepPlan | None, num_tokens: int) -> None:
        if plan is None:
            kind = "other"
        elif plan.draft:
            kind = "draft"
        else:
            kind = "verify" if plan.verify_steps else ("beam" if plan.groups else "other")
        self._current = [kind, num_tokens, time.perf_counter(), 0.0, 0.0, 0.0]

    def timed_forward(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._current is not None:
                    self._current[3] += time.perf_counter() - start
        return timed

    def decided(self, seconds: float, drafting: float = 0.0) -> None:
        """``seconds`` of decisions in this step, ``drafting`` of them drawing next forests."""
        if self._current is not None:
            self._current[4] += seconds
            self._current[5] += drafting

    def finish(self) -> None:
        if self._current is None:
            return
        kind, tokens, start, forward, decide, drafting = self._current
        self._current = None
        totals = self._totals.setdefault(kind, [0.0] * len(self.FIELDS))
        for i, v in enumerate((1, tokens, time.perf_counter() - start, forward, decide, drafting)):
            totals[i] += v

    def totals(self) -> dict[str, dict[str, float]]:
        return {kind: dict(zip(self.FIELDS, values)) for kind, values in self._totals.items()}


def _set_row(sampled: torch.Tensor, discard: np.ndarray, row: int, tokens: list[int] | None) -> None:
    """The tokens a request continues with (None: none, discard the row)."""
    if tokens is None:
        discard[row] = True
        return
    sampled[row, :] = -1  # vLLM's placeholder: dropped when the row is parsed
    sampled[row, :len(tokens)] = torch.tensor(tokens, dtype=sampled.dtype)


def _path_row_tokens(vs, decision) -> list[list[int] | None]:
    """Per path of a verified forest: accepted path tokens + new token for the path that carries a
    parent node's first child (``protocol.first_path_through``), None for the other paths."""
    out: list[list[int] | None] = [None] * len(vs.paths)
    for c in decision.beams:
        path = first_path_through(vs.paths, vs.aliases, c.parent)
        if out[path] is None:  # the tokens the path's request does not hold yet (``VerifyStep.shared``)
            out[path] = vs.path_tokens(path, layer_slot(c.parent, vs.beam_width)[0])[vs.skip(path):] + [c.token]
    return out


class DSBDCPUModelRunner(DSBDModelRunnerMixin, CPUModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cpu_memory.keep_freed_memory()  # each step's decision buffers reuse the heap, not fresh pages


class DSBDGPUModelRunner(DSBDModelRunnerMixin, GPUModelRunner):
    pass
