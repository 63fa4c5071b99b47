"""An EAGLE-3 head's forward over forest rows, outside vLLM's paged KV (groundwork for drafting inside the
verify step: step 9 of docs/dev/eagle3-design.md).

A *forest row* is one token of a draft forest being built inside a worker step: a new beam's last token
(its bonus), or a draft node. It attends, in its one head layer, to

1. its beam's context: the head's KV at positions ``0 .. context_len - 1`` of a request's paged blocks
   (``block_table``), which target steps keep up to date;
2. its ancestors in the forest: rows of earlier :func:`head_forward` calls of the same step, whose K/V
   this module keeps in a :class:`ScratchKV` instead of the paged cache (siblings would clash there:
   several children of one node sit at the same position of the same request);
3. itself.

A row may also write its K/V to a paged slot (``ForestRows.slots``: verified tokens, whose head KV later
iterations read as context); draft rows are written nowhere but the scratch. The head runs as it does in
a draft step (vLLM's own module, its rotary embedding and projections); only its attention kernel is
swapped, per call, through the layer's ``impl`` (:class:`ForestAttentionImpl`, installed once; any other
metadata goes to vLLM's kernel). The call's attention is one masked ``scaled_dot_product_attention``
batched by context: each context (read once, all in one gather) with the scratch rows its rows name is one
batch entry, so a call's cost grows with the groups drafting in it, not with their square.

vLLM 0.32's CPU cache keeps each block as ``[kv_heads, 2 * block_size, head_dim]``: values plain in the
second half, keys in an ISA-specific packing in the first. The packing is read once, by writing known
keys with the backend's own ``do_kv_cache_update`` into a one-block cache (:class:`PagedKVReader`); plain
and transposed blocks (the "vec" and "vec16" ISAs) are then read as views, any other packing element by
element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


class PagedKVReader:
    """Reads the K/V of positions ``0 .. n - 1`` of a request from one attention layer's paged CPU cache."""

    def __init__(self, layer: Any, impl: Any, kv_cache: Tensor) -> None:
        if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
            raise NotImplementedError(f"forest attention reads vLLM's CPU KV layout [blocks, kv_heads, block_size, "
                                      f"2 * head_dim]; this cache is {tuple(kv_cache.shape)}")
        _, self.kv_heads, self.block_size, two_dims = kv_cache.shape
        self.head_dim = two_dims // 2
        key_pos, value_pos = _probe_layout(layer, impl, kv_cache.dtype, self.kv_heads, self.block_size, self.head_dim)
        self.key_layout, self.value_layout = (self._layout(pos) for pos in (key_pos, value_pos))

    def read(self, kv_cache: Tensor, block_tables: list[Tensor], lengths: list[int]) -> tuple[Tensor, Tensor, list[int]]:
        """K, V of the first ``lengths[i]`` positions of each request ``i`` (its blocks ``block_tables[i]``, in
        order), the requests one after another, each padded to whole blocks: [N, kv_heads, hd] each, and the
        row where each request's positions start. One gather for all of them."""
        counts = [-(-n // self.block_size) for n in lengths]
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count * self.block_size)
        if sum(counts) == 0:
            empty = kv_cache.new_zeros((0, self.kv_heads, self.head_dim))
            return empty, empty, starts
        used = torch.cat([blocks[:count] for blocks, count in zip(block_tables, counts)]).long()
        area = kv_cache[used].reshape(used.shape[0], self.kv_heads, -1)  # [b, kvh, 2 * bs * hd]

        def flat(layout: tuple[int, bool] | Tensor) -> Tensor:  # [b * bs, kvh, hd]
            b, kvh, bs, hd = used.shape[0], self.kv_heads, self.block_size, self.head_dim
            if isinstance(layout, Tensor):  # any other packing: gather each element
                blocks = area[:, :, layout].view(b, kvh, bs, hd)
            else:
                base, transposed = layout
                part = area[:, :, base:base + bs * hd]
                blocks = part.view(b, kvh, hd, bs).transpose(2, 3) if transposed else part.view(b, kvh, bs, hd)
            return blocks.permute(0, 2, 1, 3).reshape(-1, kvh, hd)

        return flat(self.key_layout), flat(self.value_layout), starts

    def _layout(self, pos: Tensor) -> tuple[int, bool] | Tensor:
        """A probed packing (where each (offset, dim) lands) as (start, transposed) when it is a plain
        ``[block_size, head_dim]`` or ``[head_dim, block_size]`` run of the area, read as a view; else ``pos``."""
        bs, hd = self.block_size, self.head_dim
        base = int(pos.min())
        plain = torch.arange(bs * hd) + base
        if torch.equal(pos, plain):
            return base, False
        if torch.equal(pos, plain.view(hd, bs).t().reshape(-1)):
            return base, True
        return pos


def _probe_layout(layer: Any, impl: Any, dtype: torch.dtype, kv_heads: int, block_size: int,
                  head_dim: int) -> tuple[Tensor, Tensor]:
    """Where (offset, dim) of a key and of a value land in a (block, head)'s ``2 * block_size * head_dim``
    area: one index per (offset, dim), row-major. Each coordinate is written as a small integer (exact in
    bf16) in its own probe."""
    offsets = torch.arange(block_size).view(block_size, 1, 1).expand(block_size, kv_heads, head_dim)
    dims = torch.arange(head_dim).view(1, 1, head_dim).expand(block_size, kv_heads, head_dim)
    heads = torch.arange(kv_heads).view(1, kv_heads, 1).expand(block_size, kv_heads, head_dim)
    found = []
    for which in (0, 1):  # keys, values
        coords = []
        for coord in (offsets, dims, heads):
            cache = torch.zeros((1, kv_heads, block_size, 2 * head_dim), dtype=dtype)
            probe = (coord + 1).to(dtype)
            zero = torch.zeros_like(probe)
            key, value = (probe, zero) if which == 0 else (zero, probe)
            impl.do_kv_cache_update(layer, key, value, cache, torch.arange(block_size))
            coords.append(cache.reshape(kv_heads, -1).float() - 1)  # -1: not written there
        offset, dim, head = coords
        written = offset >= 0
        if not bool((head[written] == torch.arange(kv_heads).view(-1, 1).expand_as(head)[written]).all()):
            raise NotImplementedError(f"{type(impl).__name__} packs KV across heads; forest attention cannot read it")
        pos = torch.full((block_size * head_dim,), -1, dtype=torch.long)
        where = written[0].nonzero()[:, 0]
        pos[(offset[0, where] * head_dim + dim[0, where]).long()] = where
        if bool((pos < 0).any()):
            raise NotImplementedError(f"{type(impl).__name__}'s KV packing is not a permutation of each block")
        found.append(pos)
    return found[0], found[1]


@dataclass
class ScratchKV:
    """K/V of the forest rows computed so far in a step, per head attention layer, by row id."""

    keys: dict[str, list[Tensor]] = field(default_factory=dict)
    values: dict[str, list[Tensor]] = field(default_factory=dict)

    def add(self, layer: str, keys: Tensor, values: Tensor) -> list[int]:
        ks, vs = self.keys.setdefault(layer, []), self.values.setdefault(layer, [])
        start = len(ks)
        ks.extend(keys.unbind(0))
        vs.extend(values.unbind(0))
        return list(range(start, len(ks)))


@dataclass
class ForestRows:
    """The rows of one :func:`head_forward` call and what each attends to (see the module docstring)."""

    block_tables: list[Tensor]  # per row: the blocks of its context's request
    context_lens: list[int]  # per row: paged positions it reads
    ancestors: list[list[int]]  # per row: scratch row ids (given in call order from 0), root side first
    scratch: ScratchKV
    slots: list[int] | None = None  # per row: a paged KV slot its K/V is also written to (-1: none)
    row_ids: list[int] = field(default_factory=list)  # set by the call: this call's rows in ``scratch``
    # per layer: (keys, values, slots) computed in an earlier step, written to their paged slots before any row
    # reads its context (``forest_draft.KeptHeadKV``)
    preset: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None


class ForestAttentionImpl:
    """Wraps a head layer's attention impl: :class:`ForestRows` metadata runs here, anything else runs the
    wrapped kernel unchanged."""

    def __init__(self, inner: Any, layer_name: str) -> None:
        self.inner, self.layer_name = inner, layer_name
        self._reader: PagedKVReader | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def do_kv_cache_update(self, *args, **kwargs):
        return self.inner.do_kv_cache_update(*args, **kwargs)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        if not isinstance(attn_metadata, ForestRows):
            return self.inner.forward(layer, query, key, value, kv_cache, attn_metadata, output=output,
                                      output_scale=output_scale, output_block_scale=output_block_scale)
        if self._reader is None:
            self._reader = PagedKVReader(layer, self.inner, kv_cache)
        rows = attn_metadata
        inner = self.inner
        if getattr(inner, "logits_soft_cap", 0) or getattr(inner, "sliding_window", -1) not in (-1, None) \
                or getattr(inner, "alibi_slopes", None) is not None:
            raise NotImplementedError("forest attention supports plain causal attention only")
        if rows.preset is not None and self.layer_name in rows.preset:
            kept_k, kept_v, kept_slots = rows.preset[self.layer_name]
            inner.do_kv_cache_update(layer, kept_k.to(key.dtype), kept_v.to(value.dtype), kv_cache, kept_slots)
        num = len(rows.context_lens)
        q = query[:num].view(num, inner.num_heads, inner.head_size)
        k = key[:num].view(num, inner.num_kv_heads, inner.head_size)
        v = value[:num].view(num, inner.num_kv_heads, inner.head_size)
        ids = rows.scratch.add(self.layer_name, k, v)
        if rows.slots is not None and any(slot >= 0 for slot in rows.slots):
            slots = torch.tensor(rows.slots, device=key.device)
            keep = (slots >= 0).nonzero()[:, 0]
            inner.do_kv_cache_update(layer, k[keep], v[keep], kv_cache, slots[keep])
        # Rows attend within their context's *segment*: the context's keys (read once, in one gather for all
        # contexts), then the scratch rows its rows name (ancestors and themselves). Every segment is one batch
        # entry of one attention call (padded to the longest), each row masked to its context and its chain,
        # so a call's cost grows with the contexts, not with their square.
        segments: dict[tuple[int, int], list[int]] = {}  # a context (its blocks, its length): its rows
        for r in range(num):
            segments.setdefault((id(rows.block_tables[r]), rows.context_lens[r]), []).append(r)
        firsts = [members[0] for members in segments.values()]
        ctx_k, ctx_v, starts = self._reader.read(kv_cache, [rows.block_tables[r] for r in firsts],
                                                 [rows.context_lens[r] for r in firsts])
        scratch_k = torch.stack(rows.scratch.keys[self.layer_name])  # [S, kvh, hd]
        scratch_v = torch.stack(rows.scratch.values[self.layer_name])
        width = ctx_k.shape[0]
        index, mask, where = _segments(list(segments.items()), starts, width, rows.ancestors, ids)
        num_segments, num_rows = mask.shape[:2]
        device = key.device
        index, where = torch.from_numpy(index).to(device), torch.from_numpy(where).to(device)
        query_rows = torch.zeros(num_segments * num_rows, dtype=torch.long, device=device)
        query_rows[where] = torch.arange(num, device=device)
        all_k = torch.cat([ctx_k, scratch_k.to(ctx_k.dtype)])  # [T, kvh, hd]
        all_v = torch.cat([ctx_v, scratch_v.to(ctx_v.dtype)])
        attended = torch.nn.functional.scaled_dot_product_attention(
            q[query_rows].view(num_segments, num_rows, inner.num_heads, inner.head_size).transpose(1, 2).float(),
            all_k[index].transpose(1, 2).float(), all_v[index].transpose(1, 2).float(),
            attn_mask=torch.from_numpy(mask).to(device)[:, None], scale=inner.scale,
            enable_gqa=inner.num_heads != inner.num_kv_heads)  # [segments, heads, rows, hd]
        out = output[:num].view(num, inner.num_heads, inner.head_size)
        flat = attended.transpose(1, 2).reshape(-1, inner.num_heads, inner.head_size)
        out.copy_(flat[where].to(out.dtype))
        rows.row_ids = ids
        return output


def _segments(segments: list[tuple[tuple[int, int], list[int]]], starts: list[int], width: int,
              ancestors: list[list[int]], ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch entries of one call. ``segments``: per context ``(id, length)``, its rows in call order;
    ``starts``: where each context's keys begin among the gathered contexts, the scratch rows following from
    ``width``. Returns (index [S, K]: each segment's key rows, its context's first, then the scratch rows its
    rows name; mask [S, R, K]: each row's context, ancestors and itself, a padded row reading key 0 (its
    output is never used); where [rows]: each row's place in the [S x R] output), padded to the longest."""
    named = [sorted({a for r in members for a in ancestors[r]} | {ids[r] for r in members}) for _, members in segments]
    index = np.zeros((len(segments), max(length + len(n) for ((_, length), _), n in zip(segments, named))),
                     dtype=np.int64)
    num_rows = max(len(members) for _, members in segments)
    mask = np.zeros((len(segments), num_rows, index.shape[1]), dtype=bool)
    mask[:, :, 0] = True
    where = np.zeros(len(ids), dtype=np.int64)
    for s, (((_, length), members), start, scratch) in enumerate(zip(segments, starts, named)):
        index[s, :length] = np.arange(start, start + length)
        index[s, length:length + len(scratch)] = width + np.asarray(scratch, dtype=np.int64)
        place = {a: length + j for j, a in enumerate(scratch)}
        mask[s, :len(members), :length] = True
        for i, r in enumerate(members):
            mask[s, i, [place[a] for a in ancestors[r]] + [place[ids[r]]]] = True
        where[members] = s * num_rows + np.arange(len(members))
    return index, mask, where


def install(model: torch.nn.Module) -> list[str]:
    """Wrap every attention layer of ``model`` (a head) in :class:`ForestAttentionImpl`; returns their names."""
    from vllm.model_executor.layers.attention.attention import Attention

    names = []
    for module in model.modules():
        if isinstance(module, Attention) and not isinstance(module.impl, ForestAttentionImpl):
            module.impl = ForestAttentionImpl(module.impl, module.layer_name)
            names.append(module.layer_name)
    return names


def head_forward(head: torch.nn.Module, layer_names: list[str], vllm_config: Any, tokens: Tensor,
                 positions: Tensor, features: Tensor, rows: ForestRows) -> tuple[Tensor, Tensor]:
    """The head on forest rows: (normed hidden states for its logits, its own output feature), [R, hidden].

    In a compiled engine the head is the graph vLLM traced at its first call (a draft step or warm-up) and
    calls without dynamo's guards: ``tokens`` and ``positions`` must have the dtypes of vLLM's input buffers
    (``input_ids`` int32, ``positions`` int64), ``features`` the feature cache's. (int64 tokens in a graph
    traced with int32 ones are read as wrong tokens, half of them 0: measured, drafts almost never accepted.)"""
    from vllm.forward_context import set_forward_context

    with set_forward_context({name: rows for name in layer_names}, vllm_config, num_tokens=tokens.shape[0],
                             slot_mapping={}):
        return head(input_ids=tokens, positions=positions, hidden_states=features, inputs_embeds=None)
