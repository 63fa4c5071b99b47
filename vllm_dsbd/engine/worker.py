"""Workers that install the DSBD model runner (CPU now; the GPU variant is wired the same way).

A DSBD engine gets these through ``ParallelConfig.worker_cls`` (set by the
plugin, never by users). Both need vLLM's V1 model runner.
"""

from __future__ import annotations

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from vllm_dsbd.engine.model_runner import DSBDCPUModelRunner, DSBDGPUModelRunner


def _require_v1_runner(worker) -> None:
    if worker.use_v2_model_runner:
        raise RuntimeError(
            "vllm-dsbd needs vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER "
            "(or set it to 0) for a DSBD engine."
        )


class _DecisionsDigest:
    def dsbd_record_decisions(self) -> str:
        """Turn the model runner's hash of its decisions on (off by default); through ``LLM.collective_rpc``."""
        return self.model_runner.dsbd_record_decisions()

    def dsbd_decisions_digest(self) -> str | None:
        """The model runner's hash of its decisions; through ``LLM.collective_rpc`` one per rank."""
        return self.model_runner.dsbd_decisions_digest()

    def dsbd_model_dtypes(self) -> dict[str, dict[str, str]]:
        """The model runner's dtypes of the target and the draft (weights, KV cache); through ``LLM.collective_rpc``."""
        return self.model_runner.dsbd_model_dtypes()

    def dsbd_held_state(self) -> dict[str, int]:
        """What the model runner holds for beam groups across steps; through ``LLM.collective_rpc``."""
        return self.model_runner.dsbd_held_state()

    def dsbd_step_profile(self) -> dict[str, dict[str, float]]:
        """The model runner's time per step kind (``StepProfile``); through ``LLM.collective_rpc``."""
        return self.model_runner.dsbd_step_profile()


class DSBDCPUWorker(_DecisionsDigest, CPUWorker):
    def init_device(self) -> None:
        _require_v1_runner(self)
        # CPUWorker builds its runner inline from this module global.
        original = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = DSBDCPUModelRunner
        try:
            super().init_device()
        finally:
            cpu_worker.CPUModelRunner = original


class DSBDGPUWorker(_DecisionsDigest, Worker):
    def _make_model_runner(self):
        _require_v1_runner(self)
        return DSBDGPUModelRunner(self.vllm_config, self.device)
