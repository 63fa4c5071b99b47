"""Beam requests: which requests are beam-decoded, and clear errors for what is not supported."""

from __future__ import annotations

import pytest

import vllm_dsbd
from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine import requests as beam_requests

ENGINE = DSBDConfig(beam_width=8, num_speculative_tokens=0)


@pytest.fixture(scope="module", autouse=True)
def registered():
    vllm_dsbd.register()  # patch 7: greedy n > 1 for beam requests


def sp(**kw):
    from vllm.sampling_params import SamplingParams

    return SamplingParams(**kw)


def test_a_dsbd_knob_in_extra_args_makes_a_beam_request():
    assert beam_requests.is_beam_request(sp(extra_args={"beam_width": 2}))
    assert beam_requests.is_beam_request(sp(extra_args={"length_penalty": 0.5}))
    assert not beam_requests.is_beam_request(sp())
    assert not beam_requests.is_beam_request(sp(extra_args={"kv_transfer_params": None}))


def test_request_knobs_override_engine_values_within_its_maxima():
    config = beam_requests.validate(sp(n=2, extra_args={"beam_width": 3, "length_penalty": 0.0}), ENGINE)
    assert (config.beam_width, config.length_penalty, config.num_speculative_tokens) == (3, 0.0, 0)


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(extra_args={"beam_width": 0}), r"'beam_width'=0 is invalid; allowed: an integer >= 1"),
        (dict(extra_args={"beam_width": 16}), r"'beam_width'=16, above the engine's maximum 8"),
        (dict(n=5, temperature=1.0, extra_args={"beam_width": 4}), r"n=5 is larger than .*'beam_width'=4"),
        (dict(extra_args={"beam_width": 2, "beam_widht": 2}), r"Unknown key\(s\) \['beam_widht'\]"),
        (dict(extra_args={"beam_width": 2, "length_penalty": -0.5}), r"'length_penalty'=-0.5 is invalid"),
        (dict(extra_args={"beam_width": 2, "num_speculative_tokens": 2}), r"above the engine's maximum 0"),
        (dict(presence_penalty=0.5, extra_args={"beam_width": 2}), r"presence_penalty=0.5.*allowed: 0.0"),
        (dict(repetition_penalty=1.2, extra_args={"beam_width": 2}), r"repetition_penalty=1.2"),
        (dict(stop=["\n"], extra_args={"beam_width": 2}), r"SamplingParams.stop=\['\\n'\]"),
        (dict(min_tokens=3, extra_args={"beam_width": 2}), r"min_tokens=3"),
        (dict(prompt_logprobs=1, extra_args={"beam_width": 2}), r"prompt_logprobs=1"),
    ],
)
def test_bad_beam_request_names_parameter_value_and_allowed(params, message):
    with pytest.raises(ValueError, match=message):
        beam_requests.validate(sp(**params), ENGINE)


def test_fanned_out_children_share_their_group():
    tag = {beam_requests.GROUP_TAG: {"n": 3, "eos": 2}}
    assert beam_requests.group_of("2_abc-123", tag) == ("abc-123", 2, 3)
    assert beam_requests.group_of("abc-123", {beam_requests.GROUP_TAG: {"n": 1}}) == ("abc-123", 0, 1)
    with pytest.raises(ValueError, match="fanned-out child"):
        beam_requests.group_of("abc", tag)


def test_engine_side_params_cap_max_tokens_by_max_model_len():
    params = sp(max_tokens=100, seed=5, logprobs=0, temperature=0.7, top_k=3,
                extra_args={"beam_width": 2, beam_requests.GROUP_TAG: {"n": 2, "eos": 2}})
    config, beam = beam_requests.beam_params(params, ENGINE, prompt_len=30, max_model_len=64, default_seed=9)
    assert (beam.max_tokens, beam.n, beam.seed, beam.num_logprobs, beam.eos_token_id) == (34, 2, 5, 0, 2)
    assert (beam.temperature, beam.top_k, beam.beam_width) == (0.7, 3, 2)
    _, unseeded = beam_requests.beam_params(sp(extra_args={"beam_width": 2}), ENGINE, prompt_len=3,
                                            max_model_len=64, default_seed=9)
    assert unseeded.seed == 9 and unseeded.num_logprobs == -1
