"""Which requests a DSBD engine beam-decodes, and their validated parameters.

A request is a *beam request* when its ``SamplingParams.extra_args`` (the
OpenAI API's ``vllm_xargs``) name at least one DSBD knob, e.g.
``{"beam_width": 4}``; the knobs it does not name take the engine's values.
Everything else is a plain request, decoded by vLLM as usual.

The front-end validates a beam request before it is queued
(:func:`validate`: a clear ``ValueError`` naming the parameter, the value
and what is allowed) and tags it with :data:`GROUP_TAG`: how many outputs
(``n``) the group has and the tokenizer's EOS id. vLLM's front-end fans a
request with ``n > 1`` out into ``n`` engine requests ``"{k}_{id}"``; the
scheduler gathers them into one beam group and gives hypothesis ``k`` (best
first) to request ``k``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.exceptions import VLLMValidationError

from vllm_dsbd.config import PRIVATE_PREFIX, VLLM_RESERVED_EXTRA_ARGS, DSBDConfig
from vllm_dsbd.engine.beam_group import BeamParams, request_slots

#: Private ``extra_args`` key added by the front-end: ``{"n": n, "eos": eos_token_id}``.
GROUP_TAG = f"{PRIVATE_PREFIX}_group"

# SamplingParams fields beam decoding does not implement, with the value that means "unused".
_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("min_p", 0.0),
    ("min_tokens", 0),
    ("bad_words", []),
    ("logit_bias", None),
    ("allowed_token_ids", None),
    ("structured_outputs", None),
    ("prompt_logprobs", None),
    ("prompt_logprob_token_ids", None),
    ("logprob_token_ids", None),
    ("thinking_token_budget", None),
    ("repetition_detection", None),
)


class BeamRequestError(VLLMValidationError, ValueError):
    """A beam request vllm-dsbd cannot serve: the client's fault (HTTP 400), a ValueError offline."""


def requested_knobs(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The DSBD knobs a request names (other keys are vLLM's or private)."""
    names = DSBDConfig.knob_names()
    return {k: v for k, v in (extra_args or {}).items() if k in names}


def is_beam_request(params: Any) -> bool:
    extra = getattr(params, "extra_args", None) or {}
    return GROUP_TAG in extra or bool(requested_knobs(extra))


def _unknown_keys(extra_args: Mapping[str, Any]) -> list[str]:
    names = set(DSBDConfig.knob_names())
    return sorted(k for k in extra_args
                  if k not in names and k not in VLLM_RESERVED_EXTRA_ARGS and not k.startswith(PRIVATE_PREFIX))


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance with adjacent transpositions (``widht`` -> ``width`` is 1)."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, prev2[j - 2] + 1)
            row.append(cost)
        prev2, prev = prev, row
    return prev[-1]


def resembled_knob(key: str) -> str | None:
    """The DSBD knob ``key`` is probably a typo of (a different case, or at most 2 edits away), or None.

    Keys shorter than 5 characters are never taken for typos: a short key
    other code owns is more likely than a knob name mangled that far.
    """
    names = DSBDConfig.knob_names()
    if key in names or len(key) < 5:
        return None
    folded = key.lower().replace("-", "_")
    best = min(names, key=lambda name: _edit_distance(folded, name))
    return best if _edit_distance(folded, best) <= 2 else None


def check_knob_typos(extra_args: Mapping[str, Any] | None) -> None:
    """Refuse a request (beam or plain) whose extra_args hold a near-miss of a DSBD knob name.

    Without this a typo such as ``{"beam_widht": 4}`` would silently make a
    plain request. Keys vLLM or other plugins own pass unless they resemble a knob.
    """
    typos = {k: knob for k in (extra_args or {}) if not k.startswith(PRIVATE_PREFIX)
             and k not in VLLM_RESERVED_EXTRA_ARGS and (knob := resembled_knob(k))}
    if typos:
        named = "; ".join(f"{k!r} resembles DSBD knob {knob!r} (did you mean {knob!r}?)" for k, knob in typos.items())
        raise BeamRequestError(
            f"Unknown key(s) {sorted(typos)} in extra_args (vllm_xargs): {named}. "
            f"DSBD knobs: {', '.join(DSBDConfig.knob_names())}.", parameter="extra_args", value=sorted(typos))


def validate(params: Any, engine: DSBDConfig) -> DSBDConfig:
    """Check a beam request's user-given SamplingParams; return its DSBD config.

    Raises :class:`BeamRequestError` naming the parameter, its value and what is allowed.
    """
    extra = params.extra_args or {}
    check_knob_typos(extra)
    unknown = _unknown_keys(extra)
    if unknown:
        raise BeamRequestError(
            f"Unknown key(s) {unknown} in extra_args (vllm_xargs) of a beam request; "
            f"DSBD knobs: {', '.join(DSBDConfig.knob_names())}.", parameter="extra_args", value=unknown)
    try:
        config = engine.for_request(extra)
    except ValueError as e:
        raise BeamRequestError(str(e), parameter="extra_args") from None
    for name, unused in _UNSUPPORTED:
        value = getattr(params, name, unused)
        if value != unused and not (unused == [] and value is None):
            raise BeamRequestError(
                f"Beam decoding (vllm-dsbd) does not support SamplingParams.{name}={value!r}; "
                f"allowed: {unused!r} (leave it unset).", parameter=name)
    if config.mjsd and params.n > 1:
        raise BeamRequestError(
            f"SamplingParams.n={params.n} with DSBD knob 'decoder'='mjsd': MJSD decodes one sequence per "
            f"request; allowed: n = 1 (send n requests with different seeds for n samples).", parameter="n")
    if config.memory_efficient and params.n > 1:
        raise BeamRequestError(
            f"SamplingParams.n={params.n} with DSBD knob 'memory_efficient'=True: one beam is carried "
            f"between iterations, so at most one best hypothesis is returned; allowed: n = 1.", parameter="n")
    if params.n > config.beam_width:
        raise BeamRequestError(
            f"SamplingParams.n={params.n} is larger than DSBD knob 'beam_width'={config.beam_width}; "
            f"allowed: 1 <= n <= beam_width (n is the number of best hypotheses returned).", parameter="n")
    return config


def as_mjsd_request(params: Any) -> Any:
    """A plain request on an engine whose decoder is "mjsd": a copy of its params naming the decoder (the
    user's own params are left as they were). n > 1 is refused: MJSD decodes one sequence."""
    if params.n > 1:
        raise BeamRequestError(
            f"SamplingParams.n={params.n} on an MJSD engine (speculative config 'decoder': 'mjsd'): MJSD decodes "
            f"one sequence per request; allowed: n = 1.", parameter="n", value=params.n)
    params = params.clone()
    params.extra_args = {**(params.extra_args or {}), "decoder": "mjsd"}
    return params


def check_capacity(config: DSBDConfig, max_num_seqs: int) -> None:
    """Refuse a beam request whose group could never run: it needs request slots for all its beams
    (and, speculating, its draft nodes and verification paths) at once."""
    width, gamma = config.beam_width, config.num_speculative_tokens
    needed = request_slots(width, gamma)
    if needed <= max_num_seqs:
        return
    if gamma == 0:
        raise BeamRequestError(f"DSBD knob 'beam_width'={width} is larger than the engine's max_num_seqs="
                               f"{max_num_seqs} (every beam is a sequence); allowed: <= {max_num_seqs}.",
                               parameter="beam_width", value=width)
    raise BeamRequestError(
        f"DSBD knob 'beam_width'={width} with 'num_speculative_tokens'={gamma} needs up to {needed} sequences "
        f"at once (W beams, W draft nodes and W (γ + 1) verification paths), more than the engine's "
        f"max_num_seqs={max_num_seqs}; allowed: beam_width * (num_speculative_tokens + 3) <= {max_num_seqs}, "
        f"or num_speculative_tokens 0 (beam_width <= {max_num_seqs}); or start the engine with "
        f"max_num_seqs >= {needed}.", parameter="beam_width", value=width)


def group_of(request_id: str, extra_args: Mapping[str, Any]) -> tuple[str, int, int]:
    """(group id, output index k, n) of an engine request: vLLM names fanned-out children ``"{k}_{id}"``."""
    n = int(extra_args.get(GROUP_TAG, {}).get("n", 1))
    if n == 1:
        return request_id, 0, 1
    index, _, parent = request_id.partition("_")
    if not index.isdigit() or not parent:
        raise ValueError(f"beam request {request_id!r} with n={n} does not look like a fanned-out child")
    return parent, int(index), n


def beam_params(params: Any, engine: DSBDConfig, *, prompt_len: int, max_model_len: int,
                default_seed: int) -> tuple[DSBDConfig, BeamParams]:
    """The decoding parameters of a (validated, tagged) beam request, engine side."""
    extra = params.extra_args or {}
    config = engine.for_request(extra)
    tag = extra.get(GROUP_TAG, {})
    eos = tag.get("eos", params.eos_token_id)
    num_logprobs = -1 if params.logprobs is None else int(params.logprobs)
    return config, BeamParams(
        beam_width=config.beam_width,
        n=int(tag.get("n", params.n)),
        temperature=float(params.temperature),
        top_k=int(params.top_k) if params.top_k and params.top_k > 0 else 0,
        top_p=float(params.top_p),
        length_penalty=float(config.length_penalty),
        max_tokens=max(1, min(int(params.max_tokens), max_model_len - prompt_len)),
        ignore_eos=bool(params.ignore_eos),
        eos_token_id=eos,
        stop_token_ids=tuple(params.stop_token_ids or ()),  # the user's, plus a generation config's extra EOS
        stop=tuple(params.stop or ()),
        num_logprobs=num_logprobs,
        seed=int(params.seed) if params.seed is not None else default_seed,
        num_speculative_tokens=config.num_speculative_tokens,
        width_threshold=1.0 if config.uses_fixed_width else config.width_threshold,
        min_width=config.min_width,
        memory_efficient=config.memory_efficient,
        auto_depth=config.auto_depth,
        mjsd_tau=config.mjsd_tau if config.mjsd else None,
        draft_temperature_scale=config.draft_temperature_scale,
    )
