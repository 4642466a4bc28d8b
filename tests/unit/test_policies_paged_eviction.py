"""PagedEviction: token and block scores, prefill selection, a simulated decode on the real block
manager (invariants), and the pool-pressure helper."""

from __future__ import annotations

import math

import pytest
import torch

from nanokv.cache.block_manager import BlockManager
from nanokv.policies import LayerKV, make_policy, select_pool_evictions
from nanokv.policies.paged_eviction import block_scores_from_tokens, token_scores
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams


def kv_with_norms(key_norms, value_norms):
    """[n, Hkv] norms -> LayerKV whose head vectors have exactly those norms (D = 2)."""
    k = torch.tensor(key_norms, dtype=torch.float32)
    v = torch.tensor(value_norms, dtype=torch.float32)
    return LayerKV(torch.stack([k, torch.zeros_like(k)], -1),
                   torch.stack([torch.zeros_like(v), v], -1))


# ---- scores --------------------------------------------------------------------------------------
def test_token_score_variants_against_the_formula():
    kn = [[1.0, 3.0], [2.0, 2.0], [4.0, 0.0]]  # [n=3, Hkv=2]
    vn = [[2.0, 2.0], [1.0, 5.0], [6.0, 2.0]]
    kv = kv_with_norms(kn, vn)
    k_mean = [sum(r) / 2 for r in kn]  # 2, 2, 2
    v_mean = [sum(r) / 2 for r in vn]  # 2, 3, 4
    expect = {
        "value_key_ratio": [v / k for v, k in zip(v_mean, k_mean, strict=True)],
        "inv_key_norm": [1 / k for k in k_mean],
        "value_norm": v_mean,
        "key_plus_value": [k + v for k, v in zip(k_mean, v_mean, strict=True)],
    }
    for score, want in expect.items():
        assert torch.allclose(token_scores(kv.keys, kv.values, score), torch.tensor(want)), score


def test_block_scores_mean_or_sum_with_a_partial_last_block():
    s = torch.tensor([1.0, 3.0, 2.0, 2.0, 10.0])
    assert block_scores_from_tokens(s, 2, "mean").tolist() == [2.0, 2.0, 10.0]
    assert block_scores_from_tokens(s, 2, "sum").tolist() == [4.0, 4.0, 10.0]


# ---- prefill -------------------------------------------------------------------------------------
def test_prefill_keeps_block_zero_the_recent_tokens_and_the_best_middle_tokens():
    value = [9, 9, 1, 5, 2, 7, 3, 0.5, 4, 1, 0.1, 0.1]  # key norms all 1: score = value norm
    kv = kv_with_norms([[1.0]] * 12, [[x] for x in value])
    p = make_policy("paged_eviction", budget=6, block_size=2)
    assert p.select(kv, 6).tolist() == [0, 1, 3, 5, 10, 11]
    assert make_policy("paged_eviction", budget=6, block_size=2, num_recent=0).select(
        kv, 6).tolist() == [0, 1, 3, 5, 6, 8]
    # inverse key norm ranks by keys instead: low-norm keys 4 and 9 win
    keyed = kv_with_norms([[3.0]] * 4 + [[0.5]] + [[3.0]] * 4 + [[1.0]] + [[3.0]] * 2,
                          [[x] for x in value])
    inv = make_policy("paged_eviction", budget=6, block_size=2, score="inv_key_norm")
    assert inv.select(keyed, 6).tolist() == [0, 1, 4, 9, 10, 11]
    with pytest.raises(ValueError, match="below"):
        make_policy("paged_eviction", budget=3, block_size=2)
    with pytest.raises(ValueError, match="below"):  # block 0 alone cannot bound the decode
        make_policy("paged_eviction", budget=8, block_size=8, num_recent=0)


# ---- decode: a simulated request on the real block manager ---------------------------------------
def block_to_evict_reference(layer_kvs, contents, block_size):
    """Loop version: per-layer mean-of-token block scores, normalised by the layer's mean block
    score, averaged over layers; lowest among blocks 1 .. nb-2, ties to the older."""
    nb = math.ceil(len(contents) / block_size)
    per_layer = []
    for keys, values in layer_kvs:
        tok = []
        for slot in range(len(contents)):
            k = sum(float(keys[slot, h].norm()) for h in range(keys.shape[1])) / keys.shape[1]
            v = sum(float(values[slot, h].norm()) for h in range(keys.shape[1])) / keys.shape[1]
            tok.append(v / k)
        blocks = [sum(tok[b * block_size:(b + 1) * block_size])
                  / len(tok[b * block_size:(b + 1) * block_size]) for b in range(nb)]
        mean = sum(blocks) / nb
        per_layer.append([x / mean for x in blocks])
    combined = [sum(layer[b] for layer in per_layer) / len(per_layer) for b in range(nb)]
    return min(range(1, nb - 1), key=lambda b: (combined[b], b))


@pytest.mark.parametrize("budget, block_size", [(12, 4), (16, 4), (10, 4), (16, 8), (12, 8)])
def test_simulated_decode_keeps_the_paged_eviction_invariants(budget, block_size):
    num_layers, hkv, d, prompt_len, steps = 2, 2, 4, 30, 90
    total = prompt_len + steps
    g = torch.Generator().manual_seed(budget * 100 + block_size)
    keys = torch.randn(num_layers, total, hkv, d, generator=g)  # K/V of each position
    values = torch.randn(num_layers, total, hkv, d, generator=g)
    policy = make_policy("paged_eviction", budget=budget, block_size=block_size,
                         num_recent=min(4, budget - block_size))
    bm = BlockManager(64, block_size, enable_prefix_caching=False)
    req = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=steps))

    # prefill: every layer keeps C positions (compaction puts slot i = kept[i])
    assert bm.allocate_slots(req, prompt_len)
    req.num_computed_tokens = prompt_len
    kept = [policy.select(LayerKV(keys[layer, :prompt_len], values[layer, :prompt_len]),
                          budget).tolist()
            for layer in range(num_layers)]
    assert all(len(k) == budget for k in kept)
    assert all(k[:block_size] == list(range(block_size)) for k in kept)
    used = -(-budget // block_size)
    bm.free_blocks_at(req, list(range(used, len(req.block_table))))
    req.num_evicted_tokens = prompt_len - budget
    contents = kept  # per layer: the position held in each slot

    for _ in range(steps):
        pos = req.num_computed_tokens
        assert bm.allocate_slots(req, 1)
        for layer in contents:
            layer.append(pos)
        req.num_computed_tokens += 1
        num_slots = req.num_cached_slots
        layer_kvs = [(keys[layer, contents[layer]], values[layer, contents[layer]])
                     for layer in range(num_layers)]
        scores = torch.stack([policy.block_scores(LayerKV(k, v)) for k, v in layer_kvs])
        victim = policy.block_to_evict(scores, num_slots, budget)
        full = num_slots % block_size == 0
        assert (victim is not None) == (full and num_slots - block_size >= budget
                                        and len(req.block_table) >= 3)
        if victim is not None:
            nb = len(req.block_table)
            assert 0 < victim < nb - 1
            assert victim == block_to_evict_reference(layer_kvs, contents[0], block_size)
            free_before = bm.num_free_blocks
            bm.free_blocks_at(req, [victim])
            assert bm.num_free_blocks == free_before + 1  # back to the pool at once
            req.num_evicted_tokens += block_size
            for layer in contents:  # only whole blocks leave
                del layer[victim * block_size:(victim + 1) * block_size]
        bm.check_invariants([req])
        n = req.num_cached_slots
        assert all(len(layer) == n for layer in contents)
        assert len(req.block_table) == -(-n // block_size)
        upper = (budget + block_size - 1 if budget % block_size == 0
                 else -(-budget // block_size) * block_size + block_size - 1)
        assert budget <= n <= upper
        assert len(req.block_table) <= -(-budget // block_size) + 1
        for layer in contents:
            assert layer[:block_size] == list(range(block_size))  # block 0 survives
            assert layer[-1] == pos  # the newest token survives
            assert layer == sorted(layer)
    assert req.num_evicted_tokens > prompt_len - budget  # decode did evict


def test_no_eviction_without_a_budget_or_before_the_block_fills():
    p = make_policy("paged_eviction", block_size=4)  # pool-pressure mode only
    kv = LayerKV(torch.randn(20, 1, 2), torch.randn(20, 1, 2))
    assert p.select(kv, p.resolve_budget(20)).tolist() == list(range(20))
    q = make_policy("paged_eviction", budget=8, block_size=4)
    assert q.block_to_evict(torch.ones(4), 15, 8) is None  # newest block not full
    assert q.block_to_evict(torch.ones(2), 8, 8) is None  # not more than C
    assert q.block_to_evict(torch.tensor([0.0, 3.0, 1.0, 2.0, 0.0]), 20, 8) == 2


# ---- pool pressure -------------------------------------------------------------------------------
SCORES = [torch.tensor([9.0, 1.0, 5.0, 3.0, 9.0]),  # middle 1, 5, 3 -> min-max 0, 1, 0.5
          torch.tensor([9.0, 2.0, 2.5, 9.0]),  # middle 2, 2.5 -> 0, 1
          torch.tensor([9.0, 9.0]),  # nothing evictable
          torch.tensor([9.0, 4.0, 9.0])]  # single middle block -> 0


def test_pool_pressure_frees_the_least_important_blocks_down_to_the_target():
    # 18 of 20 used (90% > 80%): free 2 to reach 16
    assert select_pool_evictions(SCORES, 18, 20) == [[1], [1], [], []]
    assert select_pool_evictions(SCORES, 19, 20) == [[1], [1], [], [1]]
    assert select_pool_evictions(SCORES, 16, 20) == [[], [], [], []]  # 80%: no pressure
    # sweep: every block below the threshold goes once pressure triggers
    assert select_pool_evictions(SCORES, 17, 20, sweep_below_threshold=True) == \
        [[1], [1], [], [1]]
    # pool max: 1/5, 5/5, 3/5 | 2/5, 2.5/5 | 4/5
    assert select_pool_evictions(SCORES, 18, 20, normalize="pool_max") == [[1], [1], [], []]
    assert select_pool_evictions(SCORES, 20, 20, normalize="pool_max") == [[1, 3], [1, 2], [],
                                                                           []]
    # not enough candidates: everything evictable goes, never block 0 nor the newest
    everything = select_pool_evictions(SCORES, 20, 20, eviction_ratio=0.9)
    assert everything == [[1, 2, 3], [1, 2], [], [1]]


def test_pool_pressure_frees_what_a_waiting_prompt_needs():
    # 15 of 20 used (75%, under the 80% target) but a waiting prompt needs 7 free: free 2,
    # least important first (importance 0 in every request: request order breaks the tie)
    assert select_pool_evictions(SCORES, 15, 20, min_free_blocks=7) == [[1], [1], [], []]
    assert select_pool_evictions(SCORES, 15, 20, min_free_blocks=5) == [[], [], [], []]
    # both rules: the stricter target wins (18 used: 80% asks for 2, 5 free asks for 3)
    assert select_pool_evictions(SCORES, 18, 20, min_free_blocks=5) == [[1], [1], [], [1]]


def test_pool_evictions_combine_layers_with_the_policy_options():
    p = make_policy("paged_eviction", block_size=4, eviction_ratio=0.5)
    two_layers = [torch.stack([s, s * 100]) for s in SCORES[:2]]  # same ranking in both layers
    assert p.pool_evictions(two_layers, 10, 10) == [[1, 2, 3], [1, 2]]
    assert p.pool_evictions(two_layers, 7, 10) == [[1], [1]]
