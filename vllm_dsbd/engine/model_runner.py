"""The DSBD model runner: vLLM's V1 runner that takes each ready beam group's step.

The scheduler's :class:`~vllm_dsbd.engine.protocol.StepPlan` arrives with
``SchedulerOutput``; after vLLM's sampler has run on the batch,
:meth:`DSBDModelRunnerMixin._sample` decides each group's next beams from the
target logits (``engine.beam_step``) and rewrites the sampled token of each
beam's row: the token its request continues with, or none (the row's token
is discarded, as for a partial prefill) for beams without children and for
beams of groups that are not ready. The decisions go back to the scheduler in
``ModelRunnerOutput.dsbd_result``.

Every tensor-parallel rank runs the same decisions (same logits, same
per-group generators); only the output rank's result is read.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_dsbd.engine import beam_step
from vllm_dsbd.engine.protocol import PLAN_ATTR, RESULT_ATTR, StepPlan, StepResult


class DSBDModelRunnerMixin:
    """Mixed into vLLM's CPU or GPU (V1) model runner."""

    _dsbd_plan: StepPlan | None = None
    _dsbd_result: StepResult | None = None

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._dsbd_plan = getattr(scheduler_output, PLAN_ATTR, None)
        self._dsbd_result = None
        return super().execute_model(scheduler_output, *args, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        sampler_output = super()._sample(logits, spec_decode_metadata)
        plan, self._dsbd_plan = self._dsbd_plan, None
        if plan is None or logits is None:
            return sampler_output
        if spec_decode_metadata is not None:
            raise NotImplementedError("DSBD speculation (draft forests) is not implemented in this runner yet")
        row_of = self.input_batch.req_id_to_index
        discard = self.discard_request_mask.np
        sampled = sampler_output.sampled_token_ids  # [num_reqs, 1]
        decisions = beam_step.decide(logits, row_of, plan.groups)
        for step in plan.groups:
            tokens = beam_step.row_tokens(decisions[step.group_id], len(step.req_ids))
            for rid, token in zip(step.req_ids, tokens):
                row = row_of[rid]
                if token is None:
                    discard[row] = True
                else:
                    sampled[row, 0] = token
        for rid in plan.discard_req_ids:
            row = row_of.get(rid)
            if row is not None:
                discard[row] = True
        self._dsbd_result = StepResult(decisions)
        return sampler_output

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        result, self._dsbd_result = self._dsbd_result, None
        if result is not None:
            setattr(output, RESULT_ATTR, result)
        return output


class DSBDCPUModelRunner(DSBDModelRunnerMixin, CPUModelRunner):
    pass


class DSBDGPUModelRunner(DSBDModelRunnerMixin, GPUModelRunner):
    pass
