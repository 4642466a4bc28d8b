"""The Triton backend over the KVQuant and KIVI stores (decode: `nanokv/kernels/triton/
kvquant_decode.py`; prefill chunks in decode's view: `kvquant_read.py` then `prefill.py`)
against dequantize-then-dense (`reference_quantized_attention`, given the pasts' staged partial
blocks read before each step): uniform and non-uniform
codebooks of 2, 3, 4 and 8 bits, key and value outliers, sinks, keys kept before and after RoPE,
staged partial blocks (pasts ending mid-block, chunks that fill them, chunks of one token), a
bfloat16 staging, KIVI's value groups, block sizes 16, 32 and 256, contexts ending mid-block,
GQA ratios 1, 2 and 8, several splits, decodes next to a prefill chunk; and the
backend choice (the engine's greedy tokens through it: tests/unit/test_triton_attention.py).

On a CUDA machine the kernel compiles and runs on the GPU; without one it runs in Triton's
interpreter on CPU (TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported).
"""

import random

import pytest
import torch

from triton_device import triton_device

DEVICE = triton_device()  # the module skips without a GPU or the interpreter

from quant_stores import NUM_LAYERS, make_store, scenario, staged_pasts  # noqa: E402

from nanokv.attention.common import CommonAttentionMetadata, PrefillChunk  # noqa: E402
from nanokv.attention.quantized import QuantizedTorchBackend  # noqa: E402
from nanokv.quant.attention import reference_quantized_attention  # noqa: E402
from nanokv.attention.selector import select_backend  # noqa: E402
from nanokv.attention.triton_quantized import TritonQuantizedBackend  # noqa: E402
from nanokv.utils import cdiv  # noqa: E402

CPU = torch.device("cpu")

STORES = ["kvquant:4bit", "kvquant:3bit-nuq", "kvquant:2bit-nuq-thresholds",
          "kvquant:mixed-8-4", "kvquant:per-channel-post-rope", "kivi:2", "kivi:4"]
LENS = {16: [1, 2, 15, 16, 17, 40], 32: [3, 32, 33, 70]}


class _Splits(TritonQuantizedBackend):
    """The backend with a fixed split count (the interpreter has no SMs to fill) and blocks per
    loop iteration (`unroll`)."""

    splits = 3

    def decode_splits(self, rows: int, max_context: int) -> int:
        return max(1, min(self.splits, cdiv(max_context, self.block_size)))


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("block_size,hq,splits,unroll", [(16, 2, 1, 2), (16, 4, 3, 1),
                                                         (32, 16, 2, 4)])
def test_decode_equals_dequantize_then_dense(kind, block_size, hq, splits, unroll):
    rng = random.Random(hash((kind, block_size, hq)) % 1000)
    gen = torch.Generator().manual_seed(block_size + hq)
    lens = LENS[block_size]
    d = 32 if hq != 4 else 64
    store = make_store(kind, d, block_size, sum(cdiv(n, block_size) for n in lens) + 3,
                       len(lens) + 1, device=DEVICE)
    backend = type("Backend", (_Splits,), {"splits": splits, "unroll": unroll})
    outs, refs = scenario(store, hq, lens, rng, gen, chunk=block_size // 2 + 3,
                          backend_cls=backend, device=DEVICE)
    if "2bit" in kind:  # outliers were kept
        assert bool((store.buffers["k_oidx0"] >= 0).any())
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["kvquant:2bit-nuq-thresholds", "kvquant:per-channel-post-rope",
                                  "kivi:4"])
@pytest.mark.parametrize("block_size,windows,splits", [(16, (1, 23), 3), (32, (40, None), 2)])
def test_sliding_window_equals_dequantize_then_dense(kind, block_size, windows, splits):
    """Layers with sliding windows (each its own, or none; the blocks behind a window left in
    the tables, as a hybrid model keeps them): the decodes over several splits and the prefill
    chunks' STAGED view against dequantize-then-dense over each token's newest `window`."""
    rng = random.Random(block_size)
    gen = torch.Generator().manual_seed(block_size + len(kind))
    lens = LENS[block_size]
    store = make_store(kind, 32, block_size, sum(cdiv(n, block_size) for n in lens) + 3,
                       len(lens) + 1, device=DEVICE, windows=windows)
    backend = type("Backend", (_Splits,), {"splits": splits})
    outs, refs = scenario(store, 4, lens, rng, gen, chunk=block_size // 2 + 3,
                          backend_cls=backend, device=DEVICE)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["kvquant:4bit-outliers5", "kvquant:per-channel-post-rope"])
def test_key_outliers_in_chunks(kind):
    """Blocks whose key outliers take several of the kernel's chunks of entries (5% of a block
    of 32 x 64: 104 entries, 2 chunks of 64; the post-RoPE store at 1%: 22 in one)."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    lens = [1, 33, 70, 95]
    store = make_store(kind, 64, 32, sum(cdiv(n, 32) for n in lens) + 3, len(lens) + 1,
                       device=DEVICE)
    cap = store.buffers["k_oidx0"].shape[-1]
    backend = type("Backend", (_Splits,), {"splits": 2, "unroll": 1})
    outs, refs = scenario(store, 8, lens, rng, gen, chunk=40, backend_cls=backend, device=DEVICE)
    if "outliers5" in kind:
        assert cap > 64  # more than one chunk of 64
        assert int((store.buffers["k_oidx0"] >= 0).sum(-1).max()) > 64  # and as many kept
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["kvquant:2bit-nuq-thresholds", "kivi:4"])
def test_blocks_of_256(kind):
    """Blocks of 256 slots, contexts ending before, at and after a block's end, GQA 8: decodes
    and prefill chunks over their prefixes (read 16 slots a program) against the reference."""
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    lens = [3, 256, 300]
    store = make_store(kind, 32, 256, sum(cdiv(n, 256) for n in lens) + 2, len(lens) + 1,
                       device=DEVICE)
    backend = type("Backend", (_Splits,), {"splits": 2, "unroll": 1})
    outs, refs = scenario(store, 16, lens, rng, gen, chunk=150, backend_cls=backend,
                          device=DEVICE)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def _tokens(store, n, positions, gen, hq=None):
    """k_pre, k (rotated), v: [L, n, Hkv, D] (queries [L, n, hq, D] when hq is given)."""
    heads, d = store.layout.num_kv_heads, store.layout.head_dim
    k_pre = torch.randn(NUM_LAYERS, n, heads, d, generator=gen)
    k_pre[torch.rand(k_pre.shape, generator=gen) < 0.02] *= 8
    v = torch.randn(NUM_LAYERS, n, heads, d, generator=gen)
    pos = torch.tensor(positions, device=store.device)
    k_pre, v = k_pre.to(store.device), v.to(store.device)
    k = torch.stack([store.rotary.rotate(pos, k_pre[layer]) for layer in range(NUM_LAYERS)])
    if hq is None:
        return k_pre, k, v
    return k_pre, k, v, torch.randn(NUM_LAYERS, n, hq, d, generator=gen).to(store.device)


def _write(store, slots, positions, gen):
    k_pre, k, v = _tokens(store, len(slots), positions, gen)
    plan = store.begin_step(slots, positions)
    for layer in range(NUM_LAYERS):
        store.write_layer(layer, plan, k[layer], v[layer], k_pre[layer])


@pytest.mark.parametrize("kind,staging_dtype", [("kvquant:2bit-nuq-thresholds", None),
                                                 ("kvquant:per-channel-post-rope", torch.bfloat16),
                                                 ("kivi:2", None)])
@pytest.mark.parametrize("scratch_slots,groups", [(1 << 16, 1), (80, 3)])
def test_prefill_chunks_over_a_shared_prefix(kind, staging_dtype, scratch_slots, groups):
    """Prefill chunks of one step whose prefixes share cached blocks (prefix caching's common
    prefix), a chunk with no prefix, pasts ending mid-block (a chunk that fills that block, one
    of a single token that does, one of a single token that does not): each block of the
    chunks' contexts decoded once per group, outputs against the reference (decode's view). A
    scratch of 80 slots (5 blocks) splits them into groups of at most 5 distinct blocks, a
    shared block read again by a later group. A bfloat16 staging rounds the staged keys."""
    bs, hq = 16, 4
    gen = torch.Generator().manual_seed(13)
    store = make_store(kind, 32, bs, 16, 6, staging_dtype=staging_dtype, device=DEVICE)
    shared = [9, 4]  # two full blocks, positions 0..31
    _write(store, [b * bs + j for b in shared for j in range(bs)], list(range(2 * bs)), gen)
    # (table, cached slots before the step, new tokens this step)
    requests = [(shared + [7], 37, 6), (shared + [1, 12], 44, 9), ([3], 0, 11),
                ([shared[0], 15], 16, 4), (shared + [6], 47, 1), (shared + [10], 33, 1)]
    for table, past, _ in requests:  # each request's own cached tokens after the shared ones
        own = range(2 * bs if len(table) > 2 else bs if past else 0, past)
        if len(own):
            _write(store, [table[j // bs] * bs + j % bs for j in own], list(own), gen)
    slots, positions, chunks, start = [], [], [], 0
    for table, past, n in requests:
        slots += [table[j // bs] * bs + j % bs for j in range(past, past + n)]
        positions += list(range(past, past + n))
        chunks.append(PrefillChunk(start, n, past + n, table))
        start += n
    k_pre, k, v, q = _tokens(store, start, positions, gen, hq)
    backend = TritonQuantizedBackend(store, store.device)
    backend.prefill_scratch_slots = scratch_slots
    # each request's staged partial block before the step, as a read returns it
    before = [staged_pasts(store, table, past) for table, past, _ in requests]
    common = CommonAttentionMetadata(slots, 0, [], [], chunks)
    common.write_plan = store.begin_step(slots, positions)
    pre = backend.prefill_chunks(common)
    assert len(pre.groups) == groups
    read = [g.read_ids.tolist() for g in pre.groups]
    assert all(len(ids) == len(set(ids)) for ids in read)  # each block once in a group
    assert read == ([[9, 4, 7, 1, 12, 3, 15, 6, 10]] if groups == 1 else
                    [[9, 4, 7, 1, 12], [3, 9, 15, 4, 6], [9, 4, 10]])
    assert pre.staged_ids.tolist() == [7, 1, 6, 10]  # the pasts' partial blocks
    meta = backend.build(common)
    outs = [backend.forward(layer, q[layer], k[layer], v[layer], k_pre[layer], meta,
                            q.shape[-1] ** -0.5) for layer in range(NUM_LAYERS)]
    d, pos = store.layout.head_dim, torch.tensor(positions, device=store.device)
    for layer, out in enumerate(outs):
        for (table, past, n), c, staged in zip(requests, chunks, before):
            rows = slice(c.query_start, c.query_start + n)
            ref = reference_quantized_attention(q[layer, rows], k[layer, rows], v[layer, rows],
                                                store, layer, table, past, d ** -0.5,
                                                store.rotary.rotate, k_pre[layer, rows],
                                                pos[rows], staged[layer])
            torch.testing.assert_close(out[rows], ref, atol=2e-5, rtol=1e-4)


def test_backend_choice():
    cuda = torch.device("cuda")
    for kind in ("kvquant:4bit", "kvquant:per-channel-post-rope", "kivi:4"):
        store = make_store(kind, 32, 16, 4, 1)
        assert select_backend("auto", store, cuda)[0] is TritonQuantizedBackend
        assert select_backend("torch", store, cuda)[0] is QuantizedTorchBackend
    per_token = make_store("kvquant:ablation-per-token-post-rope", 32, 16, 4, 1)
    assert select_backend("auto", per_token, cuda)[0] is QuantizedTorchBackend
    reason, structural = TritonQuantizedBackend.why_not(per_token, cuda)
    assert structural and "per-channel" in reason
    odd = make_store("kvquant:4bit", 32, 24, 4, 1)
    reason, structural = TritonQuantizedBackend.why_not(odd, cuda)
    assert structural and "power-of-two" in reason
    int8 = make_store("int8", 32, 16, 4, 1)
    reason, structural = TritonQuantizedBackend.why_not(int8, cuda)
    assert structural and "kvquant and kivi" in reason
    unequal = make_store("kvquant:4bit", 32, 16, 4, 1)  # RoPE tables whose halves differ
    unequal.rotary.cos = unequal.rotary.cos.clone()
    unequal.rotary.cos[:, -1] += 0.5
    reason, structural = TritonQuantizedBackend.why_not(unequal, cuda)
    assert structural and "two halves repeat" in reason
    if not torch.cuda.is_available():  # on CPU: chosen by name under the interpreter only
        kvq = make_store("kvquant:4bit", 32, 16, 4, 1)
        assert select_backend("triton", kvq, CPU)[0] is TritonQuantizedBackend
        assert select_backend("auto", kvq, CPU)[0] is not TritonQuantizedBackend
