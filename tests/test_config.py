"""DSBDConfig: validation with knob-naming errors, per-request overrides."""

from __future__ import annotations

import pytest

from vllm_dsbd.config import DRAFT_DEFAULTS_FILE, DSBDConfig, draft_defaults


def test_defaults_follow_algorithm_md():
    c = DSBDConfig()
    assert (c.beam_width, c.num_speculative_tokens, c.min_width, c.width_threshold) == (4, 4, 1, 0.7)
    assert not c.memory_efficient and not c.uses_fixed_width


@pytest.mark.parametrize(
    "knobs, knob",
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2.5}, "beam_width"),
        ({"beam_width": True}, "beam_width"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"min_width": 0}, "min_width"),
        ({"min_width": 5, "beam_width": 4}, "min_width"),
        ({"width_threshold": 0.0}, "width_threshold"),
        ({"width_threshold": 1.5}, "width_threshold"),
        ({"width_threshold": float("nan")}, "width_threshold"),
        ({"memory_efficient": "yes"}, "memory_efficient"),
        ({"fixed_width": 1}, "fixed_width"),
        ({"draft_vocab_size": -1}, "draft_vocab_size"),
        ({"draft_vocab_size": 1.5}, "draft_vocab_size"),
        ({"draft_dtype": "int8"}, "draft_dtype"),
        ({"draft_dtype": None}, "draft_dtype"),
        ({"draft_dtype": "BF16"}, "draft_dtype"),
        ({"draft_in_step": "yes"}, "draft_in_step"),
        ({"decoder": "beam"}, "decoder"),
        ({"decoder": None}, "decoder"),
        ({"mjsd_tau": -0.1}, "mjsd_tau"),
        ({"mjsd_tau": float("inf")}, "mjsd_tau"),
        ({"mjsd_tau": "0.5"}, "mjsd_tau"),
        ({"draft_temperature_scale": 0.0}, "draft_temperature_scale"),
        ({"draft_temperature_scale": -1.0}, "draft_temperature_scale"),
        ({"draft_temperature_scale": float("inf")}, "draft_temperature_scale"),
        ({"draft_temperature_scale": "0.8"}, "draft_temperature_scale"),
    ],
)
def test_bad_knob_error_names_knob_value_and_range(knobs, knob):
    with pytest.raises(ValueError, match=rf"'{knob}'=.*allowed"):
        DSBDConfig(**knobs)


def test_fixed_width_by_flag_or_threshold_one():
    assert DSBDConfig(fixed_width=True).uses_fixed_width
    assert DSBDConfig(width_threshold=1.0).uses_fixed_width


def test_unknown_knob_is_named():
    with pytest.raises(ValueError, match=r"Unknown DSBD knob\(s\) \['beam_widht'\] in here"):
        DSBDConfig.from_mapping({"beam_widht": 3}, where="here")


def test_request_overrides_apply_and_keep_engine_maxima():
    engine = DSBDConfig(beam_width=8, num_speculative_tokens=4)
    req = engine.for_request({"beam_width": 2, "width_threshold": 0.5, "kv_transfer_params": None})
    assert (req.beam_width, req.width_threshold, req.num_speculative_tokens) == (2, 0.5, 4)
    assert engine.for_request(None) is engine
    with pytest.raises(ValueError, match=r"'beam_width'=16, above the engine's maximum 8"):
        engine.for_request({"beam_width": 16})
    with pytest.raises(ValueError, match=r"'num_speculative_tokens'=5, above the engine's maximum 4"):
        engine.for_request({"num_speculative_tokens": 5})
    with pytest.raises(ValueError, match=r"Unknown DSBD knob.*'gamma'"):
        engine.for_request({"gamma": 3})
    with pytest.raises(ValueError, match=r"'beam_width'=0"):
        engine.for_request({"beam_width": 0})


@pytest.mark.parametrize("sent, taken", [(True, True), (1, True), (0, False), ("true", True), ("False", False)])
def test_boolean_request_knobs_take_what_the_server_passes_for_json_booleans(sent, taken):
    """vLLM's server types vllm_xargs values str | int | float | list: JSON true arrives as 1 (the fuzz run
    found fixed_width, memory_efficient and auto_depth refused over HTTP)."""
    req = DSBDConfig(beam_width=8).for_request({"fixed_width": sent, "auto_depth": sent})
    assert req.fixed_width is taken and req.auto_depth is taken


@pytest.mark.parametrize("sent", [2, 0.5, "yes", [1]])
def test_other_values_of_boolean_request_knobs_are_refused_by_name(sent):
    with pytest.raises(ValueError, match=r"DSBD knob 'memory_efficient'=.* allowed: true or false"):
        DSBDConfig(beam_width=8).for_request({"memory_efficient": sent})


def test_engine_wide_knobs_are_refused_per_request():
    """draft_vocab_size shapes the engine's draft head: a request cannot change it, not even to its value."""
    engine = DSBDConfig(num_speculative_tokens=2, draft_vocab_size=1000)
    with pytest.raises(ValueError, match=r"\['draft_vocab_size'\] are engine-wide: set them in --speculative-config"):
        engine.for_request({"draft_vocab_size": 1000})
    with pytest.raises(ValueError, match=r"\['draft_dtype'\] are engine-wide"):
        engine.for_request({"draft_dtype": "bfloat16"})


def test_a_request_may_turn_draft_in_step_off_but_not_on():
    """draft_in_step sets the engine's head up; a request of such an engine may draft in draft steps instead."""
    engine = DSBDConfig(num_speculative_tokens=2, draft_in_step=True)
    assert engine.for_request({"draft_in_step": False}).draft_in_step is False
    assert engine.for_request({"draft_in_step": 0}).draft_in_step is False  # vllm_xargs' JSON false
    assert engine.for_request({"draft_in_step": True}).draft_in_step is True
    with pytest.raises(ValueError, match=r"'draft_in_step'=None is invalid; allowed: true or false"):
        engine.for_request({"draft_in_step": None})
    with pytest.raises(ValueError, match=r"'draft_in_step'=true, but this engine drafts in draft steps \(its draft "
                                         r"is not an EAGLE-3 head .* Allowed per request: false"):
        DSBDConfig(num_speculative_tokens=2, draft_in_step=False).for_request({"draft_in_step": True})


@pytest.mark.parametrize("knobs, knob", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"auto_depth": True}, "auto_depth"),
    ({"memory_efficient": True}, "memory_efficient"),
    ({"draft_temperature_scale": 0.8}, "draft_temperature_scale"),
])
def test_mjsd_refuses_knobs_it_cannot_honour(knobs, knob):
    with pytest.raises(ValueError, match=rf"'decoder'='mjsd'.*'{knob}'.*allowed"):
        DSBDConfig(decoder="mjsd", **knobs)


def test_a_request_may_choose_mjsd_and_its_tau():
    engine = DSBDConfig(beam_width=8, num_speculative_tokens=4)
    req = engine.for_request({"decoder": "mjsd", "mjsd_tau": 0.3, "beam_width": 6})
    assert (req.mjsd, req.mjsd_tau, req.beam_width, req.num_speculative_tokens) == (True, 0.3, 6, 4)
    assert not engine.mjsd and engine.decoder == "dsbd"
    assert not DSBDConfig(decoder="mjsd").for_request({"decoder": "dsbd"}).mjsd


def test_an_mjsd_request_draws_at_its_own_temperature_on_an_engine_with_a_draft_temperature_scale():
    """The engine's scale (set by the user or recommended by the draft) is for its DSBD requests: an MJSD
    request gets 1 unless it sets the knob itself, which MJSD refuses by name."""
    engine = DSBDConfig(draft_temperature_scale=0.75)
    assert engine.for_request({"beam_width": 2}).draft_temperature_scale == 0.75
    assert engine.for_request({"decoder": "mjsd"}).draft_temperature_scale == 1.0
    assert engine.for_request({"decoder": "mjsd", "draft_temperature_scale": 1.0}).mjsd
    with pytest.raises(ValueError, match=r"'decoder'='mjsd'.*'draft_temperature_scale'=0.5.*allowed: 1.0"):
        engine.for_request({"decoder": "mjsd", "draft_temperature_scale": 0.5})


def _draft_with(tmp_path, text):
    (tmp_path / DRAFT_DEFAULTS_FILE).write_text(text)
    return str(tmp_path)


def test_a_draft_folder_recommends_its_draft_temperature_scale(tmp_path):
    assert draft_defaults(None) == {} and draft_defaults(str(tmp_path)) == {}  # no file: nothing recommended
    assert draft_defaults("HuggingFaceTB/not-a-local-folder") == {}
    draft = _draft_with(tmp_path, '{"draft_temperature_scale": 0.75, "_measured": "a note, ignored"}')
    assert draft_defaults(draft) == {"draft_temperature_scale": 0.75}


@pytest.mark.parametrize("text, match", [
    ('{"beam_width": 8}', r"recommends \['beam_width'\]; a draft may recommend only \['draft_temperature_scale'\]"),
    ('{"draft_temperature_scale": 0}', r"'draft_temperature_scale'=0 is invalid; allowed"),
    ('[0.75]', r"must be a JSON object, not list"),
    ('{"draft_temperature_scale": 0.75', r"is not readable JSON"),
])
def test_a_bad_recommendation_file_is_refused_naming_it(tmp_path, text, match):
    with pytest.raises(ValueError, match=rf"{DRAFT_DEFAULTS_FILE}.*{match}"):
        draft_defaults(_draft_with(tmp_path, text))
