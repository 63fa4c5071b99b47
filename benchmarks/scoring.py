"""One quality score for every method: log-likelihood under the target.

Each request's best returned sequence is scored by teacher forcing
``prompt + output`` through the target in Hugging Face transformers, float32,
one sequence at a time (no padding), after all engines are shut down. The
same code scores every method, so differences come from the outputs alone.
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


def score(target: str, prompts: Sequence[Prompt], records: Sequence[RequestRecord]) -> None:
    """Set ``mean_logprob`` on every record (loads the target once)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    by_id = {p.id: p for p in prompts}
    for r in records:
        r.mean_logprob = mean_logprob(model, by_id[r.prompt_id].token_ids, r.beams[0])
