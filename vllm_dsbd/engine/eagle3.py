"""EAGLE-3 heads as DSBD drafts: the target's features, paged like its KV cache.

An EAGLE-3 head (one decoder layer, ``vllm/model_executor/models/llama_eagle3.py``)
predicts token p + 1 from the embedding of token p and a feature g of position
p - 1: the target's ``fc(aux hidden states)`` where the target computed p - 1,
else the head's own output there (its earlier draft step). DSBD keeps those
features in a :class:`FeatureCache` indexed by KV-cache slot, so every fork of a
beam (shared blocks, a copied tail block) carries its features as it carries its
KV: target steps write ``fc(aux)`` at every token they compute, draft steps read
the slot of p - 1 (zeros at position 0) and write the head's output at each
request's last token. docs/dev/eagle3-design.md has the layout and why.
"""

from __future__ import annotations

from typing import Any

import torch


def head_architecture(hf_config: Any) -> str | None:
    """The EAGLE-3 architecture of a draft's config (speculators ``Eagle3LlamaForCausalLM``, the original
    ``LlamaForCausalLMEagle3``, ...), None for a plain draft model."""
    archs = getattr(hf_config, "architectures", None) or []
    return next((a for a in archs if "eagle3" in a.lower()), None)


def draft_targets(d2t: torch.Tensor) -> torch.Tensor:
    """The target token id of each draft id ``i``: ``i + d2t[i]`` (vLLM's draft-to-target offsets)."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.detach().long()


def _head_targets(head: Any) -> torch.Tensor | None:
    d2t = getattr(head, "draft_id_to_target_id", None)
    return None if d2t is None else draft_targets(d2t)


def draft_vocabulary(head: Any) -> torch.Tensor | None:
    """The target token ids a head can propose, ascending: ``i + d2t[i]`` for each draft id ``i`` (vLLM's
    ``compute_logits`` gives every other token the logit -inf); None for a head over the whole vocabulary."""
    targets = _head_targets(head)
    return None if targets is None else targets.sort().values


def draft_vocabulary_order(head: Any) -> torch.Tensor | None:
    """The draft ids of a head's draft vocabulary in the order of :func:`draft_vocabulary` (ascending target
    ids), for :func:`draft_vocabulary_logits`; None for a head over the whole vocabulary."""
    targets = _head_targets(head)
    return None if targets is None else targets.argsort()


def draft_vocabulary_logits(head: Any, hidden_states: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The head's logits over its draft vocabulary only: [rows, K], column ``j`` the token
    ``draft_vocabulary(head)[j]``. vLLM's ``compute_logits`` without its last move, the scatter into a
    [rows, V] tensor of -inf (``order``: :func:`draft_vocabulary_order`)."""
    return head.logits_processor(head.lm_head, hidden_states).index_select(-1, order)


class FeatureCache:
    """One feature row per KV-cache slot of the target's KV-cache group: ``[num_blocks * block_size, width]``."""

    def __init__(self, num_blocks: int, block_size: int, width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.features = torch.zeros((num_blocks * block_size, width), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.features.numel() * self.features.element_size()

    def copy_blocks(self, copies) -> None:
        """The scheduler's copy-on-write block copies ``[(src, dst), ...]``, as vLLM applies them to the KV cache."""
        if not copies:
            return
        pairs = torch.as_tensor(copies, dtype=torch.long, device=self.features.device).reshape(-1, 2)
        blocks = self.features.view(self.num_blocks, -1, self.features.shape[-1])
        blocks[pairs[:, 1]] = blocks[pairs[:, 0]]

    def write(self, slots: torch.Tensor, features: torch.Tensor) -> None:
        """``features[i]`` at ``slots[i]``; negative slots (padding) are skipped."""
        keep = slots >= 0
        if not bool(keep.all()):
            slots, features = slots[keep], features[keep]
        self.features[slots] = features.to(self.features.dtype)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The features at ``slots``; zeros where a slot is negative (position 0, padding)."""
        rows = self.features[slots.clamp(min=0)]
        return rows.masked_fill((slots < 0).unsqueeze(-1), 0)


def previous_slots(positions: torch.Tensor, req_indices: torch.Tensor, block_table: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    """The KV slot of position p - 1 of each row's request (-1 where p = 0), from the block table
    ``[num_reqs, max_blocks]`` that vLLM's slot mapping uses (same block size)."""
    prev = positions.long() - 1
    safe = prev.clamp(min=0)
    blocks = block_table[req_indices.long(), safe // block_size].long()
    return torch.where(prev >= 0, blocks * block_size + safe % block_size, torch.full_like(prev, -1))


def aux_layer_ids(head_config: Any, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input states the head reads, as vLLM's runner picks them
    (``GPUModelRunner._get_eagle3_aux_layers_from_config``, else the target's default ``(2, L // 2, L - 3)``),
    sorted (vLLM exports them in ascending order)."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        eagle = getattr(head_config, "eagle_config", None)
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    return tuple(sorted(set(ids or (2, target_layers // 2, target_layers - 3))))


def _num_aux_inputs(head_config: Any) -> int:
    """How many aux states the head's ``fc`` takes (``llama_eagle3.LlamaModel``'s rule)."""
    if getattr(head_config, "num_aux_hidden_states", None):
        return int(head_config.num_aux_hidden_states)
    eagle = getattr(head_config, "eagle_config", None)
    if isinstance(eagle, dict) and eagle.get("eagle_aux_hidden_state_layer_ids"):
        return len(eagle["eagle_aux_hidden_state_layer_ids"])
    return 3


def check_head(head_config: Any, target_config: Any, head_dir: str | None) -> None:
    """Refuse, at engine start, an EAGLE-3 head that does not fit the target, naming the mismatch: hidden
    sizes, aux layer ids, and (from the checkpoint, when it is a local folder) the d2t vocabulary map."""
    name = head_dir or "the EAGLE-3 head"
    layers, hidden = target_config.num_hidden_layers, target_config.hidden_size
    ids = aux_layer_ids(head_config, layers)
    if ids[0] < 0 or ids[-1] > layers:
        raise ValueError(f"EAGLE-3 head {name}: aux layer ids {list(ids)} must lie in 0..{layers} (the target has "
                         f"{layers} layers; id i is the state entering layer i, id 0 the embeddings); set "
                         "eagle_aux_hidden_state_layer_ids in the head's config.")
    want = _num_aux_inputs(head_config)
    if len(ids) != want:
        raise ValueError(f"EAGLE-3 head {name}: its fc takes {want} aux hidden states, but its aux layer ids "
                         f"{list(ids)} name {len(ids)}.")
    target_hidden = getattr(head_config, "target_hidden_size", None) or head_config.hidden_size
    if target_hidden != hidden:
        raise ValueError(f"EAGLE-3 head {name}: it reads target hidden states of size {target_hidden} "
                         f"(target_hidden_size), the target's hidden_size is {hidden}.")
    weights = _checkpoint_tensors(head_dir, ("d2t", "embed_tokens.weight", "model.embed_tokens.weight"))
    if not any("embed_tokens" in k for k in weights) and head_config.hidden_size != hidden:
        raise ValueError(f"EAGLE-3 head {name}: hidden_size {head_config.hidden_size} differs from the target's "
                         f"{hidden}, and the head has no embeddings of its own (it shares the target's).")
    d2t = weights.get("d2t")
    vocab = target_config.vocab_size
    draft_vocab = getattr(head_config, "draft_vocab_size", None) or vocab
    if d2t is not None:
        targets = draft_targets(d2t)
        if (d2t.shape[0] != draft_vocab or int(targets.min()) < 0 or int(targets.max()) >= vocab
                or targets.unique().numel() != d2t.shape[0]):
            raise ValueError(f"EAGLE-3 head {name}: its d2t map ({d2t.shape[0]} entries) must send each of its "
                             f"draft_vocab_size={draft_vocab} ids to a distinct target id in 0..{vocab - 1}.")
    elif draft_vocab != vocab:
        raise ValueError(f"EAGLE-3 head {name}: draft_vocab_size={draft_vocab} is not the target's vocabulary "
                         f"({vocab}), and the checkpoint has no d2t map.")


def _checkpoint_tensors(head_dir: str | None, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of ``names`` in a local safetensors checkpoint (none for a hub id or another format)."""
    from pathlib import Path

    if not head_dir or not Path(head_dir).is_dir():
        return {}
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(head_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys() if k in names})
    return out


def share_target_embeddings(head: Any, target: Any) -> bool:
    """A head saved without ``embed_tokens`` (the usual EAGLE-3 checkpoint) gets the target's; in another
    dtype (``draft_dtype``), a cast copy. Returns whether the head had none."""
    if getattr(head, "has_own_embed_tokens", True):
        return False
    source = target.model.embed_tokens
    own = head.model.embed_tokens
    if source.weight.shape != own.weight.shape:
        raise ValueError(f"EAGLE-3 head: its embeddings {tuple(own.weight.shape)} do not fit the target's "
                         f"{tuple(source.weight.shape)}, and the head has none of its own to load.")
    if source.weight.dtype == own.weight.dtype:
        head.model.embed_tokens = source
    else:
        with torch.no_grad():
            own.weight.copy_(source.weight)
    return True
