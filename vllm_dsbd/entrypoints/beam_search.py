"""vLLM's ``beam_search`` API, answered by a DSBD engine's in-engine beam groups.

vLLM's own ``LLM.beam_search`` submits every beam as a new one-token request
at every step. On a DSBD engine each prompt becomes one beam request instead
(``SamplingParams(n=beam_width, extra_args={"beam_width": ...,
"length_penalty": ...})``) and the engine returns its ``beam_width`` best
hypotheses, which are repackaged as vLLM's ``BeamSearchOutput``.

Same results at temperature 0 (vLLM's beam-search rule, token for token).
Differences, by design: temperature > 0 runs beam *sampling* at that
temperature (vLLM's loop ranks by raw log-probs whatever the temperature);
each step's ``logprobs`` dict holds the chosen token only (vLLM's holds the
2W candidates); ``cum_logprob`` sums the raw log-probs of the chosen tokens.
"""

from __future__ import annotations

from vllm.entrypoints.generate.beam_search.utils import BeamSearchOutput, BeamSearchSequence
from vllm.inputs import tokens_input
from vllm.sampling_params import BeamSearchParams, SamplingParams


def sampling_params_for(params: BeamSearchParams) -> SamplingParams:
    """The beam request that answers a ``BeamSearchParams``."""
    if params.structured_outputs is not None:
        raise NotImplementedError("Beam search with structured outputs is not supported on a DSBD engine.")
    return SamplingParams(
        n=params.beam_width,
        temperature=params.temperature,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        logprobs=0,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        extra_args={"beam_width": params.beam_width, "length_penalty": params.length_penalty},
    )


def offline_beam_search(llm, prompts, params: BeamSearchParams, lora_request=None,
                        use_tqdm: bool = False) -> list[BeamSearchOutput]:
    outputs = llm.generate(prompts, sampling_params_for(params), lora_request=lora_request, use_tqdm=use_tqdm)
    tokenizer = llm.get_tokenizer()
    return [to_beam_search_output(out, tokenizer, params) for out in outputs]


def to_beam_search_output(out, tokenizer, params: BeamSearchParams) -> BeamSearchOutput:
    """A RequestOutput of a beam request (completions best first) as vLLM's BeamSearchOutput."""
    prompt_ids = list(out.prompt_token_ids)
    sequences = []
    for completion in out.outputs:
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
