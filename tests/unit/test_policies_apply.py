"""The engine-facing calls on a real KV pool and block manager: compress a request after prefill,
then the caller's bookkeeping; PagedEviction's per-step block check."""

from __future__ import annotations

import pytest
import torch

from nanokv.cache.block_manager import BlockManager
from nanokv.cache.kv_pool import KVLayout, KVPool
from nanokv.policies import LayerKV, make_policy, window_attention
from nanokv.policies.apply import compress_request, decode_block_to_evict, plan_compression
from nanokv.policies.compaction import flat_slots, gather_request_kv
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams

L, HKV, HQ, D, BS = 3, 2, 4, 8, 4


def prefilled(n, num_blocks=32, seed=0, prefix_caching=False):
    """A pool, a block manager and a request whose n prompt slots hold random K/V."""
    pool = KVPool(KVLayout(L, HKV, D, BS, torch.float32), num_blocks, torch.device("cpu"))
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    req = Request("r", list(range(n)), SamplingParams(max_tokens=4))
    assert bm.allocate_slots(req, n)
    req.num_computed_tokens = n
    g = torch.Generator().manual_seed(seed)
    flat = flat_slots(req.block_table, n, BS)
    pool.kv.view(2, L, -1, HKV, D)[:, :, flat] = torch.randn(2, L, n, HKV, D, generator=g)
    pool.slot_positions.view(-1)[flat] = torch.arange(n, dtype=torch.int32)
    q = [torch.randn(n, HQ, D, generator=g) for _ in range(L)]  # every prompt query per layer
    return pool, bm, req, q


def layers_of(pool):
    return [pool.layer(i) for i in range(L)]


def finish(bm, req, plan):
    """What the engine does after compress_request."""
    bm.free_blocks_at(req, list(range(plan.num_blocks, len(req.block_table))))
    req.num_evicted_tokens += plan.num_evicted
    bm.mark_content_changed(req, from_block=plan.first_changed_block)


@pytest.mark.parametrize("per_head", [True, False])
def test_snapkv_after_prefill_matches_the_dense_selection(per_head):
    n, budget, w = 30, 13, 4
    pool, bm, req, q = prefilled(n)
    dense = [gather_request_kv(*pool.layer(i), req.block_table, n) for i in range(L)]
    policy = make_policy("snapkv", budget=budget, window=w, per_head=per_head)
    plan = compress_request(policy, layers_of(pool), req.block_table, n,
                            q_windows=[x[-w:] for x in q], scale=D ** -0.5,
                            slot_positions=pool.slot_positions)
    finish(bm, req, plan)
    assert plan.num_slots == budget and plan.num_blocks == 4 and req.num_cached_slots == budget
    assert len(req.block_table) == 4 and bm.num_free_blocks == 32 - 4
    bm.check_invariants([req])
    for i, (keys, values) in enumerate(dense):
        attn = window_attention(q[i][-w:], keys, D ** -0.5)
        kept = policy.select(LayerKV(keys, values, attention=attn), budget)
        got_k, got_v = gather_request_kv(*pool.layer(i), req.block_table, budget)
        rows = kept if per_head else kept.expand(HKV, -1)
        for h in range(HKV):
            assert torch.equal(got_k[:, h], keys[rows[h], h])
            assert torch.equal(got_v[:, h], values[rows[h], h])
    pos = pool.slot_positions.view(-1)[flat_slots(req.block_table, budget, BS)]
    assert (pos == -1).all()  # kept slots differ per layer / head: positions unknown


def test_streaming_compacts_positions_and_keeps_unchanged_blocks_cached():
    n, budget = 24, 10
    pool, bm, req, _ = prefilled(n, prefix_caching=True)
    cached_before = len(bm.cached)
    policy = make_policy("streaming", budget=budget, block_size=BS, n_sink=4)
    plan = compress_request(policy, layers_of(pool), req.block_table, n,
                            slot_positions=pool.slot_positions)
    assert plan.first_changed_block == 1  # slots 0-3 (block 0) did not move
    finish(bm, req, plan)
    pos = pool.slot_positions.view(-1)[flat_slots(req.block_table, budget, BS)]
    assert pos.tolist() == [0, 1, 2, 3, 18, 19, 20, 21, 22, 23]
    # block 0 and the freed tail blocks (content untouched) stay in the prefix cache
    assert len(bm.cached) == cached_before - 2
    bm.check_invariants([req])


def test_per_head_compaction_keeps_the_positions_of_unchanged_blocks():
    """Kept slots that differ per head make the changed region's positions unknown (-1); the
    blocks before the first changed one are not written at all: with prefix caching another
    request may hold them."""
    n, budget, w = 30, 13, 4
    pool, bm, req, q = prefilled(n, prefix_caching=True)
    policy = make_policy("snapkv", budget=budget, window=w, per_head=True, n_sink=2 * BS)
    plan = compress_request(policy, layers_of(pool), req.block_table, n,
                            q_windows=[x[-w:] for x in q], scale=D ** -0.5,
                            slot_positions=pool.slot_positions)
    assert plan.first_changed_block == 2 and plan.kept[0].dim() == 2
    pos = pool.slot_positions.view(-1)[flat_slots(req.block_table, budget, BS)]
    assert pos[:2 * BS].tolist() == list(range(2 * BS))  # the sinks' blocks, untouched
    assert (pos[2 * BS:] == -1).all()


def test_per_layer_budgets_need_engine_support():
    pool, _, req, q = prefilled(40)
    policy = make_policy("pyramidkv", budget=12, window=4)
    with pytest.raises(ValueError, match="per-layer"):
        plan_compression(policy, layers_of(pool), req.block_table, 40,
                         q_windows=[x[-4:] for x in q], scale=0.3)
    plan = plan_compression(policy, layers_of(pool), req.block_table, 40,
                            q_windows=[x[-4:] for x in q], scale=0.3, allow_ragged_layers=True)
    assert plan.layer_num_slots[0] > plan.layer_num_slots[-1]
    assert sum(plan.layer_num_slots) == 3 * 12 and plan.num_slots == plan.layer_num_slots[0]
    with pytest.raises(ValueError, match="q_windows"):
        plan_compression(make_policy("snapkv", budget=12, window=4), layers_of(pool),
                         req.block_table, 40)


def test_decode_block_to_evict_uses_every_layer():
    n = 20  # 5 full blocks, budget 12: 20 - 4 >= 12 -> evict one
    pool, _, req, _ = prefilled(n, seed=3)
    policy = make_policy("paged_eviction", budget=12, block_size=BS)
    got = decode_block_to_evict(policy, layers_of(pool), req.block_table, n, 12)
    scores = torch.stack([policy.block_scores(LayerKV(*gather_request_kv(
        *pool.layer(i), req.block_table, n))) for i in range(L)])
    assert got == policy.block_to_evict(scores, n, 12) and 0 < got < 4
    assert decode_block_to_evict(policy, layers_of(pool), req.block_table, 19, 12) is None
    with pytest.raises(ValueError, match="does not evict blocks"):
        decode_block_to_evict(make_policy("streaming", budget=8), layers_of(pool),
                              req.block_table, n, 8)
