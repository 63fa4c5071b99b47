"""DSBDConfig: every DSBD knob, validated once, with errors that say what to fix.

Knob names follow docs/algorithm.md and docs/knobs.md everywhere (config, CLI,
API, metrics). Engine-wide values come from the speculative config::

    speculative_config={"method": "dsbd", "model": DRAFT,
                        "num_speculative_tokens": 4, "beam_width": 8,
                        "width_threshold": 0.7}

and a request may override them through ``SamplingParams.extra_args`` (the
OpenAI API's ``vllm_xargs``). The engine-wide ``beam_width`` and
``num_speculative_tokens`` are maxima: the engine reserves KV slots and
batch rows for them, so a request may ask for less, never more.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The speculative method name of a DSBD engine (``speculative_config={"method": "dsbd", ...}``).
METHOD = "dsbd"

#: Where a DSBD engine keeps its DSBDConfig in ``VllmConfig.additional_config``
#: (a plain dict: it travels pickled to the engine core and every worker).
ADDITIONAL_CONFIG_KEY = "dsbd"

#: ``extra_args`` keys starting with this are the plugin's own bookkeeping
#: (added by the front-end), never user knobs.
PRIVATE_PREFIX = "_dsbd"

#: ``extra_args`` keys that vLLM itself reads (``vllm/v1/request.py``); they
#: may sit beside DSBD knobs and are ignored here.
VLLM_RESERVED_EXTRA_ARGS = frozenset({"kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"})


#: The decoders a speculative request may use (DSBDConfig.decoder).
DECODERS = ("dsbd", "mjsd")

#: Knobs that shape the engine itself (its models), not one request's decoding.
ENGINE_ONLY_KNOBS = frozenset({"draft_vocab_size", "draft_dtype"})

#: The file in a local draft's folder that recommends DSBD knobs for that draft (engine-wide defaults, which
#: --speculative-config overrides; ``draft_defaults``), and the knobs it may set: properties of the draft.
DRAFT_DEFAULTS_FILE = "dsbd.json"
DRAFT_DEFAULT_KNOBS = ("draft_temperature_scale",)

#: What the ``draft_dtype`` knob takes: "auto" (the target's dtype) or a dtype vLLM's CPU and GPU
#: platforms run a model in.
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")

MAX_DRAFT_LAYERS = 999
"""The deepest draft: layer i draws from a random stream of its own, below the verification's
(``engine.streams`` derives its salts from this)."""


@dataclass(frozen=True)
class DSBDConfig:
    beam_width: int = 4
    """W: the maximum number of beams of a request."""
    num_speculative_tokens: int = 4
    """γ: draft depth per iteration (0 = in-engine beam decoding, no draft)."""
    min_width: int = 1
    """Lower bound of the dynamic width."""
    width_threshold: float = 0.7
    """τ: keep w_i = max{k : P(K >= k) >= τ} beams per layer; 1.0 = fixed width."""
    fixed_width: bool = False
    """Always keep W beams (same as width_threshold = 1.0)."""
    memory_efficient: bool = False
    """Carry one beam between iterations (W_out = 1)."""
    length_penalty: float = 1.0
    """Hypotheses are ranked by cum_logprob / len ** length_penalty (vLLM's beam-search score)."""
    auto_depth: bool = False
    """Choose γ in 0..num_speculative_tokens before each iteration from the engine's measured step
    costs and the request's observed acceptance (``algorithm.depth``); False: always γ."""
    decoder: str = "dsbd"
    """What a speculative request decodes with: "dsbd" (beam decoding) or "mjsd" (one sequence by
    multi-token joint speculative decoding, ``algorithm.mjsd``: ``beam_width`` draft beams K,
    ``num_speculative_tokens`` γ, ``mjsd_tau`` τ). On an engine whose decoder is "mjsd", plain
    requests with n = 1 are MJSD requests too."""
    mjsd_tau: float = 0.5
    """MJSD's τ: the longest draft prefix with log P - log Q >= log τ is accepted (0: every draft path)."""
    draft_vocab_size: int = 0
    """Engine-wide only: the draft computes logits for the N lowest token ids plus the special tokens
    (``engine.draft_head``); 0 = the whole vocabulary. Cheaper drafts, still exact (q = 0 elsewhere)."""
    draft_dtype: str = "auto"
    """Engine-wide only: the dtype the draft model computes in (weights, activations, its KV cache);
    "auto" = the target's ``--dtype``. Any dtype keeps DSBD exact: q is whatever the draft samples from."""

    draft_in_step: bool | None = None
    """With an EAGLE-3 head as the draft: a DSBD iteration's forest (an MJSD iteration's draft beams) is
    drafted inside the verify step before it (``engine.forest_draft``) instead of in draft steps of its own,
    after the first iteration of a request (with auto_depth, also inside a beam step; memory-efficient
    requests from the one beam the verification kept). None (unset): on where it runs, an EAGLE-3 head on a
    CPU engine, else off (chosen at engine start by ``engine.patches.engine_config.prepare_eagle3_head``, and
    stored chosen). True where it cannot run is refused at engine start. Set for the engine (it sets the head
    up for it); a request may turn it off."""

    draft_temperature_scale: float = 1.0
    """At T > 0 the draft samples each layer at temperature T * this (below 1: sharper than the target).
    Exact for any value: the target verifies against the distribution the draft drew from. At T 0 the draft
    ranks its candidates by beam score + its log-probs at temperature this (lossless for any value: the target
    decides every layer). A head that is less confident than the target accepts more sharpened (docs/dsbd.md).
    Not for MJSD: an MJSD request draws at T whatever the engine's value (1 only, if it sets the knob). A
    draft's ``dsbd.json`` may recommend it (``draft_defaults``)."""

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, low=1)
        # each draft layer has a random stream of its own below the verification's (engine/streams.py)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, low=0, high=MAX_DRAFT_LAYERS)
        _check_int("min_width", self.min_width, low=1)
        if self.min_width > self.beam_width:
            raise ValueError(
                f"DSBD knob 'min_width'={self.min_width} is larger than "
                f"'beam_width'={self.beam_width}; allowed: 1 <= min_width <= beam_width."
            )
        _check_float("width_threshold", self.width_threshold, low=0.0, high=1.0, low_open=True)
        _check_bool("fixed_width", self.fixed_width)
        _check_bool("memory_efficient", self.memory_efficient)
        _check_bool("auto_depth", self.auto_depth)
        if self.draft_in_step is not None:  # None: the engine chooses at start
            _check_bool("draft_in_step", self.draft_in_step)
        _check_int("draft_vocab_size", self.draft_vocab_size, low=0)
        if self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"DSBD knob 'draft_dtype'={self.draft_dtype!r} is invalid; allowed: "
                             f"{', '.join(map(repr, DRAFT_DTYPES))} (\"auto\": the target's dtype).")
        if self.decoder not in DECODERS:
            raise ValueError(f"DSBD knob 'decoder'={self.decoder!r} is invalid; allowed: "
                             f"{' or '.join(map(repr, DECODERS))}.")
        _check_float("mjsd_tau", self.mjsd_tau, low=0.0, high=math.inf, low_open=False)
        _check_float("draft_temperature_scale", self.draft_temperature_scale, low=0.0, high=math.inf,
                     low_open=True)
        if self.mjsd:
            if self.num_speculative_tokens == 0:
                raise ValueError("DSBD knob 'decoder'='mjsd' needs draft steps: 'num_speculative_tokens' (γ) "
                                 "is 0; allowed: γ >= 1 (an engine with a draft model).")
            if self.auto_depth:
                raise ValueError("DSBD knob 'decoder'='mjsd' does not choose its depth: 'auto_depth'=True is "
                                 "not supported with it; allowed: auto_depth false (γ = num_speculative_tokens).")
            if self.memory_efficient:
                raise ValueError("DSBD knob 'decoder'='mjsd' carries one sequence already: "
                                 "'memory_efficient'=True is not supported with it; allowed: false.")
            if self.draft_temperature_scale != 1.0:
                raise ValueError(f"DSBD knob 'decoder'='mjsd' compares the draft's likelihood with the target's: "
                                 f"'draft_temperature_scale'={self.draft_temperature_scale} is not supported "
                                 f"with it; allowed: 1.0.")
        _check_float("length_penalty", self.length_penalty, low=0.0, high=math.inf, low_open=False)

    @property
    def mjsd(self) -> bool:
        return self.decoder == "mjsd"

    @property
    def uses_fixed_width(self) -> bool:
        return self.fixed_width or self.width_threshold >= 1.0

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> DSBDConfig | None:
        """The engine's config, stored by the plugin in ``additional_config``; None if not a DSBD engine."""
        stored = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
        return None if stored is None else cls(**stored)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, where: str) -> DSBDConfig:
        """Build from a dict of knobs; unknown keys are an error naming ``where``."""
        return cls(**_known(values, where))

    def for_request(self, extra_args: Mapping[str, Any] | None) -> DSBDConfig:
        """This config with a request's ``extra_args`` overrides applied.

        The engine-wide ``beam_width`` and ``num_speculative_tokens`` are upper
        bounds for a request.
        """
        overrides = {k: v for k, v in (extra_args or {}).items()
                     if k not in VLLM_RESERVED_EXTRA_ARGS and not k.startswith(PRIVATE_PREFIX)}
        if not overrides:
            return self
        engine_only = sorted(set(overrides) & ENGINE_ONLY_KNOBS)
        if engine_only:
            raise ValueError(f"DSBD knob(s) {engine_only} are engine-wide: set them in --speculative-config "
                             f"(speculative_config=...), not per request.")
        overrides = {k: _request_bool(v) if k in BOOL_KNOBS else v for k, v in overrides.items()}
        if "draft_in_step" in overrides:  # a request says which; unset (None) is the engine's choice alone
            _check_bool("draft_in_step", overrides["draft_in_step"])
        if overrides.get("decoder", self.decoder) == "mjsd" and "draft_temperature_scale" not in overrides:
            # the engine's draft temperature scale is for its DSBD requests; MJSD draws at T itself
            overrides["draft_temperature_scale"] = 1.0
        merged = dataclasses.replace(self, **_known(overrides, "the request's extra_args (vllm_xargs)"))
        if merged.draft_in_step and not self.draft_in_step:
            raise ValueError("Request asks for DSBD knob 'draft_in_step'=true, but this engine drafts in draft "
                             "steps (its draft is not an EAGLE-3 head on a CPU engine, or it was started with "
                             "draft_in_step false in --speculative-config). Allowed per request: false.")
        for knob in ("beam_width", "num_speculative_tokens"):
            if getattr(merged, knob) > getattr(self, knob):
                raise ValueError(
                    f"Request asks for DSBD knob '{knob}'={getattr(merged, knob)}, above the "
                    f"engine's maximum {getattr(self, knob)} (set in --speculative-config); "
                    f"allowed: {1 if knob == 'beam_width' else 0}..{getattr(self, knob)}."
                )
        return merged


def draft_defaults(draft: str | None) -> dict[str, Any]:
    """The DSBD knobs a local draft folder recommends for itself: its ``dsbd.json`` (``DRAFT_DEFAULTS_FILE``),
    a JSON object of ``DRAFT_DEFAULT_KNOBS`` (keys starting with "_" are notes, ignored), checked as
    DSBDConfig checks them; {} for a draft without one (or a hub id). A bad file is an error naming it."""
    path = Path(draft) / DRAFT_DEFAULTS_FILE if draft else None
    if path is None or not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} (the DSBD knobs the draft recommends) is not readable JSON: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(f"{path} (the DSBD knobs the draft recommends) must be a JSON object, not "
                         f"{type(values).__name__}.")
    knobs = {k: v for k, v in values.items() if not str(k).startswith("_")}
    unknown = sorted(set(knobs) - set(DRAFT_DEFAULT_KNOBS))
    if unknown:
        raise ValueError(f"{path} recommends {unknown}; a draft may recommend only {list(DRAFT_DEFAULT_KNOBS)} "
                         f"(keys starting with '_' are notes).")
    try:
        DSBDConfig(**knobs)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return knobs


BOOL_KNOBS = ("fixed_width", "memory_efficient", "auto_depth", "draft_in_step")


def _request_bool(value: Any) -> Any:
    """A boolean knob of a request as a bool where it plainly is one: vLLM's server types ``vllm_xargs``
    values ``str | int | float | list``, so a JSON ``true`` arrives as ``1``; ``"true"`` / ``"false"`` too.
    Anything else is returned as is, for the config's check to refuse by name."""
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _known(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(values) - set(DSBDConfig.knob_names()))
    if unknown:
        raise ValueError(
            f"Unknown DSBD knob(s) {unknown} in {where}; allowed: {', '.join(DSBDConfig.knob_names())}."
        )
    return dict(values)


def _check_int(name: str, value: Any, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
        raise ValueError(f"DSBD knob '{name}'={value!r} is invalid; allowed: {allowed}.")


def _check_float(name: str, value: Any, *, low: float, high: float, low_open: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"DSBD knob '{name}'={value!r} is invalid; allowed: a number in {bracket}{low}, {high}].")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"DSBD knob '{name}'={value!r} is invalid; allowed: true or false.")
