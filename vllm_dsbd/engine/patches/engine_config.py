"""Patches 1-5: the "dsbd" speculative method and the DSBD engine it builds."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, get_args

from vllm_dsbd.config import ADDITIONAL_CONFIG_KEY, DRAFT_DEFAULTS_FILE, METHOD, DSBDConfig, draft_defaults
from vllm_dsbd.engine.upstream import original as _original
from vllm_dsbd.engine.upstream import wrapped as _wrapped


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
# Patch 5 — a "dsbd" speculative config builds a DSBD engine.
#   target:  vllm.engine.arg_utils.EngineArgs.create_engine_config
#   why:     SpeculativeConfig forbids unknown keys, but users put DSBD knobs
#            (`beam_width`, `width_threshold`, ...) next to "method": "dsbd";
#            and a DSBD engine needs the project's scheduler and worker, which
#            users must never have to name (--scheduler-cls / --worker-cls).
#   how:     before the original runs: merge --spec-method/--spec-model/
#            --spec-tokens into the speculative config as vLLM does, pop and
#            validate the DSBD knobs into a DSBDConfig (clear errors; a local
#            draft's dsbd.json fills knobs the user left unset), store it
#            in additional_config["dsbd"] (it travels pickled to every
#            process), set scheduler_cls / worker_cls, turn async scheduling
#            off. num_speculative_tokens = 0 needs no draft: no vLLM
#            speculative config is built; with a draft, prefix caching is
#            turned off (a DSBD block may hold target KV without draft KV, or
#            the other way round). After it: the draft's vocabulary must be
#            the target's (an EAGLE-3 head: its rotary cache spans
#            max_model_len, no draft_vocab_size), γ must fit max_model_len,
#            and the draft's ModelConfig takes the `draft_dtype` knob's dtype;
#            a draft whose attention or KV heads do not split over the TP
#            ranks is refused naming it (vLLM names no model, or fails in
#            the workers' model load); an unset `draft_in_step` is chosen
#            (on for an EAGLE-3 head on a CPU engine) and the stored
#            DSBDConfig rewritten with it, before any process reads it.
#   remove-when: vLLM has an extension point for method-specific options and
#            plugin-provided engine classes.
# ---------------------------------------------------------------------------
# vLLM's words (ModelConfig.verify_with_parallel_config); tests/test_patches.py pins them
TP_HEADS_MESSAGE = r"Total number of attention heads \(\d+\) must be divisible by tensor parallel size \(\d+\)\."


def _dsbd_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = _original(EngineArgs, "create_engine_config")

    def create_engine_config(self, *args, **kwargs):
        dsbd = _take_dsbd_config(self)
        if dsbd is None:
            return original(self, *args, **kwargs)
        _install_dsbd_engine(self, dsbd)
        draft = (self.speculative_config or {}).get("model")
        try:
            config = original(self, *args, **kwargs)
        except ValueError as error:  # vLLM's refusal of the draft's attention heads names no model
            words = re.search(TP_HEADS_MESSAGE, str(error))
            if draft is None or words is None or "SpeculativeConfig" not in str(error):
                raise
            raise ValueError(f"The DSBD draft {draft} is sharded like the target, so its heads must split over "
                             f"the tensor-parallel size: {words.group(0)}") from error
        if config.speculative_config is not None:
            check_draft_kv_heads(config.speculative_config)
            dsbd = prepare_eagle3_head(config.speculative_config, dsbd)
            check_same_vocabulary(config.speculative_config)
            set_draft_dtype(config.speculative_config, dsbd.draft_dtype)
            vocab = config.speculative_config.draft_model_config.get_vocab_size()
            if dsbd.draft_vocab_size >= vocab:
                raise ValueError(
                    f"DSBD knob 'draft_vocab_size'={dsbd.draft_vocab_size} is not smaller than the draft's "
                    f"vocabulary ({vocab}); allowed: 0 (the whole vocabulary) or 1..{vocab - 1}."
                )
            max_model_len = config.model_config.max_model_len
            if dsbd.num_speculative_tokens + 2 > max_model_len:
                raise ValueError(
                    f"DSBD knob 'num_speculative_tokens'={dsbd.num_speculative_tokens} does not fit "
                    f"max_model_len={max_model_len}; allowed: at most max_model_len - 2 = {max_model_len - 2}."
                )
        if dsbd.draft_in_step is None:  # no draft: nothing to draft inside the verify step
            dsbd = dataclasses.replace(dsbd, draft_in_step=False)
        config.additional_config[ADDITIONAL_CONFIG_KEY] = dsbd.to_dict()  # the knobs as the engine chose them
        return config

    EngineArgs.create_engine_config = _wrapped(original, create_engine_config)


_DSBD_ONLY = frozenset(DSBDConfig.knob_names()) - {"num_speculative_tokens"}
_DEFAULT_GAMMA = DSBDConfig().num_speculative_tokens


def _take_dsbd_config(args: Any) -> DSBDConfig | None:
    """The DSBDConfig of EngineArgs whose method is "dsbd" (None otherwise); leaves vLLM's part in place."""
    raw = {k.replace("-", "_"): v for k, v in dict(args.speculative_config or {}).items()}
    if (args.spec_method or raw.get("method")) != METHOD:
        return None
    from vllm.config.speculative import SpeculativeConfig

    for flag, key, value in (("--spec-method", "method", args.spec_method),
                             ("--spec-model", "model", args.spec_model),
                             ("--spec-tokens", "num_speculative_tokens", args.spec_tokens)):
        if value is None:
            continue
        if key in raw:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        raw[key] = value
    args.spec_method = args.spec_model = args.spec_tokens = None
    unknown = sorted(set(raw) - set(SpeculativeConfig.__dataclass_fields__) - set(DSBDConfig.knob_names()))
    if unknown:
        raise ValueError(
            f"Unknown key(s) {unknown} in --speculative-config for method 'dsbd'; "
            f"DSBD knobs: {', '.join(DSBDConfig.knob_names())} (plus vLLM's "
            f"SpeculativeConfig fields such as 'model')."
        )
    knobs = {k: raw.pop(k) for k in list(raw) if k in _DSBD_ONLY}
    if knobs.get("decoder", DSBDConfig.decoder) != "mjsd":  # MJSD compares likelihoods: the draft's own q
        recommended = {k: v for k, v in draft_defaults(raw.get("model")).items() if k not in knobs}
        if recommended:
            from vllm.logger import init_logger

            init_logger(__name__).info("DSBD: %s from the draft's %s (set in --speculative-config to override)",
                                       ", ".join(f"{k}={v}" for k, v in recommended.items()), DRAFT_DEFAULTS_FILE)
            knobs.update(recommended)
    knobs["num_speculative_tokens"] = raw.setdefault("num_speculative_tokens", _DEFAULT_GAMMA)
    dsbd = DSBDConfig.from_mapping(knobs, where="--speculative-config")
    if dsbd.num_speculative_tokens == 0:
        if dsbd.draft_vocab_size:
            raise ValueError(f"DSBD knob 'draft_vocab_size'={dsbd.draft_vocab_size} shapes the draft's head, "
                             "and 'num_speculative_tokens'=0 uses no draft; remove it.")
        if dsbd.draft_dtype != "auto":
            raise ValueError(f"DSBD knob 'draft_dtype'={dsbd.draft_dtype!r} sets the draft's dtype, "
                             "and 'num_speculative_tokens'=0 uses no draft; remove it.")
        if dsbd.draft_in_step:
            raise ValueError("DSBD knob 'draft_in_step'=True drafts inside the verify step, and "
                             "'num_speculative_tokens'=0 uses no draft; remove it.")
        if raw.get("model"):
            raise ValueError(
                "DSBD knob 'num_speculative_tokens'=0 decodes beams without a draft, but a draft "
                f"'model' ({raw['model']}) is set; remove it, or set num_speculative_tokens >= 1 to "
                "speculate with it."
            )
        leftover = sorted(set(raw) - {"method", "num_speculative_tokens"})
        if leftover:
            raise ValueError(f"--speculative-config key(s) {leftover} need a draft model, and "
                             f"'num_speculative_tokens'=0 uses none; remove them.")
        args.speculative_config = None
    else:
        if not raw.get("model"):
            raise ValueError(
                "Speculative method 'dsbd' with num_speculative_tokens >= 1 needs a draft model: set "
                "'model' in --speculative-config (or --spec-model) to a checkpoint with the target's "
                "vocabulary, or set num_speculative_tokens to 0 for in-engine beam decoding without a draft."
            )
        args.speculative_config = raw
    return dsbd


ENGINE_CLASSES = {
    "scheduler_cls": "vllm_dsbd.engine.scheduler.DSBDScheduler",
    "cpu_worker_cls": "vllm_dsbd.engine.worker.DSBDCPUWorker",
    "gpu_worker_cls": "vllm_dsbd.engine.worker.DSBDGPUWorker",
}


def _install_dsbd_engine(args: Any, dsbd: DSBDConfig) -> None:
    import os

    from vllm.platforms import current_platform

    if args.scheduler_cls not in (None, ENGINE_CLASSES["scheduler_cls"]):
        raise ValueError(f"A DSBD engine installs its own scheduler; remove --scheduler-cls "
                         f"({args.scheduler_cls}).")
    worker = ENGINE_CLASSES["cpu_worker_cls" if current_platform.is_cpu() else "gpu_worker_cls"]
    if args.worker_cls not in ("auto", worker):
        raise ValueError(f"A DSBD engine installs its own worker; remove --worker-cls ({args.worker_cls}).")
    if args.async_scheduling:
        raise ValueError("A DSBD engine schedules synchronously; remove --async-scheduling.")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("0", "false", "False"):
        raise ValueError("A DSBD engine needs vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER.")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # inherited by the engine's processes
    if dsbd.num_speculative_tokens > 0:
        if args.enable_prefix_caching:
            raise ValueError("DSBD speculation (num_speculative_tokens >= 1) needs prefix caching off; "
                             "remove --enable-prefix-caching.")
        args.enable_prefix_caching = False
    args.scheduler_cls = ENGINE_CLASSES["scheduler_cls"]
    args.worker_cls = worker
    args.async_scheduling = False
    args.additional_config = {**(args.additional_config or {}), ADDITIONAL_CONFIG_KEY: dsbd.to_dict()}


def prepare_eagle3_head(config: Any, dsbd: DSBDConfig) -> DSBDConfig:
    """An EAGLE-3 head as the draft (``engine.eagle3``): it must fit the target (``check_head``), its rotary cache
    spans the target's max_model_len, as vLLM's "eagle3" method sizes it, and DSBD's ``draft_vocab_size`` is
    refused (the head has its own vocabulary). Returns ``dsbd`` with ``draft_in_step`` chosen where it is unset:
    on for a head on a CPU engine (the only place it runs so far), off otherwise."""
    from vllm.config.speculative import SpeculativeConfig
    from vllm.platforms import current_platform

    from vllm_dsbd.engine.eagle3 import check_head, head_architecture

    head = head_architecture(config.draft_model_config.hf_config)
    if dsbd.draft_in_step:
        if head is None:
            raise ValueError(f"DSBD knob 'draft_in_step'=True needs an EAGLE-3 head as the draft; "
                             f"{config.draft_model_config.model} is a causal LM. Set draft_in_step to false.")
        if not current_platform.is_cpu():
            raise ValueError("DSBD knob 'draft_in_step'=True runs on CPU engines only so far (its forest attention "
                             "reads vLLM's CPU KV layout). Set draft_in_step to false.")
    elif dsbd.draft_in_step is None:
        dsbd = dataclasses.replace(dsbd, draft_in_step=head is not None and current_platform.is_cpu())
        if head is not None:
            from vllm.logger import init_logger

            init_logger(__name__).info(
                "DSBD: the EAGLE-3 head drafts %s (draft_in_step=%s; set it in --speculative-config to choose)",
                "inside the verify step" if dsbd.draft_in_step else "in draft steps: in-step drafting runs on "
                "CPU engines only so far", dsbd.draft_in_step)
    if head is None:
        return dsbd
    if dsbd.draft_vocab_size:
        raise ValueError(
            f"DSBD knob 'draft_vocab_size'={dsbd.draft_vocab_size} cuts a draft model's vocabulary, but the draft "
            f"{config.draft_model_config.model} is an EAGLE-3 head ({head}) with a draft vocabulary of its own "
            "(its d2t map); remove the knob."
        )
    check_head(config.draft_model_config.hf_config, config.target_model_config.hf_text_config,
               config.draft_model_config.model)
    SpeculativeConfig._maybe_override_draft_max_position_embeddings(
        config.draft_model_config.hf_config, config.target_model_config.max_model_len)
    return dsbd


def check_draft_kv_heads(config: Any) -> None:
    """vLLM shards a draft's KV heads over the tensor-parallel ranks, or replicates them when there are fewer,
    and asserts in each worker's model load when neither divides the other; refuse that here, naming the draft
    (vLLM checks the attention heads at config time, not the KV heads)."""
    tp = config.draft_parallel_config.tensor_parallel_size
    draft = config.draft_model_config
    kv, heads = draft.get_total_num_kv_heads(), draft.model_arch_config.total_num_attention_heads
    if kv % tp == 0 or tp % kv == 0:
        return
    allowed = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    raise ValueError(f"The DSBD draft {draft.model} has {kv} KV heads, which tensor_parallel_size={tp} neither "
                     f"divides nor is a multiple of (vLLM shards or replicates them); allowed for this draft: "
                     f"{allowed}.")


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


def set_draft_dtype(config: Any, draft_dtype: str) -> None:
    """The draft computes in ``draft_dtype`` ("auto": vLLM's choice, the target's dtype). vLLM builds the
    draft's ModelConfig with the target's dtype; the draft's weights, activations and KV cache (its
    attention layers take the KV dtype from the draft's ModelConfig, in the target's KV-cache group) then
    follow this one field."""
    if draft_dtype == "auto":
        return
    import torch

    config.draft_model_config.dtype = getattr(torch, draft_dtype)
