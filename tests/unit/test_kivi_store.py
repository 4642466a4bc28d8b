"""KIVI store: per-group error bound, equality with a dense fake-quantize reference under any
chunking, staging of the partial block (K and V), release / reuse, copy_blocks, memory
accounting, settings validation, and attention against dequantize-then-dense."""

import random
from types import SimpleNamespace

import pytest
import torch

from nanokv.cache.kv_pool import KVLayout
from nanokv.layers.attention import AttentionMetadata, PrefillSeq
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.quant.attention import (
    quantized_paged_attention,
    reference_quantized_attention,
    rope_from_rotary,
)
from nanokv.quant.kivi_store import KIVIStore
from nanokv.quant.packing import packed_dim

L, H, D, B, G = 2, 2, 16, 8, 4


def layout(dtype=torch.float32):
    return KVLayout(L, H, D, B, dtype)


def make(num_blocks=8, staging=2, dtype=torch.float32, **kw):
    kw.setdefault("group_size", G)
    return KIVIStore(layout(dtype), num_blocks, num_staging_blocks=staging, **kw)


def randn(gen, n, dtype=torch.float32):
    x = torch.randn(L, n, H, D, generator=gen)
    x[..., 3] *= 10.0  # an outlier channel, as KIVI observes in keys
    x[..., 5] += 4.0
    return x.to(dtype)


def write_steps(store, steps):
    """steps: list of [(table, k, v, start, n)]: each step writes n tokens of several sequences
    from `start` (slot i of a sequence holds position i)."""
    for step in steps:
        slots, positions, ks, vs = [], [], [], []
        for table, k, v, start, n in step:
            slots += [table[j // B] * B + j % B for j in range(start, start + n)]
            positions += list(range(start, start + n))
            ks.append(k[:, start:start + n])
            vs.append(v[:, start:start + n])
        plan = store.plan_write(slots, positions)
        for layer in range(L):
            store.write(layer, plan, torch.cat([k[layer] for k in ks]),
                        torch.cat([v[layer] for v in vs]))


def write_sequence(store, table, k, v, chunks):
    done, steps = 0, []
    for n in chunks:
        steps.append([(table, k, v, done, n)])
        done += n
    write_steps(store, steps)


# ---- the hand-written reference ---------------------------------------------------------------
def _fp16_down(x):
    h = x.clamp(-65504, 65504).half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.tensor(-torch.inf).half()), h)


def _fp16_up(x):
    h = x.clamp(-65504, 65504).half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.tensor(torch.inf).half()), h)


def _fake_quantize_group(g, bits):
    """One group (any shape, all its elements share min and scale) -> dequantized float32."""
    levels = 2 ** bits - 1
    lo = _fp16_down(g.min()).float()
    scale = _fp16_up((g.max() - lo) / levels).float()
    codes = torch.round((g - lo) / (scale if scale > 0 else 1.0)).clamp(0, levels)
    return codes * scale + lo


def fake_quantize(x, bits, group_size, block_size):
    """A sequence x: [T, H, D] written from slot 0 -> what KIVI returns: full blocks quantized
    (keys per channel over the block's tokens, values per token in channel groups), the
    trailing partial block unchanged. Returns (keys, values) read as if x were both."""
    t_len = x.shape[0]
    full = t_len // block_size * block_size
    xf = x.float()
    keys, values = x.clone(), x.clone()
    for start in range(0, full, block_size):
        for h in range(H):
            for c in range(D):
                sl = slice(start, start + block_size)
                keys[sl, h, c] = _fake_quantize_group(xf[sl, h, c], bits).to(x.dtype)
    for t in range(full):
        for h in range(H):
            for c0 in range(0, D, group_size):
                sl = slice(c0, c0 + group_size)
                values[t, h, sl] = _fake_quantize_group(xf[t, h, sl], bits).to(x.dtype)
    return keys, values


# ---- quantization ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_round_trip_error_within_half_a_step_per_group(bits):
    store = make(bits=bits)
    gen = torch.Generator().manual_seed(0)
    k, v = randn(gen, 3 * B), randn(gen, 3 * B)
    k[:, :B, 1, 7] = 0.25  # a constant key group: scale 0, exact
    v[:, 2, 0, :G] = -1.5  # a constant value group
    write_sequence(store, [5, 1, 6], k, v, [3 * B])
    levels = 2 ** bits - 1
    for layer in range(L):
        kr, vr = store.read(layer, [5, 1, 6], 3 * B)
        kg = k[layer].view(3, B, H, D)  # groups: (block, head, channel) over B tokens
        err = (kr.view(3, B, H, D) - kg).abs().amax(1)
        hi, lo = kg.amax(1), kg.amin(1)
        assert bool((err <= (hi - lo) / levels / 2 * (1 + 2e-3) + 1e-3 * lo.abs() + 1e-6).all())
        stored = store.buffers["k_scale"][layer][[5, 1, 6]].float()  # [3, H, D]
        assert bool((err <= stored / 2 + 1e-6).all())
        assert float(err[0, 1, 7]) == 0.0
        vg = v[layer].view(3 * B, H, D // G, G)  # groups: (token, head, G channels)
        err = (vr.view_as(vg) - vg).abs().amax(-1)
        hi, lo = vg.amax(-1), vg.amin(-1)
        assert bool((err <= (hi - lo) / levels / 2 * (1 + 2e-3) + 1e-3 * lo.abs() + 1e-6).all())
        assert float(err[2, 0, 0]) == 0.0
    assert store.buffers["k_codes"].shape[-1] == D * bits // 8


CASES = {  # (bits, group_size, dtype, chunkings of the two sequences)
    "2bit-prefill-then-decodes": (2, 4, torch.float32, ([13, 1, 1, 1, 1, 1, 1, 1, 1, 1], [29])),
    "4bit-g8-cross-blocks": (4, 8, torch.float32, ([5, 7, 15, 1, 1], [1, 2, 3, 4, 5, 6])),
    "2bit-g16-bf16": (2, 16, torch.bfloat16, ([8, 8, 3, 1], [17, 1, 1, 4])),
    "4bit-g1-exact-blocks": (4, 1, torch.float32, ([16], [8, 8, 8])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_store_equals_dense_fake_quantize_under_any_chunking(name):
    bits, group, dtype, (chunks_a, chunks_b) = CASES[name]
    store = make(12, staging=2, dtype=dtype, bits=bits, group_size=group)
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for table, chunks in (([7, 2, 5, 9], chunks_a), ([0, 11, 3, 4], chunks_b)):
        n = sum(chunks)
        seqs.append((table, randn(gen, n, dtype), randn(gen, n, dtype), chunks))
    steps, done = [], [0, 0]
    for i in range(max(len(c) for *_, c in seqs)):  # both sequences in shared steps
        step = []
        for s, (table, k, v, chunks) in enumerate(seqs):
            if i < len(chunks):
                step.append((table, k, v, done[s], chunks[i]))
                done[s] += chunks[i]
        steps.append(step)
    write_steps(store, steps)
    for table, k, v, _ in seqs:
        n = k.shape[1]
        for layer in range(L):
            kr, vr = store.read(layer, table, n)
            assert kr.dtype == dtype
            ek, _ = fake_quantize(k[layer], bits, group, B)
            _, ev = fake_quantize(v[layer], bits, group, B)
            assert torch.equal(kr, ek) and torch.equal(vr, ev)
            tail = n // B * B  # the residual (partial block) comes back exactly, K and V
            assert torch.equal(kr[tail:], k[layer, tail:])
            assert torch.equal(vr[tail:], v[layer, tail:])
            if tail:
                assert not torch.equal(kr[:tail], k[layer, :tail])
    partial = sum(1 for _, k, _, _ in seqs if k.shape[1] % B)
    assert store.num_free_staging_blocks == 2 - partial


# ---- block lifetime ---------------------------------------------------------------------------
def test_block_reuse_after_release():
    store = make(4, staging=1, bits=2)
    gen = torch.Generator().manual_seed(2)
    ka, va, kb, vb = (randn(gen, 12) for _ in range(4))
    write_sequence(store, [0, 1], ka, va, [10, 2])  # block 1 partial: holds the staging block
    store.release([0, 1])  # the full block 0 stays readable (prefix cache)
    assert store.num_free_staging_blocks == 1
    ek, ev = fake_quantize(ka[0], 2, G, B)[0], fake_quantize(va[0], 2, G, B)[1]
    kr, vr = store.read(0, [0], B)
    assert torch.equal(kr, ek[:B]) and torch.equal(vr, ev[:B])
    with pytest.raises(RuntimeError, match="out of order"):  # released partial: fill is gone
        store.plan_write([1 * B + 4], [12])
    write_sequence(store, [1, 0], kb, vb, [3, 9])  # reuse both, slot 0 restarts them
    for layer in range(L):
        ek, _ = fake_quantize(kb[layer], 2, G, B)
        _, ev = fake_quantize(vb[layer], 2, G, B)
        kr, vr = store.read(layer, [1, 0], 12)
        assert torch.equal(kr, ek) and torch.equal(vr, ev)
    write_sequence(store, [0], ka, va, [3])  # a partial block restarted without release
    kr, vr = store.read(1, [0], 3)
    assert torch.equal(kr, ka[1, :3]) and torch.equal(vr, va[1, :3])
    assert store.num_free_staging_blocks == 0


def test_staging_exhaustion_raises_clearly():
    store = make(6, staging=1)
    gen = torch.Generator().manual_seed(3)
    k, v = randn(gen, 12), randn(gen, 12)
    write_sequence(store, [0, 1], k, v, [12])  # block 1 partial
    before = store.slot_positions.clone()
    with pytest.raises(RuntimeError, match="staging blocks are in use.*num_staging_blocks"):
        write_sequence(store, [2], k, v, [3])
    assert torch.equal(store.slot_positions, before)  # nothing touched
    write_sequence(store, [3], k, v, [B])  # a block that fills at once needs no staging
    # block 1 fills in the same step as block 4 starts: the freed row is reused
    plan = store.plan_write([1 * B + j for j in range(4, 8)] + [4 * B], [12, 13, 14, 15, 0])
    x = torch.randn(5, H, D)
    for layer in range(L):
        store.write(layer, plan, x, x)
    full = torch.cat([k[0, :12], x[:4]])
    assert torch.equal(store.read(0, [0, 1], 16)[0], fake_quantize(full, 2, G, B)[0])
    assert torch.equal(store.read(0, [4], 1)[1], x[4:])


def test_copy_blocks_full_and_partial_then_diverge():
    store = make(8, staging=3, bits=4)
    gen = torch.Generator().manual_seed(4)
    k, v = randn(gen, 16), randn(gen, 16)
    k2, v2 = k.clone(), v.clone()
    k2[:, 12:], v2[:, 12:] = randn(gen, 4), randn(gen, 4)
    write_sequence(store, [0, 1], k, v, [12])  # block 0 full, block 1 partial (4 of 8)
    store.copy_blocks([(0, 2), (1, 3)])
    assert store.num_free_staging_blocks == 1  # the copy of the partial block has its own row
    for layer in range(L):
        for a, b in zip(store.read(layer, [0, 1], 12), store.read(layer, [2, 3], 12)):
            assert torch.equal(a, b)
    write_steps(store, [[([0, 1], k, v, 12, 4), ([2, 3], k2, v2, 12, 4)]])  # both fill
    for table, kk, vv in (([0, 1], k, v), ([2, 3], k2, v2)):
        for layer in range(L):
            kr, vr = store.read(layer, table, 16)
            assert torch.equal(kr, fake_quantize(kk[layer], 4, G, B)[0])
            assert torch.equal(vr, fake_quantize(vv[layer], 4, G, B)[1])
    assert store.num_free_staging_blocks == 3
    write_sequence(store, [5], k, v, [3])  # a partial destination overwritten by a full block
    store.copy_blocks([(0, 5)])
    assert store.num_free_staging_blocks == 3
    assert torch.equal(store.read(1, [5], B)[0], store.read(1, [0], B)[0])


# ---- settings and memory ----------------------------------------------------------------------
def test_bad_settings_raise_value_error():
    with pytest.raises(ValueError, match=r"bits must be one of \[2, 4\]"):
        make(bits=3)
    with pytest.raises(ValueError, match=r"bits must be one of"):
        make(bits=8)
    with pytest.raises(ValueError, match=r"group_size must divide head_dim 16: one of "
                                         r"\[1, 2, 4, 8, 16\], got 32"):
        KIVIStore(layout(), 4, num_staging_blocks=1)  # the default 32 does not divide 16
    with pytest.raises(ValueError, match="group_size"):
        make(group_size=6)
    with pytest.raises(ValueError, match="num_staging_blocks"):
        make(staging=0)
    with pytest.raises(ValueError, match="after RoPE"):
        make().read(0, [0], 4, rope=lambda pos, x: x)


def test_extra_keys_and_from_settings():
    base = make(bits=2).extra_keys()
    assert base != make(bits=4).extra_keys() != make(bits=2, group_size=8).extra_keys()
    assert base != make(bits=2, group_size=8).extra_keys()
    assert ("kv_cache_dtype", "kivi") in base and ("pre_rope_keys", False) in base
    lay = KVLayout(L, H, 64, B, torch.float32)
    store = KIVIStore.from_settings(lay, 3, "cpu", None, num_staging_blocks=2)
    assert (store.bits, store.group_size, store.num_staging_blocks) == (2, 32, 2)
    assert KIVIStore.from_settings(lay, 3, "cpu", None, bits=4, num_staging_blocks=1).bits == 4
    assert KIVIStore.from_settings(layout(), 3, "cpu", num_staging_blocks=1).group_size == 16
    with pytest.raises(ValueError, match="bits"):
        KIVIStore.from_settings(lay, 3, "cpu", None, bits=3, num_staging_blocks=1)


def test_settings_from_engine_options_and_specs_without_allocating():
    options = SimpleNamespace(kv_cache_dtype="kivi", max_num_seqs=5, kv_quant_bits=None,
                              kv_quant_config=None)
    settings = KIVIStore.settings_from_options(options, layout())
    assert settings == {"bits": 2, "group_size": 16, "num_staging_blocks": 5}
    store = KIVIStore.from_settings(layout(), 4, "cpu", **settings)
    assert store.settings == settings
    with pytest.raises(ValueError, match=r"bits must be one of \[2, 4\], got 3"):
        KIVIStore.settings_from_options(SimpleNamespace(max_num_seqs=5, kv_quant_bits=3),
                                        layout())
    fixed = sum(s.nbytes for s in KIVIStore.specs_for(layout(), 0, settings))
    one = sum(s.nbytes for s in KIVIStore.specs_for(layout(), 1, settings))
    assert fixed == store.memory().staging
    assert one - fixed == B * L * H * (2 * D * 2 // 8 + 4 * D // B + 4 * D // 16) + 4


@pytest.mark.parametrize("bits,group,dtype", [(2, 4, torch.float32), (4, 16, torch.bfloat16)])
def test_memory_counts_every_allocated_byte(bits, group, dtype):
    nb, staging = 7, 3
    store = make(nb, staging=staging, dtype=dtype, bits=bits, group_size=group)
    allocated = sum(t.nbytes for t in store.buffers.values()) + store.slot_positions.nbytes
    mem = store.memory()
    assert mem.total == store.nbytes == allocated
    elem = torch.empty(0, dtype=dtype).element_size()
    assert mem.staging == 2 * staging * B * L * H * D * elem
    per_token = L * H * (2 * packed_dim(D, bits) + 4 * D / B + 4 * D // group) + 4 / B + 4
    assert mem.bytes_per_token_excluding_staging == pytest.approx(per_token)
    meta = KIVIStore(layout(dtype), 1, "meta", bits=bits, group_size=group,
                     num_staging_blocks=staging)
    meta.num_blocks = nb  # as registry.store_memory sizes a pool without allocating it
    assert meta.memory() == mem
    shared = torch.full((nb, B), -1, dtype=torch.int32)  # positions owned by the pool
    assert make(nb, staging=staging, dtype=dtype, bits=bits, group_size=group,
                slot_positions=shared).nbytes == allocated - shared.nbytes


# ---- attention --------------------------------------------------------------------------------
def _hf_cfg():
    class Cfg:
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return Cfg()


def test_paged_attention_over_store_matches_dequantize_then_dense():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(6)
    hq, scale, nb = 4, D ** -0.5, 40
    store = make(nb, staging=8, bits=2)
    rope = rope_from_rotary(RotaryEmbedding(_hf_cfg(), D, 1024))
    seqs = [(16, 1), (21, 1), (5, 1), (12, 9), (0, 10)]  # (past, new): 3 decodes, 2 prefills
    free = list(range(nb))
    rng.shuffle(free)
    data = []
    for past, new in seqs:
        table = [free.pop() for _ in range(-(-(past + new) // B))]
        k_pre, v = randn(gen, past + new), randn(gen, past + new)
        pos = torch.arange(past + new)
        k = torch.stack([rope(pos, k_pre[layer]) for layer in range(L)])  # stored post-RoPE
        if past:
            write_sequence(store, table, k[:, :past], v[:, :past], [past])
        data.append((table, k, v, torch.randn(new, hq, D, generator=gen)))
    layer = 1
    slots, positions = [], []
    for (past, new), (table, *_rest) in zip(seqs, data):
        slots += [table[j // B] * B + j % B for j in range(past, past + new)]
        positions += list(range(past, past + new))
    k_new = torch.cat([k[layer, p:] for (p, _), (_, k, _, _) in zip(seqs, data)])
    v_new = torch.cat([v[layer, p:] for (p, _), (_, _, v, _) in zip(seqs, data)])
    q = torch.cat([d[3] for d in data])
    width = max(len(d[0]) for d in data[:3])
    dec_tables = torch.tensor([d[0] + [0] * (width - len(d[0])) for d in data[:3]])
    lens = torch.tensor([p + n for p, n in seqs[:3]])
    mask = (torch.arange(width * B)[None] < lens[:, None])[:, None, None, :]
    prefills, start = [], 3
    for (past, new), d in zip(seqs[3:], data[3:]):
        prefills.append(PrefillSeq(start, new, past + new, torch.tensor(d[0])))
        start += new
    meta = AttentionMetadata(torch.tensor(slots), 3, dec_tables, mask, prefills)
    # the pasts' partial blocks as staged before the step (a chunk fills one of them)
    before = [store.read(layer, table, past) for (past, _), (table, *_r) in zip(seqs, data)]
    plan = store.plan_write(slots, positions)
    out = quantized_paged_attention(q, k_new, v_new, k_new, store, layer, meta, plan, scale,
                                    rope)
    offset = 0
    for (past, new), (table, k, _v, qs), (k_old, v_old) in zip(seqs, data, before):
        sl = slice(offset, offset + new)
        full = past // B * B
        ref = reference_quantized_attention(qs, k_new[sl], v_new[sl], store, layer, table, past,
                                            scale, rope, staged_past=(k_old[full:],
                                                                      v_old[full:]))
        torch.testing.assert_close(out[sl], ref, atol=1e-5, rtol=1e-5)
        k_past, _ = store.read(layer, table, past)  # the oracle saw quantized full blocks
        full = past // B * B
        if full:
            assert not torch.equal(k_past[:full], k[layer, :full])
        offset += new
