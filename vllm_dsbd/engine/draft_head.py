"""A reduced-vocabulary head for the draft model (the ``draft_vocab_size`` knob).

On a CPU the draft's output layer is a large part of its cost: the
Qwen2.5-Coder-0.5B head has 151,936 rows (28 % of the model's weights), and
the head's matmul is paid for every row a draft step samples from. With
``draft_vocab_size = N`` the draft computes logits only for the ``N`` lowest
token ids (byte-level BPE vocabularies put their most frequent tokens there)
plus the tokenizer's special tokens (EOS, the chat markers), and gives every
other token the logit ``-inf``: the draft proposes nothing outside that set.

This keeps DSBD exact. The draft is only a proposal: its joint ``Q`` is
whatever the nodes were drawn from, and ``q = 0`` outside the subset is a
proposal like any other (the residual ``max(R - Q, 0)`` covers those tokens
at verification; at T 0 the target's own top-W decides). The target's
logits are untouched. What it costs is acceptance: a target token outside
the subset can never be drafted.

How: the draft model's ``LogitsProcessor._apply_head`` (vLLM 0.32.0: called
by ``_get_logits`` before the tensor-parallel gather and the padding slice;
pinned in ``patches.SUBCLASSED_SHA256``) is replaced, on the draft model
instance only, by a matmul with the subset's rows of this rank's shard,
scattered into ``-inf`` logits of the shard's width. The gather, the padding
slice and the scale then run as upstream.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor


def reduced_vocab_ids(vocab_size: int, draft_vocab_size: int, always: Iterable[int]) -> Tensor:
    """The sorted token ids the draft keeps: ``0 .. draft_vocab_size - 1`` and ``always`` (special tokens).

    vocab_size: the model's vocabulary (logits width). Returns [K] int64, ``K >= draft_vocab_size``.
    """
    if not 0 < draft_vocab_size < vocab_size:
        raise ValueError(f"DSBD knob 'draft_vocab_size'={draft_vocab_size} is invalid for a vocabulary of "
                         f"{vocab_size}; allowed: 0 (the whole vocabulary) or 1..{vocab_size - 1}.")
    extra = sorted({int(t) for t in always if draft_vocab_size <= int(t) < vocab_size})
    return torch.cat([torch.arange(draft_vocab_size), torch.tensor(extra, dtype=torch.long)])


def install_reduced_head(model: torch.nn.Module, token_ids: Tensor) -> None:
    """Make ``model.compute_logits`` compute only ``token_ids`` (-inf elsewhere); see the module docstring."""
    head = getattr(model, "lm_head", None)
    processor = getattr(model, "logits_processor", None)
    if head is None or processor is None or not hasattr(head, "shard_indices"):
        raise ValueError(f"DSBD knob 'draft_vocab_size' needs a draft with a vLLM lm_head and logits "
                         f"processor; {type(model).__name__} has none. Set draft_vocab_size to 0.")
    if processor.soft_cap is not None or getattr(head, "bias", None) is not None:
        raise ValueError(f"DSBD knob 'draft_vocab_size' does not support a draft whose head has a bias or a "
                         f"logit soft-cap ({type(model).__name__}). Set draft_vocab_size to 0.")
    shard = head.shard_indices
    start, end = shard.org_vocab_start_index, shard.org_vocab_end_index
    local = token_ids[(token_ids >= start) & (token_ids < end)] - start  # rows of this rank's shard
    local = local.to(head.weight.device)
    weight = head.weight.detach().index_select(0, local).contiguous()  # [K_local, hidden]
    num_rows = head.weight.shape[0]  # the shard's padded width, as upstream's matmul returns it

    def apply_head(lm_head, hidden_states: Tensor, embedding_bias: Tensor | None) -> Tensor:
        out = hidden_states.new_full((*hidden_states.shape[:-1], num_rows), float("-inf"), dtype=weight.dtype)
        out[..., local] = F.linear(hidden_states.to(weight.dtype), weight)
        return out

    processor._apply_head = apply_head
