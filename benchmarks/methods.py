"""The registry of benchmarked methods and the backends they run on.

A *backend* is started once per run (a vLLM engine, a transformers model)
and shut down before the next one starts. A *method* is a small function
``make(handle, settings) -> generate`` registered with :func:`method`; the
harness calls ``generate(prompts, max_tokens)`` and gets back, per prompt, the
output token ids of every returned sequence, best first.

Adding a method::

    @method("vllm-top-p", backend="vllm", description="vLLM sampling, top_p=0.9")
    def _vllm_top_p(llm, s):
        return lambda prompts, max_tokens: _vllm_generate(llm, prompts, SamplingParams(...))

A method that cannot run here is reported as skipped with a reason, never
replaced by something else: a method with ``needs_draft`` is skipped without a
draft, and a backend whose start raises :class:`NotImplementedError` (the
plugin's refusal of something it does not implement) or
:class:`vllm_dsbd.models.ModelUnavailableError` skips all its methods with
that message.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import Completion, GenerateFn, Probes, Prompt
from vllm_dsbd.demo import engine_kwargs


@dataclass(frozen=True)
class Settings:
    """Everything a backend or method may read; recorded in every result."""

    target: str
    draft: str | None
    beam_width: int
    temperature: float  # for the sampling methods; search methods use 0
    seed: int
    num_speculative_tokens: int
    width_threshold: float
    draft_model_tokens: int | None = None  # γ of vLLM's draft_model (default: num_speculative_tokens)
    dtype: str = "float32"  # of every model, vLLM's and transformers' (vllm_dsbd.dtypes)
    dtype_reason: str = "the default"
    enforce_eager: bool = False  # vLLM's engines: compiled (vLLM's default) unless --enforce-eager


@dataclass(frozen=True)
class Method:
    name: str
    backend: str
    description: str
    make: Callable[[Any, Settings], GenerateFn]
    needs_draft: bool = False


Backend = Callable[[Settings], AbstractContextManager[tuple[Any, Probes]]]

METHODS: dict[str, Method] = {}
BACKENDS: dict[str, Backend] = {}


def method(name: str, *, backend: str, description: str, needs_draft: bool = False):
    """Register ``make(handle, settings) -> generate`` as method ``name``."""

    def register(make: Callable[[Any, Settings], GenerateFn]) -> Callable[[Any, Settings], GenerateFn]:
        if name in METHODS:
            raise ValueError(f"method {name!r} registered twice")
        METHODS[name] = Method(name, backend, description, make, needs_draft)
        return make

    return register


def skip_reason(m: Method, settings: Settings) -> str | None:
    """Why ``m`` cannot run with ``settings`` (checked before its backend starts), or None."""
    if m.needs_draft and settings.draft is None:
        return (
            "needs a draft model: none given and no default draft prepared "
            "(vllm_dsbd.models.default_draft_path() is None); pass --draft PATH"
        )
    return None


# ---------------------------------------------------------------------------
# vLLM backends
# ---------------------------------------------------------------------------


def _vllm_counters(llm, dsbd: bool = False, speculative: bool = False) -> dict[str, float]:
    """Cumulative counters from ``llm.get_metrics()``, summed over engines.

    ``engine_steps`` counts engine iterations (``vllm:iteration_tokens_total``
    observations); each runs one target forward pass. On a DSBD engine that
    histogram misses beam groups (they emit output only when they finish) and
    draft steps are engine steps too, so ``engine_steps`` is the DSBD
    iterations there (``vllm:spec_decode_num_drafts``: one target forward of a
    group each) and absent (not observable) without speculation.
    """
    from vllm.v1.metrics.reader import Counter, Histogram

    counters = {"vllm:spec_decode_num_drafts": "spec_drafts",
                "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens"}
    if dsbd and speculative:
        counters.update({"vllm:dsbd_beam_layers": "dsbd_beam_layers", "vllm:dsbd_beam_width_sum": "dsbd_beam_width_sum"})
    out = {"engine_steps": 0.0, **{key: 0.0 for key in counters.values()}}
    for m in llm.get_metrics():
        if m.name == "vllm:iteration_tokens_total" and isinstance(m, Histogram):
            out["engine_steps"] += m.count
        elif m.name in counters and isinstance(m, Counter):
            out[counters[m.name]] += m.value
    if dsbd:
        del out["engine_steps"]
        if speculative:
            out["engine_steps"] = out["spec_drafts"]
    return out


def _vllm_kv_usage(llm) -> float:
    from vllm.v1.metrics.reader import Gauge

    return max(
        (m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc" and isinstance(m, Gauge)),
        default=0.0,
    )


@contextmanager
def _vllm_engine(settings: Settings, **overrides) -> Iterator[tuple[Any, Probes]]:
    """One vLLM engine with the project's CPU settings and stats on; shut down on exit."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported
    from vllm import LLM

    llm = LLM(**engine_kwargs(settings.target, settings.dtype, settings.enforce_eager), disable_log_stats=False,
              **overrides)
    spec = overrides.get("speculative_config") or {}
    try:
        yield llm, Probes(
            counters=lambda: _vllm_counters(llm, dsbd=spec.get("method") == "dsbd",
                                            speculative=spec.get("num_speculative_tokens", 0) > 0),
            kv_usage=lambda: _vllm_kv_usage(llm),
            num_kv_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _tokens_prompt(p: Prompt) -> dict:
    return {"prompt_token_ids": list(p.token_ids)}


def _vllm_generate(llm, prompts: Sequence[Prompt], params) -> list[Completion]:
    outs = llm.generate([_tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    return [Completion([list(o.token_ids) for o in out.outputs]) for out in outs]


def _sampling_params(settings: Settings, max_tokens: int, **kw):
    """Every request gets the run's seed (vLLM gives each request its own generator)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, seed=settings.seed, **kw)


BACKENDS["vllm"] = _vllm_engine
BACKENDS["vllm-draft"] = lambda s: _vllm_engine(
    s,
    speculative_config={
        "method": "draft_model",
        "model": s.draft,
        "num_speculative_tokens": s.draft_model_tokens or s.num_speculative_tokens,
    },
)


BACKENDS["vllm-eagle3"] = lambda s: _vllm_engine(
    s,
    speculative_config={
        "method": "eagle3",
        "model": s.draft,
        "num_speculative_tokens": s.draft_model_tokens or s.num_speculative_tokens,
    },
)


@method("vllm-greedy", backend="vllm", description="vLLM greedy decoding")
def _vllm_greedy(llm, s: Settings) -> GenerateFn:
    return lambda prompts, max_tokens: _vllm_generate(
        llm, prompts, _sampling_params(s, max_tokens, temperature=0.0)
    )


@method("vllm-sampling", backend="vllm", description="vLLM multinomial sampling (temperature T, n=1)")
def _vllm_sampling(llm, s: Settings) -> GenerateFn:
    return lambda prompts, max_tokens: _vllm_generate(
        llm, prompts, _sampling_params(s, max_tokens, temperature=s.temperature)
    )


@method("vllm-beam-search", backend="vllm", description="vLLM built-in LLM.beam_search (width W)")
def _vllm_beam_search(llm, s: Settings) -> GenerateFn:
    from vllm.sampling_params import BeamSearchParams

    def generate(prompts: Sequence[Prompt], max_tokens: int) -> list[Completion]:
        outs = llm.beam_search(
            [_tokens_prompt(p) for p in prompts],
            BeamSearchParams(beam_width=s.beam_width, max_tokens=max_tokens),
        )
        # BeamSearchSequence.tokens holds prompt + output.
        return [
            Completion([seq.tokens[len(p.token_ids) :] for seq in out.sequences])
            for p, out in zip(prompts, outs)
        ]

    return generate


@method(
    "vllm-draft-model",
    backend="vllm-draft",
    description="vLLM draft_model speculative decoding, greedy (γ draft tokens)",
    needs_draft=True,
)
def _vllm_draft_model(llm, s: Settings) -> GenerateFn:
    return lambda prompts, max_tokens: _vllm_generate(
        llm, prompts, _sampling_params(s, max_tokens, temperature=0.0)
    )


method("vllm-eagle3", backend="vllm-eagle3", needs_draft=True,
       description="vLLM eagle3 speculative decoding, greedy (--draft: an EAGLE-3 head; γ draft tokens)")(
    _vllm_draft_model)


# ---------------------------------------------------------------------------
# Hugging Face transformers backend
# ---------------------------------------------------------------------------


@contextmanager
def _hf_model(settings: Settings) -> Iterator[tuple[Any, Probes]]:
    """The target in transformers, in the settings' dtype, eval mode (torch's default CPU threads)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(settings.target, dtype=getattr(torch, settings.dtype)).eval()
    try:
        yield model, Probes()
    finally:
        del model
        gc.collect()


BACKENDS["hf"] = _hf_model


def _hf_generate(model, prompts: Sequence[Prompt], max_tokens: int, seed: int, **gen) -> list[Completion]:
    """``model.generate`` on a left-padded batch; W returned sequences per prompt."""
    import torch
    from transformers import GenerationConfig

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    width = max(len(p.token_ids) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p.token_ids)) + list(p.token_ids) for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p.token_ids)) + [1] * len(p.token_ids) for p in prompts])
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        num_return_sequences=gen["num_beams"],
        pad_token_id=pad,
        eos_token_id=model.config.eos_token_id,
        top_k=0,  # plain multinomial when sampling; None would become transformers' default 50
        top_p=1.0,
        **gen,
    )
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    new = out[:, width:].reshape(len(prompts), gen["num_beams"], -1).tolist()
    return [Completion(beams) for beams in new]


@method("hf-beam-search", backend="hf", description="transformers generate, num_beams=W, do_sample=False")
def _hf_beam_search(model, s: Settings) -> GenerateFn:
    return lambda prompts, max_tokens: _hf_generate(
        model, prompts, max_tokens, s.seed, num_beams=s.beam_width, do_sample=False
    )


@method("hf-beam-sampling", backend="hf", description="transformers generate, num_beams=W, do_sample=True (T)")
def _hf_beam_sampling(model, s: Settings) -> GenerateFn:
    return lambda prompts, max_tokens: _hf_generate(
        model,
        prompts,
        max_tokens,
        s.seed,
        num_beams=s.beam_width,
        do_sample=True,
        temperature=s.temperature,
    )


# ---------------------------------------------------------------------------
# vllm-dsbd: the documented user API (README.md, docs/getting-started.md: "what
# users do"). In-engine beam decoding runs on a DSBD engine without a draft
# (num_speculative_tokens 0); the speculative DSBD methods on a DSBD engine
# drafting with the run's draft (num_speculative_tokens γ).
# ---------------------------------------------------------------------------

BACKENDS["vllm-dsbd-beams"] = lambda s: _vllm_engine(
    s, speculative_config={"method": "dsbd", "num_speculative_tokens": 0, "beam_width": s.beam_width},
)
def _dsbd_engine(s: Settings, **knobs):
    """A speculative DSBD engine drafting with the run's draft (γ, W), with engine-wide ``knobs``."""
    return _vllm_engine(s, speculative_config={"method": "dsbd", "model": s.draft, "beam_width": s.beam_width,
                                               "num_speculative_tokens": s.num_speculative_tokens, **knobs})


# The engine's default: with an EAGLE-3 head on CPU each later iteration is drafted inside the verify step
# before it (draft_in_step), a request may turn that off; a draft model drafts in draft steps.
BACKENDS["vllm-dsbd"] = _dsbd_engine
# An EAGLE-3 head as the draft only: the knob set, so a draft model or a GPU engine is refused.
BACKENDS["vllm-dsbd-in-step"] = lambda s: _dsbd_engine(s, draft_in_step=True)


def _dsbd(sample: bool, **knobs) -> Callable[[Any, Settings], GenerateFn]:
    """A beam request: ``n`` = W sequences (1 when one beam is carried), T = 0 (search) or T (sampling),
    knobs in ``extra_args``."""

    def make(llm, s: Settings) -> GenerateFn:
        extra = {"beam_width": s.beam_width, **knobs}
        temperature = s.temperature if sample else 0.0
        n = 1 if knobs.get("memory_efficient") else s.beam_width
        return lambda prompts, max_tokens: _vllm_generate(
            llm,
            prompts,
            _sampling_params(s, max_tokens, n=n, temperature=temperature, extra_args=extra),
        )

    return make


def _dsbd_speculative(**knobs) -> Callable[[Any, Settings], GenerateFn]:
    def make(llm, s: Settings) -> GenerateFn:
        return _dsbd(True, width_threshold=s.width_threshold, **knobs)(llm, s)

    return make


method("dsbd-engine-beam-search", backend="vllm-dsbd-beams",
       description="vllm-dsbd in-engine beam search (γ=0, T=0)")(_dsbd(False))
method("dsbd-engine-beam-sampling", backend="vllm-dsbd-beams",
       description="vllm-dsbd in-engine beam sampling (γ=0, T)")(_dsbd(True))
method("dsbd-search", backend="vllm-dsbd", needs_draft=True,
       description="DSBD speculative beam search (γ, T=0: lossless)")(_dsbd(False))
method("dsbd-auto-search", backend="vllm-dsbd", needs_draft=True,
       description="DSBD speculative beam search, γ chosen per iteration (auto_depth, at most γ; T=0)")(
    _dsbd(False, auto_depth=True))
for _name, _description, _make in (
    ("dsbd-fixed", "DSBD, fixed width W (T)", _dsbd_speculative(fixed_width=True)),
    ("dsbd-dynamic", "DSBD, dynamic width (τ, T)", _dsbd_speculative()),
    ("dsbd-memory-efficient", "DSBD, dynamic width, one beam carried (T)", _dsbd_speculative(memory_efficient=True)),
    ("dsbd-auto-fixed", "DSBD, fixed width W, auto_depth (T)", _dsbd_speculative(fixed_width=True, auto_depth=True)),
    ("dsbd-auto-dynamic", "DSBD, dynamic width (τ), auto_depth (T)", _dsbd_speculative(auto_depth=True)),
):  # fmt: skip
    method(_name, backend="vllm-dsbd", description=_description, needs_draft=True)(_make)


def _mjsd(tau: float, **knobs) -> Callable[[Any, Settings], GenerateFn]:
    """An MJSD request (one sequence): K = W draft beams, γ, τ, temperature T, ``knobs`` in ``extra_args``."""

    def make(llm, s: Settings) -> GenerateFn:
        extra = {"decoder": "mjsd", "beam_width": s.beam_width, "mjsd_tau": tau, **knobs}
        return lambda prompts, max_tokens: _vllm_generate(
            llm, prompts, _sampling_params(s, max_tokens, temperature=s.temperature, extra_args=extra))

    return make


MJSD_TAUS = (0.3, 0.5, 0.9)
for _tau in MJSD_TAUS:
    method(f"mjsd-tau-{_tau}", backend="vllm-dsbd", needs_draft=True,
           description=f"MJSD, one sequence: K = W draft beams, γ, τ = {_tau} (T), drafting in draft steps"
           )(_mjsd(_tau, draft_in_step=False))
    method(f"mjsd-in-step-tau-{_tau}", backend="vllm-dsbd-in-step", needs_draft=True,
           description=f"MJSD, τ = {_tau} (T), an EAGLE-3 head drafting inside the verify step")(_mjsd(_tau))
