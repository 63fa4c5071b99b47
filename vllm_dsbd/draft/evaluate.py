"""``vllm-dsbd eval-draft``: how well a draft agrees with its target, and what it costs.

On held-out prompts (``prompts.EVAL_PROMPTS``, never used for training) the
target samples an answer at T=1 (vLLM, seeded). Both models are then
teacher-forced on prompt + answer (Hugging Face, float32), and at every
answer position:

- ``alpha_t1`` / ``alpha_t07``: mean of sum_v min(p_v, q_v) with p, q the
  target's and the draft's next-token distributions at T=1 / T=0.7 (the
  expected acceptance of one speculative token);
- ``greedy_agreement``: mean of [argmax p == argmax q].

``cost_ratio``: median time of one draft forward over median time of one
target forward, each on a batch of 8 sequences x 4 new tokens over a
256-token KV cache (Hugging Face eager forward, float32, this CPU). The draft
measured is the assembled checkpoint vLLM loads (full 49,152-row head).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from vllm_dsbd.draft.prompts import EVAL_PROMPTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None,
                   help="draft checkpoint, or a `distill-draft --out` directory (assembled here with the target); "
                        "default: the shipped draft, assembled by `models prepare`")
    p.add_argument("--target", default=None, help="target checkpoint (default: the prepared SmolLM2)")
    p.add_argument("--out", default=None,
                   help="result file (default: eval.json in --draft, or the shipped draft's "
                        "vllm_dsbd/draft/default/eval.json)")
    p.add_argument("--num-prompts", type=int, default=len(EVAL_PROMPTS), help="held-out prompts measured")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest target answer per prompt")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampled answers")
    p.add_argument("--cost-repeats", type=int, default=60, help="timed forwards of each model")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads, for the in-process vLLM sampling and the HF forwards (default: torch's)")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $VLLM_DSBD_CACHE or ~/.cache/vllm-dsbd)")


def load(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def target_answers(llm, tokenizer, prompts, *, max_new_tokens: int, seed: int,
                   temperature: float = 1.0) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) with each answer sampled from the target (a vLLM ``LLM``) at ``temperature``."""
    from vllm_dsbd.draft import teacher

    ids = [teacher.chat_ids(tokenizer, p, teacher.TeacherConfig.max_prompt_tokens) for p in prompts]
    seeds = [teacher.request_seed(seed, 0, j) for j in range(len(ids))]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        teacher.sampling_params(seeds, max_new_tokens=max_new_tokens, top_k=None,
                                                temperature=temperature), use_tqdm=False)
    return [(p, list(o.outputs[0].token_ids)) for p, o in zip(ids, outs)]


def sample_held_out(target_dir: Path, prompts, *, max_new_tokens: int, seed: int, temperature: float = 1.0):
    """:func:`target_answers` in a vLLM engine started (and stopped) here."""
    from transformers import AutoTokenizer

    from vllm_dsbd.draft import teacher

    cfg = teacher.TeacherConfig(max_new_tokens=max_new_tokens, max_num_seqs=64, kv_cache_bytes=1 << 30)
    llm = teacher.start_engine(target_dir, cfg)
    try:
        return target_answers(llm, AutoTokenizer.from_pretrained(target_dir), prompts,
                              max_new_tokens=max_new_tokens, seed=seed, temperature=temperature)
    finally:
        llm.llm_engine.engine_core.shutdown()


def overlap(target_logits, draft_logits, d2t=None, scale: float = 1.0):
    """Per row, sum_x min(p(x), q(x)) (speculative sampling's alpha): p = softmax(target_logits) over the target's
    vocabulary, q = softmax(draft_logits / scale); with ``d2t`` q is over a head's draft vocabulary, draft id i
    standing for target id i + d2t[i] (q = 0 elsewhere)."""
    import torch

    p = torch.softmax(target_logits.float(), -1)
    q = torch.softmax(draft_logits.float() / scale, -1)
    if d2t is not None:
        p = p[..., torch.arange(q.shape[-1]) + d2t]
    return torch.minimum(p, q).sum(-1)


def agreement(target, draft, seqs, temperatures=None) -> dict:
    """Per-position alpha at each temperature and greedy agreement, averaged over all answer positions."""
    import torch

    if draft.config.vocab_size != target.config.vocab_size:
        name = getattr(draft.config, "_name_or_path", "") or "the draft"
        raise ValueError(f"{name}: vocabulary {draft.config.vocab_size} is not the target's "
                         f"{target.config.vocab_size} (a draft must share the target's tokens)")
    temperatures = temperatures or {"alpha_t1": 1.0, "alpha_t07": 0.7}
    sums = {k: 0.0 for k in temperatures}
    greedy, n = 0, 0
    for prompt, answer in seqs:
        ids = torch.tensor([prompt + answer[:-1]])
        sl = slice(len(prompt) - 1, len(prompt) - 1 + len(answer))  # positions predicting the answer
        with torch.inference_mode():
            lp = target(input_ids=ids).logits[0, sl].float()  # [L, V]
            lq = draft(input_ids=ids).logits[0, sl].float()
        for k, t in temperatures.items():
            sums[k] += overlap(lp / t, lq / t).sum().item()
        greedy += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        n += len(answer)
    out = {k: v / n for k, v in sums.items()}
    out["greedy_agreement"] = greedy / n
    out["positions"] = n
    return out


def timed_forward(model, *, batch: int = 8, context: int = 256, new: int = 4, seed: int = 0):
    """A function that runs one forward of [batch, new] tokens over a [batch, context] KV cache
    and returns its seconds."""
    import torch
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
    step = torch.randint(0, model.config.vocab_size, (batch, new), generator=g)
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ctx, past_key_values=cache)

    def run_once() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(input_ids=step, past_key_values=cache)
            dt = time.perf_counter() - t0
        cache.crop(-new)  # drop the new tokens again
        return dt

    return run_once


def cost_ratio(target, draft, repeats: int = 30, warmup: int = 3) -> dict:
    """Median draft forward time over median target forward time; the two alternate forward by
    forward so that both see the same load on a shared machine."""
    runs = {"target": timed_forward(target), "draft": timed_forward(draft)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(warmup + repeats):
        for k, run_once in runs.items():
            dt = run_once()
            if i >= warmup:
                times[k].append(dt)
    t, d = statistics.median(times["target"]), statistics.median(times["draft"])
    return {"cost_ratio": d / t, "target_forward_ms": 1e3 * t, "draft_forward_ms": 1e3 * d,
            "cost_repeats": repeats}


def run(args: argparse.Namespace) -> int:
    from vllm_dsbd import models
    from vllm_dsbd.draft import DEFAULT_DIR, distill, student

    target_dir = Path(args.target) if args.target else models.prepare_target(args.cache_dir)
    draft_dir = Path(args.draft) if args.draft else models.prepare_default_pair(args.cache_dir).draft
    out = Path(args.out) if args.out else (Path(args.draft) if args.draft else DEFAULT_DIR) / "eval.json"
    if (draft_dir / student.CONFIG).exists():  # shippable weights only: assemble with the target
        draft_dir = models.cache_root(args.cache_dir) / "eval-drafts" / draft_dir.resolve().name
        student.assemble(Path(args.draft), target_dir, draft_dir)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    prompts = list(EVAL_PROMPTS[: args.num_prompts])
    t0 = time.time()
    seqs = sample_held_out(target_dir, prompts, max_new_tokens=args.max_new_tokens, seed=args.seed)
    target, draft = load(target_dir), load(draft_dir)
    result = agreement(target, draft, seqs)
    result.update(cost_ratio(target, draft, repeats=args.cost_repeats))
    result.update({
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "draft_layers": draft.config.num_hidden_layers,
        "cost_setup": "HF forward, float32, batch 8 x 4 new tokens over a 256-token KV cache, "
                      "median of repeats, target and draft forwards alternating",
        "machine": distill.machine(),
        "date": distill.now(),
        "eval_seconds": round(time.time() - t0, 1),
    })
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    distill.write_json(out, result)
    print(json.dumps(result, indent=1))
    return 0
