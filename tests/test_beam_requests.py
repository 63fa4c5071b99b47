"""Beam requests: which requests are beam-decoded, and clear errors for what is not supported."""

from __future__ import annotations

from types import SimpleNamespace

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


def test_stop_strings_and_stop_tokens_are_beam_request_parameters():
    params = sp(n=2, stop=["\n\n"], stop_token_ids=[7], include_stop_str_in_output=True,
                extra_args={"beam_width": 2, beam_requests.GROUP_TAG: {"n": 2, "eos": 2}})
    beam_requests.validate(params, ENGINE)  # no error
    _, beam = beam_requests.beam_params(params, ENGINE, prompt_len=3, max_model_len=64, default_seed=0)
    assert (beam.stop, beam.stop_token_ids) == (("\n\n",), (7,))


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
        (dict(bad_words=["no"], extra_args={"beam_width": 2}), r"SamplingParams.bad_words=\['no'\]"),
        (dict(min_tokens=3, extra_args={"beam_width": 2}), r"min_tokens=3"),
        (dict(prompt_logprobs=1, extra_args={"beam_width": 2}), r"prompt_logprobs=1"),
    ],
)
def test_bad_beam_request_names_parameter_value_and_allowed(params, message):
    with pytest.raises(ValueError, match=message):
        beam_requests.validate(sp(**params), ENGINE)


@pytest.mark.parametrize(
    "key, knob",
    [("beam_widht", "beam_width"), ("Beam_Width", "beam_width"), ("beamwidth", "beam_width"),
     ("BEAM-WIDTH", "beam_width"), ("num_speculative_token", "num_speculative_tokens"), ("auto-depth", "auto_depth"),
     ("fixedwidth", "fixed_width"), ("lenght_penalty", "length_penalty")],
)
def test_a_near_miss_of_a_knob_is_refused_naming_the_knob_even_on_a_plain_request(key, knob):
    message = rf"Unknown key\(s\) \['{key}'\].*resembles DSBD knob '{knob}'"
    with pytest.raises(beam_requests.BeamRequestError, match=message):
        beam_requests.check_knob_typos({key: 4})
    with pytest.raises(ValueError, match=message):  # a beam request with the typo beside a real knob
        beam_requests.validate(sp(extra_args={"beam_width": 2, key: 4}), ENGINE)


@pytest.mark.parametrize("key", ["kv_transfer_params", "kv_cache_report_mode", "my_plugin_option", "lora_name",
                                 "top_k", "gamma", "width", "temperature", "_dsbd_group"])
def test_keys_other_code_owns_pass_the_typo_check(key):
    beam_requests.check_knob_typos({key: 1})


@pytest.mark.parametrize("width, gamma, max_num_seqs, fits", [
    (128, 0, 128, True), (129, 0, 128, False),  # every beam is a sequence
    (64, 1, 256, True), (128, 1, 256, False),  # speculating: W beams + W draft nodes + W (γ + 1) paths
    (128, 2, 640, True), (128, 2, 639, False),
])
def test_a_group_that_could_never_run_is_refused_naming_what_would_fit(width, gamma, max_num_seqs, fits):
    config = DSBDConfig(beam_width=width, num_speculative_tokens=gamma)
    if fits:
        beam_requests.check_capacity(config, max_num_seqs)
        return
    with pytest.raises(beam_requests.BeamRequestError, match=rf"'beam_width'={width}.*max_num_seqs={max_num_seqs}"):
        beam_requests.check_capacity(config, max_num_seqs)
    if gamma:
        with pytest.raises(ValueError, match=rf"needs up to {width * (gamma + 3)} sequences.*num_speculative_tokens 0"):
            beam_requests.check_capacity(config, max_num_seqs)


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
    assert unseeded.seed == 9 and unseeded.num_logprobs == -1 and unseeded.draft_temperature_scale == 1.0


def test_the_drafts_temperature_scale_reaches_every_step_of_the_group():
    """``draft_temperature_scale``, engine-wide or per request, is in the group's params and in what its steps
    tell the runner (``GroupDecoding``), where ``spec_step.draft_layer`` tempers the draft by it."""
    from vllm_dsbd.engine.beam_group import BeamGroup

    engine = DSBDConfig(beam_width=4, num_speculative_tokens=2, draft_temperature_scale=0.8)
    _, wide = beam_requests.beam_params(sp(temperature=1.0, extra_args={"beam_width": 2}), engine, prompt_len=3,
                                        max_model_len=64, default_seed=1)
    _, own = beam_requests.beam_params(sp(temperature=1.0, extra_args={"draft_temperature_scale": 0.6}), engine,
                                       prompt_len=3, max_model_len=64, default_seed=1)
    assert (wide.draft_temperature_scale, own.draft_temperature_scale) == (0.8, 0.6)
    group = BeamGroup("g", ["u"], 3, own, SimpleNamespace(request_id="r0"))
    assert group.decoding()["draft_temperature_scale"] == 0.6


def test_a_plain_request_on_an_mjsd_engine_becomes_an_mjsd_request_without_touching_the_users_params():
    engine = DSBDConfig(beam_width=4, num_speculative_tokens=3, decoder="mjsd")
    user = sp(temperature=0.7, max_tokens=9, extra_args={"kv_transfer_params": None})
    converted = beam_requests.as_mjsd_request(user)
    assert user.extra_args == {"kv_transfer_params": None}
    assert converted.extra_args == {"kv_transfer_params": None, "decoder": "mjsd"}
    assert (converted.temperature, converted.max_tokens) == (0.7, 9)
    assert beam_requests.is_beam_request(converted) and beam_requests.validate(converted, engine).mjsd
    with pytest.raises(beam_requests.BeamRequestError, match=r"n=2 on an MJSD engine.*allowed: n = 1"):
        beam_requests.as_mjsd_request(sp(n=2, temperature=1.0))


def test_mjsd_requests_get_their_tau_and_one_output():
    engine = DSBDConfig(beam_width=8, num_speculative_tokens=3)
    config, params = beam_requests.beam_params(sp(temperature=1.0, max_tokens=5, extra_args={
        "decoder": "mjsd", "mjsd_tau": 0.25, "beam_width": 6}), engine, prompt_len=3, max_model_len=64,
        default_seed=1)
    assert (params.mjsd_tau, params.beam_width, params.num_speculative_tokens, params.n) == (0.25, 6, 3, 1)
    _, plain = beam_requests.beam_params(sp(extra_args={"beam_width": 2}), engine, prompt_len=3, max_model_len=64,
                                         default_seed=1)
    assert plain.mjsd_tau is None
    with pytest.raises(beam_requests.BeamRequestError, match=r"n=3 with DSBD knob 'decoder'='mjsd'"):
        beam_requests.validate(sp(n=3, temperature=1.0, extra_args={"decoder": "mjsd"}), engine)
