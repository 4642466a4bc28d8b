"""Compaction and gathering on paged caches with random block tables against slot-by-slot loops,
and the observation-window attention against a per-query softmax."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanokv.layers.attention import dense_reference_attention
from nanokv.policies import compact_blocks, compact_slots, gather_request_kv, window_attention
from nanokv.policies.apply import CompressionPlan

HKV, D = 2, 3


def loop_gather(cache, table, n, bs):
    return torch.stack([cache[table[j // bs], j % bs] for j in range(n)]) if n else \
        cache.new_zeros(0, *cache.shape[2:])


@st.composite
def paged_case(draw):
    bs = draw(st.integers(1, 5))
    num_blocks = draw(st.integers(2, 12))
    table_len = draw(st.integers(1, num_blocks))
    table = draw(st.permutations(list(range(num_blocks))))[:table_len]
    n = draw(st.integers(1, table_len * bs))
    c = draw(st.integers(1, n))
    per_head = draw(st.booleans())
    rows = HKV if per_head else 1
    kept = [sorted(draw(st.permutations(list(range(n))))[:c]) for _ in range(rows)]
    seed = draw(st.integers(0, 2**16))
    return bs, num_blocks, table, n, kept, per_head, seed


@settings(max_examples=120, deadline=None)
@given(paged_case())
def test_compaction_round_trip_matches_a_dense_gather(case):
    bs, num_blocks, table, n, kept_rows, per_head, seed = case
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, bs, HKV, D, generator=g)
    v_cache = torch.randn(num_blocks, bs, HKV, D, generator=g)
    k0, v0 = k_cache.clone(), v_cache.clone()
    keys, values = gather_request_kv(k_cache, v_cache, table, n)
    assert torch.equal(keys, loop_gather(k0, table, n, bs))
    assert torch.equal(values, loop_gather(v0, table, n, bs))

    kept = torch.tensor(kept_rows if per_head else kept_rows[0])
    c = kept.shape[-1]
    used = compact_blocks(k_cache, v_cache, table, n, kept)
    assert used == math.ceil(c / bs)
    new_k, new_v = gather_request_kv(k_cache, v_cache, table, c)
    for h in range(HKV):  # slot i of head h now holds what slot kept[h][i] held
        row = kept_rows[h] if per_head else kept_rows[0]
        assert torch.equal(new_k[:, h], keys[row, h])
        assert torch.equal(new_v[:, h], values[row, h])
    others = [b for b in range(num_blocks) if b not in table]
    assert torch.equal(k_cache[others], k0[others])  # blocks of other requests untouched
    assert torch.equal(v_cache[others], v0[others])


def test_compaction_of_slot_positions_and_bad_input():
    positions = torch.arange(12, dtype=torch.int32).view(4, 3)  # [num_blocks, B]
    table = [2, 0, 3]  # logical slots 0..8 hold 6, 7, 8, 0, 1, 2, 9, 10, 11
    assert compact_slots(positions, table, 8, torch.tensor([1, 3, 4, 7])) == 2
    assert positions.view(-1)[[6, 7, 8, 0]].tolist() == [7, 0, 1, 10]
    with pytest.raises(ValueError, match="lie in"):
        compact_slots(positions, table, 8, torch.tensor([1, 8]))
    with pytest.raises(ValueError, match="do not fit"):
        gather_request_kv(torch.zeros(4, 3, 1, 1), torch.zeros(4, 3, 1, 1), table, 10)
    with pytest.raises(ValueError, match="per-head"):
        compact_slots(positions, table, 8, torch.tensor([[0, 1], [1, 2]]))


@pytest.mark.parametrize("n", [1, 11, 12])
def test_views_where_the_table_is_the_first_blocks_in_order(n):
    """copy=False and table 0, 1, 2 (a quantized cache's policy view): views of the caches,
    equal to the copies the default gives."""
    k_cache, v_cache = torch.randn(5, 4, 2, 3), torch.randn(5, 4, 2, 3)
    keys, values = gather_request_kv(k_cache, v_cache, [0, 1, 2], n, copy=False)
    ref_k, ref_v = gather_request_kv(k_cache, v_cache, [0, 1, 2], n)
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v) and keys.shape == (n, 2, 3)
    assert keys.data_ptr() == k_cache.data_ptr() and values.data_ptr() == v_cache.data_ptr()
    assert ref_k.data_ptr() != k_cache.data_ptr()  # the default copies
    other, _ = gather_request_kv(k_cache, v_cache, [0, 2, 1], n, copy=False)
    # past block 0 the table is not in order: a copy (n <= 4 reads block 0 alone: a view)
    assert (other.data_ptr() == k_cache.data_ptr()) == (n <= 4)
    torch.testing.assert_close(other, gather_request_kv(k_cache, v_cache, [0, 2, 1], n)[0])


def test_attention_over_the_compacted_cache_equals_dense_attention_over_the_kept_tokens():
    g = torch.Generator().manual_seed(0)
    bs, n, hq = 4, 14, 4
    k_cache = torch.randn(8, bs, HKV, D, generator=g)
    v_cache = torch.randn(8, bs, HKV, D, generator=g)
    table = [5, 1, 7, 2]
    keys, values = gather_request_kv(k_cache, v_cache, table, n)
    kept = torch.tensor([0, 1, 5, 8, 12, 13])
    compact_blocks(k_cache, v_cache, table, n, kept)
    q = torch.randn(1, hq, D, generator=g)
    kc, vc = gather_request_kv(k_cache, v_cache, table, len(kept))
    assert torch.allclose(dense_reference_attention(q, kc, vc, 0.5),
                          dense_reference_attention(q, keys[kept], values[kept], 0.5))


@pytest.mark.parametrize("soft_cap", [None, 1.0])
@pytest.mark.parametrize("w, n, hq", [(1, 1, 2), (3, 9, 4), (9, 9, 2), (5, 17, 6)])
def test_window_attention_matches_a_per_query_softmax(w, n, hq, soft_cap):
    """soft_cap: the model's attention logit soft-cap (Gemma 2), c * tanh(score / c)."""
    g = torch.Generator().manual_seed(w * n)
    q = torch.randn(w, hq, D, generator=g)
    keys = torch.randn(n, HKV, D, generator=g)
    probs = window_attention(q, keys, 0.7, soft_cap)
    cap = (lambda s: s) if soft_cap is None else (lambda s: soft_cap * math.tanh(s / soft_cap))
    assert probs.shape == (hq, w, n)
    group = hq // HKV
    for h in range(hq):
        for j in range(w):
            visible = n - w + j + 1
            logits = torch.tensor([cap(float(q[j, h].double() @ keys[i, h // group].double())
                                       * 0.7) for i in range(visible)])
            want = torch.cat([logits.softmax(0), torch.zeros(n - visible, dtype=torch.float64)])
            assert torch.allclose(probs[h, j].double(), want, atol=1e-6)
    with pytest.raises(ValueError):
        window_attention(torch.randn(n + 1, hq, D), keys, 1.0)


def test_whole_block_sources_finds_blocks_kept_whole_in_every_layer_and_head():
    """B = 4. Kept slots shifted by one block after 2 sinks: new blocks 1 and 2 take old blocks
    2 and 3 whole; block 0 mixes sinks and window. Per head, per layer: all must agree."""
    from nanokv.policies.compaction import whole_block_sources

    shared = torch.tensor([0, 1, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])  # n = 16, C = 12
    assert whole_block_sources([shared, shared], 4, 0, 3) == {1: 2, 2: 3}
    assert whole_block_sources([shared], 4, 2, 3) == {2: 3}  # only the blocks asked about
    assert whole_block_sources([shared], 4, 3, 3) == {}
    per_head = torch.stack([shared, shared])  # [Hkv, C]
    assert whole_block_sources([per_head], 4, 0, 3) == {1: 2, 2: 3}
    other_head = shared.clone()
    other_head[4:8] = torch.tensor([4, 5, 6, 7])  # head 1 keeps old block 1 at new block 1
    other_head[2:4] = torch.tensor([2, 3])
    assert whole_block_sources([torch.stack([shared, other_head])], 4, 0, 3) == {2: 3}
    assert whole_block_sources([shared, other_head], 4, 0, 3) == {2: 3}  # layers disagree
    unaligned = torch.tensor([0, 1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])  # shifted by 3
    assert whole_block_sources([unaligned], 4, 0, 3) == {}


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_a_plans_unread_tail_holds_no_kept_slot_of_any_layer_or_head(data):
    """`CompressionPlan.unread_tail`: the table indexes from `num_blocks` on whose slots no
    layer's (or KV head's) kept indexes name. Oracle: each block's slots checked one by one."""
    bs = data.draw(st.integers(1, 5))
    table_len = data.draw(st.integers(1, 10))
    n = data.draw(st.integers(1, table_len * bs))
    c = data.draw(st.integers(1, n))
    kept = []
    for _ in range(data.draw(st.integers(1, 3))):  # layers
        rows = data.draw(st.sampled_from([None, HKV]))
        picks = [sorted(data.draw(st.permutations(list(range(n))))[:c])
                 for _ in range(rows or 1)]
        kept.append(torch.tensor(picks[0] if rows is None else picks))
    plan = CompressionPlan(kept, n, c, -(-c // bs), [c] * len(kept), 0)
    named = {int(s) for k in kept for s in k.flatten()}
    expected = [j for j in range(plan.num_blocks, table_len)
                if not any(s in named for s in range(j * bs, (j + 1) * bs))]
    assert plan.unread_tail(table_len, bs) == expected
