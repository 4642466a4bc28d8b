"""Prefill over a quantized store in decode's view (`nanokv.quant.decode_view`): a sequence
prefilled in chunks gets, token for token, what it gets decoding one token a step (the brute
force: every token its own step through the backend's decode path); the staged rows a step's
write quantizes away, read after `plan_write` (`staging.read_filling`), equal a read made before
the step; the grouped flash path equals the one-call masked path."""


import pytest
import torch

from nanokv.attention.common import PrefillChunk
from nanokv.attention.native_quantized import NativeQuantizedBackend
from nanokv.attention.quantized import QuantizedTorchBackend
from nanokv.quant import decode_view
from nanokv.quant.staging import read_filling
from quant_stores import HKV, NUM_LAYERS, make_store, step
from nanokv.utils import cdiv

KINDS = ["int8", "fp8_e4m3", "fp8_e5m2", "int8-pre-rope", "kvquant:4bit",
         "kvquant:2bit-nuq-thresholds", "kvquant:per-channel-post-rope", "kivi:2", "kivi:4"]


def _tokens(store, n, gen, hq, p0=5):
    """q, k (after RoPE), v, k_pre: [L, n, H, D]; positions [n] from p0."""
    d = store.layout.head_dim
    pos = torch.arange(p0, p0 + n)
    k_pre = torch.randn(NUM_LAYERS, n, HKV, d, generator=gen)
    k_pre[torch.rand(k_pre.shape, generator=gen) < 0.02] *= 8  # outliers
    v = torch.randn(NUM_LAYERS, n, HKV, d, generator=gen)
    k = torch.stack([store.rotary.rotate(pos, k_pre[layer]) for layer in range(NUM_LAYERS)])
    q = torch.randn(NUM_LAYERS, n, hq, d, generator=gen) * 2
    return q, k, v, k_pre, pos


def _chunked(store, backend, table, q, k, v, k_pre, pos, cuts):
    """The sequence prefilled in chunks ending at `cuts`: each layer's rows [L][n, Hq, D]."""
    bs, rows, done = store.block_size, [], 0
    for end in cuts:
        sl = slice(done, end)
        slots = [table[j // bs] * bs + j % bs for j in range(done, end)]
        chunk = PrefillChunk(0, end - done, end, table[:cdiv(end, bs)])
        rows.append(step(store, backend, q[:, sl], k[:, sl], v[:, sl], k_pre[:, sl], slots,
                         pos[sl].tolist(), [], [], [chunk]))
        done = end
    return [torch.cat([r[layer] for r in rows]) for layer in range(NUM_LAYERS)]


def _one_a_step(store, backend, table, q, k, v, k_pre, pos):
    """The same sequence one token a step: the first a one-token prefill, the rest decodes."""
    bs, rows = store.block_size, []
    for t in range(q.shape[1]):
        sl = slice(t, t + 1)
        slot = [table[t // bs] * bs + t % bs]
        if t == 0:
            out = step(store, backend, q[:, sl], k[:, sl], v[:, sl], k_pre[:, sl], slot,
                       pos[sl].tolist(), [], [], [PrefillChunk(0, 1, 1, table[:1])])
        else:
            out = step(store, backend, q[:, sl], k[:, sl], v[:, sl], k_pre[:, sl], slot,
                       pos[sl].tolist(), [table[:cdiv(t + 1, bs)]], [t + 1])
        rows.append(out)
    return [torch.cat([r[layer] for r in rows]) for layer in range(NUM_LAYERS)]


@pytest.mark.parametrize("backend_cls", [QuantizedTorchBackend, NativeQuantizedBackend])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size,hq,cuts", [
    (16, 2, [7, 16, 23, 50, 51, 90]),  # chunks ending and starting mid-block, one of 1 token
    (16, 16, [40, 300]),  # GQA 8; a chunk of 260 rows: several flash groups
    (256, 4, [100, 300, 301]),  # a chunk filling a block begun by the one before
])
def test_chunked_prefill_equals_one_token_a_step(kind, block_size, hq, cuts, backend_cls):
    n = cuts[-1]
    gen = torch.Generator().manual_seed(block_size + hq)
    stores = [make_store(kind, 32, block_size, cdiv(n, block_size) + 2, 2) for _ in range(2)]
    table = list(range(1, cdiv(n, block_size) + 1))
    q, k, v, k_pre, pos = _tokens(stores[0], n, gen, hq)
    chunked = _chunked(stores[0], backend_cls(stores[0], torch.device("cpu")), table, q, k, v,
                       k_pre, pos, cuts)
    ref = _one_a_step(stores[1], backend_cls(stores[1], torch.device("cpu")), table, q, k, v,
                      k_pre, pos)
    for got, want in zip(chunked, ref):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind,staging_dtype", [
    ("kvquant:4bit", None), ("kvquant:4bit", torch.bfloat16), ("kvquant:2bit-nuq-thresholds", None),
    ("kvquant:per-channel-post-rope", torch.bfloat16), ("kivi:4", None)])
def test_read_filling_equals_a_read_before_the_step(kind, staging_dtype):
    bs = 16
    store = make_store(kind, 32, bs, 8, 3, staging_dtype=staging_dtype)
    gen = torch.Generator().manual_seed(3)
    table, past = [5, 2, 7], 21  # block 2 holds 5 staged slots
    _, k, v, k_pre, pos = _tokens(store, 40, gen, 2)
    write = store.begin_step([table[j // bs] * bs + j % bs for j in range(past)],
                             pos[:past].tolist())
    for layer in range(NUM_LAYERS):
        store.write_layer(layer, write, k[layer, :past], v[layer, :past], k_pre[layer, :past])
    rope = store.rotary.rotate if store.pre_rope_keys else None
    before = [store.read(layer, table, past, rope) for layer in range(NUM_LAYERS)]
    plan = store.begin_step([table[j // bs] * bs + j % bs for j in range(past, 40)],
                            pos[past:].tolist())  # fills block 2 (and block 7 partly)
    got = []
    for layer in range(NUM_LAYERS):
        got.append(read_filling(store, layer, plan, table[1], past - bs, rope))
        store.write_layer(layer, plan, k[layer, past:], v[layer, past:], k_pre[layer, past:])
    for layer, (k_got, v_got) in enumerate(got):  # checked after the writes: copies
        torch.testing.assert_close(k_got, before[layer][0][bs:], atol=0, rtol=0)
        torch.testing.assert_close(v_got, before[layer][1][bs:], atol=0, rtol=0)
    after_k, _ = store.read(0, table, past, rope)
    assert not torch.equal(after_k[bs:], before[0][0][bs:])  # the write quantized them


@pytest.mark.parametrize("window", [None, 1, 20, 150])
@pytest.mark.parametrize("stages", [None, "keys and values", "keys"])  # None: per token
@pytest.mark.parametrize("block_size,past,length", [(16, 0, 300), (16, 37, 129), (256, 250, 70),
                                                    (16, 5, 1), (16, 15, 1), (16, 16, 2),
                                                    (128, 100, 300), (128, 127, 1), (128, 0, 129)])
def test_grouped_flash_path_equals_the_masked_path(stages, block_size, past, length, window):
    """With a sliding window too: the flash path's parts by tiles of rows (two tiles at 300
    rows), the masked path by tiles of 8 rows and in one call."""
    gen = torch.Generator().manual_seed(past + length)
    total, hq, hkv, d = past + length, 8, 2, 32
    q = torch.randn(length, hq, d, generator=gen)
    k_new, v_new = torch.randn(length, hkv, d, generator=gen), torch.randn(length, hkv, d,
                                                                          generator=gen)
    k_fin, v_fin = torch.randn(total, hkv, d, generator=gen), torch.randn(total, hkv, d,
                                                                          generator=gen)
    start = past // block_size * block_size
    staged = (torch.randn(total - start, hkv, d, generator=gen),
              torch.randn(total - start, hkv, d, generator=gen)) if stages else None
    if stages == "keys":  # KVQuant: values read from their codes (final) from the first write
        staged = (staged[0], None)
    args = (q, k_new, v_new, k_fin, v_fin, staged, past, block_size, d ** -0.5, window)
    tensors = [x for x in (q, k_new, v_new, k_fin, v_fin, *(staged or ())) if x is not None]
    inputs = [x.clone() for x in tensors]
    assert decode_view._FLASH_CPU is not None
    fast = decode_view.decode_view_attention(*args)
    for x, before in zip(tensors, inputs):
        assert torch.equal(x, before)  # the parts merge in place, never in the inputs
    masked = decode_view.decode_view_attention_masked(*args, tile=10**6)  # one call
    torch.testing.assert_close(fast, masked, atol=2e-5, rtol=1e-4)
    if window is not None:
        torch.testing.assert_close(decode_view.decode_view_attention_masked(*args, tile=8),
                                   masked, atol=2e-5, rtol=1e-4)


def test_visible_rule_by_hand():
    rows, keys = torch.tensor([17, 18, 31, 32]), torch.arange(33)
    final, staged = decode_view.visible(rows, keys, 16, stages=True)
    assert final[0].nonzero().flatten().tolist() == list(range(16))  # block 0 full
    assert staged[0].nonzero().flatten().tolist() == [16]  # its own block, filling
    assert staged[1].nonzero().flatten().tolist() == [16, 17]
    assert final[2].nonzero().flatten().tolist() == list(range(31))  # 31 fills block 1
    assert not staged[2].any()
    assert final[3].nonzero().flatten().tolist() == list(range(32)) and not staged[3].any()
    final, staged = decode_view.visible(rows, keys, 16, stages=False)
    assert final[1].nonzero().flatten().tolist() == list(range(18)) and not staged.any()
