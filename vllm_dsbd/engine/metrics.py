"""DSBD metrics in vLLM's Prometheus registry (so ``llm.get_metrics()`` and ``/metrics``).

vLLM's spec-decode counters already carry what maps one to one onto DSBD
(the scheduler fills them, see ``DSBDScheduler._observe``):

- ``vllm:spec_decode_num_drafts``: DSBD iterations = target forwards of a group's forest;
- ``vllm:spec_decode_num_draft_tokens`` / ``..._accepted_tokens``: draft nodes proposed / accepted;
- ``vllm:spec_decode_num_accepted_tokens_per_pos``: draft nodes accepted at depth ``position + 1``.

What has no slot there is added here:

- ``vllm:dsbd_beam_layers``: beam layers produced, i.e. tokens appended to each
  beam (1 to γ + 1 per iteration); ``/ num_drafts`` = output tokens per target forward;
- ``vllm:dsbd_beam_width_sum``: over the layers produced, the live beams at
  the layer (hypotheses finished there not counted; at most W);
  ``/ dsbd_beam_layers`` = mean beam width (W with a fixed width until beams
  finish, less with a dynamic width, 1 for the carried layer in
  memory-efficient mode);
- ``vllm:dsbd_draft_layers``: draft layers built, i.e. the depth γ of each
  iteration summed (with ``auto_depth`` the engine chooses it per iteration,
  0 = a plain beam step); ``/ num_drafts`` = mean speculation depth;
- gauges ``vllm:dsbd_mean_beam_width``, ``vllm:dsbd_tokens_per_target_forward``
  and ``vllm:dsbd_mean_draft_depth``: the ratios over the engine's lifetime,
  for readers without PromQL.

Transport: the engine core sends ``SchedulerStats`` to the front end through
msgspec, which keeps only the declared fields of ``SpecDecodingStats`` (extra
fields of a subclass are dropped). ``num_draft_tokens_per_pos`` is declared
and read by no vLLM 0.32 consumer, so the two DSBD counts ride at its end,
after the ``num_spec_tokens`` per-position entries (:func:`new_stats`).
"""

from __future__ import annotations

import prometheus_client
from vllm.v1.metrics.utils import create_metric_per_engine
from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

from vllm_dsbd.config import METHOD

#: the DSBD counts appended to ``SpecDecodingStats.num_draft_tokens_per_pos``, in this order
EXTRA_SLOTS = ("beam_layers", "beam_width_sum", "draft_layers")


def new_stats(num_draft_layers: int) -> SpecDecodingStats:
    stats = SpecDecodingStats.new(num_draft_layers)
    stats.num_draft_tokens_per_pos.extend([0] * len(EXTRA_SLOTS))
    return stats


def observe_layers(stats: SpecDecodingStats, layer_widths: list[int], num_draft_layers: int) -> None:
    """One iteration of ``num_draft_layers`` draft layers produced ``len(layer_widths)`` beam layers,
    ``layer_widths[i]`` live beams at layer i."""
    extra = stats.num_spec_tokens
    stats.num_draft_tokens_per_pos[extra] += len(layer_widths)
    stats.num_draft_tokens_per_pos[extra + 1] += sum(layer_widths)
    stats.num_draft_tokens_per_pos[extra + 2] += num_draft_layers


def extra_counts(stats: SpecDecodingStats) -> tuple[int, int, int] | None:
    """(beam layers, beam width sum, draft layers) carried by ``stats``, or None (stats of another method)."""
    extra = stats.num_draft_tokens_per_pos[stats.num_spec_tokens:]
    if len(extra) != len(EXTRA_SLOTS):
        return None
    return extra[0], extra[1], extra[2]


class DSBDSpecDecodingProm(SpecDecodingProm):
    """vLLM's spec-decode Prometheus metrics plus, on a DSBD engine, the counters above."""

    _gauge_cls = prometheus_client.Gauge

    def __init__(self, speculative_config, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 is_diffusion: bool = False):
        super().__init__(speculative_config, labelnames, per_engine_labelvalues, is_diffusion=is_diffusion)
        self.dsbd_enabled = speculative_config is not None and speculative_config.method == METHOD
        if not self.dsbd_enabled:
            return

        def per_engine(cls, name: str, doc: str, **kw):
            return create_metric_per_engine(cls(name=name, documentation=doc, labelnames=labelnames, **kw),
                                            per_engine_labelvalues)

        Counter, Gauge = self._counter_cls, self._gauge_cls
        self.counter_beam_layers = per_engine(
            Counter, "vllm:dsbd_beam_layers",
            "DSBD beam layers produced (tokens appended to each beam); per vllm:spec_decode_num_drafts: "
            "output tokens per target forward.")
        self.counter_beam_width_sum = per_engine(
            Counter, "vllm:dsbd_beam_width_sum",
            "Sum over DSBD beam layers of the live beams at the layer; per vllm:dsbd_beam_layers: "
            "mean beam width.")
        self.gauge_mean_beam_width = per_engine(
            Gauge, "vllm:dsbd_mean_beam_width", "DSBD mean beam width over the engine's lifetime.",
            multiprocess_mode="mostrecent")
        self.gauge_tokens_per_target_forward = per_engine(
            Gauge, "vllm:dsbd_tokens_per_target_forward",
            "DSBD output tokens (beam layers) per target forward over the engine's lifetime.",
            multiprocess_mode="mostrecent")
        self.counter_draft_layers = per_engine(
            Counter, "vllm:dsbd_draft_layers",
            "DSBD draft layers built (the depth of each iteration, summed); per vllm:spec_decode_num_drafts: "
            "mean speculation depth.")
        self.gauge_mean_draft_depth = per_engine(
            Gauge, "vllm:dsbd_mean_draft_depth",
            "DSBD mean speculation depth (draft layers per iteration) over the engine's lifetime.",
            multiprocess_mode="mostrecent")
        self._totals = {idx: [0, 0, 0, 0] for idx in per_engine_labelvalues}  # drafts, layers, width sum, depth

    def observe(self, spec_decoding_stats: SpecDecodingStats, engine_idx: int = 0):
        super().observe(spec_decoding_stats, engine_idx)
        counts = extra_counts(spec_decoding_stats) if self.dsbd_enabled else None
        if counts is None:
            return
        layers, width_sum, draft_layers = counts
        self.counter_beam_layers[engine_idx].inc(layers)
        self.counter_beam_width_sum[engine_idx].inc(width_sum)
        self.counter_draft_layers[engine_idx].inc(draft_layers)
        totals = self._totals[engine_idx]
        totals[0] += spec_decoding_stats.num_drafts
        totals[1] += layers
        totals[2] += width_sum
        totals[3] += draft_layers
        if totals[1]:
            self.gauge_mean_beam_width[engine_idx].set(totals[2] / totals[1])
        if totals[0]:
            self.gauge_tokens_per_target_forward[engine_idx].set(totals[1] / totals[0])
            self.gauge_mean_draft_depth[engine_idx].set(totals[3] / totals[0])
