"""Paged attention against the dense reference on random tensors and random block layouts, with
and without a sliding window, with and without an attention logit soft-cap."""

import random

import pytest
import torch

from nanokv.layers.attention import (AttentionMetadata, PrefillSeq, dense_reference_attention,
                                     paged_attention)
from nanokv.attention.torch_paged import padded_decode_tables
from nanokv.layers.native_attention import build_decode_runs

HQ, HKV, D = 4, 2, 8


def scatter_into_pool(k_all, v_all, num_blocks, block_size, rng):
    """Write each sequence's K/V into randomly chosen (shuffled) blocks; return tables."""
    k_cache = torch.zeros(num_blocks, block_size, HKV, D)
    v_cache = torch.zeros(num_blocks, block_size, HKV, D)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for k, v in zip(k_all, v_all):
        n_blocks = -(-k.shape[0] // block_size)
        table = [free.pop() for _ in range(n_blocks)]
        for i in range(k.shape[0]):
            k_cache[table[i // block_size], i % block_size] = k[i]
            v_cache[table[i // block_size], i % block_size] = v[i]
        tables.append(table)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("soft_cap", [None, 0.7])
@pytest.mark.parametrize("window", [None, 1, 6, 13])
@pytest.mark.parametrize("decode_path", ["padded", "per_request", "native"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_and_prefill_with_past_match_dense(block_size, decode_path, window, soft_cap,
                                                  monkeypatch):
    """soft_cap: Gemma 2's (0.7 caps most of these scores), its explicit path taking a few
    query rows at a time (SOFT_CAP_SCORE_BYTES: the 12-row chunk in tiles of 5 rows)."""
    import nanokv.layers.attention as attention

    monkeypatch.setattr(attention, "SOFT_CAP_SCORE_BYTES", 4 * HQ * 12 * 5)
    per_request = decode_path != "padded"
    rng = random.Random(0)
    torch.manual_seed(0)
    # three decodes with different context lengths, two prefill chunks with a cached past
    decode_lens = [5, 16, 17, 33]  # partial and exactly full last blocks
    nd = len(decode_lens)
    prefill = [(10, 7), (0, 12), (21, 5)]  # (past, new)
    seqs = decode_lens + [p + n for p, n in prefill]
    k_all = [torch.randn(n, HKV, D) for n in seqs]
    v_all = [torch.randn(n, HKV, D) for n in seqs]
    q_lens = [1] * nd + [n for _, n in prefill]
    q_all = [torch.randn(n, HQ, D) for n in q_lens]
    # the pool holds everything but the new tokens, which paged_attention writes itself
    past_k = [k[:-q] for k, q in zip(k_all, q_lens)]
    past_v = [v[:-q] for v, q in zip(v_all, q_lens)]
    full_k = [k for k in k_all]
    k_cache, v_cache, tables = scatter_into_pool(full_k, v_all, 40, block_size, rng)
    # blank the slots of the new tokens so only the kernel's own write can fill them
    slots = []
    for k, q, table in zip(full_k, q_lens, tables):
        for i in range(k.shape[0] - q, k.shape[0]):
            slots.append(table[i // block_size] * block_size + i % block_size)
    k_cache.view(-1, HKV, D)[slots] = 0
    v_cache.view(-1, HKV, D)[slots] = 0
    del past_k, past_v

    dec_tables, mask = padded_decode_tables(tables[:nd], decode_lens, block_size,
                                            torch.device("cpu"), window)
    prefills, start = [], nd
    for (past, new), table in zip(prefill, tables[nd:]):
        prefills.append(PrefillSeq(start, new, past + new, torch.tensor(table)))
        start += new
    meta = AttentionMetadata(torch.tensor(slots), nd, dec_tables, mask, prefills,
                             decode_context_lens=decode_lens if per_request else None,
                             window=window, soft_cap=soft_cap)
    if decode_path == "native":  # the C kernel (tests/unit/test_native_attention.py)
        meta.decode_runs = build_decode_runs(tables[:nd], decode_lens, block_size, window)
    q = torch.cat(q_all)
    k_new = torch.cat([k[-n:] for k, n in zip(k_all, q_lens)])
    v_new = torch.cat([v[-n:] for v, n in zip(v_all, q_lens)])
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale=D ** -0.5)

    offset = 0
    for qs, k, v in zip(q_all, k_all, v_all):
        ref = dense_reference_attention(qs, k, v, D ** -0.5, window, soft_cap)
        torch.testing.assert_close(out[offset:offset + qs.shape[0]], ref, atol=1e-5, rtol=1e-5)
        offset += qs.shape[0]


@pytest.mark.parametrize("num_past,length,window,tile", [
    (0, 37, 5, 4),  # tiles of the window (5 > 4)
    (0, 37, 3, 8),  # tiles of 8 over windows of 3
    (10, 23, 7, 4),  # a cached past in view
    (3, 40, 43, 16),  # a window past the first slot: causal only
])
def test_window_attention_by_tiles_matches_dense(num_past, length, window, tile):
    from nanokv.layers.attention import window_attention

    torch.manual_seed(3)
    q = torch.randn(length, HQ, D)
    k, v = torch.randn(num_past + length, HKV, D), torch.randn(num_past + length, HKV, D)
    out = window_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                           v.transpose(0, 1)[None], num_past, window, 0.3, tile=tile)
    torch.testing.assert_close(out[0].transpose(0, 1),
                               dense_reference_attention(q, k, v, 0.3, window),
                               atol=1e-5, rtol=1e-5)


def test_dense_reference_window_sees_the_newest_tokens_only():
    torch.manual_seed(2)
    q, k, v = torch.randn(6, HQ, D), torch.randn(9, HKV, D), torch.randn(9, HKV, D)
    scale = 0.3
    out = dense_reference_attention(q, k, v, scale, window=4)
    # a window of 1: each query's output is its own value
    own = dense_reference_attention(q, k, v, scale, window=1)
    torch.testing.assert_close(own, v[3:].repeat_interleave(HQ // HKV, dim=1))
    # query i (token 3 + i) over tokens 3 + i - 3 .. 3 + i only: as if the rest were absent
    for i in range(6):
        last = 3 + i
        alone = dense_reference_attention(q[i:i + 1], k[last - 3:last + 1], v[last - 3:last + 1],
                                          scale)
        torch.testing.assert_close(out[i:i + 1], alone)
    # a window as long as the context is no window
    torch.testing.assert_close(dense_reference_attention(q, k, v, scale, window=9),
                               dense_reference_attention(q, k, v, scale))


def test_dense_reference_is_causal():
    torch.manual_seed(1)
    q, k, v = torch.randn(6, HQ, D), torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    out = dense_reference_attention(q, k, v, 0.3)
    # the first query sees only the first key: its output is that value (per group head)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(HQ // HKV, dim=0))
    # changing a future key does not change earlier outputs
    k2 = k.clone()
    k2[5] += 10
    torch.testing.assert_close(dense_reference_attention(q, k2, v, 0.3)[:5], out[:5])


def test_slot_runs_merge_consecutive_full_blocks_only():
    from nanokv.layers.native_attention import slot_runs

    # (first pool slot, slots): block b's slots start at b * 16
    assert slot_runs([4, 5, 6], 40, 16) == [(64, 40)]
    assert slot_runs([4, 5, 9, 10], 60, 16) == [(64, 32), (144, 28)]
    assert slot_runs([7], 3, 16) == [(112, 3)]
    assert slot_runs([3, 2], 20, 16) == [(48, 16), (32, 4)]
    # from a sliding window's first slot: inside a block, at a block's start, in the last one
    assert slot_runs([4, 5, 9, 10], 60, 16, start=20) == [(84, 12), (144, 28)]
    assert slot_runs([4, 5, 9, 10], 60, 16, start=32) == [(144, 28)]
    assert slot_runs([4, 5, 9, 10], 60, 16, start=59) == [(171, 1)]


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_over_consecutive_blocks_matches_dense(block_size):
    """Requests whose blocks are consecutive in the pool are read as one view per run."""
    torch.manual_seed(1)
    lens = [7, 16, 37]
    k_all = [torch.randn(n, HKV, D) for n in lens]
    v_all = [torch.randn(n, HKV, D) for n in lens]
    k_cache = torch.zeros(40, block_size, HKV, D)
    v_cache = torch.zeros(40, block_size, HKV, D)
    tables, nxt = [], 1
    for r, (k, v) in enumerate(zip(k_all, v_all)):
        nb = -(-k.shape[0] // block_size)
        table = list(range(nxt, nxt + nb))  # consecutive
        if nb > 2:
            table[-1] = 39 - r  # and a jump for the last block
        nxt += nb
        for i in range(k.shape[0]):
            k_cache[table[i // block_size], i % block_size] = k[i]
            v_cache[table[i // block_size], i % block_size] = v[i]
        tables.append(table)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]), None, [],
                             write_cache=False, decode_context_lens=lens)
    q = torch.randn(len(lens), HQ, D)
    out = paged_attention(q, torch.empty(0, HKV, D), torch.empty(0, HKV, D), k_cache, v_cache,
                          meta, scale=D ** -0.5)
    for i, (k, v) in enumerate(zip(k_all, v_all)):
        ref = dense_reference_attention(q[i:i + 1], k, v, D ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("past,length", [(1, 1), (1, 9), (37, 5), (300, 200), (64, 700)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
def test_chunk_over_prefix_matches_dense(past, length, heads):
    """A prefill chunk over its cached prefix: the split path (prefix and chunk apart, merged by
    log-sum-exp, CPU float32) and the masked reference both equal the float64 dense oracle."""
    from nanokv.layers.attention import chunk_over_prefix, chunk_over_prefix_masked

    hq, hkv = heads
    gen = torch.Generator().manual_seed(past * 1000 + length + hq)
    q = torch.randn(length, hq, 32, generator=gen)
    k = torch.randn(past + length, hkv, 32, generator=gen) * 2
    v = torch.randn(past + length, hkv, 32, generator=gen)
    scale = 32 ** -0.5
    ref = dense_reference_attention(q, k, v, scale)  # [L, Hq, D]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    got = chunk_over_prefix(qh, k[:past], v[:past], k[past:], v[past:], scale)
    torch.testing.assert_close(got.squeeze(0).transpose(0, 1), ref.float(), atol=2e-5, rtol=1e-4)

    def heads_first(x):
        return x.transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]

    masked = chunk_over_prefix_masked(qh, heads_first(k[:past]), heads_first(v[:past]),
                                      heads_first(k[past:]), heads_first(v[past:]), scale)
    torch.testing.assert_close(masked.squeeze(0).transpose(0, 1), ref.float(), atol=2e-5,
                               rtol=1e-4)
