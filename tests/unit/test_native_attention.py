"""The C decode-attention kernel against the dense reference, its run layout against brute
force, and the backend choice (fallback when no compiler, error when 'native' is forced)."""

import logging
import random

import pytest
import torch

import nanokv.layers.native_attention as native
from nanokv.attention.native_quantized import NativeQuantizedBackend
from nanokv.attention.selector import select_backend
from nanokv.cache.kv_pool import KVLayout, KVPool
from nanokv.layers.attention import (AttentionMetadata, _decode_per_request,
                                     dense_reference_attention)
from nanokv.layers.native_attention import build_decode_runs, native_decode_attention


def random_pool(lens, block_size, hkv, d, rng, consecutive=False):
    """K/V of each request written into its blocks: shuffled, or consecutive with jumps."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    k_cache = torch.randn(num_blocks, block_size, hkv, d)  # garbage outside the tables
    v_cache = torch.randn(num_blocks, block_size, hkv, d)
    order = list(range(num_blocks))
    if not consecutive:
        rng.shuffle(order)
    tables, k_all, v_all = [], [], []
    for n in lens:
        table = [order.pop(0) for _ in range(-(-n // block_size))]
        k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        for i in range(n):
            k_cache[table[i // block_size], i % block_size] = k[i]
            v_cache[table[i // block_size], i % block_size] = v[i]
        if consecutive and rng.random() < 0.5:
            order.append(order.pop(0))  # leave a hole: the next request starts a new run
        tables.append(table)
        k_all.append(k)
        v_all.append(v)
    return k_cache, v_cache, tables, k_all, v_all


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 32), (8, 2, 64), (16, 8, 128), (6, 1, 16)])
@pytest.mark.parametrize("block_size,consecutive,soft_cap", [
    (16, False, None), (16, True, None), (32, True, None), (16, False, 2.0)])
def test_kernel_matches_dense_reference(hq, hkv, d, block_size, consecutive, soft_cap):
    """soft_cap: Gemma 2's attention logit soft-cap (2 caps most of these peaked scores)."""
    rng = random.Random(hq * 100 + d + block_size)
    torch.manual_seed(hq + d)
    # 1 slot, around the kernel's 16-slot tile, around block boundaries, long
    lens = [1, 15, 16, 17, 31, 33, 100, 257]
    k_cache, v_cache, tables, k_all, v_all = random_pool(lens, block_size, hkv, d, rng,
                                                         consecutive)
    q = torch.randn(len(lens), hq, d) * 3  # peaked softmax: exercises the running max
    scale = d ** -0.5
    out = native_decode_attention(q, k_cache, v_cache,
                                  build_decode_runs(tables, lens, block_size), scale, soft_cap)
    for i, (k, v) in enumerate(zip(k_all, v_all)):
        ref = dense_reference_attention(q[i:i + 1], k, v, scale, soft_cap=soft_cap)[0]
        torch.testing.assert_close(out[i], ref, atol=2e-5, rtol=2e-5)
    # and the PyTorch per-request path (the reference fast path) agrees
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), None, None, [],
                             decode_context_lens=lens, decode_block_lists=tables,
                             soft_cap=soft_cap)
    torch.testing.assert_close(out, _decode_per_request(q, k_cache, v_cache, meta, scale),
                               atol=2e-5, rtol=2e-5)


def test_runs_cover_exactly_the_slots_of_each_request():
    """Brute force: expanding the runs gives the slot of every logical position, in order."""
    rng = random.Random(0)
    for trial in range(200):
        bs = rng.choice([1, 2, 4, 16])
        lens = [rng.randint(1, 80) for _ in range(rng.randint(1, 6))]
        pool = list(range(1000))
        if trial % 2:
            rng.shuffle(pool)
        tables, nxt = [], 0
        for n in lens:
            nb = -(-n // bs)
            tables.append(pool[nxt:nxt + nb])
            nxt += nb + rng.randint(0, 1)
        runs = build_decode_runs(tables, lens, bs)
        ptr, start, length = (t.tolist() for t in (runs.run_ptr, runs.run_start, runs.run_len))
        assert ptr[0] == 0 and len(ptr) == len(lens) + 1
        for i, (table, n) in enumerate(zip(tables, lens)):
            expanded = [s for r in range(ptr[i], ptr[i + 1])
                        for s in range(start[r], start[r] + length[r])]
            assert expanded == [table[j // bs] * bs + j % bs for j in range(n)]
            # maximal: two runs of one request never touch (they would have been one run)
            for r in range(ptr[i], ptr[i + 1] - 1):
                assert start[r] + length[r] != start[r + 1] or length[r] % bs != 0


def test_kernel_rejects_what_it_cannot_read():
    q = torch.randn(2, 4, 8)
    cache = torch.randn(4, 16, 2, 8)
    runs = build_decode_runs([[0], [1]], [3, 5], 16)
    with pytest.raises(ValueError, match="float32"):
        native_decode_attention(q.double(), cache.double(), cache.double(), runs, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        native_decode_attention(q, cache.transpose(0, 1), cache, runs, 1.0)
    with pytest.raises(ValueError, match="cover 2 requests"):
        native_decode_attention(q[:1], cache, cache, runs, 1.0)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A machine without a working C compiler (and nothing built in the cache yet)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_error", None)


def _layout(dtype=torch.float32):
    return KVLayout(num_layers=1, block_size=16, num_kv_heads=2, head_dim=8, dtype=dtype)


def _pool(dtype=torch.float32):
    return KVPool(_layout(dtype), 4, torch.device("cpu"))


def _int8_store():
    from nanokv.quant import make_kv_store

    return make_kv_store("int8", _layout(), 4)


def choose_decode_backend(requested, device, kv_cache):
    """The name of the attention backend the engine would choose (the choice made once)."""
    return select_backend(requested, kv_cache, device)[0].name


def test_auto_falls_back_to_torch_without_a_compiler(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="nanokv"):
        assert choose_decode_backend("auto", torch.device("cpu"), _pool()) == "torch"
    assert "no-such-cc" in caplog.text and "PyTorch path" in caplog.text
    with pytest.raises(ValueError, match="attention_backend 'native' cannot be used: C compiler"):
        choose_decode_backend("native", torch.device("cpu"), _pool())


def test_backend_choice_where_the_kernel_applies():
    cpu = torch.device("cpu")
    assert choose_decode_backend("auto", cpu, _pool()) == "native"
    assert choose_decode_backend("native", cpu, _pool()) == "native"
    assert choose_decode_backend("torch", cpu, _pool()) == "torch"
    assert choose_decode_backend("auto", cpu, _pool(torch.bfloat16)) == "torch"
    with pytest.raises(ValueError, match="float32 caches only"):
        choose_decode_backend("native", cpu, _pool(torch.bfloat16))
    # an int8 store has its own C kernels (tests/unit/test_native_quant_attention.py)
    assert select_backend("native", _int8_store(), cpu)[0] is NativeQuantizedBackend


def test_unwritable_cache_directory_falls_back(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_error", None)
    assert choose_decode_backend("auto", torch.device("cpu"), _pool()) == "torch"
    with pytest.raises(ValueError, match="not writable.*NANOKV_CACHE_DIR"):
        choose_decode_backend("native", torch.device("cpu"), _pool())
