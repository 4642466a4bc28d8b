"""BlockManager: allocation, ref counting, prefix caching, freeing (example based + a stateful
property test against a brute-force model)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import nanokv.cache.block_manager as bm_module
from nanokv.cache.block_manager import BlockManager
from nanokv.cache.hashing import ROOT_HASH, hash_block
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import RunnerOutput
from nanokv.scheduler.scheduler import Scheduler

_ids = itertools.count()


def make_request(tokens, salt=None, rid=None) -> Request:
    rid = rid if rid is not None else f"r{next(_ids)}"
    return Request(rid, list(tokens), SamplingParams(max_tokens=64), cache_salt=salt)


def admit(bm: BlockManager, request: Request, num_new: int | None = None):
    """Scheduler-like admission: take prefix hits, allocate, and mark the tokens computed."""
    hits, hit_tokens = bm.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - hit_tokens
    assert bm.allocate_slots(request, num_new, hits)
    request.num_computed_tokens = hit_tokens + num_new
    return hits, hit_tokens


def decode(bm: BlockManager, request: Request, token: int) -> bool:
    """Append a sampled token and make room for it (one decode step)."""
    assert request.num_computed_tokens == request.num_tokens
    request.output_token_ids.append(token)
    if not bm.allocate_slots(request, 1):
        return False
    request.num_computed_tokens += 1
    return True


def snapshot(bm: BlockManager, *requests: Request):
    return (
        [b.block_id for b in bm.free_queue],
        [(b.ref_cnt, b.block_hash, b.token_ids, b.extra_keys) for b in bm.blocks],
        dict(bm.cached),
        Counter(bm.stats.evicted_blocks),
        [(list(r.block_table), list(r.block_hashes), r.peak_blocks, r.num_computed_tokens)
         for r in requests],
    )


# ---- prefix caching --------------------------------------------------------------------------
def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request(range(10))  # blocks: [0..3] [4..7] [8 9]
    admit(bm, a)
    assert len(a.block_table) == 3
    assert len(bm.cached) == 2  # the two full blocks
    b = make_request(list(range(8)) + [50, 51, 52])
    hits, hit_tokens = admit(bm, b)
    assert hit_tokens == 8
    assert [h.block_id for h in hits] == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_cnt for i in a.block_table] == [2, 2, 1]
    assert b.block_hashes[:2] == a.block_hashes[:2]
    bm.check_invariants([a, b])
    # a request diverging inside the second block only hits the first
    c = make_request([0, 1, 2, 3, 4, 5, 99, 7, 8])
    _, hit_tokens = admit(bm, c)
    assert hit_tokens == 4
    assert bm.blocks[a.block_table[0]].ref_cnt == 3
    bm.check_invariants([a, b, c])


def test_no_hit_for_different_first_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request(range(9))
    admit(bm, a)
    b = make_request([100] + list(range(1, 9)))  # second block identical, first differs
    _, hit_tokens = admit(bm, b)
    assert hit_tokens == 0  # the chain breaks at the first block: the second is never reached
    assert set(a.block_table).isdisjoint(b.block_table)


def test_hit_on_freed_cached_blocks_takes_them_out_of_the_free_queue():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_request(range(9))
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6
    b = make_request(range(9))
    hits, hit_tokens = admit(bm, b)
    assert hit_tokens == 8 and [h.block_id for h in hits] == table[:2]
    assert all(not bm.free_queue.contains(bm.blocks[i]) for i in table[:2])
    assert bm.num_free_blocks == 6 - 3
    bm.check_invariants([b])


@pytest.mark.parametrize("constant", [12345, ROOT_HASH])
def test_collisions_never_give_a_false_hit(monkeypatch, constant):
    """Every block hashes to the same value: only a content match may be served."""
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens, extra: constant)
    bm = BlockManager(num_blocks=20, block_size=4)
    a = make_request([1, 1, 1, 1, 1, 1, 1, 1, 1])  # repeated content: block 1 == block 0
    admit(bm, a)
    live = [a]
    probes = [
        [1, 1, 1, 1, 1, 1, 1, 1, 1],  # true hit on block 0 only may be served
        [2, 2, 2, 2, 1, 1, 1, 1, 1],  # first block differs
        [1, 1, 1, 2, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 2, 2, 2, 2, 2],
    ]
    for tokens in probes:
        r = make_request(tokens)
        hits, hit_tokens = bm.get_computed_blocks(r)
        # blocks served must hold exactly this request's tokens, at the same depth
        a_blocks = {a.block_table[i]: i for i in range(2)}
        for depth, block in enumerate(hits):
            assert block.token_ids == tuple(tokens[depth * 4:(depth + 1) * 4])
            assert a_blocks.get(block.block_id) == depth
        assert len({b.block_id for b in hits}) == len(hits)
        assert bm.allocate_slots(r, r.num_tokens - hit_tokens, hits)
        r.num_computed_tokens = r.num_tokens
        live.append(r)
        bm.check_invariants(live)
    assert bm.get_computed_blocks(make_request([2, 2, 2, 2, 9]))[1] == 0


def test_hash_is_chained_and_deterministic():
    h0 = hash_block(ROOT_HASH, [1, 2], ())
    assert h0 == hash_block(ROOT_HASH, (1, 2), ())
    assert h0 != hash_block(ROOT_HASH, [2, 1], ())
    assert hash_block(h0, [3, 4], ()) != hash_block(ROOT_HASH, [3, 4], ())
    assert hash_block(ROOT_HASH, [1, 2], ("x",)) != h0
    bm = BlockManager(num_blocks=4, block_size=2)
    r = make_request([1, 2, 3, 4, 5])
    admit(bm, r)
    assert r.block_hashes == [h0, hash_block(h0, [3, 4], ())]


def test_only_full_blocks_are_cached_and_decode_registers_filled_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request(range(6))
    admit(bm, a)
    assert [bm.blocks[i].block_hash is not None for i in a.block_table] == [True, False]
    assert len(bm.cached) == 1 and len(a.block_hashes) == 1
    assert decode(bm, a, 6)  # 7 computed: block 1 still partial
    assert len(bm.cached) == 1
    assert decode(bm, a, 7)  # 8 computed: block 1 full -> registered
    assert len(bm.cached) == 2 and len(a.block_hashes) == 2
    blk = bm.blocks[a.block_table[1]]
    assert blk.token_ids == (4, 5, 6, 7)
    assert len(a.block_table) == 2
    assert decode(bm, a, 8)  # 9th slot: a third block
    assert len(a.block_table) == 3
    bm.check_invariants([a])
    # the output tokens' block is served to a request with the same full sequence
    b = make_request(list(range(8)) + [8, 9])
    _, hit_tokens = admit(bm, b)
    assert hit_tokens == 8


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = make_request(range(9))
    admit(bm, a)
    b = make_request(range(9))
    _, hit_tokens = admit(bm, b)
    assert hit_tokens == 0 and not bm.cached
    assert all(bm.blocks[i].block_hash is None for i in a.block_table + b.block_table)
    bm.check_invariants([a, b])


@pytest.mark.parametrize("num_full", [1, 2, 3])
def test_hit_capped_so_last_token_is_computed(num_full):
    bs = 4
    bm = BlockManager(num_blocks=20, block_size=bs)
    tokens = list(range(num_full * bs))  # exactly num_full full blocks
    a = make_request(tokens)
    admit(bm, a)
    assert len(bm.cached) == num_full
    b = make_request(tokens)
    hits, hit_tokens = bm.get_computed_blocks(b)
    assert len(hits) == num_full - 1 and hit_tokens == (num_full - 1) * bs
    # one more token: every full block may be served
    c = make_request(tokens + [77])
    hits, hit_tokens = bm.get_computed_blocks(c)
    assert len(hits) == num_full and hit_tokens == num_full * bs


# ---- freeing and eviction order --------------------------------------------------------------
def test_free_order_unhashed_front_hashed_back_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(range(10))  # blocks 0, 1 hashed; 2 partial
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    assert all(b.ref_cnt == 0 for b in bm.blocks)
    # unhashed block 2 at the front; hashed blocks at the back, the tail block (1) first
    assert [b.block_id for b in bm.free_queue] == [2, 3, 4, 5, 6, 7, 1, 0]
    bm.check_invariants([])
    # the next allocations pop in that order; the cached blocks are reused last
    order = []
    live = []
    for i in range(8):
        r = make_request([200 + i])  # one partial block each: never cached
        admit(bm, r)
        order.extend(r.block_table)
        live.append(r)
        if i < 6:
            assert len(bm.cached) == 2 and bm.stats.evicted_blocks["prefix_lru"] == 0
    assert order == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.stats.evicted_blocks["prefix_lru"] == 2
    assert len(bm.stats.evicted_block_lifetimes) == 2
    assert not bm.cached
    assert all(b.block_hash is None for b in bm.blocks)
    bm.check_invariants(live)


def test_lru_between_requests():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request([1, 2, 3])  # block 0 hashed (a's), block 1 partial
    b = make_request([4, 5, 6])
    admit(bm, a)
    admit(bm, b)
    a_cached, b_cached = a.block_hashes[0], b.block_hashes[0]
    bm.free(a)  # a freed first: least recently used
    bm.free(b)
    assert set(bm.cached) == {a_cached, b_cached}
    c = make_request([9, 9, 9, 9, 9])  # needs 3 blocks: 2 unhashed + the LRU cached one
    admit(bm, c)
    assert bm.stats.evicted_blocks["prefix_lru"] == 1
    assert b_cached in bm.cached and a_cached not in bm.cached
    # a's prefix is gone (its block was reused); b's is still served
    assert bm.get_computed_blocks(make_request([1, 2, 3]))[1] == 0
    assert bm.get_computed_blocks(make_request([4, 5, 6]))[1] == 2
    bm.check_invariants([c])


def test_a_recomputed_block_refreshes_its_prefix_in_lru_order():
    """A prompt ending on a block boundary recomputes its last full block (the last token is
    never a hit) while that block's twin sits free in the cache: the fresh copy takes over the
    hash, so the prefix is as recently used as its last request (vLLM's order), and the stale
    twin becomes a plain free block. A twin some request holds stays the cached copy."""
    bm = BlockManager(num_blocks=6, block_size=2)
    x = make_request([1, 2, 3, 4, 5])  # blocks [1,2] [3,4] cached, [5] partial
    w = make_request([7, 8, 9, 10, 11])
    admit(bm, x)
    admit(bm, w)
    x_hash = x.block_hashes[1]
    bm.free(x)  # x's prefix is older than w's
    bm.free(w)
    twin = bm.cached[x_hash]
    y = make_request([1, 2, 3, 4])  # hits [1,2]; [3,4] holds its last token: recomputed
    hits, hit_tokens = admit(bm, y)
    assert hit_tokens == 2 and y.block_hashes[1] == x_hash
    fresh = bm.blocks[y.block_table[1]]
    assert fresh is not twin and bm.cached[x_hash] is fresh
    assert twin.block_hash is None and twin.ref_cnt == 0
    bm.free(y)  # x's prefix is now the most recently used
    bm.check_invariants([])
    z = make_request([20, 21, 22, 23, 24, 25, 26])  # 4 blocks: evicts the two oldest
    admit(bm, z)
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 5]))[1] == 4  # still cached
    assert bm.get_computed_blocks(make_request([7, 8, 9, 10, 11]))[1] == 0  # w's went first
    bm.check_invariants([z])
    # a held twin is not replaced: the recomputed copy stays unregistered
    bm.free(z)
    a = make_request([30, 31, 32])
    admit(bm, a)
    held = bm.cached[a.block_hashes[0]]
    b = make_request([30, 31, 40])  # its first block is a hit; then one like a's, computed
    admit(bm, b)
    c = make_request([30, 31])  # its only block holds its last token: computed afresh
    admit(bm, c)
    assert c.block_hashes[0] == a.block_hashes[0]
    assert bm.cached[a.block_hashes[0]] is held and bm.blocks[c.block_table[0]] is not held
    assert bm.blocks[c.block_table[0]].block_hash is None
    bm.check_invariants([a, b, c])


def copy_of_a_held_block(bm: BlockManager):
    """a holds [1,2]; c recomputes it (its prompt ends on the block boundary): a registered
    block and its held copy. Returns (a, c, the registered block, the copy)."""
    a = make_request([1, 2, 3])
    admit(bm, a)
    c = make_request([1, 2])
    admit(bm, c)
    twin, copy = bm.blocks[a.block_table[0]], bm.blocks[c.block_table[0]]
    assert bm.cached[a.block_hashes[0]] is twin and copy.copy_of == a.block_hashes[0]
    bm.check_invariants([a, c])
    return a, c, twin, copy


def fill_pool(bm: BlockManager, first_token: int) -> Request:
    """A request that takes every free block (evicting what they cached)."""
    z = make_request(range(first_token, first_token + 2 * bm.num_free_blocks - 1))
    admit(bm, z)
    assert bm.num_free_blocks == 0
    return z


def test_a_held_copy_keeps_its_content_cached_when_the_registered_block_goes():
    """vLLM registers every copy; nanokv one block per hash. When the registered block is
    evicted, content a running request still holds must stay a hit: its copy takes over."""
    bm = BlockManager(num_blocks=5, block_size=2)
    a, c, twin, copy = copy_of_a_held_block(bm)
    bm.free(a)  # the registered block is free (cached), its copy still held by c
    z = fill_pool(bm, 50)  # evicts it
    assert twin.block_hash is None
    assert bm.cached[c.block_hashes[0]] is copy and copy.copy_of is None
    hits, hit_tokens = bm.get_computed_blocks(make_request([1, 2, 9]))
    assert hit_tokens == 2 and hits == [copy]
    bm.check_invariants([c, z])


def test_a_copy_freed_after_its_twin_takes_the_later_place_in_lru_order():
    """The content's place in the LRU order is its latest use: a copy freed after its
    registered twin takes over the hash (at the back of the free queue) and the twin, holding
    nothing to serve, goes to the front."""
    bm = BlockManager(num_blocks=6, block_size=2)
    a, c, twin, copy = copy_of_a_held_block(bm)
    w = make_request([7, 8, 9])
    admit(bm, w)
    h = c.block_hashes[0]
    bm.free(a)  # [1,2] freed before [7,8] ...
    bm.free(w)
    bm.free(c)  # ... and used again after it
    assert bm.cached[h] is copy and twin.block_hash is None
    queue = list(bm.free_queue)
    assert queue[0] is twin and queue[-1] is copy
    bm.check_invariants([])
    z = make_request(range(50, 59))  # 5 blocks: the 4 uncached ones, then the oldest cached
    admit(bm, z)
    assert bm.get_computed_blocks(make_request([7, 8, 0]))[1] == 0  # [7,8] went first
    assert bm.get_computed_blocks(make_request([1, 2, 0]))[1] == 2
    bm.check_invariants([z])


def test_a_hash_handed_over_leaves_its_old_block_first_in_the_free_queue():
    """A recomputed block takes the hash from its free twin; the twin is then a plain free
    block, reused before any cached one (it used to keep its place among them)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    x = make_request([1, 2, 3])
    admit(bm, x)
    twin = bm.cached[x.block_hashes[0]]
    bm.free(x)
    y = make_request([1, 2])  # recomputes [1,2]
    admit(bm, y)
    assert twin.block_hash is None and next(iter(bm.free_queue)) is twin
    bm.check_invariants([y])


def test_colliding_parent_hashes_never_chain_into_another_prefix(monkeypatch):
    """With a 2-bit hash, [0,1] and [0,0] share their hash, and so do the [0,0] blocks after
    them: a block's identity holds its parent's content id, not its parent's hash, so a chain of
    hits is the whole prefix it claims. Oracle: the prefix each physical block was written
    with."""
    monkeypatch.setattr(bm_module, "hash_block", _weak_hash)
    assert _weak_hash(ROOT_HASH, [0, 1], ()) == _weak_hash(ROOT_HASH, [0, 0], ())
    bm = BlockManager(num_blocks=10, block_size=2)
    written = {}  # block id -> the tokens up to its end it holds the K/V of

    def run(tokens):
        request = make_request(tokens)
        admit(bm, request)
        for i, block_id in enumerate(request.block_table[:len(tokens) // 2]):
            written[block_id] = tuple(tokens[:2 * i + 2])
        return request

    q1 = run([0, 0, 0, 0, 0])
    bm.free_blocks_at(q1, [1])  # [0,0][0,0] stays cached, free
    q2 = run([0, 1, 0, 0])  # its [0,0] block's hash is [0,0][0,0]'s
    bm.free(q2)
    bm.free(q1)
    for tokens in ([0, 0, 0, 0, 0], [0, 1, 0, 0, 0]):
        hits, _ = bm.get_computed_blocks(make_request(tokens))
        assert [written[b.block_id] for b in hits] == [tuple(tokens[:2 * i + 2])
                                                      for i in range(len(hits))]
    bm.check_invariants([])


def test_a_block_whose_parent_a_policy_freed_is_replaced_by_a_reachable_copy():
    """A policy frees a request's first block, which is then evicted: the request's second
    block stays registered, but its parent's content (and id) went, so no hit reaches it. The
    next request computing the same prefix registers its own copy instead (it used to see the
    unreachable block as a collision and register nothing from there on)."""
    bm = BlockManager(num_blocks=6, block_size=2)
    x = make_request([1, 2, 3, 4, 5])
    admit(bm, x)
    orphan = bm.blocks[x.block_table[1]]
    bm.free_blocks_at(x, [0])  # [1,2] freed (still cached) ...
    z = fill_pool(bm, 50)  # ... and evicted
    bm.free(z)
    bm.free(x)
    assert orphan.block_hash is not None  # registered, unreachable
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 9]))[1] == 0
    y = make_request([1, 2, 3, 4, 5])
    admit(bm, y)
    assert orphan.block_hash is None and next(iter(bm.free_queue)) is orphan
    bm.free(y)
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 9]))[1] == 4
    bm.check_invariants([])


def test_reusing_evicted_block_drops_hash_entry():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_request([1, 2, 3, 4, 5])
    admit(bm, a)
    old = {h: bm.cached[h].block_id for h in a.block_hashes}
    bm.free(a)
    b = make_request([7, 7, 7, 7, 7])  # different content, takes all 3 blocks
    admit(bm, b)
    assert bm.stats.evicted_blocks["prefix_lru"] == 2
    for h in old:
        assert h not in bm.cached
    assert set(bm.cached) == set(b.block_hashes)
    for h, blk in bm.cached.items():
        assert blk.block_hash == h and blk.token_ids == (7, 7)
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 5]))[1] == 0
    bm.check_invariants([b])


def test_free_with_reason_and_drop_cache():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_request([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a, reason="preemption")
    # only the partial block's content is lost: the two full ones stay cached (a later reuse
    # counts them as prefix_lru), so they are not evictions (each block counted once)
    assert bm.stats.evicted_blocks["preemption"] == 1
    assert len(bm.stats.evicted_block_lifetimes) == 1
    assert len(bm.cached) == 2  # preemption keeps the content cached
    b = make_request([1, 2, 3, 4, 5])
    _, hit_tokens = admit(bm, b)
    assert hit_tokens == 4
    bm.free(b, drop_cache=True)  # e.g. a failed step: the content may be garbage
    assert not bm.cached
    assert all(blk.block_hash is None for blk in bm.blocks)
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 5]))[1] == 0
    bm.check_invariants([])


def test_each_evicted_block_counts_once_whatever_the_reason():
    """A preempted request's blocks count as evicted when their content is lost: not a block
    another request holds, not a cached one until its reuse (then as prefix_lru, once), and
    every count has its lifetime."""
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = make_request([1, 2, 3, 4, 5]), make_request([1, 2, 3, 4, 9, 9, 9])
    admit(bm, a)
    admit(bm, b)  # shares a's two full blocks
    assert b.block_table[:2] == a.block_table[:2]
    bm.free(b, reason="preemption")  # [9, 9] is cached, [9] partial: only the latter is lost
    assert bm.stats.evicted_blocks["preemption"] == 1
    bm.free(a, reason="preemption")  # a's partial block: lost; its full blocks stay cached
    assert bm.stats.evicted_blocks["preemption"] == 2
    assert len(bm.cached) == 3
    c = make_request(list(range(100, 116)))  # 8 blocks of new content: every cached one reused
    admit(bm, c)
    assert bm.stats.evicted_blocks["prefix_lru"] == 3  # the three cached blocks, reused
    # a and b held 5 distinct blocks (2 shared, b's [9, 9], two partial ones): each once
    assert sum(bm.stats.evicted_blocks.values()) == 5
    assert len(bm.stats.evicted_block_lifetimes) == 5
    bm.check_invariants([c])


def test_drop_cache_keeps_blocks_other_requests_hold_cached():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_request([1, 2, 3])
    admit(bm, a)
    b = make_request([1, 2, 3])
    admit(bm, b)
    assert b.block_table[0] == a.block_table[0]
    bm.free(b, drop_cache=True)
    assert len(bm.cached) == 1  # still held by a
    bm.check_invariants([a])


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request([1, 2, 3])
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and a.block_hashes == []
    bm.free(a)  # a second free of the same request is a no-op: its table is empty
    a.block_table = table  # a stale table: releasing it again must raise
    with pytest.raises(RuntimeError):
        bm.free(a)


# ---- extra keys ------------------------------------------------------------------------------
def test_cache_salt_separates_caches():
    bm = BlockManager(num_blocks=20, block_size=4)
    tokens = list(range(9))
    a = make_request(tokens, salt="tenant-a")
    admit(bm, a)
    assert admit(bm, make_request(tokens))[1] == 0  # unsalted
    assert admit(bm, make_request(tokens, salt="tenant-b"))[1] == 0
    b = make_request(tokens, salt="tenant-a")
    assert admit(bm, b)[1] == 8
    assert b.block_table[:2] == a.block_table[:2]


def test_engine_extra_keys_separate_caches():
    tokens = list(range(9))
    bm1 = BlockManager(num_blocks=8, block_size=4, extra_keys=(("kv_dtype", "fp8"),))
    bm2 = BlockManager(num_blocks=8, block_size=4, extra_keys=(("kv_dtype", "bf16"),))
    a1, a2 = make_request(tokens), make_request(tokens)
    admit(bm1, a1)
    admit(bm2, a2)
    assert set(a1.block_hashes).isdisjoint(a2.block_hashes)
    # within one manager, changing the engine keys (e.g. a new KV policy) stops serving old blocks
    bm1.extra_keys = (("kv_dtype", "int8"),)
    assert bm1.get_computed_blocks(make_request(tokens))[1] == 0
    bm1.extra_keys = (("kv_dtype", "fp8"),)
    assert bm1.get_computed_blocks(make_request(tokens))[1] == 8
    # salt and engine keys combine
    assert bm1.get_computed_blocks(make_request(tokens, salt="s"))[1] == 0


# ---- allocation failure ----------------------------------------------------------------------
def test_allocate_slots_false_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request(range(6))
    admit(bm, a)  # 2 blocks
    b = make_request(range(100, 109))  # needs 3
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(b, 9)
    assert snapshot(bm, a, b) == before
    assert bm.allocate_slots(b, 4)  # one block does fit
    bm.check_invariants([a, b])
    # a decode that needs a new block fails cleanly too
    a.output_token_ids += [6, 7]
    a.num_computed_tokens = 8
    a.output_token_ids.append(8)
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(a, 1)
    assert snapshot(bm, a, b) == before


def test_allocate_counts_free_hits_as_taken():
    """Hits that sit in the free queue stop being free: they cannot also serve as new blocks."""
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request(range(9))
    admit(bm, a)
    bm.free(a)
    b = make_request(list(range(8)) + [20, 21, 22, 23, 24])  # 2 hits + 2 new blocks: 4 > 3
    hits, hit_tokens = bm.get_computed_blocks(b)
    assert hit_tokens == 8
    before = snapshot(bm, b)
    assert not bm.allocate_slots(b, b.num_tokens - hit_tokens, hits)
    assert snapshot(bm, b) == before
    c = make_request(list(range(8)) + [20, 21])  # 2 hits + 1 new block: fits exactly
    hits, hit_tokens = bm.get_computed_blocks(c)
    assert bm.allocate_slots(c, c.num_tokens - hit_tokens, hits)
    assert bm.num_free_blocks == 0
    bm.check_invariants([c])


def test_hits_only_for_request_without_blocks():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_request([1, 2, 3])
    admit(bm, a)
    b = make_request([1, 2, 3])
    hits, _ = bm.get_computed_blocks(b)
    assert bm.allocate_slots(b, 1)
    with pytest.raises(RuntimeError):
        bm.allocate_slots(b, 1, hits)
    # a request that has computed tokens gets no hits
    b.num_computed_tokens = 1
    assert bm.get_computed_blocks(b) == ([], 0)


def test_constructor_validates():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# ---- free_blocks_at / mark_content_changed ---------------------------------------------------
def test_free_blocks_at_frees_middle_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_request(range(9))  # 5 blocks, 4 hashed
    admit(bm, a)
    table = list(a.block_table)
    bm.free_blocks_at(a, [1, 2])
    a.num_evicted_tokens += 4
    assert a.block_table == [table[0], table[3], table[4]]
    assert a.block_hashes == a.block_hashes[:1] and len(a.block_hashes) == 1
    assert not a.prefix_cacheable
    assert bm.stats.evicted_blocks["policy"] == 2
    for i in (1, 2):
        assert bm.blocks[table[i]].ref_cnt == 0 and bm.free_queue.contains(bm.blocks[table[i]])
    assert bm.num_free_blocks == 8 - 3
    bm.check_invariants([a])
    # the request keeps decoding into its last block; new full blocks are not registered
    n_cached = len(bm.cached)
    assert decode(bm, a, 9)
    assert a.num_cached_slots == 6 and len(a.block_table) == 3
    assert len(bm.cached) == n_cached
    bm.check_invariants([a])
    bm.free(a)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_free_blocks_at_shared_block_stays_with_other_holder():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_request([1, 2, 3, 4, 5])
    admit(bm, a)
    b = make_request([1, 2, 3, 4, 5])
    admit(bm, b)
    shared = a.block_table[0]
    bm.free_blocks_at(a, [0], reason="snapkv")
    a.num_evicted_tokens += 2
    assert bm.blocks[shared].ref_cnt == 1
    assert not bm.free_queue.contains(bm.blocks[shared])
    assert bm.stats.evicted_blocks["snapkv"] == 1
    bm.check_invariants([a, b])


def test_free_blocks_at_rejects_bad_indices():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_request(range(5))
    admit(bm, a)
    before = snapshot(bm, a)
    for bad in ([3], [-1], [0, 7]):
        with pytest.raises(ValueError):
            bm.free_blocks_at(a, bad)
        assert snapshot(bm, a) == before


def test_mark_content_changed_uncaches_exclusive_blocks():
    bm = BlockManager(num_blocks=10, block_size=2)
    a = make_request([1, 2, 3, 4, 5, 6, 7])
    admit(bm, a)
    b = make_request([1, 2, 9])  # shares a's block 0
    admit(bm, b)
    bm.mark_content_changed(a, from_block=0)
    assert not a.prefix_cacheable and a.block_hashes == []
    # block 0 is shared with b: it stays cached; a's exclusive blocks 1, 2 are dropped
    assert bm.blocks[a.block_table[0]].block_hash is not None
    assert all(bm.blocks[i].block_hash is None for i in a.block_table[1:])
    assert len(bm.cached) == 1
    bm.check_invariants([a, b])
    table = list(a.block_table)
    bm.free(a)
    # a's blocks, now unhashed, went to the front of the queue: they are reused first
    front = [blk.block_id for blk in itertools.islice(iter(bm.free_queue), 3)]
    assert set(front) == set(table[1:])
    assert bm.blocks[table[0]].ref_cnt == 1
    bm.check_invariants([b])


@pytest.mark.parametrize("free", [0, 1, 2])
def test_make_private_takes_free_blocks_then_spare_ones_of_the_request(free):
    """b shares a's first two blocks and holds four of its own; a compaction of b rewrites its
    table's first three blocks and discards its 4th and 5th (its spare: they hold nothing it
    keeps). The copies take free blocks first, then trade places with spare blocks, which the
    shared blocks leave with; nothing changes when both are short. Oracle: reference counts
    recounted from the tables (`check_invariants`), the blocks' places, the free count."""
    bm = BlockManager(num_blocks=12, block_size=2)
    a = make_request([1, 2, 3, 4, 5])
    admit(bm, a)  # 3 blocks
    b = make_request([1, 2, 3, 4] + list(range(10, 18)))
    admit(bm, b)  # a's first 2 blocks, then 4 of its own
    filler = make_request(range(100, 100 + 2 * (bm.num_free_blocks - free)))
    admit(bm, filler)
    assert bm.num_free_blocks == free
    shared, own = b.block_table[:2], b.block_table[2:]
    before = snapshot(bm, a, b, filler)
    if free < 2:  # without spare blocks, or with fewer than the free blocks miss
        for spare in ([], [3, 4][:1 - free]):
            assert bm.make_private(b, range(3), spare) is None
            assert snapshot(bm, a, b, filler) == before
    copies = bm.make_private(b, range(3), [3, 4])
    from_spare = 2 - free
    assert [src for src, _ in copies] == shared and bm.num_free_blocks == 0
    assert b.block_table[:2] == [dst for _, dst in copies]
    assert [dst for _, dst in copies][free:] == own[1:1 + from_spare]  # the spare ones
    assert b.block_table[3:3 + from_spare] == shared[free:]  # left with the tail
    bm.check_invariants([a, b, filler])
    bm.free_blocks_at(b, [3, 4, 5])
    assert b.block_table == [dst for _, dst in copies] + [own[0]]
    assert [bm.blocks[i].ref_cnt for i in shared] == [1, 1]  # a's alone again
    assert bm.num_free_blocks == 3 - from_spare  # the tail, less the shared blocks in it
    bm.check_invariants([a, b, filler])


def test_reset_prefix_cache_drops_only_unheld_blocks():
    bm = BlockManager(num_blocks=10, block_size=2)
    a = make_request([1, 2, 3])
    b = make_request([4, 5, 6])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    assert bm.reset_prefix_cache() == 1
    assert set(bm.cached) == set(b.block_hashes)
    bm.check_invariants([b])


# ---- same-step sharing via the scheduler -----------------------------------------------------
def test_same_step_admissions_share_prefix_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    prefix = list(range(8))
    a = make_request(prefix + [30, 31, 32], rid="a")
    b = make_request(prefix + [40, 41], rid="b")
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    # b's 2 tokens after the 8 shared slots go as decode rows, first in the batch (each layer
    # writes the step's K/V, a's prefix too, before any row attends)
    assert [s.request_id for s in out.scheduled] == ["b", "a"]
    sb, sa = out.scheduled
    assert sb.decode_rows and not sa.decode_rows
    assert sa.start_position == 0 and sa.num_tokens == 11
    assert sb.start_position == 8 and sb.start_slot == 8 and sb.token_ids == [40, 41]
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_cnt for i in a.block_table[:2]] == [2, 2]
    assert bm.num_used_blocks == 3 + 1
    sched.check_invariants()
    sched.update_from_output(out, RunnerOutput({"a": 1, "b": 2}))
    sched.check_invariants()
    assert bm.stats.prefix_cache_hits == 8
    assert bm.stats.prefix_cache_queries == 11 + 10


# ---- stateful property test ------------------------------------------------------------------
TAINTED = "tainted"


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / decode / free / abort / preempt / free_blocks_at sequences against a
    brute-force model of what every physical block really holds."""

    BLOCK_SIZE = 2
    NUM_BLOCKS = 10
    HASH = None  # replaces hash_block (a weak hash forces collisions)

    def __init__(self) -> None:
        super().__init__()
        self._saved_hash = bm_module.hash_block
        if self.HASH is not None:
            bm_module.hash_block = self.HASH
        self.hash = bm_module.hash_block
        self.bs = self.BLOCK_SIZE
        self.bm = BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.free_order = [b.block_id for b in self.bm.free_queue]  # model of the free queue
        self.live: dict[str, Request] = {}
        self.waiting: list[Request] = []  # preempted, holding no blocks
        self.tainted: set[str] = set()  # requests whose later K/V is not a plain prefix
        # what each physical block holds once full: (extra keys, all tokens up to its end) for a
        # plain prefix, ("tainted", n) otherwise, None while partial or fresh
        self.content: dict[int, object] = {}
        self.ids = itertools.count()
        self.taint_ids = itertools.count()

    def teardown(self) -> None:
        bm_module.hash_block = self._saved_hash

    # ---- helpers --------------------------------------------------------------------------------
    def _before(self):
        """What the free-queue model needs to know of the blocks before an operation: each
        block's copy_of, and the registered block of each hash."""
        return ({b.block_id: b.copy_of for b in self.bm.blocks},
                {h: b.block_id for h, b in self.bm.cached.items()})

    def _to_front(self, block_id: int) -> None:
        self.free_order.remove(block_id)
        self.free_order.insert(0, block_id)

    def _released(self, block_ids, before) -> None:
        """Model of the free queue: in release order, unhashed blocks go to the front, cached
        ones to the back; a copy freed after its registered twin takes its hash (to the back),
        and the twin goes to the front."""
        copy_of, registered = before
        for block_id in block_ids:
            block = self.bm.blocks[block_id]
            if block.ref_cnt != 0:
                continue
            if block.block_hash is None:
                self.free_order.insert(0, block_id)
                continue
            h = copy_of[block_id]
            if h is not None:  # took over from its free twin
                assert block.block_hash == h and self.bm.blocks[registered[h]].block_hash is None
                self._to_front(registered[h])
            self.free_order.append(block_id)

    def _key(self, request: Request, end: int):
        return (self.bm.request_extra_keys(request), tuple(request.all_token_ids[:end]))

    def _expected_hits(self, request: Request) -> int:
        cached_keys = {self.content.get(b.block_id) for b in self.bm.cached.values()}
        n = 0
        while n < (request.num_tokens - 1) // self.bs and \
                self._key(request, (n + 1) * self.bs) in cached_keys:
            n += 1
        return n

    def _allocate(self, request: Request, num_new: int, hits=()) -> bool:
        bm, bs = self.bm, self.bs
        hits = list(hits)
        table_before = len(request.block_table)
        slots = request.num_cached_slots + len(hits) * bs + num_new
        need = max(0, -(-slots // bs) - table_before - len(hits))
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        expect_ok = need <= bm.num_free_blocks - free_hits
        before = snapshot(bm, request)
        free_registered = {b.block_id: b.block_hash for b in bm.free_queue
                           if b.block_hash is not None}
        ok = bm.allocate_slots(request, num_new, hits)
        assert ok == expect_ok
        if not ok:
            assert snapshot(bm, request) == before
            return False
        assert len(request.block_table) == table_before + len(hits) + need
        for block in hits:
            if block.block_id in self.free_order:
                self.free_order.remove(block.block_id)
        new = request.block_table[table_before + len(hits):]
        assert new == self.free_order[:need]  # popped from the front
        del self.free_order[:need]
        # a free registered block whose content the request computed again hands its hash to
        # the fresh copy and goes to the front, in the order of the request's blocks
        handed = [b for b, h in free_registered.items()
                  if bm.blocks[b].ref_cnt == 0 and bm.blocks[b].block_hash is None]
        for block_id in sorted(handed,
                               key=lambda b: request.block_hashes.index(free_registered[b])):
            assert bm.cached[free_registered[block_id]].block_id in request.block_table
            self._to_front(block_id)
        for block_id in new:
            self.content[block_id] = None  # fresh block: garbage until written
        # "compute" the new tokens into their slots
        request.num_computed_tokens += len(hits) * bs
        start_slot = request.num_cached_slots
        for j in range(num_new):
            slot = start_slot + j
            pos = request.num_computed_tokens + j
            if (slot + 1) % bs == 0:  # this write fills the block
                block_id = request.block_table[slot // bs]
                if request.request_id in self.tainted:
                    self.content[block_id] = (TAINTED, next(self.taint_ids))
                else:
                    assert slot == pos
                    self.content[block_id] = self._key(request, pos + 1)
        request.num_computed_tokens += num_new
        return True

    def _admit(self, request: Request, num_new: int | None) -> bool:
        hits, hit_tokens = self.bm.get_computed_blocks(request)
        assert hit_tokens == len(hits) * self.bs
        if self.HASH is None:
            # at most the hits the content allows: a block whose parent a policy freed or the
            # prefix-cache reset dropped keeps its parent's old content id, so it misses hits
            # until a request computes it again (a known limit of content ids; never a wrong hit)
            assert len(hits) <= self._expected_hits(request)
        else:  # collisions may hide a hit, never invent one
            assert len(hits) <= self._expected_hits(request)
        assert len({b.block_id for b in hits}) == len(hits)
        for i, block in enumerate(hits):  # a hit holds exactly what it claims, and what we need
            assert self.content[block.block_id] == self._key(request, (i + 1) * self.bs)
            assert block.token_ids == tuple(
                request.all_token_ids[i * self.bs:(i + 1) * self.bs])
        remaining = request.num_tokens - hit_tokens
        num_new = remaining if num_new is None else min(num_new, remaining)
        if not self._allocate(request, num_new, hits):
            return False
        self.live[request.request_id] = request
        return True

    def _release(self, request: Request, **kwargs) -> None:
        held = list(request.block_table)
        before = self._before()
        self.bm.free(request, **kwargs)
        assert request.block_table == [] and request.block_hashes == []
        del self.live[request.request_id]
        for block_id in held:
            block = self.bm.blocks[block_id]
            assert block.ref_cnt == sum(block_id in r.block_table for r in self.live.values())
            if kwargs.get("drop_cache") and block.ref_cnt == 0:
                assert block.block_hash is None  # its content is not trusted any more
        self._released(reversed(held), before)

    # ---- rules ----------------------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=13),
          salt=st.sampled_from([None, None, None, "s"]),
          chunk=st.none() | st.integers(1, 6))
    def new_request(self, tokens, salt, chunk):
        request = Request(f"q{next(self.ids)}", tokens, SamplingParams(max_tokens=64),
                          cache_salt=salt)
        if not self._admit(request, chunk):
            assert request.block_table == [] and request.num_computed_tokens == 0
            self.waiting.append(request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data):
        request = data.draw(st.sampled_from(self.waiting))
        if self._admit(request, None):
            self.waiting.remove(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 1))
    def grow(self, data, token):
        """Decode one token, or compute the next prefill chunk."""
        request = data.draw(st.sampled_from(sorted(self.live.values(),
                                                   key=lambda r: r.request_id)))
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(token)
            num_new = 1
        else:
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = data.draw(st.integers(1, remaining))
        self._allocate(request, num_new)  # may not fit: then nothing changes

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        request = data.draw(st.sampled_from(sorted(self.live.values(),
                                                   key=lambda r: r.request_id)))
        self._release(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), drop_cache=st.booleans())
    def abort(self, data, drop_cache):
        request = data.draw(st.sampled_from(sorted(self.live.values(),
                                                   key=lambda r: r.request_id)))
        self._release(request, drop_cache=drop_cache)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        request = data.draw(st.sampled_from(sorted(self.live.values(),
                                                   key=lambda r: r.request_id)))
        evicted_before = self.bm.stats.evicted_blocks["preemption"]
        lifetimes_before = len(self.bm.stats.evicted_block_lifetimes)
        held = set(request.block_table)
        self._release(request, reason="preemption")
        # evicted: the blocks whose content went (free and uncached), each once
        lost = sum(1 for b in held if self.bm.blocks[b].ref_cnt == 0
                   and self.bm.blocks[b].block_hash is None)
        assert self.bm.stats.evicted_blocks["preemption"] == evicted_before + lost
        assert len(self.bm.stats.evicted_block_lifetimes) == lifetimes_before + lost
        request.num_computed_tokens = 0
        request.num_evicted_tokens = 0
        request.prefix_cacheable = True
        self.tainted.discard(request.request_id)
        if not self._admit(request, None):  # recompute from zero, prefix hits allowed
            self.waiting.append(request)

    @precondition(lambda self: any(r.num_cached_slots >= 2 * self.bs
                                   for r in self.live.values()))
    @rule(data=st.data())
    def free_blocks_at(self, data):
        candidates = sorted((r for r in self.live.values()
                             if r.num_cached_slots >= 2 * self.bs), key=lambda r: r.request_id)
        request = data.draw(st.sampled_from(candidates))
        full = request.num_cached_slots // self.bs  # only whole, written blocks are dropped
        indices = data.draw(st.lists(st.integers(0, full - 1), min_size=1, max_size=full - 1,
                                     unique=True))
        table = list(request.block_table)
        before = self._before()
        self.bm.free_blocks_at(request, indices)
        assert request.block_table == [b for i, b in enumerate(table) if i not in indices]
        self._released((table[i] for i in sorted(indices, reverse=True)), before)
        request.num_evicted_tokens += len(indices) * self.bs
        self.tainted.add(request.request_id)
        for i in indices:
            assert self.bm.blocks[table[i]].ref_cnt == sum(
                table[i] in r.block_table for r in self.live.values())

    @precondition(lambda self: any(len(r.block_table) >= 2 for r in self.live.values()))
    @rule(data=st.data())
    def compact(self, data):
        """A policy's compaction: the table's first k blocks kept, [f, k) rewritten (made
        private first: free blocks, then spare tail blocks), the tail freed."""
        bm = self.bm
        request = data.draw(st.sampled_from(sorted(
            (r for r in self.live.values() if len(r.block_table) >= 2),
            key=lambda r: r.request_id)))
        table = list(request.block_table)
        k = data.draw(st.integers(1, len(table) - 1))
        f = data.draw(st.integers(0, k - 1))
        spare = sorted(data.draw(st.sets(st.integers(k, len(table) - 1))))
        spare = bm.held_alone(request, spare)
        assert spare == [j for j in spare if bm.blocks[table[j]].ref_cnt == 1]
        shared = [i for i in range(f, k) if bm.blocks[table[i]].ref_cnt > 1]
        from_queue = min(len(shared), bm.num_free_blocks)
        before, model = snapshot(bm, *self.live.values()), self._before()
        copies = bm.make_private(request, range(f, k), spare)
        if len(shared) > from_queue + len(spare):
            assert copies is None and snapshot(bm, *self.live.values()) == before
            return
        assert [src for src, _ in copies] == [table[i] for i in shared]
        popped, self.free_order = self.free_order[:from_queue], self.free_order[from_queue:]
        assert [dst for _, dst in copies] == popped + [table[j] for j in
                                                       spare[:len(shared) - from_queue]]
        for src, dst in copies:
            self.content[dst] = self.content[src]
        tail = list(range(k, len(table)))
        released = [request.block_table[i] for i in reversed(tail)]
        bm.free_blocks_at(request, tail)
        self._released(released, model)
        request.num_evicted_tokens += request.num_cached_slots - k * self.bs
        bm.mark_content_changed(request, f)
        for block_id in request.block_table[f:]:
            self.content[block_id] = (TAINTED, next(self.taint_ids))
        self.tainted.add(request.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def mark_content_changed(self, data):
        request = data.draw(st.sampled_from(sorted(self.live.values(),
                                                   key=lambda r: r.request_id)))
        from_block = data.draw(st.integers(0, len(request.block_table)))
        # the policy rewrites only blocks no other request holds
        rewritten = [b for b in request.block_table[from_block:]
                     if self.bm.blocks[b].ref_cnt == 1]
        self.bm.mark_content_changed(request, from_block)
        for block_id in rewritten:
            self.content[block_id] = (TAINTED, next(self.taint_ids))
        self.tainted.add(request.request_id)

    @rule()
    def reset_prefix_cache(self):
        # what stays: content a request holds, in its registered block or in a held copy
        held = {h for h, b in self.bm.cached.items() if b.ref_cnt > 0} | set(self.bm.copies)
        self.bm.reset_prefix_cache()
        assert set(self.bm.cached) == held

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        bm, bs = self.bm, self.bs
        live = list(self.live.values())
        bm.check_invariants(live)
        refs = Counter()
        for r in live:
            assert len(set(r.block_table)) == len(r.block_table)  # no block twice in a table
            refs.update(r.block_table)
            # no leak: a request holds exactly the blocks its cached slots need
            assert len(r.block_table) == -(-r.num_cached_slots // bs)
        for r in self.waiting:
            assert r.block_table == [] and r.request_id not in self.live
        queued = [b.block_id for b in bm.free_queue]
        assert len(queued) == len(set(queued))  # no double free
        assert queued == self.free_order
        for block in bm.blocks:
            assert block.ref_cnt == refs[block.block_id]
            assert (block.block_id in set(queued)) == (refs[block.block_id] == 0)
        assert len(queued) + len(refs) == bm.num_blocks
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        # every cached block holds exactly the plain prefix its chained hash claims
        for h, block in bm.cached.items():
            content = self.content.get(block.block_id)
            assert content is not None and content[0] != TAINTED, (block, content)
            extra, tokens = content
            assert len(tokens) % bs == 0
            chain = ROOT_HASH
            for i in range(len(tokens) // bs):
                chain = self.hash(chain, tokens[i * bs:(i + 1) * bs], extra)
            assert chain == h
            assert block.token_ids == tokens[-bs:]
        # a live plain request's registered hashes describe its own tokens
        for r in live:
            if r.prefix_cacheable and r.request_id not in self.tainted:
                chain = ROOT_HASH
                extra = bm.request_extra_keys(r)
                for i, h in enumerate(r.block_hashes):
                    chain = self.hash(chain, r.all_token_ids[i * bs:(i + 1) * bs], extra)
                    assert chain == h


class BlockManagerMachineBs3(BlockManagerMachine):
    BLOCK_SIZE = 3
    NUM_BLOCKS = 7


def _weak_hash(parent, tokens, extra):
    """2-bit hash: nearly every lookup collides; 0 (the root hash) is a frequent value."""
    return hash_block(parent, tokens, extra) & 3


class BlockManagerMachineWeakHash(BlockManagerMachine):
    HASH = staticmethod(_weak_hash)


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestBlockManagerStatefulWeakHash = BlockManagerMachineWeakHash.TestCase
TestBlockManagerStatefulWeakHash.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestBlockManagerStatefulBs3 = BlockManagerMachineBs3.TestCase
TestBlockManagerStatefulBs3.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
