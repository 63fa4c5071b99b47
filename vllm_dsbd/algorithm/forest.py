"""Forest bookkeeping: one group's draft forest as nodes, and as root-to-leaf paths.

A group's forest has ``R`` roots (layer 0: the input beams) and ``γ`` draft
layers of ``W`` slots each; slot ``j`` of layer ``i`` holds a node if the
draft drew one. Node ids are regular: roots ``0..R-1``, then draft node
``(i, j)`` is ``R + (i - 1) * W + j`` (absent slots keep their id, with
``exists = False``).

The engine verifies a forest on CPU as *paths*: one target request per
root-to-leaf path, sharing the KV of common prefixes (vLLM's stock causal
attention suffices). Each path position ``p`` yields the target's next-token
distribution after the node at ``p``; a node appearing in several paths takes
its distribution from exactly one *owning* occurrence, the first in path
order. Paths are in depth-first order (roots ascending, children by node id),
so the prefix a path shares with any earlier path is the prefix it shares
with the previous one (``num_shared``): those positions' KV can be forked
rather than recomputed. A root without children is a one-position path: its
distribution is still needed (layer 1 or the bonus draw).

Worked example (``R = 2``, ``W = 2``, ``γ = 2``)::

    layer 1: slot 0 = (parent root 0, token 5), slot 1 = (root 0, token 7)
    layer 2: slot 0 = (parent layer-1 slot 1, token 3), slot 1 = (slot 1, token 4)

    node ids    0 1 | 2 3 | 4 5          (roots | layer 1 | layer 2)
    parents    -1 -1  0 0   3 3
    leaves      1, 2, 4, 5
    paths       [0, 2]  [0, 3, 4]  [0, 3, 5]  [1]
    path_nodes  0 2 0 3 4 0 3 5 1,  cu_num_positions 0 2 5 8 9
    num_shared  0 1 2 0
    node_position (flat position of each node's owning occurrence)
                node 0 -> 0, 1 -> 8, 2 -> 1, 3 -> 3, 4 -> 4, 5 -> 7
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Forest:
    """One group's forest. Layer-0 tokens are -1 (the roots are whole input beams)."""

    parents: Tensor  # [num_nodes] parent node id, -1 for roots and absent slots
    tokens: Tensor  # [num_nodes]
    depths: Tensor  # [num_nodes] 0 for roots
    exists: Tensor  # [num_nodes] bool

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]


def build_forest(num_roots: int, draft_parents: Tensor, draft_tokens: Tensor, draft_exists: Tensor,
                 root_exists: Tensor | None = None) -> Forest:
    """Forest from per-layer draft slots.

    draft_parents: [γ, W] slot in layer i-1 (a root index for layer 1).
    draft_tokens: [γ, W]. draft_exists: [γ, W] bool. root_exists: [num_roots]
    bool (default all). With ``num_roots = W`` (input beams padded to W, as
    ``verify.verify_forest`` takes them) per-node rows reshape to ``[γ + 1, W, ...]``.
    """
    gamma, width = draft_parents.shape
    if root_exists is None:
        root_exists = torch.ones(num_roots, dtype=torch.bool)
    # first node id of the parents' layer, for layers 1..γ
    parent_offset = torch.tensor([0] + [num_roots + (i - 2) * width for i in range(2, gamma + 1)], dtype=torch.long)
    parent_ids = (draft_parents.long() + parent_offset[:gamma, None]).masked_fill(~draft_exists, -1)
    return Forest(
        parents=torch.cat([torch.full((num_roots,), -1, dtype=torch.long), parent_ids.flatten()]),
        tokens=torch.cat([torch.full((num_roots,), -1, dtype=torch.long), draft_tokens.long().flatten()]),
        depths=torch.cat([torch.zeros(num_roots, dtype=torch.long),
                          torch.arange(1, gamma + 1, dtype=torch.long).repeat_interleave(width)]),
        exists=torch.cat([root_exists.bool(), draft_exists.flatten()]),
    )


@dataclass
class ForestPaths:
    """Root-to-leaf paths of a forest, concatenated."""

    path_nodes: Tensor  # [num_positions] node id at each position
    cu_num_positions: Tensor  # [num_paths + 1] path k is path_nodes[cu[k]:cu[k+1]]
    num_shared: Tensor  # [num_paths] leading positions shared with earlier paths
    node_position: Tensor  # [num_nodes] flat position owning each node's distribution, -1 if absent

    @property
    def num_paths(self) -> int:
        return self.cu_num_positions.shape[0] - 1


def root_to_leaf_paths(forest: Forest) -> ForestPaths:
    """Expand a forest into depth-first root-to-leaf paths (see the module docstring)."""
    parents = forest.parents.tolist()
    exists = forest.exists.tolist()
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for node, (parent, present) in enumerate(zip(parents, exists)):
        if not present:
            continue
        if parent < 0:
            roots.append(node)
        else:
            children[parent].append(node)

    paths: list[list[int]] = []
    stack = [[root] for root in reversed(roots)]
    while stack:
        path = stack.pop()
        kids = children[path[-1]]
        if not kids:
            paths.append(path)
        stack.extend(path + [kid] for kid in reversed(kids))

    flat, cu, shared = [], [0], []
    node_position = [-1] * len(parents)
    previous: list[int] = []
    for path in paths:
        common = 0
        while common < min(len(path), len(previous)) and path[common] == previous[common]:
            common += 1
        shared.append(common)
        for pos, node in enumerate(path):
            if node_position[node] < 0:
                node_position[node] = len(flat) + pos
        flat.extend(path)
        cu.append(len(flat))
        previous = path
    return ForestPaths(
        path_nodes=torch.tensor(flat, dtype=torch.long),
        cu_num_positions=torch.tensor(cu, dtype=torch.long),
        num_shared=torch.tensor(shared, dtype=torch.long),
        node_position=torch.tensor(node_position, dtype=torch.long),
    )


def gather_node_rows(position_rows: Tensor, paths: ForestPaths) -> Tensor:
    """Per-node rows from per-position rows, each from the node's owning position.

    position_rows: [num_positions, ...] (e.g. target logits of every path position).
    Returns [num_nodes, ...]; rows of absent nodes are zero.
    """
    rows = position_rows[paths.node_position.clamp_min(0)]
    absent = (paths.node_position < 0).reshape(-1, *([1] * (rows.dim() - 1)))
    return rows.masked_fill(absent, 0)


def ancestor_mask(forest: Forest) -> Tensor:
    """[num_nodes, num_nodes] bool: ``mask[a, b]`` iff b is a or an ancestor of a (tree attention)."""
    num_nodes = forest.num_nodes
    mask = torch.eye(num_nodes, dtype=torch.bool) & forest.exists[:, None]
    parent = forest.parents.clone()
    rows = torch.arange(num_nodes)
    while bool((parent >= 0).any()):
        has = parent >= 0
        mask[rows[has], parent[has]] = True
        parent = torch.where(has, forest.parents[parent.clamp_min(0)], parent)
    return mask
