"""benchmarks/scoring.py: the shared-prefix scorer equals scoring each sequence alone."""

import math

from benchmarks import scoring
from benchmarks.harness import Prompt, RequestRecord


def test_cached_prompt_scores_equal_full_forwards_and_duplicates_score_once(tiny_pair):
    import torch
    from transformers import AutoModelForCausalLM

    prompts = [Prompt("a", "c", "", (5, 9, 17, 3)), Prompt("b", "c", "", (11, 2))]
    outputs = {"a": [[7, 8, 9], [7, 8, 9], [40, 1], []], "b": [[3, 3, 3, 3, 3]]}
    records = [RequestRecord(f"m{i}", pid, "c", 0, 0.0, [out]) for pid, outs in outputs.items()
               for i, out in enumerate(outs)]
    scoring.score(str(tiny_pair.target), prompts, records)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair.target), dtype=torch.float32).eval()
    by_id = {p.id: p for p in prompts}
    for r in records:
        alone = scoring.mean_logprob(model, by_id[r.prompt_id].token_ids, r.beams[0])
        if alone is None:
            assert r.mean_logprob is None
        else:
            assert math.isclose(r.mean_logprob, alone, rel_tol=1e-4, abs_tol=1e-5), (r, alone)
    assert records[0].mean_logprob == records[1].mean_logprob  # the same output, scored once
    assert records[0].mean_logprob != records[2].mean_logprob
