"""Per-layer block tables (layer slices) against brute-force counting."""

import random

import pytest

from nanokv.cache.block_manager import BlockManager
from nanokv.cache.layer_slices import LayerSlices
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams


def test_blocks_needed_is_packed_slice_count():
    rng = random.Random(0)
    for _ in range(200):
        layers, bs = rng.randint(1, 6), rng.choice([1, 4, 16])
        lengths = [rng.randint(0, 100) for _ in range(layers)]
        ls = LayerSlices([[] for _ in range(layers)], lengths, 0, bs, 1000)
        # brute force: one slice per started block, then blocks of `layers` slices
        slices = sum((n + bs - 1) // bs for n in lengths)
        blocks = 0
        while blocks * layers < slices:
            blocks += 1
        assert ls.blocks_needed(lengths) == blocks


def test_growth_through_the_block_manager_never_shares_a_slice():
    """A request with per-layer lengths grows token by token; the block manager adds a block
    only when the packed slices run out, and every slice is used once."""
    bs, pool = 4, 64
    bm = BlockManager(pool, bs, enable_prefix_caching=False)
    req = Request("r", list(range(40)), SamplingParams(max_tokens=100))
    assert bm.allocate_slots(req, 8)  # 2 blocks, shared table
    req.num_computed_tokens = 12  # (as if 12 were computed and 2 evicted)
    # layers keep 10, 5, 2 slots: 3 + 2 + 1 slices packed into the 2 blocks
    b0, b1 = req.block_table
    tables = [[b0, b1, 2 * pool + b1], [pool + b0, pool + b1], [2 * pool + b0]]
    req.layer_slices = LayerSlices(tables, [10, 5, 2], 12, bs, pool)
    req.num_evicted_tokens = 2
    for _ in range(30):
        assert bm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        lengths = req.layer_slices.lengths(req.num_computed_tokens)
        assert len(req.block_table) == req.layer_slices.blocks_needed(lengths)
        bm.check_invariants([req])  # includes LayerSlices.check: coverage, ownership, no reuse
        used = [s for t in req.layer_slices.tables for s in t]
        assert len(used) == len(set(used))
    with pytest.raises(ValueError, match="layer slices"):
        bm.free_blocks_at(req, [0])
    bm.free(req)
    assert req.layer_slices is None and bm.num_free_blocks == pool


def test_reserve_without_blocks_raises():
    ls = LayerSlices([[5], [69]], [4, 4], 0, 4, 64)
    with pytest.raises(RuntimeError, match="exhausted"):
        ls.reserve([5], [8, 8])
