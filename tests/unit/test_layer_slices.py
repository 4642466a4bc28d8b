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


# ---- windowed layers that give back what their windows pass (the hybrid KV manager) ---------

def _slot(req, layer: int, pos: int, bs: int, pool: int) -> int:
    """Flat slot (in num_layers * pool * bs) holding layer `layer`'s token at position pos."""
    ls = req.layer_slices
    if ls is None:
        return (layer * pool + req.block_table[pos // bs]) * bs + pos % bs
    return ls.slot(layer, pos - ls.offsets[layer])


def _copier(memory: dict, bs: int):
    """The KV cache's copy_slices over `memory` (flat slot -> what was written): every move
    reads before any writes, as `KVPool.copy_slices` does."""
    def copy_slices(pairs):
        staged = [(dst, [memory.get(src * bs + j) for j in range(bs)]) for src, dst in pairs]
        for dst, values in staged:
            for j, value in enumerate(values):
                memory[dst * bs + j] = value
    return copy_slices


def _grow(bm, req, windows, memory, n_new, bs, pool):
    """One step of n_new tokens: allocate, write each layer's tokens into `memory` (flat slot
    -> (request, layer, position)), then give back what the windows passed."""
    assert bm.allocate_slots(req, n_new)
    start = req.num_computed_tokens
    for layer in range(len(windows)):
        for pos in range(start, start + n_new):
            memory[_slot(req, layer, pos, bs, pool)] = (req.request_id, layer, pos)
    req.num_computed_tokens += n_new
    if req.layer_slices is not None:
        bm.recycle_window_slices(req)


def _readable(req, windows, memory, bs, pool):
    """Every slot a later query can read holds what was written there (brute force over the
    layers and positions the windows still cover)."""
    n = req.num_computed_tokens
    for layer, window in enumerate(windows):
        first = 0 if window is None else max(0, n + 1 - window)
        for pos in range(first, n):
            assert memory[_slot(req, layer, pos, bs, pool)] == (req.request_id, layer, pos), \
                (layer, pos)


@pytest.mark.parametrize("seed", range(12))
def test_windowed_layers_give_their_passed_slices_to_the_others(seed):
    """Random windows, block sizes and step sizes: after slicing, no slot a query still reads is
    overwritten, no slice is used twice, no held block is idle, and the request holds at most
    what `sliced_request_blocks` counts: its slices packed into as few blocks as hold them
    (the moved ones copied)."""
    from nanokv.cache.layout import sliced_request_blocks

    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    num_layers = rng.randint(2, 7)
    windows = [rng.choice([None, rng.randint(1, 40)]) for _ in range(num_layers)]
    windows[rng.randrange(num_layers)] = None
    windows[rng.randrange(num_layers)] = windows[rng.randrange(num_layers)] or 9
    if all(w is None for w in windows):
        windows[0] = 5
    pool, max_step = 4096, rng.choice([1, 3, 8])
    memory: dict = {}
    bm = BlockManager(pool, bs, enable_prefix_caching=False,
                      on_slices_moved=_copier(memory, bs))
    req = Request("r", list(range(400)), SamplingParams(max_tokens=1))
    slice_at = rng.randint(1, 120)
    while req.num_computed_tokens < 300:
        if req.layer_slices is None and req.num_computed_tokens >= slice_at:
            bm.slice_for_windows(req, windows)
            assert not req.prefix_cacheable
        _grow(bm, req, windows, memory, rng.randint(1, max_step), bs, pool)
        bm.check_invariants([req])  # coverage, ownership, no slice twice, no idle block
        _readable(req, windows, memory, bs, pool)
        if req.layer_slices is not None:  # packed: as few blocks as its slices need
            used = sum(map(len, req.layer_slices.tables))
            assert len(req.block_table) == -(-used // num_layers)
            assert len(req.block_table) <= sliced_request_blocks(
                req.num_computed_tokens + max_step, tuple(windows), bs, max_step)
    assert req.layer_slices is not None
    bm.free(req)
    assert bm.num_free_blocks == pool


def test_shared_and_cached_blocks_keep_their_content():
    """A sliced request never writes into a block another request holds (a prefix hit of both),
    and a cached block stops being a hit once one of its slices takes other tokens; the cached
    blocks still registered after it finishes hold exactly their prefix."""
    bs, pool, windows = 4, 256, [4, None, 4, 4]
    memory: dict = {}
    bm = BlockManager(pool, bs, enable_prefix_caching=True, on_slices_moved=_copier(memory, bs))
    prompt = list(range(1, 41))
    first = Request("a", prompt + [99], SamplingParams(max_tokens=50))
    _grow(bm, first, windows, memory, 40, bs, pool)  # 10 full blocks, registered
    second = Request("b", prompt + [98], SamplingParams(max_tokens=50))
    hits, hit_tokens = bm.get_computed_blocks(second)
    assert hit_tokens == 40
    assert bm.allocate_slots(second, 1, hits)  # shares the 10 blocks
    second.num_computed_tokens = 40
    shared_table = list(second.block_table[:10])
    shared = set(shared_table)
    before = {s: v for s, v in memory.items()}
    bm.slice_for_windows(first, windows)
    for _ in range(60):
        _grow(bm, first, windows, memory, 1, bs, pool)
        bm.check_invariants([first, second])
        _readable(first, windows, memory, bs, pool)
    for block in shared:  # nothing of first's went into them
        for layer in range(len(windows)):
            for j in range(bs):
                s = (layer * pool + block) * bs + j
                assert memory[s] == before[s]
    bm.free(second)  # first now holds them alone: it may move out of them or write into them
    for _ in range(40):
        _grow(bm, first, windows, memory, 1, bs, pool)
        bm.check_invariants([first])
        _readable(first, windows, memory, bs, pool)
    bm.free(first)
    third = Request("c", prompt + [97], SamplingParams(max_tokens=1))
    hits, _ = bm.get_computed_blocks(third)

    def intact(i: int, block: int) -> bool:  # every layer's slots of token block i
        return all(memory[(layer * pool + block) * bs + j][1:] == (layer, i * bs + j)
                   for layer in range(len(windows)) for j in range(bs))

    assert all(intact(i, b.block_id) for i, b in enumerate(hits))  # a hit holds its prefix
    rewritten = [i for i, b in enumerate(shared_table) if not intact(i, b)]
    assert len(hits) <= (rewritten + [10])[0]  # a rewritten one ends the hits


@pytest.mark.parametrize("windows", [[4, None, 4, 4], [8, 8, None, 16, 4]])
def test_a_cached_block_rewritten_is_no_hit(windows):
    """A request alone registers its prompt's blocks, is sliced, and its tokens then go into
    their free slices (moved there when packing, or taken as they come): those blocks stop
    being hits; every block still a hit after it finishes holds exactly its prefix."""
    bs, pool = 4, 256
    memory: dict = {}
    bm = BlockManager(pool, bs, enable_prefix_caching=True, on_slices_moved=_copier(memory, bs))
    prompt = list(range(1, 41))
    first = Request("a", prompt + [99], SamplingParams(max_tokens=100))
    _grow(bm, first, windows, memory, 40, bs, pool)  # 10 full blocks, registered
    table = list(first.block_table)

    def check_hits() -> list[bool]:
        """Every prefix hit's block holds its tokens' K/V (all layers); returns which of the
        prompt's blocks do."""
        intact = [all(memory[(layer * pool + b) * bs + j][1:] == (layer, i * bs + j)
                      for layer in range(len(windows)) for j in range(bs))
                  for i, b in enumerate(table)]
        hits, _ = bm.get_computed_blocks(Request("c", prompt + [97], SamplingParams()))
        assert [b.block_id for b in hits] == table[:len(hits)]
        assert all(intact[:len(hits)])
        return intact

    bm.slice_for_windows(first, windows)  # packs: slices moved into the prompt's blocks
    assert not all(check_hits())
    for _ in range(60):
        _grow(bm, first, windows, memory, 1, bs, pool)
        bm.check_invariants([first])
        _readable(first, windows, memory, bs, pool)
        check_hits()
    bm.free(first)
    intact = check_hits()
    hits, _ = bm.get_computed_blocks(Request("c", prompt + [97], SamplingParams()))
    assert len(hits) == intact.index(False)  # the rest of the intact prefix still hits
