"""Quantized stores for the kernel tests (tests/unit/test_native_quant_attention.py,
tests/unit/test_triton_kvquant.py): every layout they check, by name ("int8", "fp8_e4m3",
"int8-pre-rope", "kvquant:<config>", "kivi:<bits>"), with a rotary table for keys kept before
RoPE."""

import random
from types import SimpleNamespace

import torch

from nanokv.attention.common import CommonAttentionMetadata, PrefillChunk
from nanokv.attention.native_quantized import NativeQuantizedBackend
from nanokv.cache.kv_pool import KVLayout
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.quant import KVQuantConfig, KVQuantStore, make_kv_store
from nanokv.quant.codebook import fisher_kmeans
from nanokv.quant.attention import reference_quantized_attention
from nanokv.quant.kivi_store import KIVIStore
from nanokv.utils import cdiv

NUM_LAYERS, HKV, MAX_POS = 2, 2, 4096
CPU = torch.device("cpu")


class _HFConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def codebooks(bits, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(fisher_kmeans(torch.randn(4000, generator=gen).tanh(), None,
                                     2 ** bits).tolist()) for _ in range(NUM_LAYERS))


def thresholds(head_dim):
    gen = torch.Generator().manual_seed(head_dim)  # the same for every store of this width
    lo = -torch.rand(NUM_LAYERS, 1, HKV, head_dim, generator=gen) - 1.0  # keys lie beyond
    return torch.cat([lo, -lo], dim=1)  # [L, 2, Hkv, D]


def kvquant_config(name, head_dim):
    return {
        "4bit": lambda: KVQuantConfig(bits=4),
        "3bit-nuq": lambda: KVQuantConfig(bits=3, key_codebooks=codebooks(3, 0),
                                          value_codebooks=codebooks(3, 1)),
        "2bit-nuq-thresholds": lambda: KVQuantConfig(
            bits=2, key_codebooks=codebooks(2, 2), value_codebooks=codebooks(2, 3),
            key_outlier_thresholds=thresholds(head_dim), outlier_fraction=0.02,
            num_sink_tokens=3),
        "mixed-8-4": lambda: KVQuantConfig(bits=4, layer_bits=(8, 4)),
        "per-channel-post-rope": lambda: KVQuantConfig(bits=4, pre_rope_keys=False),
        "4bit-outliers5": lambda: KVQuantConfig(bits=4, outlier_fraction=0.05),
        "ablation-per-token-post-rope": lambda: KVQuantConfig(
            bits=4, per_channel_keys=False, pre_rope_keys=False, num_sink_tokens=0),
    }[name]()


def make_store(kind, head_dim, block_size, num_blocks, num_requests, staging_dtype=None,
               device=CPU, num_layers=NUM_LAYERS, windows=()):
    """num_layers: other than NUM_LAYERS only for configs without per-layer tables; windows:
    each layer's sliding window (None: the whole context), () none."""
    lay = KVLayout(num_layers, HKV, head_dim, block_size, torch.float32, tuple(windows))
    if kind.startswith("kvquant:"):
        store = KVQuantStore(lay, num_blocks, kvquant_config(kind[8:], head_dim),
                             num_staging_blocks=num_requests, device=device,
                             staging_dtype=staging_dtype)
    elif kind.startswith("kivi:"):  # value groups: gcd(32, head_dim) channels, 4 at D = 128
        store = KIVIStore.from_settings(lay, num_blocks, device, bits=int(kind[5:]),
                                        num_staging_blocks=num_requests)
    elif kind.endswith("-pre-rope"):  # per-token codes of keys before RoPE
        store = make_kv_store(kind[:-9], lay, num_blocks, device, pre_rope_keys=True)
    else:
        store = make_kv_store(kind, lay, num_blocks, device)
    store.rotary = RotaryEmbedding(_HFConfig(), head_dim, MAX_POS)
    store.rotary.build_tables(torch.device(device))
    return store


def fill(store, lens, chunk, seed):
    """Requests of `lens` tokens written in chunks of `chunk` (positions not the slots, as after
    eviction; some large key entries, so outliers are kept). Returns their block tables."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs, d, heads = store.block_size, store.layout.head_dim, store.layout.num_kv_heads
    blocks = list(range(store.num_blocks))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(cdiv(n, bs))] for n in lens]
    for table, n in zip(tables, lens):
        p0 = rng.randrange(0, 50)
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            slots = [table[j // bs] * bs + j % bs for j in range(start, start + m)]
            pos = list(range(p0 + start, p0 + start + m))
            plan = store.begin_step(slots, pos)
            for layer in range(store.layout.num_layers):
                k_pre = torch.randn(m, heads, d, generator=gen)
                k_pre[torch.rand(k_pre.shape, generator=gen) < 0.02] *= 8
                v = torch.randn(m, heads, d, generator=gen)
                k_pre, v = k_pre.to(store.device), v.to(store.device)
                k = store.rotary.rotate(torch.tensor(pos, device=store.device), k_pre)
                store.write_layer(layer, plan, k.to(store.layout.dtype),
                                  v.to(store.layout.dtype), k_pre.to(store.layout.dtype))
    return tables


def check_policy_view(store, tables, lens, atol=2e-5, rtol=1e-4):
    """Each request's `policy_view` through the block reader an attention backend installed
    against the one through the store's own `read_blocks`: every written slot of every layer,
    the table and the positions."""
    reader = store.block_reader
    assert reader is not None, "no block reader installed"
    for i, (table, n) in enumerate(zip(tables, lens)):
        request = SimpleNamespace(num_cached_slots=n, block_table=table, request_id=f"r{i}")
        fast = store.policy_view(request)
        store.use_block_reader(None)
        try:
            ref = store.policy_view(request)
        finally:
            store.use_block_reader(reader)
        assert fast.block_table == ref.block_table and torch.equal(fast.positions, ref.positions)
        for (k, v), (k_ref, v_ref) in zip(fast.layers, ref.layers):  # each [nb, B, Hkv, D]
            assert k.shape == k_ref.shape and k.dtype == k_ref.dtype and k.device == k_ref.device
            torch.testing.assert_close(k.flatten(0, 1)[:n], k_ref.flatten(0, 1)[:n], atol=atol,
                                       rtol=rtol)
            torch.testing.assert_close(v.flatten(0, 1)[:n], v_ref.flatten(0, 1)[:n], atol=atol,
                                       rtol=rtol)


def staged_pasts(store, table, past):
    """Each layer's (k, v) of the past's partial block as the store holds it now, before a step
    writes (`reference_quantized_attention`'s staged_past), or None where there is none."""
    start = past // store.block_size * store.block_size
    if start == past:
        return [None] * store.layout.num_layers
    rope = store.rotary.rotate if store.pre_rope_keys else None
    out = []
    for layer in range(store.layout.num_layers):
        k, v = store.read(layer, table, past, rope)
        out.append((k[start:], v[start:]))
    return out


def step(store, backend, q, k, v, k_pre, slots, positions, decode_tables, decode_lens,
         prefills=(), layers=range(NUM_LAYERS)):
    """One engine step through the backend: write, then attend; returns each layer's output."""
    common = CommonAttentionMetadata(slots, len(decode_lens), decode_tables, decode_lens,
                                     list(prefills))
    common.write_plan = store.begin_step(slots, positions)
    meta = backend.build(common)
    return [backend.forward(layer, q[layer], k[layer], v[layer], k_pre[layer], meta,
                            q.shape[-1] ** -0.5) for layer in layers]


def scenario(store, hq, lens, rng, gen, chunk=None, backend_cls=NativeQuantizedBackend,
             device=CPU):
    """Requests with `lens` cached slots (the last one the step's new token), written as prefill
    chunks through `backend_cls` (each checked against the reference on the way); then one step
    of all of them decoding next to a new request's first chunk. Returns (outputs per layer,
    reference per layer). `device`: the store's (the tensors are drawn on CPU, then moved)."""
    bs, d = store.block_size, store.layout.head_dim
    rotate = store.rotary.rotate
    blocks = list(range(store.num_blocks))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(cdiv(n, bs))] for n in lens]
    starts = [rng.randrange(0, 50) for _ in lens]  # positions != slots (as after eviction)

    def tokens(n, pos):  # k_pre, k (rotated), v: [L, n, Hkv, D]; some large entries
        k_pre = torch.randn(NUM_LAYERS, n, HKV, d, generator=gen)
        k_pre[torch.rand(k_pre.shape, generator=gen) < 0.01] *= 8
        v = torch.randn(NUM_LAYERS, n, HKV, d, generator=gen)
        k_pre, v, pos = k_pre.to(device), v.to(device), pos.to(device)
        k = torch.stack([rotate(pos, k_pre[layer]) for layer in range(NUM_LAYERS)])
        return k_pre, k, v

    def queries(n, scale=1.0):
        return (torch.randn(NUM_LAYERS, n, hq, d, generator=gen) * scale).to(device)

    backend = backend_cls(store, torch.device(device))
    # the past, one request at a time, in chunks (each a prefill step)
    for table, n, p0 in zip(tables, lens, starts):
        done = 0
        while done < n - 1:
            m = min(chunk or n, n - 1 - done)
            pos = torch.arange(p0 + done, p0 + done + m)
            k_pre, k, v = tokens(m, pos)
            q = queries(m)
            slots = [table[j // bs] * bs + j % bs for j in range(done, done + m)]
            chunk_meta = PrefillChunk(0, m, done + m, table[:cdiv(done + m, bs)])
            before = staged_pasts(store, table, done)
            outs = step(store, backend, q, k, v, k_pre, slots, pos.tolist(), [], [], [chunk_meta])
            for layer, out in enumerate(outs):  # the prefill path, checked on the way
                ref = reference_quantized_attention(q[layer], k[layer], v[layer], store, layer,
                                                    table, done, d ** -0.5, rotate,
                                                    k_pre[layer], pos.to(device), before[layer],
                                                    store.layout.window(layer))
                torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
            done += m
    # one step: every request's new token (decodes), then a new request's first chunk of m
    nd, m = len(lens), bs + 3
    new_table = [blocks.pop() for _ in range(cdiv(m, bs))]
    pos = torch.tensor([p0 + n - 1 for p0, n in zip(starts, lens)] + list(range(m)))
    k_pre, k, v = tokens(nd + m, pos)
    q = queries(nd + m, 3.0)  # peaked softmax
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)] \
        + [new_table[j // bs] * bs + j % bs for j in range(m)]
    outs = step(store, backend, q, k, v, k_pre, slots, pos.tolist(), tables, list(lens),
                [PrefillChunk(nd, m, m, new_table)])
    refs = []
    for layer in range(NUM_LAYERS):
        window = store.layout.window(layer)
        rows = [reference_quantized_attention(q[layer, i:i + 1], k[layer, i:i + 1],
                                              v[layer, i:i + 1], store, layer, tables[i], n - 1,
                                              d ** -0.5, rotate, window=window)
                for i, n in enumerate(lens)]
        rows.append(reference_quantized_attention(q[layer, nd:], k[layer, nd:], v[layer, nd:],
                                                  store, layer, new_table, 0, d ** -0.5, rotate,
                                                  k_pre[layer, nd:], pos[nd:].to(device),
                                                  window=window))
        refs.append(torch.cat(rows))
    return outs, refs
