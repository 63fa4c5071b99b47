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
