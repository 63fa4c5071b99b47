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
``stop``, ``stop_token_ids``, ``logprobs``, ``vllm_xargs`` and sampling
options when it builds them; patch 11 builds :class:`BeamRequestParams`
instead, which keep them. The beam request applies the stop rules as a
``generate`` beam request does (a hypothesis finishes at a stop string or
stop token as at EOS), returns the logprobs asked for, takes the DSBD knobs of
``vllm_xargs``, and is refused, naming them, for options a search does not
apply (``top_p``, ``top_k``, ``min_p``, penalties, ``logit_bias``, ...).
Offline, pass ``BeamRequestParams`` to ``LLM.beam_search`` for the same.
"""

from __future__ import annotations

from vllm.entrypoints.generate.beam_search.utils import BeamSearchOutput, BeamSearchSequence
from vllm.inputs import tokens_input
from vllm.sampling_params import BeamSearchParams, SamplingParams

from vllm_dsbd.engine.requests import BeamRequestError


#: Request options beam search does not apply (a search ranks by the model's own log-probs), with the
#: values besides None and empty that mean "unset". A use_beam_search request that sets one is refused.
_NOT_APPLIED_BY_SEARCH: dict[str, tuple] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,), "min_tokens": (0,), "logit_bias": (), "bad_words": (), "allowed_token_ids": (),
    "prompt_logprobs": (), "logprob_token_ids": (), "structured_outputs": (), "response_format": (),
    "thinking_token_budget": (), "repetition_detection": (),
}


def _is_set(name: str, value) -> bool:
    if value is None or (isinstance(value, (list, dict, str)) and not value):
        return False
    if name == "response_format":
        return getattr(value, "type", None) != "text"
    return value not in _NOT_APPLIED_BY_SEARCH[name]


class BeamRequestParams(BeamSearchParams):
    """``BeamSearchParams`` with what else a ``use_beam_search`` request asked for (vLLM's drop it).

    ``stop``, ``stop_token_ids``, ``logprobs`` and the DSBD knobs of ``vllm_xargs`` (``extra_args``) are
    honoured on a DSBD engine; ``not_applied`` names the options set that beam search does not apply,
    and a DSBD engine refuses the request for them (:func:`sampling_params_for`).
    """

    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    extra_args: dict | None = None
    not_applied: list[str] | None = None

    @classmethod
    def from_request(cls, params: BeamSearchParams, request) -> BeamRequestParams:
        """``params`` plus what else an OpenAI completion or chat ``request`` asked for."""
        fields = {name: getattr(params, name) for name in BeamSearchParams.__struct_fields__}
        stop = request.stop
        stops = [stop] if isinstance(stop, str) else stop
        logprobs = request.logprobs
        if isinstance(logprobs, bool):  # chat: logprobs is a switch, top_logprobs the count
            logprobs = (request.top_logprobs or 0) if logprobs else None
        sent = request.model_fields_set
        not_applied = [f"{name}={getattr(request, name)!r}" for name in _NOT_APPLIED_BY_SEARCH
                       if name in sent and _is_set(name, getattr(request, name, None))]
        return cls(**fields, stop=list(stops) if stops else None,
                   stop_token_ids=list(request.stop_token_ids) if request.stop_token_ids else None,
                   logprobs=logprobs, extra_args=dict(request.vllm_xargs) if request.vllm_xargs else None,
                   not_applied=not_applied or None)


def _search_knobs(params: BeamSearchParams) -> dict:
    """The beam request's extra_args: the search's width, length penalty and decoder, plus the request's
    other ``vllm_xargs``; a ``vllm_xargs`` knob that contradicts the search is refused by name."""
    xargs = dict(getattr(params, "extra_args", None) or {})
    search = {"beam_width": params.beam_width, "decoder": "dsbd"}
    if "length_penalty" in xargs and params.length_penalty == 1.0:
        search["length_penalty"] = xargs["length_penalty"]  # given only as a knob
    else:
        search["length_penalty"] = params.length_penalty
    for name, value in search.items():
        if name in xargs and xargs[name] != value:
            what = {"beam_width": "n", "decoder": "use_beam_search", "length_penalty": "length_penalty"}[name]
            raise BeamRequestError(
                f"vllm_xargs {name!r}={xargs[name]!r} contradicts {what} of this use_beam_search request "
                f"({name} = {value!r}); allowed: leave {name!r} out of vllm_xargs, or equal to {value!r}.",
                parameter=name, value=xargs[name])
    return {**xargs, **search}


def sampling_params_for(params: BeamSearchParams) -> SamplingParams:
    """The beam request that answers a ``BeamSearchParams`` (with what else a ``BeamRequestParams`` carries)."""
    if params.structured_outputs is not None:
        raise NotImplementedError("Beam search with structured outputs is not supported on a DSBD engine.")
    not_applied = getattr(params, "not_applied", None)
    if not_applied:
        raise BeamRequestError(
            f"use_beam_search does not apply {', '.join(not_applied)}: beam search keeps the hypotheses of highest "
            f"log-probability under the model's own distribution; allowed: leave them unset.",
            parameter=not_applied[0].partition("=")[0], value=not_applied)
    logprobs = getattr(params, "logprobs", None)
    return SamplingParams(
        n=params.beam_width,
        temperature=0.0,  # search: candidates ranked by raw log-probs, as vLLM's loop does
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        logprobs=0 if logprobs is None else logprobs,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        stop=getattr(params, "stop", None),
        stop_token_ids=getattr(params, "stop_token_ids", None),
        # "decoder": beam search even on an engine whose default decoder is MJSD
        extra_args=_search_knobs(params),
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
