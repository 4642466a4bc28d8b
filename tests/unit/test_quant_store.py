"""Quantized KV stores: write / read across partial and full blocks, block reuse, sinks, RoPE
after dequantization, memory accounting, and attention against dequantize-then-dense."""

import random

import pytest
import torch

from nanokv.cache.kv_pool import KVLayout
from nanokv.layers.attention import AttentionMetadata, PrefillSeq
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.quant import KVQuantConfig, KVQuantStore, make_kv_store, store_memory
from nanokv.quant.attention import (
    quantized_paged_attention,
    reference_quantized_attention,
    rope_from_rotary,
)
from nanokv.quant.codebook import fisher_kmeans
from nanokv.quant.codec import LayerCodec, fake_quantize_sequence
from nanokv.quant.kivi_store import KIVIStore

L, H, D, B = 2, 2, 16, 16


def layout(dtype=torch.float32, block_size=B):
    return KVLayout(L, H, D, block_size, dtype)


def codebooks(bits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(fisher_kmeans(torch.randn(4000, generator=gen).tanh(), None,
                                     2 ** bits).tolist()) for _ in range(L))


def write_sequence(store, table, k, v, chunks, start_pos=0):
    """Write k, v [L, T, H, D] of one sequence in chunks; slot i holds position start_pos + i."""
    done, bs = 0, store.block_size
    for n in chunks:
        slots = [table[j // bs] * bs + j % bs for j in range(done, done + n)]
        plan = store.plan_write(slots, [start_pos + j for j in range(done, done + n)])
        for layer in range(L):
            store.write(layer, plan, k[layer, done:done + n], v[layer, done:done + n])
        done += n


def expected(cfg, k, v, layer, num_sinks):
    codec = LayerCodec.from_config(cfg, layer)
    return (fake_quantize_sequence(k[layer:layer + 1], codec, "key", B, num_sinks)[0],
            fake_quantize_sequence(v[layer:layer + 1], codec, "value", B, num_sinks)[0])


CONFIGS = {
    "4bit": KVQuantConfig(bits=4),
    "3bit-nuq": KVQuantConfig(bits=3, key_codebooks=codebooks(3), value_codebooks=codebooks(3, 1)),
    "2bit-3sinks-2pct": KVQuantConfig(bits=2, num_sink_tokens=3, outlier_fraction=0.02),
    "mixed-4-8": KVQuantConfig(bits=4, layer_bits=(8, 4)),
    "ablation-all-off": KVQuantConfig(bits=4, per_channel_keys=False, pre_rope_keys=False,
                                      outlier_fraction=0.0, num_sink_tokens=0),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_store_reads_back_what_simulation_predicts(name):
    cfg = CONFIGS[name]
    store = make_kv_store("kvquant", layout(), 12, kvquant_config=cfg, num_staging_blocks=2)
    gen = torch.Generator().manual_seed(1)
    k1, v1 = torch.randn(L, 45, H, D, generator=gen), torch.randn(L, 45, H, D, generator=gen)
    k2, v2 = torch.randn(L, 20, H, D, generator=gen), torch.randn(L, 20, H, D, generator=gen)
    k1[:, 0] *= 30  # a sink-like first token
    t1, t2 = [7, 2, 5], [0, 11]
    write_sequence(store, t1, k1[:, :10], v1[:, :10], [10])
    write_sequence(store, t2, k2, v2, [3, 17])
    # continue the first sequence in chunks crossing block boundaries, then decodes
    store_k, store_v = k1, v1
    done = 10
    for n in (20, 1, 1, 13):
        slots = [t1[j // B] * B + j % B for j in range(done, done + n)]
        plan = store.plan_write(slots, list(range(done, done + n)))
        for layer in range(L):
            store.write(layer, plan, store_k[layer, done:done + n], store_v[layer, done:done + n])
        done += n
    for layer in range(L):
        for table, k, v in ((t1, k1, v1), (t2, k2, v2)):
            kr, vr = store.read(layer, table, k.shape[1])
            ek, ev = expected(cfg, k, v, layer, cfg.num_sink_tokens)
            assert torch.equal(kr, ek) and torch.equal(vr, ev)
            if cfg.per_channel_keys:  # the partial block's keys are staged: exact
                tail = k.shape[1] // B * B
                assert torch.equal(kr[tail:], k[layer, tail:])
    if cfg.per_channel_keys:
        assert store.num_free_staging_blocks == 0  # one partial block per sequence
    else:
        assert store.num_staging_blocks == 0 and "staging_k" in store.buffers


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleaved_sequences_with_reuse(seed):
    """Several sequences grow in random chunks in shared steps; finished ones release their
    blocks, which new ones reuse. Every live sequence always reads back its simulation."""
    rng = random.Random(seed)
    cfg = KVQuantConfig(bits=3, num_sink_tokens=2)
    store = KVQuantStore(layout(), 14, cfg, num_staging_blocks=3)
    free, live, gen = list(range(14)), [], torch.Generator().manual_seed(seed)
    for _step in range(25):
        while len(live) < 3 and len(free) >= 4:  # admit: up to 60 tokens = 4 blocks
            n = rng.randrange(5, 61)
            live.append({"table": [free.pop() for _ in range(-(-n // B))], "done": 0,
                         "k": torch.randn(L, n, H, D, generator=gen),
                         "v": torch.randn(L, n, H, D, generator=gen)})
        slots, positions, ks, vs = [], [], [], []
        for seq in live:  # one step: a random chunk of every live sequence
            n = min(rng.choice([1, 1, 3, 17]), seq["k"].shape[1] - seq["done"])
            for j in range(seq["done"], seq["done"] + n):
                slots.append(seq["table"][j // B] * B + j % B)
                positions.append(j)
            ks.append(seq["k"][:, seq["done"]:seq["done"] + n])
            vs.append(seq["v"][:, seq["done"]:seq["done"] + n])
            seq["done"] += n
        plan = store.plan_write(slots, positions)
        for layer in range(L):
            store.write(layer, plan, torch.cat([k[layer] for k in ks]),
                        torch.cat([v[layer] for v in vs]))
        for seq in live:
            n = seq["done"]
            kr, vr = store.read(1, seq["table"], n)
            ek, ev = expected(cfg, seq["k"][:, :n], seq["v"][:, :n], 1, 2)
            assert torch.equal(kr, ek) and torch.equal(vr, ev)
        for seq in [s for s in live if s["done"] == s["k"].shape[1]]:
            live.remove(seq)
            store.release(seq["table"])
            free += seq["table"][::-1]


def test_sinks_exact_and_positions_recorded():
    cfg = KVQuantConfig(bits=2, num_sink_tokens=2)
    store = KVQuantStore(layout(), 4, cfg, num_staging_blocks=1)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(L, 16, H, D, generator=gen), torch.randn(L, 16, H, D, generator=gen)
    k[:, :2] = (torch.randn(L, 2, H, D, generator=gen) * 50).half().float()
    write_sequence(store, [3], k, v, [16])
    kr, vr = store.read(0, [3], 16)
    assert torch.equal(kr[:2], k[0, :2]) and torch.equal(vr[:2], v[0, :2].half().float())
    assert float((kr[2:] - k[0, 2:]).abs().max()) < 2.0  # huge sinks left out of the stats
    assert store.slot_positions[3].tolist() == list(range(16))


def test_rope_applied_after_dequantization_at_recorded_positions():
    cfg = KVQuantConfig(bits=4)
    store = KVQuantStore(layout(), 6, cfg, num_staging_blocks=1)
    rotary = RotaryEmbedding(_hf_cfg(), D, 512)
    rope = rope_from_rotary(rotary)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(L, 24, H, D, generator=gen), torch.randn(L, 24, H, D, generator=gen)
    write_sequence(store, [4, 1], k, v, [24], start_pos=300)  # positions != slots (eviction)
    kr, _ = store.read(1, [4, 1], 24, rope)
    ek, _ = expected(cfg, k, v, 1, 0)  # no position < 1: no sink
    pos = torch.arange(300, 324)
    torch.testing.assert_close(kr, rope(pos, ek), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="after RoPE"):
        make_kv_store("int8", layout(), 2).read(0, [0], 4, rope)


def test_block_reuse_release_and_staging_limits():
    store = KVQuantStore(layout(), 4, KVQuantConfig(bits=4), num_staging_blocks=1)
    gen = torch.Generator().manual_seed(4)
    ka, va = torch.randn(L, 20, H, D, generator=gen), torch.randn(L, 20, H, D, generator=gen)
    kb, vb = torch.randn(L, 20, H, D, generator=gen), torch.randn(L, 20, H, D, generator=gen)
    write_sequence(store, [0, 1], ka, va, [20])  # block 1 partial: holds the staging block
    with pytest.raises(RuntimeError, match="staging"):
        write_sequence(store, [2, 3], kb, vb, [4])
    store.release([0, 1])  # freed: the full block 0 stays readable (prefix cache)
    assert torch.equal(store.read(0, [0], 16)[0], expected(store.config, ka, va, 0, 1)[0][:16])
    write_sequence(store, [1, 0], kb, vb, [5, 15])  # reuse both blocks, slot 0 restarts them
    kr, vr = store.read(1, [1, 0], 20)
    ek, ev = expected(store.config, kb, vb, 1, 1)
    assert torch.equal(kr, ek) and torch.equal(vr, ev)
    # a partial block freed WITHOUT release is still restarted by its slot-0 write
    write_sequence(store, [0], ka, va, [3])
    assert torch.equal(store.read(0, [0], 3)[0], ka[0, :3])
    with pytest.raises(RuntimeError, match="out of order"):
        store.plan_write([0 * B + 5], [5])


@pytest.mark.parametrize("kind,opts", [
    ("kvquant", dict(kvquant_config=KVQuantConfig(bits=2, num_sink_tokens=2,
                                                  outlier_fraction=0.02))),
    ("kvquant", dict(kvquant_config=KVQuantConfig(bits=4))),
    ("kivi", dict(bits=2, group_size=16))], ids=["kvquant-2bit-sinks-outliers", "kvquant-4bit",
                                                 "kivi"])
def test_rejected_draft_slots_written_again_read_as_if_never_written(kind, opts):
    """Speculative decoding on a store that quantizes full blocks: a partial block's slots of
    rejected drafts (other K/V) written again from an earlier slot, then the block filled by a
    known token, read exactly as a store that only ever saw the final tokens; a full block's
    slots cannot be rewound."""
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(L, 40, H, D, generator=gen), torch.randn(L, 40, H, D, generator=gen)
    wrong_k, wrong_v = torch.randn(L, 40, H, D, generator=gen), torch.randn(L, 40, H, D,
                                                                           generator=gen)
    table = [3, 0, 5]

    def write(store, first, end, rejected_from=None):
        """Slots [first, end) of the sequence, those from rejected_from on with other K/V."""
        slots = [table[j // B] * B + j % B for j in range(first, end)]
        plan = store.plan_write(slots, list(range(first, end)))
        kk, vv = k[:, first:end].clone(), v[:, first:end].clone()
        if rejected_from is not None:
            kk[:, rejected_from - first:] = wrong_k[:, rejected_from:end]
            vv[:, rejected_from - first:] = wrong_v[:, rejected_from:end]
        for layer in range(L):
            store.write(layer, plan, kk[layer], vv[layer])

    def make():
        if kind == "kivi":
            return KIVIStore(layout(), 6, num_staging_blocks=2, **opts)
        return make_kv_store(kind, layout(), 6, num_staging_blocks=2, **opts)

    once = make()
    write(once, 0, 10)
    write(once, 10, 40)
    spec = make()
    write(spec, 0, 10)
    write(spec, 10, 15, rejected_from=12)  # a token and 4 drafts, the last 3 rejected
    write(spec, 12, 14, rejected_from=13)  # the next step: 1 rejected again
    write(spec, 13, 16)  # the block filled by a known token
    write(spec, 16, 19, rejected_from=16)  # drafts opening the next block, all rejected
    write(spec, 16, 40)
    for layer in range(L):
        for a, b in zip(spec.read(layer, table, 40), once.read(layer, table, 40)):
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="out of order"):  # block 3 is full, quantized
        spec.plan_write([3 * B + 14], [14])


@pytest.mark.parametrize("kv_dtype", ["kvquant", "int8"])
def test_copy_blocks_then_diverge(kv_dtype):
    """Copy-on-write (KV policies): a copied block reads the same and grows on its own."""
    opts = {"num_staging_blocks": 2} if kv_dtype == "kvquant" else {}
    store = make_kv_store(kv_dtype, layout(), 5, **opts)
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(L, 30, H, D, generator=gen), torch.randn(L, 30, H, D, generator=gen)
    k2, v2 = k.clone(), v.clone()
    k2[:, 20:], v2[:, 20:] = torch.randn(L, 10, H, D, generator=gen), torch.randn(L, 10, H, D,
                                                                                 generator=gen)
    write_sequence(store, [0, 1], k[:, :20], v[:, :20], [20])
    store.copy_blocks([(0, 2), (1, 3)])
    for layer in range(L):
        for a, b in zip(store.read(layer, [0, 1], 20), store.read(layer, [2, 3], 20)):
            assert torch.equal(a, b)
    for table, kk, vv in (([0, 1], k, v), ([2, 3], k2, v2)):  # both continue past the block
        done, bs = 20, B
        slots = [table[j // bs] * bs + j % bs for j in range(done, 30)]
        plan = store.plan_write(slots, list(range(done, 30)))
        for layer in range(L):
            store.write(layer, plan, kk[layer, 20:], vv[layer, 20:])
    if kv_dtype == "kvquant":
        for table, kk, vv in (([0, 1], k, v), ([2, 3], k2, v2)):
            ek, ev = expected(store.config, kk, vv, 1, 1)
            kr, vr = store.read(1, table, 30)
            assert torch.equal(kr[:16], ek[:16]) and torch.equal(vr, ev)
            assert torch.equal(kr[16:], kk[1, 16:])  # still staged: exact
    else:
        assert float((store.read(1, [2, 3], 30)[0] - k2[1]).abs().max()) < 0.02


@pytest.mark.parametrize("name,bound", [("int8", 0.02), ("fp8_e4m3", 0.15), ("fp8_e5m2", 0.3)])
def test_per_token_stores(name, bound):
    store = make_kv_store(name, layout(), 5)
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(L, 20, H, D, generator=gen), torch.randn(L, 20, H, D, generator=gen)
    write_sequence(store, [4, 2], k, v, [7, 13])
    kr, vr = store.read(1, [4, 2], 20)
    assert float((kr - k[1]).abs().max()) < bound and float((vr - v[1]).abs().max()) < bound
    assert store.buffers["k_codes"].dtype == torch.uint8


def test_registry_validation():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_kv_store("int4", layout(), 2)
    with pytest.raises(ValueError, match="num_staging_blocks"):
        make_kv_store("kvquant", layout(), 2)
    with pytest.raises(ValueError, match="only applies"):
        make_kv_store("int8", layout(), 2, kvquant_config=KVQuantConfig())
    with pytest.raises(ValueError, match="pre_rope_keys must be True or False"):
        make_kv_store("int8", layout(), 2, pre_rope_keys="yes")
    for bad in (torch.int8, "float16"):  # partial blocks' keys are kept in a float dtype
        with pytest.raises(ValueError, match="staging_dtype must be one of"):
            make_kv_store("kvquant", layout(), 2, num_staging_blocks=1, staging_dtype=bad)
    assert make_kv_store("auto", layout(), 2) is None
    a = make_kv_store("kvquant", layout(), 2, num_staging_blocks=1)
    b = make_kv_store("kvquant", layout(), 2, num_staging_blocks=1,
                      kvquant_config=KVQuantConfig(bits=3))
    assert a.extra_keys() != b.extra_keys()


# ---- memory ----------------------------------------------------------------------------------
SETTINGS = {
    "int8": ("int8", {}), "fp8": ("fp8", {}),
    "kvquant-4bit-1%": ("kvquant", {"kvquant_config": KVQuantConfig(bits=4)}),
    "kvquant-3bit-1%": ("kvquant", {"kvquant_config": KVQuantConfig(bits=3)}),
    "kvquant-2bit-1%": ("kvquant", {"kvquant_config": KVQuantConfig(bits=2)}),
    "kvquant-4bit-0%": ("kvquant", {"kvquant_config": KVQuantConfig(bits=4,
                                                                     outlier_fraction=0.0)}),
}


def test_memory_report_counts_every_allocated_byte():
    for dtype, opts in SETTINGS.values():
        if dtype == "kvquant":
            opts = dict(opts, num_staging_blocks=3)
        store = make_kv_store(dtype, layout(), 7, **opts)
        allocated = sum(t.nbytes for t in store.buffers.values()) + store.slot_positions.nbytes
        assert store.nbytes == allocated
        assert store_memory(dtype, layout(), 7, **opts) == store.memory()


@pytest.mark.parametrize("model,dims", [("llama-7b", (32, 32, 128)), ("qwen3-0.6b", (28, 8, 128)),
                                        ("nanokv-tiny", (2, 2, 16))])
def test_bytes_per_token_below_float(model, dims):
    """Bytes per token of everything allocated (a 64k-token pool; staging for 16 or 64
    running requests), printed as a ratio to the float32 / bfloat16 pool (`pytest -s`)."""
    layers, heads, dim = dims
    rows = []
    for block_size in (16, 128, 256):
        num_blocks = 65536 // block_size
        for dtype in (torch.float32, torch.bfloat16):
            lay = KVLayout(layers, heads, dim, block_size, dtype)
            cells = []
            for name, (kv_dtype, opts) in SETTINGS.items():
                for staging in ((16, 64) if kv_dtype == "kvquant" else (None,)):
                    extra = {} if staging is None else {"num_staging_blocks": staging}
                    mem = store_memory(kv_dtype, lay, num_blocks, **opts, **extra)
                    assert mem.bytes_per_token < lay.bytes_per_block / block_size
                    assert mem.bytes_per_token_excluding_staging <= mem.bytes_per_token
                    label = name if staging is None else f"{name} S={staging}"
                    cells.append(f"{label} {mem.ratio_to(lay):.3f}")
            rows.append(f"{model} B={block_size} vs {str(dtype)[6:]}: " + ", ".join(cells))
    print("\n" + "\n".join(rows))


# ---- attention -------------------------------------------------------------------------------
def _hf_cfg():
    class Cfg:
        def __init__(self):
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return Cfg()


@pytest.mark.parametrize("name", ["kvquant-2bit", "kvquant-4bit-nuq", "int8"])
def test_paged_attention_over_store_matches_dequantize_then_dense(name):
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(6)
    hq, scale = 4, D ** -0.5
    if name == "int8":
        store = make_kv_store("int8", layout(), 40)
    else:
        cfg = (KVQuantConfig(bits=2) if name == "kvquant-2bit"
               else KVQuantConfig(bits=4, key_codebooks=codebooks(4), value_codebooks=None))
        store = make_kv_store("kvquant", layout(), 40, kvquant_config=cfg, num_staging_blocks=8)
    rope = rope_from_rotary(RotaryEmbedding(_hf_cfg(), D, 1024))
    # three decodes, one prefill chunk with a past, one prefill without past
    seqs = [(16, 1), (37, 1), (5, 1), (20, 9), (0, 18)]  # (past, new)
    free = list(range(40))
    rng.shuffle(free)
    data = []
    for past, new in seqs:
        table = [free.pop() for _ in range(-(-(past + new) // B))]
        k = torch.randn(L, past + new, H, D, generator=gen)
        v = torch.randn(L, past + new, H, D, generator=gen)
        if past:
            write_sequence(store, table, k[:, :past], v[:, :past], [past])
        data.append((table, k, v, torch.randn(new, hq, D, generator=gen)))
    layer = 1
    slots, positions = [], []
    for (past, new), (table, *_rest) in zip(seqs, data):
        slots += [table[j // B] * B + j % B for j in range(past, past + new)]
        positions += list(range(past, past + new))
    pos = torch.tensor(positions)
    k_pre = torch.cat([k[layer, p:] for (p, _), (_, k, _, _) in zip(seqs, data)])
    v_new = torch.cat([v[layer, p:] for (p, _), (_, _, v, _) in zip(seqs, data)])
    k_rot = rope(pos, k_pre)
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
    plan = store.plan_write(slots, positions)
    k_store = k_pre if store.pre_rope_keys else k_rot
    out = quantized_paged_attention(q, k_rot, v_new, k_store, store, layer, meta, plan, scale,
                                    rope)
    offset = 0
    for (past, new), (table, *_r, qs) in zip(seqs, data):
        sl = slice(offset, offset + new)
        ref = reference_quantized_attention(qs, k_rot[sl], v_new[sl], store, layer, table, past,
                                            scale, rope)
        torch.testing.assert_close(out[sl], ref, atol=1e-5, rtol=1e-5)
        offset += new


@pytest.mark.parametrize("kind", ["kvquant:3bit-nuq", "kvquant:2bit-nuq-thresholds"])
def test_copy_blocks_with_codebooks(kind):
    """Copy-on-write of a store with non-uniform codebooks (a calibrated KVQuant cache): the
    copy reads as its source, and the codebook buffers (one per layer, not per block: the codecs'
    centroids) stay as they were. Copied as per-block buffers, a 3-bit codebook's entries were
    overwritten and a 2-bit one's 4 entries indexed past."""
    from quant_stores import fill, make_store

    store = make_store(kind, 32, 16, num_blocks=12, num_requests=2)
    table = fill(store, [48], chunk=48, seed=4)[0]
    books = {name: b.clone() for name, b in store.buffers.items() if "codebook" in name}
    for layer, codec in enumerate(store.codecs):  # the buffers hold the codecs' centroids
        assert torch.equal(books[f"key_codebook{layer}"], codec.key_codebook)
        assert torch.equal(books[f"value_codebook{layer}"], codec.value_codebook)
    free = [b for b in range(12) if b not in table][:2]
    store.copy_blocks([(table[0], free[0]), (table[1], free[1])])
    for layer in range(store.layout.num_layers):
        k_src, v_src = store.read(layer, table[:2], 32, store.rope)
        k_dst, v_dst = store.read(layer, free, 32, store.rope)
        assert torch.equal(k_src, k_dst) and torch.equal(v_src, v_dst)
    assert all(torch.equal(store.buffers[name], b) for name, b in books.items())


def test_reselecting_policy_with_more_sinks_than_kvquant_keeps_warns_once(caplog):
    """A policy that re-selects while decoding and keeps more first tokens than KVQuant holds at
    full precision: a warning naming the fix, once per (policy, n_sink); none where KVQuant
    keeps them all or the policy never re-selects."""
    from nanokv.policies.base import PolicyConfig

    def policy(name, **options):
        return PolicyConfig(name, 64, options=options).build(block_size=16)

    store = make_kv_store("kvquant", layout(), 8, num_staging_blocks=1)  # 1 sink
    with caplog.at_level("WARNING", logger="nanokv"):
        store.check_policy(policy("streaming", n_sink=4))
        store.check_policy(policy("streaming", n_sink=4))
        store.check_policy(policy("streaming", n_sink=4, slide="block"))
        store.check_policy(policy("streaming", n_sink=1))
        store.check_policy(policy("snapkv", n_sink=4))  # compacts once
    assert len(caplog.records) == 1
    assert "num_sink_tokens >= 4" in caplog.text and "slide='block'" in caplog.text
    caplog.clear()
    four = make_kv_store("kvquant", layout(), 8, num_staging_blocks=1,
                         kvquant_config=KVQuantConfig(num_sink_tokens=4))
    with caplog.at_level("WARNING", logger="nanokv"):
        four.check_policy(policy("streaming", n_sink=4))
        store.check_policy(policy("h2o", n_sink=2))
    assert len(caplog.records) == 1 and "'h2o'" in caplog.text and "slide" not in caplog.text
