"""Bigram models made from a Llama checkpoint: the next token is a fixed permutation of the current one.

Every layer adds nothing, so the logits at a position depend on its token alone: the model is a bigram table
whose rows can be computed on their own (:func:`bigram_logprobs`), which makes exact beam sampling cheap to
simulate (``benchmarks.exact_reference``). The tests build their permutation targets and EAGLE-3 heads from
these (``tests/eagle3_heads.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

LOGIT_SCALE = 3.0  # the right token's logit is ~24, the others ~N(0, 9): one candidate dominates


def permutation(vocab: int, seed: int):
    import torch

    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def write_permutation_target(target_dir: Path, out_dir: Path, seed: int = 0, logit_scale: float = LOGIT_SCALE) -> Path:
    """The Llama target in ``target_dir`` turned into a bigram model: every layer adds nothing (zero ``o_proj`` and
    ``down_proj``), embeddings are unit rows, and the untied ``lm_head`` makes token ``perm[t]`` follow token t
    (``perm`` = :func:`permutation`). Every aux hidden state at position p is then the embedding of token p."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    w = load_file(str(target_dir / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    emb = emb / emb.norm(dim=-1, keepdim=True)
    w["model.embed_tokens.weight"] = emb.contiguous()
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    perm = permutation(emb.shape[0], seed)
    out = torch.empty_like(emb)
    out[perm] = emb  # row perm[t] is embedding t: the logit of perm[t] after t is the largest
    w["lm_head.weight"] = (out * logit_scale).contiguous()
    save_file(w, str(out_dir / "model.safetensors"))
    config = json.loads((target_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    manifest = out_dir / "dsbd-manifest.json"
    if manifest.exists():
        manifest.unlink()
    return out_dir


def bigram_logprobs(model_dir: Path, check_prompt):
    """``(tokens [n] -> log-probs [n, V], error)`` of the bigram model in ``model_dir``
    (:func:`write_permutation_target`), from its weights: with every layer adding nothing, the logits at a
    position are ``lm_head(norm(embed(t)))`` of its token ``t`` alone. ``error``: the largest difference from the
    full model's log-probs at the last position of ``check_prompt`` (token ids). Float32, in this process's torch
    threads."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    embed, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head

    def logprobs(tokens):
        with torch.inference_mode():
            return head(norm(embed(tokens))).float().log_softmax(-1)

    with torch.inference_mode():
        full = model(input_ids=torch.tensor([list(check_prompt)])).logits[0, -1].float().log_softmax(-1)
    return logprobs, float((full - logprobs(torch.tensor([check_prompt[-1]]))[0]).abs().max())
