"""Random-weight EAGLE-3 heads for a target, in the two checkpoint layouts vLLM 0.32 reads.

- ``"speculators"``: the speculators library's layout: ``config.json`` with
  ``speculators_model_type: "eagle3"``, the decoder layer's config in
  ``transformer_layer_config``, ``speculators_config`` (proposal method,
  verifier), weights ``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``;
- ``"eagle3"``: the original EAGLE-3 / SpecForge layout: a Llama config with
  ``architectures: ["LlamaForCausalLMEagle3"]`` and ``draft_vocab_size``, weights
  ``midlayer.*`` instead of ``layers.0.*``.

Neither has ``embed_tokens`` (shared with the target). The draft vocabulary is
the ``draft_vocab_size`` lowest token ids (``d2t`` all zeros).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.bigram import LOGIT_SCALE, write_permutation_target  # noqa: F401  (the permutation target)
from benchmarks.bigram import permutation as _permutation

LAYOUTS = ("speculators", "eagle3")


def head_weights(target: dict, draft_vocab_size: int, seed: int, prefix: str) -> dict:
    import torch

    h, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    w = {f"{prefix}.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
         f"{prefix}.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
         f"{prefix}.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
         f"{prefix}.self_attn.o_proj.weight": rand(h, heads * head_dim),
         f"{prefix}.mlp.gate_proj.weight": rand(inter, h), f"{prefix}.mlp.up_proj.weight": rand(inter, h),
         f"{prefix}.mlp.down_proj.weight": rand(h, inter)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"{prefix}.{norm}.weight"] = torch.ones(h)
    w["fc.weight"] = rand(h, 3 * h)
    w["norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = rand(draft_vocab_size, h) * 50
    w["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(target["vocab_size"], dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    w["t2d"] = t2d
    return w


def write_tiny_head(target_dir: Path, out_dir: Path, layout: str, draft_vocab_size: int = 1024,
                    seed: int = 0) -> Path:
    """A random EAGLE-3 head for the Llama target in ``target_dir``, written to ``out_dir`` (returned)."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    target = json.loads((Path(target_dir) / "config.json").read_text())
    # Residual-stream states entering layers 0, L // 2 and L (id i: the input of layer i, vLLM's numbering);
    # vLLM's default (2, L // 2, L - 3) does not fit a 2-layer target.
    layers = target["num_hidden_layers"]
    aux_ids = [0, layers // 2, layers]
    layer = {k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                                    "hidden_act", "bos_token_id", "eos_token_id") if k in target}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
                 rope_parameters=target.get("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default"}))
    if layout == "speculators":
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.9.0", "transformer_layer_config": layer,
                  "draft_vocab_size": draft_vocab_size, "norm_before_residual": False,
                  "target_hidden_size": target["hidden_size"], "eagle_aux_hidden_state_layer_ids": aux_ids,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": str(target_dir),
                                                      "architectures": target["architectures"]}}}
        prefix = "layers.0"
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab_size,
                  "eagle_aux_hidden_state_layer_ids": aux_ids}
        prefix = "midlayer"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(head_weights(target, draft_vocab_size, seed, prefix), str(out_dir / "model.safetensors"))
    return out_dir


# ---------------------------------------------------------------------------
# A head that reads the permutation target's next token from the features (the target: benchmarks/bigram.py).
# ---------------------------------------------------------------------------
def write_permutation_head(target_dir: Path, out_dir: Path, steps: int = 2, seed: int = 0,
                           logit_scale: float = LOGIT_SCALE, draft_tokens=None) -> Path:
    """A speculators-layout head for :func:`write_permutation_target` (same ``seed``) whose layer adds nothing and
    whose ``lm_head`` predicts ``perm^steps`` of the token its feature comes from. A head fed the feature of
    position p - 1 (EAGLE-3's layout) predicts token p + 1 with ``steps=2``; ``steps=1`` predicts token p again.
    ``draft_tokens``: the head's draft vocabulary (target token ids; its ``d2t`` / ``t2d``), else the whole one."""
    import torch
    from safetensors.torch import load_file, save_file

    head = write_tiny_head(target_dir, out_dir, "speculators", draft_vocab_size=1024, seed=seed)
    config = json.loads((head / "config.json").read_text())
    vocab = config["transformer_layer_config"]["vocab_size"]
    tokens = None if draft_tokens is None else torch.tensor(sorted(set(draft_tokens)))
    config["draft_vocab_size"] = vocab if tokens is None else len(tokens)  # the whole vocabulary: no d2t
    (head / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    w = load_file(str(head / "model.safetensors"))
    emb = load_file(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"]
    hidden = emb.shape[1]
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        w[name] = torch.zeros_like(w[name])
    fc = torch.zeros(hidden, 3 * hidden)
    fc[:, :hidden] = torch.eye(hidden)  # the first aux state (id 0: the embedding of the feature's token)
    w["fc.weight"] = fc
    perm = _permutation(emb.shape[0], seed)
    power = torch.arange(emb.shape[0])
    for _ in range(steps):
        power = perm[power]
    out = torch.empty_like(emb)
    out[power] = emb
    w["lm_head.weight"] = (out * logit_scale).contiguous()
    del w["d2t"], w["t2d"]
    if tokens is not None:  # the rows of the draft vocabulary, d2t[i] = token_i - i, t2d marks the tokens
        w["lm_head.weight"] = w["lm_head.weight"][tokens].contiguous()
        w["d2t"] = tokens - torch.arange(len(tokens))
        w["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        w["t2d"][tokens] = True
    save_file(w, str(head / "model.safetensors"))
    return head


def fake_teacher_shards(data_dir: Path, num_shards: int = 2, rows: int = 10, seed: int = 0) -> Path:
    """``draft.teacher`` shards of random prompts and answers (answers from the 2,000 lowest ids)."""
    import torch

    from vllm_dsbd.draft import teacher

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for s in range(num_shards):
        shard = [{"prompt": torch.randint(0, 49152, (10,), generator=gen).tolist(),
                  "answer": torch.randint(0, 2000, (30,), generator=gen).tolist()} for _ in range(rows)]
        torch.save({"index": s, "seed": seed, "num_tokens": 30 * rows, "rows": shard}, teacher.shard_path(data_dir, s))
    return data_dir
