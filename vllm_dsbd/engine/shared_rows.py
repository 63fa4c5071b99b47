"""Forest nodes that several verification paths share, computed once by the target (on CPU).

Each root-to-leaf path of a verified forest is one vLLM request, so a node on several paths (a root with
several children, a draft node with several below it) would be a row of each of them. With
``BeamGroup.share_path_rows`` (the scheduler sets it on CPU, where every row of a forward costs) a later
path's request holds the nodes an earlier path computes as *computed* tokens (``VerifyStep.shared``): its
rows start at its first own node. Its attention still reads those nodes' K/V at their positions in its
own blocks, so the target's KV update writes them there too: vLLM runs each attention layer's KV update
for the whole batch (``unified_kv_cache_update``) before that layer's attention reads the cache, and
:class:`SharedRowsImpl` makes that update also write the computing rows' keys and values to the later
paths' slots. The EAGLE-3 feature cache gets their features the same way (the head reads the feature of
a token's previous position from its request's slots).

A group's paths are verified in the same step or not at all (a group never advances partially), so the
computing rows are in every forward whose copies this module plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass
class RowCopies:
    """One forward's copies: ``rows[i]`` (a row of the forward) to ``slots[gid][i]`` in each KV-cache group."""

    rows: Tensor
    slots: dict[int, Tensor]


class SharedRows:
    """The copies of the forward in flight (None: none), read by every :class:`SharedRowsImpl`."""

    def __init__(self) -> None:
        self.now: RowCopies | None = None


class SharedRowsImpl:
    """Wraps a target attention layer's impl: its KV update also writes the shared rows (:class:`SharedRows`);
    everything else is the wrapped impl's."""

    def __init__(self, inner: Any, shared: SharedRows, group: int) -> None:
        self.inner, self.shared, self.group = inner, shared, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        copies = self.shared.now
        if copies is not None:
            self.inner.do_kv_cache_update(layer, key[copies.rows], value[copies.rows], kv_cache,
                                          copies.slots[self.group])


def install(model: torch.nn.Module, shared: SharedRows, layer_groups: dict[str, int]) -> int:
    """Wrap each attention layer of ``model`` (the target) whose KV-cache group is known; returns how many."""
    from vllm.model_executor.layers.attention.attention import Attention

    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and module.layer_name in layer_groups \
                and not isinstance(module.impl, SharedRowsImpl):
            if not hasattr(module.impl, "do_kv_cache_update"):
                raise NotImplementedError(f"{type(module.impl).__name__} writes its KV inside its forward; DSBD's "
                                          "shared forest rows need vLLM's separate KV update")
            module.impl = SharedRowsImpl(module.impl, shared, layer_groups[module.layer_name])
            count += 1
    return count


def attach(runner, kv_cache_config) -> set[int]:
    """Wrap the runner's target attention layers (:func:`install`, their ``runner._dsbd_shared``); returns the
    KV-cache groups whose slots the copies fill: the target layers', and the EAGLE-3 features' (a head)."""
    target = {m.layer_name for m in runner.get_model().modules() if hasattr(m, "layer_name")}
    layer_groups = {name: gid for gid, group in enumerate(kv_cache_config.kv_cache_groups)
                    for name in group.layer_names if name in target}
    install(runner.get_model(), runner._dsbd_shared, layer_groups)
    return set(layer_groups.values()) | ({runner._dsbd_features_gid} if runner._dsbd_features is not None else set())


def copies_for(runner, verify_steps) -> RowCopies | None:
    """A verify forward's copies (:func:`plan`) from the runner's input batch, None if none."""
    if not runner._dsbd_shared_groups or not any(vs.shared for vs in verify_steps):
        return None
    tables = {gid: (runner.input_batch.block_table[gid].block_table.np, runner.input_batch.block_table[gid].block_size)
              for gid in runner._dsbd_shared_groups}
    return plan(verify_steps, runner.input_batch.req_id_to_index, runner.query_start_loc.np, tables, runner.device)


def plan(verify_steps, req_index: dict[str, int], query_start_loc: np.ndarray,
         tables: dict[int, tuple[np.ndarray, int]], device) -> RowCopies | None:
    """This forward's copies: for each path's shared nodes (``VerifyStep.shared``), the row of the path that
    computes the node (the first path through it, where it is among the request's last rows) and the slot
    of the node's position in the later path's blocks, per KV-cache group (``tables``: block table rows by
    request index, block size). ``query_start_loc``: each request's first row, by request index. None: no
    shared node."""
    rows, reqs, positions = [], [], []
    for vs in verify_steps:
        if not vs.shared:
            continue
        row_of: dict[int, int] = {}
        for k, (rid, path) in enumerate(zip(vs.path_req_ids, vs.paths)):
            end = int(query_start_loc[req_index[rid] + 1])
            for offset in range(vs.skip(k), len(path)):
                row_of.setdefault(path[offset], end - (len(path) - offset))
        for k, (rid, path) in enumerate(zip(vs.path_req_ids, vs.paths)):
            for offset in range(vs.skip(k)):  # the root's last token sits at seq_len - 1
                rows.append(row_of[path[offset]])
                reqs.append(req_index[rid])
                positions.append(vs.seq_len - 1 + offset)
    if not rows:
        return None
    reqs_np, pos_np = np.asarray(reqs), np.asarray(positions)
    slots = {gid: torch.from_numpy(table[reqs_np, pos_np // size].astype(np.int64) * size + pos_np % size).to(device)
             for gid, (table, size) in tables.items()}
    return RowCopies(torch.tensor(rows, device=device), slots)
