"""The fuzz run's requests and answers, shared by the offline (:mod:`benchmarks.fuzz`) and served
(:mod:`benchmarks.fuzz_served`) transports: a request as a user sends it, and what came back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "List three fruits:\n1."]


@dataclass
class Spec:
    """One request as a user sends it: the decoder, the prompt, the options and the knobs (extra_args)."""

    kind: str
    prompt: str
    options: dict[str, Any]
    knobs: dict[str, Any] = field(default_factory=dict)
    abort_after: int | None = None  # engine steps (offline) or seconds (served) before the client aborts
    api: bool = False  # offline: through LLM.beam_search (kind beam_search) rather than the mixed batch

    def __repr__(self) -> str:
        prompt = self.prompt if len(self.prompt) < 80 else f"{self.prompt[:20]!r}... ({len(self.prompt)} chars)"
        options = {k: (f"<{len(v)} ids {v[0]}..{v[-1]}>" if isinstance(v, list) and len(v) > 8 else v)
                   for k, v in self.options.items()}
        extra = f", abort_after={self.abort_after}" if self.abort_after else ""
        return f"Spec({self.kind}, {prompt!r}, {options}, knobs={self.knobs}{extra}{', api' if self.api else ''})"

    @property
    def n(self) -> int:
        return self.options.get("n", 1)

    @property
    def greedy(self) -> bool:
        return self.kind == "beam_search" or self.options.get("temperature", 1.0) == 0.0

    def names(self) -> set[str]:
        """What a refusal may name: the options and knobs set, the prompt, and the knobs' carrier."""
        return set(self.options) | set(self.knobs) | {"prompt", "extra_args", "vllm_xargs", "max_model_len"}

    def sampling_params(self):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        from vllm_dsbd.entrypoints.beam_search import sampling_params_for

        options = dict(self.options)
        if "structured_outputs" in options:
            options["structured_outputs"] = StructuredOutputsParams(**options["structured_outputs"])
        if self.kind == "beam_search":  # what LLM.beam_search and the server's use_beam_search submit
            return sampling_params_for(self.beam_search_params())
        return SamplingParams(**options, extra_args=dict(self.knobs) or None)

    def beam_search_params(self):
        """A beam-search request's ``BeamRequestParams``: its stop rules, logprobs and knobs, and the options
        a search does not apply named in ``not_applied``, as the server's use_beam_search builds them."""
        from vllm_dsbd.entrypoints.beam_search import BeamRequestParams

        options = dict(self.options)
        own = {k: options.pop(k) for k in ("stop", "stop_token_ids", "logprobs", "include_stop_str_in_output",
                                           "ignore_eos") if k in options}
        not_applied = [f"{k}={v!r}" for k, v in options.items()
                       if k not in ("n", "max_tokens", "temperature", "seed", "detokenize")]
        return BeamRequestParams(beam_width=options.get("n", 1), max_tokens=options["max_tokens"],
                                 not_applied=not_applied or None, extra_args=self.knobs or None, **own)


@dataclass
class Completion:
    token_ids: list[int]
    text: str | None  # None where the transport does not return the completion's own text
    finish_reason: str | None
    stop_reason: Any
    logprobs: list | None  # per token: the ids (offline) or strings (served) it holds


@dataclass
class Result:
    outcome: str  # "answered", "refused", "aborted" or "failed"
    completions: list[Completion] = field(default_factory=list)
    message: str = ""
