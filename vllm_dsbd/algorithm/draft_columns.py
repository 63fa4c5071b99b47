"""A layer's verification over the draft's own columns: W x (K + 1) entries instead of W x V.

A draft that proposes only the tokens of a set C of K columns (an EAGLE-3 head's draft vocabulary, a
reduced-vocabulary draft) has ``Q' = 0`` outside them. Outside C the residual ladder of
:mod:`.verify` (``R_{r+1} = norm(max(R_r - Q', 0))``) then only rescales the target: ``R_r(b, x) = P(b, x) /
M_r`` for ``x`` not in C, ``M_r`` the product of the masses so far. So a layer can be verified on vectors of
``W * (K + 1)`` entries: for each parent ``b`` its K columns of C (ascending), then one *outside* entry
holding ``P``'s mass at ``b`` outside C. On that vector every step of ``verify.verify_layer`` (the
residuals and their masses, the width DP's α, the gathers at the drafts) computes what it computes on the
``W * V`` one, up to the order of float sums: ``Q'`` is 0 at the outside entry as at every column it
stands for, and a residual scales those columns alike. A draw that lands on ``b``'s outside entry is
completed by a draw from ``P(b, .)`` outside C, which is what ``R_r`` is there, up to its scale.

Worked example (W 1, V 4, C = {0, 2}): ``P = (.4, .1, .3, .2)`` becomes ``(.4, .3 | .3)``, the last entry
``P(1) + P(3)``; a residual draw landing on it is finished as token 1 or 3 with odds .1 : .2.

Compacting costs one gather of the K columns, a fill and a sum over ``P`` per layer; each ladder level and
each draw then passes over ``W * (K + 1)`` entries. With the default pair's head (K 8,192 of V 49,152)
that is a sixth of the work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_dsbd.algorithm.joint import sample_from_uniforms


class DraftColumns:
    """The draft's columns ``support`` ([K] ascending token ids) of a vocabulary of ``vocab`` tokens, for layers
    of ``width`` parents."""

    def __init__(self, support: Tensor, vocab: int, width: int) -> None:
        self.support = support.long()
        self.vocab, self.width = vocab, width
        self.num_columns = self.support.numel()
        if not 0 < self.num_columns < vocab:
            raise ValueError(f"a draft support must hold 1..{vocab - 1} of the {vocab} tokens, "
                             f"got {self.num_columns}")
        # [W*K] flat pair indices of the columns: a flat gather is ten times faster on CPU than one along the
        # last dimension of [g, W, V]
        parents = torch.arange(width, device=self.support.device)[:, None] * vocab
        self._flat = (parents + self.support).flatten()

    @property
    def row(self) -> int:
        """Entries per parent in the compact layout: the K columns, then the outside entry."""
        return self.num_columns + 1

    def target(self, target: Tensor) -> tuple[Tensor, Tensor]:
        """``P`` [g, W*V] as its compact [g, W*(K+1)], and ``P`` outside C [g, W, V] (``target`` itself, the
        columns of C set to 0 in place), from which draws on the outside entries are finished."""
        num_groups = target.shape[0]
        inside = target.index_select(1, self._flat).view(num_groups, self.width, self.num_columns)
        target.index_fill_(1, self._flat, 0.0)
        full = target.view(num_groups, self.width, self.vocab)
        return torch.cat([inside, full.sum(-1, keepdim=True)], -1).view(num_groups, -1), full

    def draft(self, joint: Tensor) -> Tensor:
        """A draft joint over C ([g, W*K]) in the compact layout: 0 at each outside entry. [g, W*(K+1)]."""
        num_groups = joint.shape[0]
        return F.pad(joint.view(num_groups, self.width, self.num_columns), (0, 1)).view(num_groups, -1)

    def index(self, flat: Tensor) -> Tensor:
        """Compact indices of flat pair indices ``parent * V + token``; a token outside C maps to its parent's
        outside entry (where ``Q'`` is 0, so such a draft is never accepted)."""
        parent, token = flat // self.vocab, flat % self.vocab
        column = torch.searchsorted(self.support, token).clamp(max=self.num_columns - 1)
        column = torch.where(self.support[column] == token, column, self.num_columns)
        return parent * self.row + column

    def flat(self, index: Tensor, outside: Tensor, uniforms_for: Callable[[Tensor, int], Tensor]) -> Tensor:
        """Flat pair indices of compact draws ``index`` [g, S]. A draw on parent ``b``'s outside entry becomes a
        draw from ``outside[g, b]`` (:meth:`target`) with a uniform of ``uniforms_for(groups, S)`` ([len(groups),
        S], asked only for the groups that have such draws)."""
        parent, column = index // self.row, index % self.row
        flat = parent * self.vocab + self.support[column.clamp(max=self.num_columns - 1)]
        off = column == self.num_columns
        if not bool(off.any()):
            return flat
        groups = off.any(-1).nonzero()[:, 0]
        u = uniforms_for(groups, index.shape[1])
        rows, slots = off[groups].nonzero(as_tuple=True)
        g, b = groups[rows], parent[groups[rows], slots]
        tokens = sample_from_uniforms(outside[g, b], u[rows, slots][:, None])[:, 0]
        flat[g, slots] = b * self.vocab + tokens
        return flat
