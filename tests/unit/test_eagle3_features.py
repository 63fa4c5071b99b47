"""The paged feature cache of EAGLE-3 heads (``engine.eagle3``): slots as vLLM's slot mapping numbers them."""

from __future__ import annotations

import torch

from vllm_dsbd.engine.eagle3 import FeatureCache, previous_slots

BLOCK = 4


def _slot(table, req, pos):  # vLLM's slot mapping: block of the position, offset in it
    return table[req, pos // BLOCK] * BLOCK + pos % BLOCK


def test_each_row_reads_the_slot_of_the_position_before_it_across_block_boundaries():
    table = torch.tensor([[5, 2, 7, 0], [3, 6, 1, 4]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 3, 4, 5, 8, 9, 4, 12])
    reqs = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1])
    got = previous_slots(positions, reqs, table, BLOCK)
    want = [-1] + [int(_slot(table, r, p - 1)) for r, p in zip(reqs[1:].tolist(), positions[1:].tolist())]
    assert got.tolist() == want
    assert got[3] == 5 * BLOCK + 3 and got[4] == 2 * BLOCK  # position 4 reads the last slot of block 0
    assert got[7] == 3 * BLOCK + 3 and got[8] == 1 * BLOCK + 3  # request 1's own blocks


def test_written_features_are_read_back_and_position_zero_and_padding_read_zeros():
    cache = FeatureCache(num_blocks=8, block_size=BLOCK, width=3, dtype=torch.float32)
    slots = torch.tensor([9, 2, -1, 30])
    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 1
    cache.write(slots, rows)
    got = cache.read(torch.tensor([2, 9, -1, 30, 31]))
    assert torch.equal(got, torch.stack([rows[1], rows[0], torch.zeros(3), rows[3], torch.zeros(3)]))
    assert cache.nbytes == 8 * BLOCK * 3 * 4


def test_block_copies_carry_a_forked_tail_block_and_nothing_else():
    cache = FeatureCache(num_blocks=6, block_size=BLOCK, width=2, dtype=torch.bfloat16)
    cache.features.copy_(torch.arange(6 * BLOCK * 2, dtype=torch.float32).reshape(-1, 2))
    before = cache.features.clone()
    cache.copy_blocks([(1, 4), (3, 0)])
    blocks, old = cache.features.view(6, BLOCK, 2), before.view(6, BLOCK, 2)
    assert torch.equal(blocks[4], old[1]) and torch.equal(blocks[0], old[3])
    assert all(torch.equal(blocks[b], old[b]) for b in (1, 2, 3, 5))
    cache.copy_blocks([])
    assert torch.equal(cache.features.view(6, BLOCK, 2)[4], old[1])

