"""vLLM's ``beam_search`` API, answered by a DSBD engine's in-engine beam groups.

vLLM's own ``LLM.beam_search`` submits every beam as a new one-token request
at every step. On a DSBD engine each prompt becomes one beam request instead
(``SamplingParams(n=beam_width, extra_args={"beam_width": ...,
"length_penalty": ...})``) and the engine returns its ``beam_width`` best
hypotheses, which are repackaged as vLLM's ``BeamSearchOutput``.

The results are vLLM's beam-search results token for token. Like vLLM's
loop, which ranks candidates by raw log-probs, the search ignores
``temperature`` (the OpenAI server passes 1.0 when a request sets none);
beam *sampling* is asked for with ``generate`` / the completions API and
``extra_args={"beam_width": W}`` at a temperature > 0. One difference, by
design: each step's ``logprobs`` dict holds the chosen token only (vLLM's
holds the 2W candidates).

Both entry points are reached through ``vllm_dsbd.engine.patches`` (patches 8
and 9): ``LLM.beam_search`` offline, and the OpenAI server's
``use_beam_search`` (completions and chat completions). vLLM's
``BeamSearchParams`` has no stop rules, and its server drops a request's
``stop`` and ``stop_token_ids`` when it builds them; patch 11 builds
:class:`BeamRequestParams` instead, which keep them, and the beam request
applies them as a ``generate`` beam request does (a hypothesis finishes at a
stop string or stop token as at EOS). Offline, pass ``BeamRequestParams`` to
``LLM.beam_search`` for the same.
"""

from __future__ import annotations

from vllm.entrypoints.generate.beam_search.utils import BeamSearchOutput, BeamSearchSequence
from vllm.inputs import tokens_input
from vllm.sampling_params import BeamSearchParams, SamplingParams


class BeamRequestParams(BeamSearchParams):
    """``BeamSearchParams`` with the stop rules a beam request honours (vLLM's have none)."""

    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None

    @classmethod
    def with_stops(cls, params: BeamSearchParams, stop: str | list[str] | None,
                   stop_token_ids: list[int] | None) -> BeamRequestParams:
        """``params`` plus a request's ``stop`` (one string or a list) and ``stop_token_ids``."""
        fields = {name: getattr(params, name) for name in BeamSearchParams.__struct_fields__}
        stops = [stop] if isinstance(stop, str) else stop
        return cls(**fields, stop=list(stops) if stops else None,
                   stop_token_ids=list(stop_token_ids) if stop_token_ids else None)


def sampling_params_for(params: BeamSearchParams) -> SamplingParams:
    """The beam request that answers a ``BeamSearchParams`` (with a ``BeamRequestParams``' stop rules)."""
    if params.structured_outputs is not None:
        raise NotImplementedError("Beam search with structured outputs is not supported on a DSBD engine.")
    return SamplingParams(
        n=params.beam_width,
        temperature=0.0,  # search: candidates ranked by raw log-probs, as vLLM's loop does
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        logprobs=0,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        stop=getattr(params, "stop", None),
        stop_token_ids=getattr(params, "stop_token_ids", None),
        # "decoder": beam search even on an engine whose default decoder is MJSD
        extra_args={"beam_width": params.beam_width, "length_penalty": params.length_penalty, "decoder": "dsbd"},
    )


def vllm_builtin_beam_search(llm, prompts, params: BeamSearchParams, **kwargs) -> list[BeamSearchOutput]:
    """vLLM's own front-end beam-search loop, even on a DSBD engine (its requests are plain ones there).

    For side-by-side comparisons on one engine (demo, benchmarks).
    """
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin

    from vllm_dsbd.engine.upstream import original

    return original(BeamSearchOfflineMixin, "beam_search")(llm, prompts, params, **kwargs)


def offline_beam_search(llm, prompts, params: BeamSearchParams, lora_request=None,
                        use_tqdm: bool = False) -> list[BeamSearchOutput]:
    outputs = llm.generate(prompts, sampling_params_for(params), lora_request=lora_request, use_tqdm=use_tqdm)
    tokenizer = llm.get_tokenizer()
    return [to_beam_search_output(out, tokenizer, params) for out in outputs]


async def online_beam_search(serving, prompt, request_id: str, params: BeamSearchParams, lora_request=None,
                             trace_headers=None, session_id=None):
    """The OpenAI server's beam search (``use_beam_search``): one beam request, one final output."""
    from vllm.sampling_params import RequestOutputKind

    sampling_params = sampling_params_for(params)
    sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
    final = None
    async for out in serving.engine_client.generate(prompt, sampling_params, request_id, lora_request=lora_request,
                                                    trace_headers=trace_headers, session_id=session_id):
        final = out
    if final is not None:
        yield final


def to_beam_search_output(out, tokenizer, params: BeamSearchParams) -> BeamSearchOutput:
    """A RequestOutput of a beam request (completions best first) as vLLM's BeamSearchOutput."""
    prompt_ids = list(out.prompt_token_ids)
    sequences = []
    for completion in out.outputs:
        if completion.finish_reason == "abort" and not completion.token_ids:
            continue  # the group ended with fewer hypotheses than beams
        tokens = prompt_ids + list(completion.token_ids)
        sequences.append(BeamSearchSequence(
            orig_prompt=tokens_input(prompt_ids, prompt=out.prompt),
            tokens=tokens,
            logprobs=list(completion.logprobs or []),
            lora_request=out.lora_request,
            cum_logprob=completion.cumulative_logprob,
            text=tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        ))
    return BeamSearchOutput(sequences=sequences)
