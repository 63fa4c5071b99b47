"""One quality score for every method: log-likelihood under the target.

Each request's best returned sequence is scored by teacher forcing
``prompt + output`` through the target in Hugging Face transformers, float32,
one sequence at a time (no padding), after all engines are shut down. The
same code scores every method, so differences come from the outputs alone.
A prompt's key-value cache is computed once and shared by its outputs, and an
output several methods returned (greedy and ``draft_model``, beam search with
and without a draft) is scored once.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.harness import Prompt, RequestRecord

SCORING = "mean per-token log-likelihood of the best sequence under the target (transformers, float32, teacher-forced)"


def mean_logprob(model, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> float | None:
    """Mean log p(output_t | prompt, output_<t) under ``model``; None for an empty output."""
    import torch

    if not output_ids:
        return None
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()  # [len, vocab]
    # Position i predicts token i + 1: the outputs are predicted by positions len(prompt)-1 ...
    start = len(prompt_ids) - 1
    logprobs = torch.log_softmax(logits[start:-1], dim=-1)  # [len(output), vocab]
    picked = logprobs.gather(1, torch.tensor(output_ids).unsqueeze(1))  # [len(output), 1]
    return picked.mean().item()


def load_scorer(target: str):
    """The target in transformers, float32, in eval mode: the model every score here is computed with."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def score_outputs(model, prompt: Sequence[int], outputs) -> dict[tuple[int, ...], float | None]:
    """:func:`mean_logprob` of each distinct output of one prompt, the prompt's key-value cache computed once."""
    import torch
    from transformers import DynamicCache

    prompt = list(prompt)
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
    scored: dict[tuple[int, ...], float | None] = {}
    for output in map(tuple, outputs):
        if output not in scored:
            scored[output] = _mean_logprob_cached(model, cache, prompt, output)
            if output:
                cache.crop(-len(output))  # back to the prompt
    return scored


def score(target: str, prompts: Sequence[Prompt], records: Sequence[RequestRecord]) -> None:
    """Set ``mean_logprob`` on every record (loads the target once)."""
    model = load_scorer(target)
    by_prompt: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt_id, []).append(r)
    for p in prompts:
        if p.id not in by_prompt:
            continue
        scored = score_outputs(model, p.token_ids, [r.beams[0] for r in by_prompt[p.id]])
        for r in by_prompt[p.id]:
            r.mean_logprob = scored[tuple(r.beams[0])]


def _mean_logprob_cached(model, cache, prompt: list[int], output: Sequence[int]) -> float | None:
    """:func:`mean_logprob` with the prompt's first ``len(prompt) - 1`` positions already in ``cache``."""
    import torch

    if not output:
        return None
    ids = torch.tensor([[prompt[-1], *output[:-1]]])
    with torch.inference_mode():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(list(output)).unsqueeze(1))
    return picked.mean().item()
