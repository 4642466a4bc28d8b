"""The quantized C decode kernels (`csrc/quant_decode_attention.c`, backend `native` over int8 /
fp8 / KVQuant / KIVI stores) against dequantize-then-dense (`reference_quantized_attention`): every
store, bit widths, codebooks, outliers, sinks, pre-RoPE keys, block sizes 16 and 256, contexts
that end mid-block, GQA ratios 1, 2 and 8, prefill chunks next to decodes; and the backend
choice."""

import random

import pytest
import torch
from narrow_builds import run_narrow_build

from quant_stores import (HKV, MAX_POS, NUM_LAYERS, _HFConfig, check_policy_view, fill,
                          make_store, scenario, step)

from nanokv.attention.common import CommonAttentionMetadata
from nanokv.attention.native_quantized import NativeQuantizedBackend
from nanokv.attention.quantized import QuantizedTorchBackend
from nanokv.attention.selector import select_backend
from nanokv.cache.kv_pool import KVLayout
from nanokv.layers.native_attention import NativeKernelUnavailable
from nanokv.layers.native_quant_attention import load_quant_kernels
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.quant import KVQuantConfig, KVQuantStore, make_kv_store
from nanokv.quant.attention import reference_quantized_attention
from nanokv.quant.kivi_store import KIVIStore
from nanokv.utils import cdiv

try:
    load_quant_kernels()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"quantized kernels unavailable: {e}", allow_module_level=True)

CPU = torch.device("cpu")


LENS = {16: [1, 2, 15, 16, 17, 40, 100, 161], 256: [1, 5, 256, 257, 300, 600]}
STORES = ["int8", "fp8_e4m3", "fp8_e5m2", "int8-pre-rope", "kvquant:4bit", "kvquant:3bit-nuq",
          "kvquant:2bit-nuq-thresholds", "kvquant:mixed-8-4", "kvquant:per-channel-post-rope",
          "kvquant:ablation-per-token-post-rope", "kivi:2", "kivi:4"]


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("hq", [2, 4, 16])  # GQA ratios 1, 2, 8 over 2 KV heads
def test_decode_equals_dequantize_then_dense(kind, block_size, hq):
    rng = random.Random(hash((kind, block_size, hq)) % 1000)
    gen = torch.Generator().manual_seed(block_size + hq)
    lens = LENS[block_size]
    d = 32 if hq != 4 else 128
    store = make_store(kind, d, block_size, sum(cdiv(n, block_size) for n in lens) + 3,
                       len(lens) + 1)
    outs, refs = scenario(store, hq, lens, rng, gen, chunk=block_size // 2 + 3)
    if kind.startswith("kvquant:") and "2bit" in kind:  # outliers were kept
        assert bool((store.buffers["k_oidx0"] >= 0).any())
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend_cls", [NativeQuantizedBackend, QuantizedTorchBackend])
@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("block_size,windows", [
    (16, (1, 23)),  # a window of the token alone; one starting mid-block
    (16, (16, None)),  # a window of one block next to a layer over the whole context
    (256, (40, 300)),  # within the first block; across two
])
def test_sliding_window_decode_and_prefill_equal_the_reference(kind, block_size, windows,
                                                               backend_cls):
    """Layers with sliding windows (each its own, or none): the prefill chunks and the decodes
    of every store against dequantize-then-dense over each token's newest `window` tokens,
    the blocks behind the windows left in the tables (a hybrid model keeps them)."""
    rng = random.Random(block_size)
    gen = torch.Generator().manual_seed(len(kind))
    lens = LENS[block_size]
    store = make_store(kind, 32, block_size, sum(cdiv(n, block_size) for n in lens) + 3,
                       len(lens) + 1, windows=windows)
    outs, refs = scenario(store, 4, lens, rng, gen, chunk=block_size // 2 + 3,
                          backend_cls=backend_cls)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_dim,hq", [(64, 24), (32, 2), (48, 4)])
def test_codes_in_registers_equal_the_tile_path_and_the_reference(kind, head_dim, hq):
    """int8 and fp8 with keys after RoPE widen the codes in the FMA loops (AVX-512 and AVX2,
    head_dim % 32 == 0) instead of decoding a tile into a buffer, reading each tile's rows in
    place or from a copy made in address order, or either by the layer's shape
    (set_int8_stage): every path equals the reference and the others, at a GQA group of 12
    (value heads in registers 8 + 4 at a time on AVX-512, 4 + 4 + 4 on AVX2), tiles that end
    mid-run, and head_dim 48 (not a multiple of 32: the tile path whatever the switches). Also
    run built without AVX-512 and without AVX2
    (test_kernels_of_narrower_builds_equal_the_reference)."""
    from nanokv.layers.native_quant_attention import int8_stage, set_int8_fused, set_int8_stage

    lens = [1, 15, 16, 17, 100, 161]
    results = []
    default_stage = int8_stage()
    try:
        for fused, stage in ((True, True), (True, False), (True, None), (False, False)):
            set_int8_fused(fused)
            set_int8_stage(stage)
            assert int8_stage() is stage
            store = make_store(kind, head_dim, 16, sum(cdiv(n, 16) for n in lens) + 3,
                               len(lens) + 1)
            outs, refs = scenario(store, hq, lens, random.Random(7),
                                  torch.Generator().manual_seed(7), chunk=11)
            for out, ref in zip(outs, refs):
                torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
            results.append(outs)
    finally:
        set_int8_fused(True)
        set_int8_stage(default_stage)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind,finite", [("fp8_e4m3", lambda c: c & 0x7F != 0x7F),
                                          ("fp8_e5m2", lambda c: c & 0x7C != 0x7C)])
def test_fp8_codes_every_code_decodes_exactly(kind, finite):
    """Every finite fp8 code (zero, -0, subnormals, the largest) placed in the keys and values of
    a cached request's slots, read by the kernel (codes in registers where head_dim % 32 == 0,
    the tile path at 48) against the reference's torch float8 conversion."""
    codes = torch.tensor([c for c in range(256) if finite(c)], dtype=torch.uint8)
    gen = torch.Generator().manual_seed(3)
    for head_dim in (64, 48):
        n, bs, hq = 90, 16, 4
        table = list(range(cdiv(n, bs)))
        store = make_store(kind, head_dim, bs, len(table) + 1, 2)
        for name in ("k", "v"):
            buf = store.buffers[f"{name}_codes"]  # [L, blocks, B, Hkv, D]
            pattern = codes[torch.randint(len(codes), buf.shape, generator=gen)]
            buf.copy_(pattern)
            store.buffers[f"{name}_scales"].copy_(
                torch.rand(store.buffers[f"{name}_scales"].shape, generator=gen) * 0.02)
        q = torch.randn(NUM_LAYERS, 1, hq, head_dim, generator=gen)
        k = torch.randn(NUM_LAYERS, 1, HKV, head_dim, generator=gen)
        v = torch.randn(NUM_LAYERS, 1, HKV, head_dim, generator=gen)
        slot = table[(n - 1) // bs] * bs + (n - 1) % bs
        outs = step(store, NativeQuantizedBackend(store, CPU), q, k, v, k, [slot], [n - 1],
                    [table], [n])
        for layer, out in enumerate(outs):
            ref = reference_quantized_attention(q[layer], k[layer], v[layer], store, layer, table,
                                                n - 1, head_dim ** -0.5, store.rotary.rotate)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_int8_stage_by_shape_copies_only_far_apart_rows():
    """set_int8_stage(None): the tile copy where a slot's row of every KV head is >= 512 bytes
    and head_dim >= 128 (rows a KV head apart that a prefetcher does not follow), in place
    otherwise; True / False whatever the shape."""
    from nanokv.layers.native_quant_attention import (int8_stage, int8_stages,
                                                      set_int8_stage)

    default = int8_stage()
    shapes = [(8, 128), (4, 128), (32, 128), (2, 128), (8, 64), (16, 32), (4, 32), (4, 256)]
    try:
        set_int8_stage(None)
        assert [int8_stages(h, d) for h, d in shapes] == [
            h * d >= 512 and d >= 128 for h, d in shapes]
        assert [int8_stages(h, d) for h, d in shapes] == [
            True, True, True, False, False, False, False, True]
        for on in (True, False):
            set_int8_stage(on)
            assert all(int8_stages(h, d) is on for h, d in shapes)
    finally:
        set_int8_stage(default)


@pytest.mark.parametrize("kind", ["kvquant:4bit", "kvquant:2bit-nuq-thresholds"])
def test_kvquant_block_size_not_a_multiple_of_16(kind):
    """Blocks of 24 slots (the row path; the block path takes multiples of 16)."""
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    lens = [1, 23, 24, 25, 70]
    store = make_store(kind, 64, 24, sum(cdiv(n, 24) for n in lens) + 3, len(lens) + 1)
    outs, refs = scenario(store, 4, lens, rng, gen, chunk=15)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [32, 128])  # value outliers patched / corrected
def test_kvquant_constant_value_rows(head_dim):
    """Value rows constant over their channels (half-range 0: no centroid scale), some with one
    large entry, next to ordinary rows; whole blocks, so the block path reads them."""
    from types import SimpleNamespace

    bs, n, hq = 16, 40, 4
    lay = KVLayout(1, HKV, head_dim, bs, torch.float32)
    store = KVQuantStore(lay, 4, KVQuantConfig(bits=4), num_staging_blocks=2)
    store.rotary = RotaryEmbedding(_HFConfig(), head_dim, MAX_POS)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(n, HKV, head_dim, generator=gen)
    v = torch.randn(n, HKV, head_dim, generator=gen)
    v[::3] = v[::3, :, :1]  # constant rows
    v[::6, :, 5] = 40.0  # ... with one large entry
    v[1::7, :, 2] = -25.0  # ordinary rows with a large entry
    slots = list(range(n))
    store.write(0, store.plan_write(slots, slots), k, v)
    table, past = [0, 1, 2], n
    common = CommonAttentionMetadata([0], 1, [table], [past + 1], [])  # + the new token
    common.write_plan = SimpleNamespace(slot_mapping=torch.empty(0, dtype=torch.long))
    backend = NativeQuantizedBackend(store, CPU)
    q = torch.randn(1, hq, head_dim, generator=gen) * 3
    k_new = torch.randn(1, HKV, head_dim, generator=gen)
    v_new = torch.randn(1, HKV, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = backend.decode(0, q, k_new, v_new, backend.build(common).decodes[None], scale)
    ref = reference_quantized_attention(q, k_new, v_new, store, 0, table, past, scale,
                                        store.rope)
    assert bool((store.buffers["v_half0"][:2] == 0).any())  # rows without a centroid scale
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def _many_heads_store(bits, sparse_dtype, block_size, native_write=True, d=128, fraction=0.05,
                      start=7, positions=None, hkv=8):
    """hkv KV heads (8 by default) of d channels, many outliers (at d = 128 and 5%: a slot's
    value lists of every head hold 64 entries, several groups of 16; a block's key lists
    2 x ceil(2.5% of B x 128)),
    whole blocks and a partial one, positions from `start` (0: the first slot is the sink, kept
    in full precision) or the given ones; returns (store, table, past)."""
    n = 2 * block_size + 5
    lay = KVLayout(1, hkv, d, block_size, torch.float32)
    store = KVQuantStore(lay, 4, KVQuantConfig(bits=bits, outlier_fraction=fraction,
                                               sparse_dtype=sparse_dtype), num_staging_blocks=2)
    store.native_write = store.native_write and native_write
    store.rotary = RotaryEmbedding(_HFConfig(), d, MAX_POS)
    gen = torch.Generator().manual_seed(bits * 1000 + block_size)
    k = torch.randn(n, hkv, d, generator=gen)
    k[torch.rand(k.shape, generator=gen) < 0.01] *= 8
    v = torch.randn(n, hkv, d, generator=gen)
    table = [2, 0, 3]
    slots = [table[j // block_size] * block_size + j % block_size for j in range(n)]
    positions = [start + j for j in range(n)] if positions is None else positions(n)
    store.write(0, store.plan_write(slots, positions), k, v)
    return store, table, n


def _decode_one(store, table, past, seed=6, hq=16):
    from types import SimpleNamespace

    hkv, d = store.layout.num_kv_heads, store.layout.head_dim
    common = CommonAttentionMetadata([0], 1, [table], [past + 1], [])  # + the new token
    common.write_plan = SimpleNamespace(slot_mapping=torch.empty(0, dtype=torch.long))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, d, generator=gen) * 3
    k_new, v_new = torch.randn(1, hkv, d, generator=gen), torch.randn(1, hkv, d, generator=gen)
    backend = NativeQuantizedBackend(store, CPU)
    out = backend.decode(0, q, k_new, v_new, backend.build(common).decodes[None], d ** -0.5)
    ref = reference_quantized_attention(q, k_new, v_new, store, 0, table, past, d ** -0.5,
                                        store.rope)
    return out, ref


@pytest.mark.parametrize("bits,sparse_dtype", [(4, "float16"), (2, "bfloat16"),
                                               (4, "float32")])
@pytest.mark.parametrize("block_size", [16, 256])  # key indices int16 / int32
def test_kvquant_outliers_of_many_kv_heads(bits, sparse_dtype, block_size):
    """Many outliers per slot and per block over 8 KV heads (GQA 2): a slot's value outliers of
    every head, corrected 16 at a time after the block's last value pass on AVX-512, and the
    key outliers' score corrections, whose entries of one slot lie next to each other in a
    list in index order; every sparse dtype, 2 and 4-bit codes."""
    store, table, past = _many_heads_store(bits, sparse_dtype, block_size)
    assert int((store.buffers["v_oidx0"] < 128).sum((-2, -1)).max()) > 16  # a slot: 4 groups
    out, ref = _decode_one(store, table, past)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("d,fraction,cap,hkv", [(32, 0.05, 2, 8), (64, 0.12, 8, 8),
                                                (64, 0.07, 6, 8), (32, 0.05, 2, 1),
                                                (64, 0.05, 4, 3)])
@pytest.mark.parametrize("bits,sparse_dtype", [(4, "float16"), (2, "bfloat16"),
                                               (4, "float32")])
def test_kvquant_value_patches_of_many_kv_heads(d, fraction, cap, hkv, bits, sparse_dtype):
    """Heads of at most 64 channels, whose value outliers are patched into the value pass: the
    patches of every KV head of a block made 16 at a time on AVX-512, 8 on AVX2 (capacities 2,
    4 and 8; with 1 and 3 KV heads a partial block's lists end inside a group: 5 slots x 1 x 2
    and 5 x 3 x 4 entries), or a KV head at a time (capacity 6, not a power of two); a sink
    slot among them (its row added in full precision apart); every sparse dtype; against the
    reference."""
    store, table, past = _many_heads_store(bits, sparse_dtype, 16, d=d, fraction=fraction,
                                           start=0, hkv=hkv)
    assert store.buffers["v_oidx0"].shape[-1] == cap
    assert bool((store.buffers["sink_slot"][table[0]] == 0).any())  # position 0: a sink
    out, ref = _decode_one(store, table, past, hq=2 * hkv)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("block_size", [16, 256])
def test_kvquant_key_outliers_at_positions_not_consecutive(bits, block_size):
    """Key outliers' RoPE rows where a block's positions are consecutive are found from the
    block's first (no gather); positions with gaps and out of order (as compaction or a
    policy leaves them) take each slot's own: both against the reference."""
    def scattered(n):  # every 7th slot jumps ahead, every 5th pair swapped
        pos = [3 * j + (40 if j % 7 == 3 else 0) for j in range(n)]
        for j in range(0, n - 1, 5):
            pos[j], pos[j + 1] = pos[j + 1], pos[j]
        return pos
    for positions in (None, scattered):
        store, table, past = _many_heads_store(bits, "float16", block_size, positions=positions)
        out, ref = _decode_one(store, table, past)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq", [8, 16, 32])  # GQA 1, 2, 4 over 8 KV heads
def test_kvquant_value_pass_widths_equal_the_reference(bits, d, hq):
    """The AVX-512 planar value pass holds every chunk of a head at once where their
    accumulators fit in registers (2 or 4 chunks of 16 x codes-a-byte channels, 1, 2 or 4
    query heads: d 64 / 128 at 4 bits, 128 / 256 at 2 bits), else one chunk at a time (d 256 at
    4 bits, GQA 4 at d 128); value outliers patched into it (d 64) or corrected after it;
    against the reference."""
    store, table, past = _many_heads_store(bits, "float16", 16, d=d)
    out, ref = _decode_one(store, table, past, hq=hq)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("hkv,hq", [(8, 16), (4, 16), (2, 16), (4, 12), (16, 16)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_kvquant_value_outliers_by_pairs_of_heads(hkv, hq, block_size):
    """The AVX-512 value outliers (uint8 channels: head_dim 128) of an even group (P of at most
    16 query heads by slots) add two heads' corrections of a channel as one 64-bit lane into a
    buffer added to the accumulators after the block: groups 2 (taken apart by permutes), 4
    and 8 (gathered); groups 3 and 1 one head at a time; against the reference."""
    store, table, past = _many_heads_store(4, "float16", block_size, hkv=hkv)
    assert store.buffers["v_oidx0"].dtype == torch.uint8
    assert int((store.buffers["v_oidx0"] < 128).sum()) > 0
    out, ref = _decode_one(store, table, past, hq=hq)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("native_write", [True, False])
def test_kvquant_key_outlier_lists_in_index_order(native_write):
    """A per-channel (key) outlier list is written in index order, unused entries last, by the C
    write path and by the PyTorch one; per-token (value) lists keep the selection's order."""
    store, _, _ = _many_heads_store(4, "float16", 16, native_write)
    assert store.native_write == (native_write and store.native_write)
    oidx = store.buffers["k_oidx0"][[2, 0]].long()  # the two full blocks: [2, Hkv, cap]
    key = torch.where(oidx < 0, 1 << 20, oidx)
    assert bool((key[..., 1:] >= key[..., :-1]).all())
    assert bool((oidx >= 0).any()) and bool((key[..., 1:] > key[..., :-1]).any())


@pytest.mark.parametrize("order", ["shuffled", "reversed"])
def test_kvquant_key_outliers_in_any_order(order):
    """The decode kernel's result does not depend on the order of a key outlier list: the lists
    of the store shuffled or reversed (unused entries first; entries and values alike) give the
    same output, equal to the reference. The store writes them in index order, unused last, and
    the AVX2 key pass walks them with a cursor per KV head on that promise; a block out of order
    takes the kernel's path for entries in any order."""
    store, table, past = _many_heads_store(4, "float16", 16)
    out, ref = _decode_one(store, table, past)
    oidx, oval = store.buffers["k_oidx0"], store.buffers["k_oval0"]
    gen = torch.Generator().manual_seed(3)
    for b in range(oidx.shape[0]):
        for g in range(oidx.shape[1]):
            perm = (torch.randperm(oidx.shape[2], generator=gen) if order == "shuffled"
                    else torch.arange(oidx.shape[2] - 1, -1, -1))
            oidx[b, g], oval[b, g] = oidx[b, g][perm].clone(), oval[b, g][perm].clone()
    shuffled, ref2 = _decode_one(store, table, past)
    torch.testing.assert_close(ref2, ref)
    torch.testing.assert_close(shuffled, out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(shuffled, ref, atol=2e-5, rtol=1e-4)


def _one_request_with_outliers(bits, d, hkv, block_size, halves, position, seed, gqa=2):
    """One request of 2 * block_size + 5 slots (blocks 2, 0, 3: a last tile cut short) in a
    KVQuant store with outliers (3%, keys with 2% spikes), slot j at position(j), gqa query heads
    per KV head; RoPE
    tables whose halves are equal, unequal (the second half's angles differ) or none (keys
    stored after RoPE). Returns (store, q, k_new, v_new, common metadata, reference output)."""
    from types import SimpleNamespace

    n = 2 * block_size + 5
    lay = KVLayout(1, hkv, d, block_size, torch.float32)
    store = KVQuantStore(lay, 4, KVQuantConfig(bits=bits, outlier_fraction=0.03,
                                               pre_rope_keys=halves != "none"),
                         num_staging_blocks=2)
    store.rotary = RotaryEmbedding(_HFConfig(), d, MAX_POS)
    if halves == "unequal":  # the second half's angles differ from the first's
        store.rotary.cos[:, d // 2:] = torch.cos(torch.arange(MAX_POS)[:, None] * 0.37
                                                 / (1 + torch.arange(d // 2)))
        store.rotary.sin[:, d // 2:] = torch.sin(torch.arange(MAX_POS)[:, None] * 0.37
                                                 / (1 + torch.arange(d // 2)))
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, hkv, d, generator=gen)
    k[torch.rand(k.shape, generator=gen) < 0.02] *= 8
    v = torch.randn(n, hkv, d, generator=gen)
    table = [2, 0, 3]
    slots = [table[j // block_size] * block_size + j % block_size for j in range(n)]
    store.write(0, store.plan_write(slots, [position(j) for j in range(n)]), k, v)
    assert bool((store.buffers["k_oidx0"] >= 0).any())
    hq = gqa * hkv
    common = CommonAttentionMetadata([0], 1, [table], [n + 1], [])
    common.write_plan = SimpleNamespace(slot_mapping=torch.empty(0, dtype=torch.long))
    q = torch.randn(1, hq, d, generator=gen) * 3
    k_new, v_new = torch.randn(1, hkv, d, generator=gen), torch.randn(1, hkv, d, generator=gen)
    ref = reference_quantized_attention(q, k_new, v_new, store, 0, table, n, d ** -0.5,
                                        store.rope)
    return store, q, k_new, v_new, common, ref


@pytest.mark.parametrize("bits,d,hkv", [
    (4, 32, 4),    # a slot's row of every KV head is one vector: transposed once a tile
    (4, 128, 2),   # a KV head's row is one vector: transposed per head
    (4, 64, 8),    # neither: the tile's words gathered
    (2, 128, 2),   # 2-bit: 16 codes a word
    (2, 32, 8),
    (4, 96, 2),    # not a power of two: the AVX2 pass corrects key outliers a tile at a time
    (4, 192, 2),   # the same in the AVX2 slot-lanes pass (a head of 3 x 64 channels)
])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("halves", ["equal", "unequal", "none"])
def test_kvquant_key_passes_equal_the_reference(bits, d, hkv, block_size, halves):
    """KVQuant's two key passes, slots in the lanes (the default where it fits) and channels in
    the lanes (`set_slot_keys(False)`: AVX-512's planar pass, AVX2's channel-lanes pass), each
    equal the reference and each other: every way the AVX-512 slot-lanes pass reads a tile's
    codes, 2 and 4-bit, block sizes 16 and 256 with a last tile cut short, GQA 2, outliers, and
    RoPE tables whose halves are equal (the common rotate-half tables), unequal (each half's
    cos / sin read), or no RoPE in the kernel (keys stored after RoPE). The AVX2 slot-lanes
    pass (halves equal; 4-bit at head_dim 64 and 128, 2-bit at 128) is checked by the AVX2
    build of test_kernels_of_narrower_builds_equal_the_reference and on AVX2-only CPUs."""
    from nanokv.layers.native_quant_attention import set_slot_keys

    store, q, k_new, v_new, common, ref = _one_request_with_outliers(
        bits, d, hkv, block_size, halves, lambda j: 7 + 3 * j, bits * 100 + d + block_size)
    outs = []
    try:
        for slot_keys in (True, False):
            set_slot_keys(slot_keys)
            backend = NativeQuantizedBackend(store, CPU)
            outs.append(backend.decode(0, q, k_new, v_new, backend.build(common).decodes[None],
                                       d ** -0.5))
    finally:
        set_slot_keys(True)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_kvquant_bf16_staging_and_all_slots_staged():
    """Staged (partial-block) keys in bfloat16, and blocks that never fill."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    store = make_store("kvquant:4bit", 64, 256, 8, 5, staging_dtype=torch.bfloat16)
    outs, refs = scenario(store, 8, [3, 100, 255, 200], rng, gen, chunk=64)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


BLOCK_TABLE_KINDS = [k for k in STORES if k.startswith(("kvquant:", "kivi:"))]


@pytest.mark.parametrize("kind", BLOCK_TABLE_KINDS + ["kvquant:4bit-outliers5"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_policy_views_read_through_the_c_reader(kind, block_size):
    """The backend installs its C read as the store's block reader: a policy's view of each
    request (contexts ending mid-block, staged partial blocks, sinks, outliers, keys before
    RoPE) equals the view through the store's `read_blocks`; per-token stores keep theirs."""
    lens = [1, block_size - 1, 2 * block_size + 5]
    store = make_store(kind, 64, block_size, sum(cdiv(n, block_size) for n in lens) + 2,
                       len(lens))
    assert store.block_reader is None
    NativeQuantizedBackend(store, CPU)
    tables = fill(store, lens, block_size // 2 + 3, seed=block_size)
    check_policy_view(store, tables, lens)


def test_per_token_stores_keep_their_reader():
    store = make_store("int8", 32, 16, 4, 1)
    NativeQuantizedBackend(store, CPU)
    assert store.block_reader is None


def test_backend_choice():
    lay = KVLayout(NUM_LAYERS, HKV, 32, 16, torch.float32)
    for kind in ("int8", "fp8_e4m3", "fp8_e5m2"):
        store = make_kv_store(kind, lay, 4)
        assert select_backend("auto", store, CPU)[0] is NativeQuantizedBackend
        assert select_backend("native", store, CPU)[0] is NativeQuantizedBackend
        assert select_backend("torch", store, CPU)[0] is QuantizedTorchBackend
        # on CUDA: the Triton kernels (tests/unit/test_triton_attention.py), else PyTorch
        assert select_backend("torch", store, torch.device("cuda"))[0] is QuantizedTorchBackend
    kvq = KVQuantStore(lay, 4, KVQuantConfig(), num_staging_blocks=1)
    assert select_backend("auto", kvq, CPU)[0] is NativeQuantizedBackend
    kivi = KIVIStore.from_settings(lay, 4, CPU, num_staging_blocks=1)
    assert select_backend("auto", kivi, CPU)[0] is NativeQuantizedBackend
    assert select_backend("torch", kivi, CPU)[0] is QuantizedTorchBackend


@pytest.mark.parametrize("kv", [dict(kv_cache_dtype="int8"),
                                dict(kv_cache_dtype="fp8_e5m2"),
                                dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
                                dict(kv_cache_dtype="kivi", kv_quant_bits=2)])
def test_engine_decodes_through_the_kernels_equal_the_reference(tiny_model, monkeypatch, kv):
    """In the engine (auto backend, chunked prefill, prefix hits): every decode call of the
    kernels equals dequantize-then-dense over the store."""
    from nanokv import LLM, SamplingParams

    real = NativeQuantizedBackend.decode
    checked = []

    def checking(self, layer, q, k, v, step, scale):
        out = real(self, layer, q, k, v, step, scale)
        store, bs = self.kv_cache, self.kv_cache.block_size
        tables = (step.blk_ids.split(torch.diff(step.blk_ptr).tolist()) if step.past is not None
                  else None)
        for i in range(q.shape[0]):
            if tables is not None:
                table, past = tables[i].tolist(), int(step.past[i])
            else:  # per-token stores: the runs' slots (consecutive blocks)
                r0, r1 = step.runs.run_ptr[i].item(), step.runs.run_ptr[i + 1].item()
                table = [s // bs + j for s, n in zip(step.runs.run_start[r0:r1].tolist(),
                                                     step.runs.run_len[r0:r1].tolist())
                         for j in range(cdiv(n, bs))]
                past = int(step.runs.run_len[r0:r1].sum())
            ref = reference_quantized_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], store,
                                                layer, table, past, scale, store.rope)
            torch.testing.assert_close(out[i:i + 1], ref, atol=2e-5, rtol=1e-4)
        checked.append(q.shape[0])
        return out

    monkeypatch.setattr(NativeQuantizedBackend, "decode", checking)
    prompts = [list(range(1, 40)), list(range(1, 33)) + [7, 8, 9], list(range(1, 33)) + [5]]
    llm = LLM(tiny_model, skip_tokenizer_init=True, block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=24, max_num_seqs=4, **kv)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert type(llm.engine.attention_backend) is NativeQuantizedBackend
    assert sum(checked) > 0 and all(len(o.token_ids) == 12 for o in outs)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("gqa", [1, 2, 3, 8])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("halves", ["equal", "unequal", "none"])
def test_kvquant_heads_of_32_in_fixed_instances(bits, gqa, block_size, halves):
    """AVX2: the key pass of heads of 32 channels in its instances with head_dim a constant (2-
    and 4-bit keys, 1, 2, 4 or 8 query heads at a time; 4-bit rows looked up in one) gives the
    same outputs, bit for bit, as with head_dim read at run time (`set_fixed_head_dims(False)`),
    and both equal the reference; 3-bit keys and 3 query heads a KV head take the run-time
    instances either way. Outliers, a last tile cut short, RoPE tables with halves equal,
    unequal and none."""
    from nanokv.layers.native_quant_attention import set_fixed_head_dims

    store, q, k_new, v_new, common, ref = _one_request_with_outliers(
        bits, 32, 4, block_size, halves, lambda j: 3 + j, bits * 10 + gqa + block_size, gqa=gqa)
    backend = NativeQuantizedBackend(store, CPU)
    outs = []
    try:
        for fixed in (True, False):
            set_fixed_head_dims(fixed)
            outs.append(backend.decode(0, q, k_new, v_new, backend.build(common).decodes[None],
                                       32 ** -0.5))
    finally:
        set_fixed_head_dims(True)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx2"])
def test_kernels_of_narrower_builds_equal_the_reference(tmp_path, flags):
    """The same checks with the library built without AVX-512 (`CC="cc -mno-avx512f"`: the AVX2
    paths, the block path's AVX2 kernels among them, on a CPU that has AVX2) and without AVX2
    (`-mno-avx2`: the plain C paths every CPU builds, KVQuant a row at a time), in a fresh
    process with its own kernel cache. KVQuant at head_dim 128 too: its 4-bit key pass looks up
    32 channels at a time only where half a head holds them; heads of 32 in the AVX2 key
    pass's fixed instances; the key passes over RoPE tables of every kind (head_dim 96: key
    outliers corrected a tile at a time) and the compact RoPE rows switched on and off; the AVX2
    slot-lanes key pass at head_dim 64-256, GQA 1, 2, 3, 4 and 8 (the value-pass and
    value-outlier checks' layers); KVQuant with sliding windows (a first block read from a slot
    past its first)."""
    run_narrow_build(__file__, "(test_decode_equals_dequantize_then_dense and (kvquant or (int8 "
                     "or fp8) and not hq-4)) or registers or fp8_codes or heads_of_32 or "
                     "key_passes or compact_rope or value_pass_widths or "
                     "value_outliers_by_pairs or (sliding_window and Native and kvquant)",
                     tmp_path,
                     "quant_decode_attention",
                     flags=flags)


def test_rope_tiles_are_the_tables_first_halves_transposed():
    """`rope_tiles` against a brute-force walk: tile j, table i (cos, sin), channel c, lane u is
    table i's [16 j + u, c] for c < rot_dim / 2, and 0 past the last position."""
    from nanokv.layers.native_quant_attention import rope_tiles

    positions, rot = 37, 8
    cos = torch.randn(positions, rot)
    sin = torch.randn(positions, rot)
    tiles = rope_tiles(cos, sin)
    assert tiles.shape == (3, 2, rot // 2, 16) and tiles.is_contiguous()
    for j in range(3):
        for i, table in enumerate((cos, sin)):
            for c in range(rot // 2):
                for u in range(16):
                    p = 16 * j + u
                    want = float(table[p, c]) if p < positions else 0.0
                    assert float(tiles[j, i, c, u]) == want


def test_rope_rows_are_the_tables_first_halves_side_by_side():
    """`rope_rows` against a brute-force walk: position p, table i (cos, sin), channel c is
    table i's [p, c] for c < rot_dim / 2."""
    from nanokv.layers.native_quant_attention import rope_rows

    positions, rot = 21, 12
    cos = torch.randn(positions, rot)
    sin = torch.randn(positions, rot)
    rows = rope_rows(cos, sin)
    assert rows.shape == (positions, 2, rot // 2) and rows.is_contiguous()
    for p in range(positions):
        for i, table in enumerate((cos, sin)):
            for c in range(rot // 2):
                assert float(rows[p, i, c]) == float(table[p, c])


@pytest.mark.parametrize("bits,d,hkv", [(4, 32, 4), (4, 128, 2), (2, 64, 8)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("first,gap", [(0, 1), (8, 1), (5, 1), (7, 3)])
def test_kvquant_compact_rope_tables_equal_the_full_ones(bits, d, hkv, block_size, first, gap):
    """The block path reading the build's compact RoPE table gives the same outputs, bit for
    bit, as without it (`set_rope_tiles(False)`), and both equal the reference. AVX-512: the
    slot-lanes key pass reads transposed tiles (in place where a tile's 16 positions are
    consecutive from a multiple of 16; the key outliers' coefficients gathered from the tiles)
    where it would transpose each tile's rows; AVX2: the key pass reads the tables' first halves
    side by side (`rope_rows`) where it would read the full tables (its slot-lanes pass, 4-bit
    at head_dim 128 here, transposes each tile's half rows). Positions from 0 (every tile read
    in place), consecutive from 8 and from 5 (none), and 3 apart (not consecutive); a last
    tile cut short; outliers present."""
    from nanokv.layers.native_quant_attention import (ROPE_ROWS, ROPE_TILES, rope_layout,
                                                      set_rope_tiles)

    store, q, k_new, v_new, common, ref = _one_request_with_outliers(
        bits, d, hkv, block_size, "equal", lambda j: first + gap * j,
        bits * 100 + d + block_size + first)
    hq = q.shape[1]
    backend = NativeQuantizedBackend(store, CPU)
    layer = backend._block_layer(0, hq)
    layout = rope_layout()  # the layer has the one this build reads (halves repeat)
    assert bool(layer.rope_tiles) == (layout == ROPE_TILES)
    assert bool(layer.rope_rows) == (layout == ROPE_ROWS)
    outs = []
    try:
        for on in (True, False):
            set_rope_tiles(on)
            outs.append(backend.decode(0, q, k_new, v_new, backend.build(common).decodes[None],
                                       d ** -0.5))
    finally:
        set_rope_tiles(True)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(outs[0], outs[1])
