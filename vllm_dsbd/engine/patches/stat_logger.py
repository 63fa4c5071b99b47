"""Patch 10: DSBD's metrics in vLLM's Prometheus stat logger."""

from __future__ import annotations


# ---------------------------------------------------------------------------
# Patch 10 — DSBD's mean beam width and output tokens per target forward in
# vLLM's Prometheus metrics (llm.get_metrics(), /metrics).
#   target:  vllm.v1.metrics.loggers.PrometheusStatLogger._spec_decoding_cls
#            (the SpecDecodingProm class its __init__ instantiates)
#   why:     SpecDecodingStats has no slot for them, extra fields of a
#            subclass do not survive msgspec to the front end, and stat-logger
#            plugins load in AsyncLLM only (not offline LLM).
#   how:     the scheduler appends the two counts to
#            SpecDecodingStats.num_draft_tokens_per_pos (declared, read by no
#            vLLM consumer); a SpecDecodingProm subclass that behaves as
#            upstream on other engines registers and feeds the DSBD metrics
#            (vllm_dsbd.engine.metrics).
#   remove-when: vLLM lets a speculative method add its own metrics.
# ---------------------------------------------------------------------------
def _dsbd_spec_decoding_metrics() -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from vllm_dsbd.engine.metrics import DSBDSpecDecodingProm

    PrometheusStatLogger._spec_decoding_cls = DSBDSpecDecodingProm
