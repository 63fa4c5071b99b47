"""Toy language models for tests and examples: random order-n Markov models.

A :class:`MarkovLM` is a ``logits_fn(sequences: list[list[int]]) -> [num_seqs, V]``
whose next-token logits depend only on the last ``order`` tokens (shorter
sequences are left-padded with token 0). Drafts with controllable agreement
come from :func:`perturbed_draft`; :meth:`MarkovLM.masked` gives a model zero
probability on chosen tokens, and :func:`perturbed_draft` with
``zero_target_top > 0`` gives a draft zero probability on the tokens the
target likes most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MarkovLM:
    """Next-token logits looked up by the last ``order`` tokens."""

    table: Tensor  # [V ** order, V] float32 logits, -inf = probability 0
    order: int

    @property
    def vocab_size(self) -> int:
        return self.table.shape[-1]

    def context_index(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        """[num_seqs] row of ``table`` for each sequence."""
        vocab, order = self.vocab_size, self.order
        ctx = torch.tensor([[0] * max(0, order - len(s)) + list(s[-order:]) for s in sequences], dtype=torch.long)
        ctx = ctx.reshape(len(sequences), order)
        weights = vocab ** torch.arange(order - 1, -1, -1, dtype=torch.long)
        return (ctx * weights).sum(-1)

    def __call__(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        return self.table[self.context_index(sequences)]

    def masked(self, tokens: Sequence[int]) -> MarkovLM:
        """This model with probability 0 on ``tokens`` in every context."""
        table = self.table.clone()
        table[:, list(tokens)] = float("-inf")
        return MarkovLM(table, self.order)


def random_markov(vocab_size: int, order: int = 1, seed: int = 0, scale: float = 1.5) -> MarkovLM:
    """Logits ~ N(0, scale^2), i.i.d. per context and token."""
    gen = torch.Generator().manual_seed(seed)
    return MarkovLM(scale * torch.randn((vocab_size**order, vocab_size), generator=gen), order)


def perturbed_draft(target: MarkovLM, agreement: float, seed: int = 1, scale: float = 1.5,
                    zero_target_top: int = 0) -> MarkovLM:
    """A draft: ``agreement * target + (1 - agreement) * fresh noise`` logits.

    agreement: 1.0 gives the target itself (on its finite logits), 0.0 an
    unrelated model. zero_target_top: in every context, the draft gives
    probability 0 to that many of the target's most likely tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    noise = scale * torch.randn(target.table.shape, generator=gen)
    finite = torch.isfinite(target.table)
    table = torch.where(finite, agreement * target.table.masked_fill(~finite, 0) + (1 - agreement) * noise, noise)
    if zero_target_top:
        top = target.table.topk(zero_target_top, dim=-1).indices
        table = table.scatter(-1, top, float("-inf"))
    return MarkovLM(table, target.order)
