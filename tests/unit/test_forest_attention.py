"""Forest attention (engine.forest_attention) against attention written out row by row, on a paged cache in
each packing it reads: keys plain or transposed per block (vLLM's CPU layouts), and any other permutation
(read element by element). The engine test in tests/engine/test_dsbd_eagle3.py checks it against vLLM's own
kernel; this one covers the packings and the masks without an engine."""

from __future__ import annotations

import pytest
import torch

from vllm_dsbd.engine.forest_attention import ForestAttentionImpl, ForestRows, PagedKVReader, ScratchKV

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


class PackedCache:
    """An attention impl's KV write in vLLM's CPU cache shape [blocks, kv_heads, block_size, 2 * head_dim]: per
    (block, head) an area of 2 * block_size * head_dim, keys first (packed by ``packing``), then values."""

    num_heads, num_kv_heads, head_size, scale = HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5

    def __init__(self, packing: str) -> None:
        size = BLOCK * HEAD_DIM
        plain = torch.arange(size)
        self.key_pos = {"plain": plain, "transposed": plain.view(HEAD_DIM, BLOCK).t().reshape(-1),
                        "shuffled": torch.randperm(size, generator=torch.Generator().manual_seed(1))}[packing]

    def do_kv_cache_update(self, layer, key, value, cache, slots):
        area = cache.view(cache.shape[0], KV_HEADS, -1)
        for row, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BLOCK)
            at = self.key_pos.view(BLOCK, HEAD_DIM)[offset]  # where (offset, dim) of a key lands
            area[block, :, at] = key[row].view(KV_HEADS, HEAD_DIM)
            area[block, :, BLOCK * HEAD_DIM + offset * HEAD_DIM + torch.arange(HEAD_DIM)] = value[row].view(
                KV_HEADS, HEAD_DIM)


def _attend(q, keys, values):
    """One row: q [heads, hd] over keys, values [n, kv_heads, hd] (grouped-query heads)."""
    group = HEADS // KV_HEADS
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [n, heads, hd]
    probs = (torch.einsum("hd,nhd->hn", q, k) * PackedCache.scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", probs, v)


@pytest.mark.parametrize("packing", ["plain", "transposed", "shuffled"])
def test_forest_rows_attend_to_their_context_their_ancestors_and_themselves(packing):
    gen = torch.Generator().manual_seed(0)
    impl = PackedCache(packing)
    cache = torch.zeros((12, KV_HEADS, BLOCK, 2 * HEAD_DIM))
    # two requests sharing their first block (a fork), 7 and 6 context positions
    tables = [torch.tensor([3, 5, 9]), torch.tensor([3, 7, 2])]
    lengths = [7, 6]
    context = []
    for table, length in zip(tables, lengths):
        k, v = torch.randn((2, length, KV_HEADS * HEAD_DIM), generator=gen)
        if table is tables[1]:  # the shared block holds the first request's positions 0..3
            k[:BLOCK], v[:BLOCK] = context[0][0][:BLOCK].flatten(1), context[0][1][:BLOCK].flatten(1)
        slots = torch.tensor([int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(length)])
        impl.do_kv_cache_update(None, k, v, cache, slots)
        context.append((k.view(length, KV_HEADS, HEAD_DIM), v.view(length, KV_HEADS, HEAD_DIM)))

    attention = ForestAttentionImpl(impl, "layer")
    scratch = ScratchKV()
    calls = [  # (request, ancestors) per row: a chain on request 0, a child of its last row, a row of request 1
        [(0, []), (0, [0]), (1, [])],
        [(0, [0, 1]), (1, [2]), (0, [0, 1])],
    ]
    every_k, every_v = [], []
    for call in calls:
        n = len(call)
        q = torch.randn((n, HEADS * HEAD_DIM), generator=gen)
        k, v = torch.randn((2, n, KV_HEADS * HEAD_DIM), generator=gen)
        rows = ForestRows([tables[r] for r, _ in call], [lengths[r] for r, _ in call], [a for _, a in call], scratch)
        out = torch.zeros((n, HEADS * HEAD_DIM))
        attention.forward(None, q, k, v, cache, rows, output=out)
        base = len(every_k)
        every_k += list(k.view(n, KV_HEADS, HEAD_DIM))
        every_v += list(v.view(n, KV_HEADS, HEAD_DIM))
        assert rows.row_ids == list(range(base, base + n))
        for row, (request, ancestors) in enumerate(call):
            chain = ancestors + [base + row]
            keys = torch.cat([context[request][0], torch.stack([every_k[a] for a in chain])])
            values = torch.cat([context[request][1], torch.stack([every_v[a] for a in chain])])
            want = _attend(q[row].view(HEADS, HEAD_DIM), keys, values)
            torch.testing.assert_close(out[row].view(HEADS, HEAD_DIM), want, atol=1e-5, rtol=1e-5)


def test_the_reader_finds_each_packing_and_reads_plain_packings_as_views():
    layouts = {}
    for packing in ("plain", "transposed", "shuffled"):
        reader = PagedKVReader(None, PackedCache(packing), torch.zeros((1, KV_HEADS, BLOCK, 2 * HEAD_DIM)))
        layouts[packing] = reader.key_layout if isinstance(reader.key_layout, tuple) else "gather"
        assert reader.value_layout == (BLOCK * HEAD_DIM, False)
    assert layouts == {"plain": (0, False), "transposed": (0, True), "shuffled": "gather"}
