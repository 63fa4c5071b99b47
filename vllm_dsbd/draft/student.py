"""The draft model: a shallow Llama that shares the target's embedding.

Trainable parts: ``K`` decoder layers (initialised from the target's first
``K``), the final norm, and a low-rank correction of the output layer:

    lm_head = E + A @ B        E: [V, H] target embedding (frozen, tied input)
                               A: [V, r], B: [r, H] (A starts at 0)

Only the trainable parts are shipped (``draft.safetensors``, float16);
:func:`assemble` rebuilds a plain Hugging Face Llama checkpoint from them and
the target (untied ``lm_head`` with the full 49,152-row vocabulary, as vLLM's
``draft_model`` method requires), so nothing at serving time knows about the
factorisation: vLLM runs an ordinary K-layer Llama.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

WEIGHTS = "draft.safetensors"
CONFIG = "draft-config.json"
FROZEN = "body.embed_tokens.weight"  # the target's embedding, never trained nor shipped


class Student(nn.Module):
    def __init__(self, target_config, num_layers: int, rank: int):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        cfg = LlamaConfig(**{**target_config.to_dict(), "num_hidden_layers": num_layers})
        cfg.tie_word_embeddings = False
        self.config = cfg
        self.body = LlamaModel(cfg)
        self.body.embed_tokens.weight.requires_grad_(False)
        self.head_a = nn.Parameter(torch.zeros(cfg.vocab_size, rank))  # [V, r]
        self.head_b = nn.Parameter(torch.randn(rank, cfg.hidden_size) / cfg.hidden_size**0.5)  # [r, H]

    @classmethod
    def from_target(cls, target, num_layers: int, rank: int) -> "Student":
        s = cls(target.config, num_layers, rank)
        sd = {k[len("model."):]: v for k, v in target.state_dict().items() if k.startswith("model.")}
        keep = {k: v for k, v in sd.items()
                if not k.startswith("layers.") or int(k.split(".")[1]) < num_layers}
        s.body.load_state_dict(keep, strict=True)
        return s

    def hidden(self, input_ids, attention_mask):  # [b, t] -> [b, t, H]
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).last_hidden_state

    def logits(self, h):  # [..., H] -> [..., V]
        emb = self.body.embed_tokens.weight
        return h @ emb.T + (h @ self.head_b.T) @ self.head_a.T

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen (target) embedding."""
        return {k: v for k, v in self.state_dict().items() if k != FROZEN}

    def shipped_state(self) -> dict[str, torch.Tensor]:
        sd = {f"model.{k}": v for k, v in self.body.state_dict().items() if k != "embed_tokens.weight"}
        sd["head_a"] = self.head_a.detach()
        sd["head_b"] = self.head_b.detach()
        return {k: v.detach().to(torch.float16).contiguous() for k, v in sd.items()}


def load_trainable(student: "Student", state: dict[str, torch.Tensor]) -> None:
    """Load a :func:`trainable_state` (the embedding stays the student's own)."""
    missing, unexpected = student.load_state_dict(state, strict=False)
    if set(missing) != {FROZEN} or unexpected:
        raise ValueError(f"checkpoint does not fit the student: missing {missing}, unexpected {unexpected}")


def save_shipped(student: Student, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = student.shipped_state()
    save_file(state, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    (out_dir / WEIGHTS).chmod(0o644)
    meta = {
        "num_hidden_layers": student.config.num_hidden_layers,
        "head_rank": int(student.head_a.shape[1]),
        "vocab_size": student.config.vocab_size,
        "hidden_size": student.config.hidden_size,
    }
    (out_dir / CONFIG).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def assemble(shipped_dir: Path, target_dir: Path, out_dir: Path) -> None:
    """Write a full HF Llama draft checkpoint (float32) into ``out_dir``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    shipped_dir, target_dir = Path(shipped_dir), Path(target_dir)
    meta = json.loads((shipped_dir / CONFIG).read_text())
    tcfg = AutoConfig.from_pretrained(target_dir)
    if tcfg.vocab_size != meta["vocab_size"] or tcfg.hidden_size != meta["hidden_size"]:
        raise ValueError(f"draft in {shipped_dir} does not fit target {target_dir}: {meta} vs {tcfg}")
    emb = target_embedding(target_dir)  # [V, H]
    w = {k: v.float() for k, v in load_file(str(shipped_dir / WEIGHTS)).items()}
    cfg = type(tcfg)(**{**tcfg.to_dict(), "num_hidden_layers": meta["num_hidden_layers"]})
    cfg.tie_word_embeddings = False
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg)
    sd = {k: v for k, v in w.items() if k.startswith("model.")}
    sd["model.embed_tokens.weight"] = emb
    sd["lm_head.weight"] = emb + w["head_a"] @ w["head_b"]
    model.load_state_dict(sd, strict=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out_dir)


def target_embedding(target_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(Path(target_dir) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()
