"""Every monkeypatch vllm-dsbd applies to vLLM 0.32.0, in one place.

Each patch has a header (target, why, how, remove-when) and pins the source
of what it replaces or wraps in :data:`UPSTREAM_SHA256`; the test
``tests/test_patches.py`` fails when upstream moved under a patch.
:func:`apply_all` is idempotent and runs from ``vllm_dsbd.register()`` in
every vLLM process.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Literal, get_args

from vllm_dsbd.config import DSBDConfig

METHOD = "dsbd"

#: sha256 of ``inspect.getsource`` of every upstream function a patch wraps
#: or replaces (vLLM 0.32.0). A mismatch means the patch must be re-checked.
UPSTREAM_SHA256 = {
    "vllm.config.speculative.SpeculativeConfig.__post_init__": (
        "aff56b18ad15a2a8e2b354066f790fd62617db5e67edf4d4e3ce49caea84d3ac"
    ),
    "vllm.config.speculative.SpeculativeConfig.uses_draft_model": (
        "26307ee92b9c36e2cdd61a656c9592d0dc84360f9467dc167910441b0e117983"
    ),
    "vllm.engine.arg_utils.EngineArgs.add_cli_args": (
        "0b7444570415c68c90cbf8636cc15988c3bab33438acd65dbc75c26c125e5cba"
    ),
    "vllm.engine.arg_utils.EngineArgs.create_engine_config": (
        "b9b94288f46d2f679c3f30825ddd2eb3b1f6a9958115c80505c4c948b972150f"
    ),
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config": (
        "489aa2fc045a50957f16bbc80987c07a4ac4993ab0a8d57a430c7030a02d70c6"
    ),
}

_applied = False


class DSBDEngineNotImplementedError(NotImplementedError):
    """A valid DSBD request for a part of the engine that does not exist yet."""


def source_sha256(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def _original(owner: type, name: str) -> Any:
    """The upstream function behind ``owner.name``, whether patched or not."""
    fn = owner.__dict__[name]
    fn = getattr(fn, "__func__", fn)  # staticmethod
    return getattr(fn, "__dsbd_original__", fn)


def upstream_function(qualname: str) -> Any:
    """Resolve a :data:`UPSTREAM_SHA256` key to the upstream function."""
    import importlib

    module, owner, name = qualname.rsplit(".", 2)
    return _original(getattr(importlib.import_module(module), owner), name)


def _wrapped(original: Any, wrapper: Any) -> Any:
    wrapper.__dsbd_original__ = original
    wrapper.__name__ = original.__name__
    wrapper.__qualname__ = original.__qualname__
    wrapper.__doc__ = original.__doc__
    return wrapper


# ---------------------------------------------------------------------------
# Patch 1 — the "dsbd" speculative method is a valid `SpeculativeConfig.method`.
#   target:  vllm.config.speculative.SpeculativeConfig (field `method`, a
#            pydantic-validated Literal; also argparse choices of --spec-method)
#   why:     the Literal is closed; pydantic rejects "dsbd" (literal_error).
#   how:     widen the annotation, rebuild the pydantic dataclass, clear the
#            lru-cached argparse kwargs so --spec-method offers "dsbd".
#   remove-when: vLLM lets plugins register speculative methods.
# ---------------------------------------------------------------------------
def _add_method_to_literal() -> None:
    import pydantic
    from vllm.config import speculative as S
    from vllm.engine import arg_utils

    SC = S.SpeculativeConfig
    methods = get_args(S.SpeculativeMethod)
    if METHOD in _flatten_literal(S.SpeculativeMethod):
        return
    widened = Literal[tuple(methods) + (METHOD,)] | None  # type: ignore[valid-type]
    SC.__annotations__["method"] = widened
    SC.__dataclass_fields__["method"].type = widened
    SC.__pydantic_fields__["method"].annotation = widened
    pydantic.dataclasses.rebuild_dataclass(SC, force=True)
    S.SpeculativeMethod = Literal[tuple(methods) + (METHOD,)]  # type: ignore[valid-type]
    arg_utils._compute_kwargs.cache_clear()


def _flatten_literal(tp: Any) -> set[str]:
    out: set[str] = set()
    for arg in get_args(tp):
        out |= _flatten_literal(arg) if get_args(arg) else {arg}
    return out


# ---------------------------------------------------------------------------
# Patch 2 — "dsbd" builds its draft like "draft_model".
#   target:  vllm.config.speculative.SpeculativeConfig.__post_init__
#   why:     methods with a `model` go through an auto-detect chain that ends
#            in NotImplementedError("Unsupported speculative method").
#   how:     run the original with method "draft_model", restore "dsbd".
#   remove-when: patch 1's remove-when.
# ---------------------------------------------------------------------------
def _post_init_as_draft_model() -> None:
    from vllm.config.speculative import SpeculativeConfig as SC

    original = _original(SC, "__post_init__")

    def __post_init__(self):
        if self.method != METHOD:
            return original(self)
        self.method = "draft_model"
        try:
            return original(self)
        finally:
            self.method = METHOD

    SC.__post_init__ = _wrapped(original, __post_init__)


# ---------------------------------------------------------------------------
# Patch 3 — "dsbd" uses a draft model with KV in the paged cache.
#   target:  vllm.config.speculative.SpeculativeConfig.uses_draft_model
#   why:     lookahead slots, draft KV layers sharing the block tables, and
#            the draft loader all key on uses_draft_model().
#   how:     True for "dsbd" as for "draft_model".
#   remove-when: patch 1's remove-when.
# ---------------------------------------------------------------------------
def _uses_draft_model() -> None:
    from vllm.config.speculative import SpeculativeConfig as SC

    original = _original(SC, "uses_draft_model")

    def uses_draft_model(self) -> bool:
        return self.method == METHOD or original(self)

    SC.uses_draft_model = _wrapped(original, uses_draft_model)


# ---------------------------------------------------------------------------
# Patch 4 — `--speculative-method` flag.
#   target:  vllm.engine.arg_utils.EngineArgs.add_cli_args
#   why:     users write `vllm serve T --speculative-method dsbd`; vLLM only
#            has --spec-method (and --speculative-config's "method").
#   how:     after the original, add an alias with the same dest (spec_method)
#            and choices; EngineArgs.from_cli_args then needs no change.
#   remove-when: vLLM grows the flag.
# ---------------------------------------------------------------------------
def _speculative_method_flag() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = _original(EngineArgs, "add_cli_args")

    def add_cli_args(parser):
        parser = original(parser)
        spec = next(a for a in parser._actions if "--spec-method" in a.option_strings)
        if not any("--speculative-method" in a.option_strings for a in parser._actions):
            parser.add_argument(
                "--speculative-method",
                dest="spec_method",
                choices=spec.choices,
                default=None,
                help="Alias of --spec-method. 'dsbd' selects dynamic-width "
                "speculative beam decoding (vllm-dsbd).",
            )
        return parser

    EngineArgs.add_cli_args = staticmethod(_wrapped(original, add_cli_args))


# ---------------------------------------------------------------------------
# Patch 5 — DSBD knobs ride in --speculative-config, validated once.
#   target:  vllm.engine.arg_utils.EngineArgs.create_speculative_config
#   why:     SpeculativeConfig forbids unknown keys, but users put
#            `beam_width`, `width_threshold`, ... next to "method": "dsbd".
#   how:     pop the DSBD knobs, validate them into a DSBDConfig (clear
#            errors), pass the rest on; the result is attached to the
#            SpeculativeConfig as `dsbd` (it travels pickled to every process)
#            and the draft's vocabulary is checked against the target's.
#   remove-when: vLLM has an extension point for method-specific options.
# ---------------------------------------------------------------------------
def _dsbd_knobs_in_speculative_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = _original(EngineArgs, "create_speculative_config")

    def create_speculative_config(self, target_model_config, target_parallel_config):
        raw = dict(self.speculative_config or {})
        if (self.spec_method or raw.get("method")) != METHOD:
            return original(self, target_model_config, target_parallel_config)
        from vllm.config.speculative import SpeculativeConfig

        unknown = sorted(set(raw) - set(SpeculativeConfig.__dataclass_fields__) - set(DSBDConfig.knob_names()))
        if unknown:
            raise ValueError(
                f"Unknown key(s) {unknown} in --speculative-config for method 'dsbd'; "
                f"DSBD knobs: {', '.join(DSBDConfig.knob_names())} (plus vLLM's "
                f"SpeculativeConfig fields such as 'model')."
            )
        # num_speculative_tokens is both a vLLM field and a DSBD knob: read, keep.
        knobs = {k: raw.pop(k) for k in list(raw) if k in DSBDConfig.knob_names() and k in _DSBD_ONLY}
        spec_tokens = self.spec_tokens if self.spec_tokens is not None else raw.get("num_speculative_tokens")
        if spec_tokens is not None:
            knobs["num_speculative_tokens"] = spec_tokens
        dsbd = DSBDConfig.from_mapping(knobs, where="--speculative-config")
        if not (raw.get("model") or self.spec_model):
            raise ValueError(
                "Speculative method 'dsbd' needs a draft model: set 'model' in "
                "--speculative-config (or --spec-model) to a checkpoint with the target's vocabulary."
            )
        if dsbd.num_speculative_tokens == 0:
            raise DSBDEngineNotImplementedError(
                "DSBD knob 'num_speculative_tokens'=0 (in-engine beam decoding without a draft) "
                "is not implemented yet; allowed today: an integer >= 1."
            )
        if spec_tokens is None:
            raw["num_speculative_tokens"] = dsbd.num_speculative_tokens
        self.speculative_config = raw
        config = original(self, target_model_config, target_parallel_config)
        check_same_vocabulary(config)
        config.dsbd = dsbd
        return config

    EngineArgs.create_speculative_config = _wrapped(original, create_speculative_config)


_DSBD_ONLY = frozenset(DSBDConfig.knob_names()) - {"num_speculative_tokens"}


def check_same_vocabulary(config: Any) -> None:
    target = config.target_model_config.get_vocab_size()
    draft = config.draft_model_config.get_vocab_size()
    if target != draft:
        raise ValueError(
            f"DSBD needs a draft with the target's vocabulary: target "
            f"{config.target_model_config.model} has vocab_size={target}, draft "
            f"{config.draft_model_config.model} has vocab_size={draft}. Use a draft "
            f"trained with the target's tokenizer."
        )


# ---------------------------------------------------------------------------
# Patch 6 — refuse to start a "dsbd" engine until the DSBD engine exists.
#   target:  vllm.engine.arg_utils.EngineArgs.create_engine_config
#   why:     the config is accepted and validated (patches 1-5), but the
#            scheduler and model runner that run DSBD are not written yet;
#            running "dsbd" as plain draft_model decoding would silently give
#            the user something else.
#   how:     build the config (so every validation error surfaces), then
#            raise NotImplementedError.
#   remove-when: the DSBD scheduler/worker land; this patch then installs
#            them as scheduler_cls/worker_cls instead.
# ---------------------------------------------------------------------------
def _refuse_dsbd_engine() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = _original(EngineArgs, "create_engine_config")

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        spec = config.speculative_config
        if spec is not None and spec.method == METHOD:
            raise DSBDEngineNotImplementedError(
                f"The speculative config is valid ({spec.dsbd}), but the DSBD engine "
                f"(in-engine beam groups and forest verification) is not implemented "
                f"in vllm-dsbd yet. Use vLLM's LLM.beam_search or method='draft_model' "
                f"for now."
            )
        return config

    EngineArgs.create_engine_config = _wrapped(original, create_engine_config)


PATCHES = (
    _add_method_to_literal,
    _post_init_as_draft_model,
    _uses_draft_model,
    _speculative_method_flag,
    _dsbd_knobs_in_speculative_config,
    _refuse_dsbd_engine,
)


def apply_all() -> None:
    """Apply every patch once per process."""
    global _applied
    if _applied:
        return
    for patch in PATCHES:
        patch()
    _applied = True
