"""DSBD's extra metrics: what the scheduler packs survives the trip to the front end and lands in Prometheus."""

import functools
from types import SimpleNamespace

import prometheus_client
import pytest
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_dsbd.engine import metrics


def _prom(method: str, registry):
    """A DSBDSpecDecodingProm registering into ``registry`` (not vLLM's process-global one)."""

    class Prom(metrics.DSBDSpecDecodingProm):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)
        _gauge_cls = functools.partial(prometheus_client.Gauge, registry=registry)

    config = SimpleNamespace(method=method, num_speculative_tokens=3)
    return Prom(config, ["model_name", "engine"], {0: ["m", "0"]})


def _value(registry, name: str) -> float:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0"})


def _step(iterations: list[list[int]]) -> SpecDecodingStats:
    """One stats record; an iteration's depth is taken as its layers minus one (all passed)."""
    stats = metrics.new_stats(3)
    for widths in iterations:
        stats.num_drafts += 1
        metrics.observe_layers(stats, widths, len(widths) - 1)
    return stats


def test_dsbd_counts_survive_the_engine_core_to_front_end_serialization():
    stats = _step([[4, 2, 3], [4]])
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=SchedulerStats(spec_decoding_stats=stats)))
    received = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats.spec_decoding_stats
    assert metrics.extra_counts(received) == (4, 13, 2)
    assert received.num_draft_tokens_per_pos[:3] == [0, 0, 0]  # vLLM's per-position entries untouched


def test_mean_beam_width_and_tokens_per_target_forward():
    registry = prometheus_client.CollectorRegistry()
    prom = _prom("dsbd", registry)
    prom.observe(_step([[4, 2, 3], [4]]))  # 2 forwards, 4 layers, widths 13
    prom.observe(_step([[1, 1, 1, 1]]))  # 1 forward, 4 layers, widths 4
    assert _value(registry, "vllm:spec_decode_num_drafts_total") == 3
    assert _value(registry, "vllm:dsbd_beam_layers_total") == 8
    assert _value(registry, "vllm:dsbd_beam_width_sum_total") == 17
    assert _value(registry, "vllm:dsbd_mean_beam_width") == pytest.approx(17 / 8)
    assert _value(registry, "vllm:dsbd_tokens_per_target_forward") == pytest.approx(8 / 3)
    assert _value(registry, "vllm:dsbd_draft_layers_total") == 5  # depths 2 + 0 + 3
    assert _value(registry, "vllm:dsbd_mean_draft_depth") == pytest.approx(5 / 3)


def test_stats_without_dsbd_counts_and_other_methods_keep_vllm_behaviour():
    registry = prometheus_client.CollectorRegistry()
    prom = _prom("dsbd", registry)
    plain = SpecDecodingStats.new(3)
    plain.observe_draft(3, 2)
    prom.observe(plain)
    assert _value(registry, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert _value(registry, "vllm:dsbd_beam_layers_total") == 0

    other = prometheus_client.CollectorRegistry()
    _prom("draft_model", other).observe(plain)
    assert _value(other, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert _value(other, "vllm:dsbd_beam_layers_total") is None  # not registered
