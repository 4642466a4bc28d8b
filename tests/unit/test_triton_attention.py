"""The Triton paged-attention backend (`nanokv/kernels/triton/`, backend `triton`) against
independent oracles: the KV write against the stores' own PyTorch writes (bit for bit), the code
formats against PyTorch's casts, attention against dense attention over what the cache holds
(`dense_reference_attention`, and `reference_quantized_attention` for int8 / fp8 codes). Block
sizes 16 and 64, contexts ending mid-block, GQA ratios 1, 2 and 8, decodes of different lengths
with several splits next to prefill chunks with and without a cached prefix, padded rows, the
CUDA-graph metadata, the backend choice, and greedy decoding through the engine.

On a CUDA machine the kernels compile and run on the GPU; without one they run in Triton's
interpreter on CPU (TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported).
"""

import logging
import os
import random

import pytest
import torch

from triton_device import triton_device

DEVICE = triton_device()  # the module skips without a GPU or the interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanokv.attention import triton_paged  # noqa: E402
from nanokv.attention.common import CommonAttentionMetadata, PrefillChunk  # noqa: E402
from nanokv.attention.quantized import QuantizedTorchBackend  # noqa: E402
from nanokv.attention.selector import select_backend  # noqa: E402
from nanokv.attention.torch_paged import TorchPagedBackend  # noqa: E402
from nanokv.attention.triton_paged import TritonPagedBackend  # noqa: E402
from nanokv.attention.triton_quantized import TritonQuantizedBackend  # noqa: E402
from nanokv.cache.kv_pool import KVLayout, KVPool  # noqa: E402
from nanokv.kernels.triton import codes as kernel_codes  # noqa: E402
from nanokv.kernels.triton.kv_write import write_kv  # noqa: E402
from nanokv.kernels.triton.paged_kv import FORMATS  # noqa: E402
from nanokv.layers.attention import dense_reference_attention  # noqa: E402
from nanokv.quant import make_kv_store  # noqa: E402
from nanokv.quant.attention import reference_quantized_attention  # noqa: E402
from nanokv.quant.kivi_store import KIVIStore  # noqa: E402
from nanokv.utils import cdiv  # noqa: E402

CPU = torch.device("cpu")
HKV = 2


# ---- the code formats ----------------------------------------------------------------------------
def _codes_probe(codes_ptr, values_ptr, y_ptr, encoded_ptr, n, KV_FORMAT: tl.constexpr,
                 BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    c = tl.load(codes_ptr + i, mask=m, other=0)
    tl.store(values_ptr + i, kernel_codes.code_values(c, KV_FORMAT), mask=m)
    y = tl.load(y_ptr + i, mask=m, other=0.0)
    tl.store(encoded_ptr + i, kernel_codes.encode_codes(y, KV_FORMAT), mask=m)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_codes_equal_torch_casts(kind):
    """Every code decodes to PyTorch's value of it; encoding rounds as PyTorch's casts do, on
    every representable value, every midpoint between neighbours (ties to even), subnormals,
    +-0 and random values."""
    gen = torch.Generator().manual_seed(3)
    if kind == "int8":
        fmax = 127.0
        codes = torch.arange(-127, 128, dtype=torch.int8).view(torch.uint8)
        values = codes.view(torch.int8).float()
    else:
        dt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kind]
        fmax = float(torch.finfo(dt).max)
        codes = torch.arange(256, dtype=torch.uint8)
        codes = codes[codes.view(dt).float().isfinite()]
        values = codes.view(dt).float()
    grid = values.unique().sort().values
    y = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([0.0, -0.0]),
                   (torch.rand(3000, generator=gen) * 2 - 1) * fmax,
                   (torch.rand(1000, generator=gen) * 2 - 1) * 1e-3])
    n = max(codes.numel(), y.numel())
    codes = torch.cat([codes, codes[:1].repeat(n - codes.numel())])
    y = torch.cat([y, y[:1].repeat(n - y.numel())])
    got_values = torch.empty(n, device=DEVICE)
    got_codes = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    triton.jit(_codes_probe)[(cdiv(n, 1024),)](codes.to(DEVICE), got_values, y.to(DEVICE),
                                               got_codes, n, KV_FORMAT=FORMATS[kind], BLOCK=1024)
    got_values, got_codes = got_values.cpu(), got_codes.cpu()
    if kind == "int8":
        want_values = codes.view(torch.int8).float()
        want_codes = torch.round(y).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        want_values, want_codes = codes.view(dt).float(), y.to(dt).view(torch.uint8)
    assert torch.equal(got_values, want_values)
    assert torch.equal(got_codes, want_codes)


# ---- the KV write --------------------------------------------------------------------------------
def make_cache(kind, head_dim, block_size, num_blocks, num_layers=1, window=None):
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    lay = KVLayout(num_layers, HKV, head_dim, block_size, dtype,
                   () if window is None else (window,) * num_layers)
    if kind in ("float32", "bfloat16"):
        return KVPool(lay, num_blocks, DEVICE)
    return make_kv_store(kind, lay, num_blocks, DEVICE)


def cache_tensors(cache):
    if isinstance(cache, KVPool):
        return {"kv": cache.kv}
    return cache.buffers


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_write_equals_the_stores_write_and_skips_padded_slots(kind):
    gen = torch.Generator().manual_seed(1)
    dim, bs, n = 24, 16, 13
    ours, theirs = make_cache(kind, dim, bs, 4, 2), make_cache(kind, dim, bs, 4, 2)
    for name, buf in cache_tensors(ours).items():  # the same old content, partly overwritten
        buf.copy_(torch.randint(0, 200, buf.shape, generator=gen).to(buf.dtype).to(DEVICE))
        cache_tensors(theirs)[name].copy_(buf)
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    k = (torch.randn(n, HKV, dim, generator=gen) * 3).to(dtype)
    v = torch.randn(n, HKV, dim, generator=gen).to(DEVICE, dtype)
    k[2, 1] = 0  # a zero row: scale 0, codes 0
    fmax = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}.get(kind)
    if fmax is not None:  # scale exactly 1: ties and subnormals reach the rounding as they are
        k[3, 0, 0] = fmax
        k[3, 0, 1:] = (torch.arange(dim - 1) - 11.5) / (1 if kind == "int8" else 8)
    k = k.to(DEVICE)
    slots = torch.randperm(4 * bs, generator=gen)[:n].to(DEVICE)
    slots[[4, 9]] = -1  # padded rows
    real = slots >= 0
    plan = theirs.begin_step(slots[real].tolist(), list(range(int(real.sum()))))
    theirs.write_layer(1, plan, k[real], v[real], k[real])
    write_kv(k, v, slots, TritonPagedBackend(ours, DEVICE).paged_kv(1))
    for name, buf in cache_tensors(theirs).items():
        assert torch.equal(cache_tensors(ours)[name], buf), name


# ---- attention through the backend ---------------------------------------------------------------
def new_backend(cache, tile_n=32, block_rows=32, target_programs=64, soft_cap=None):
    backend = TritonPagedBackend(cache, DEVICE, soft_cap)
    backend.tile_n, backend.block_rows = tile_n, block_rows  # small tiles: several per context
    backend.decode_tile_n = tile_n
    backend.target_programs = target_programs  # several decode splits
    return backend


def run_step(cache, backend, q, k, v, slots, decode_tables, decode_lens, prefills):
    common = CommonAttentionMetadata(slots, len(decode_lens), decode_tables, decode_lens,
                                     list(prefills))
    common.write_plan = cache.begin_step(slots, list(range(len(slots))))
    meta = backend.build(common)
    return backend.forward(0, q, k, v, k, meta, q.shape[-1] ** -0.5), meta


def reference(cache, q, k_new, v_new, table, past, window=None, soft_cap=None):
    """Dense attention over the first `past` slots the cache holds, then the fresh K/V (with a
    sliding window: each query over its last `window` of them; with a soft-cap, the scores
    capped)."""
    scale = q.shape[-1] ** -0.5
    if not isinstance(cache, KVPool):
        assert soft_cap is None  # the backend refuses a soft-cap over codes
        return reference_quantized_attention(q, k_new, v_new, cache, 0, table, past, scale,
                                             window=window)
    heads, dim = k_new.shape[1:]
    k_cache, v_cache = cache.layer(0)
    ids = torch.tensor(table, dtype=torch.long, device=DEVICE)
    k_past = k_cache[ids].reshape(-1, heads, dim)[:past]  # [past, Hkv, D]
    v_past = v_cache[ids].reshape(-1, heads, dim)[:past]
    return dense_reference_attention(q, torch.cat([k_past, k_new]), torch.cat([v_past, v_new]),
                                     scale, window, soft_cap)


def slots_of(table, first, count, bs):
    return [table[j // bs] * bs + j % bs for j in range(first, first + count)]


DECODE_LENS = {16: [1, 2, 15, 16, 17, 40], 64: [1, 5, 64, 65, 100]}
CASES = [  # (cache, block size, query heads over 2 KV heads: GQA 1, 2, 8, head dim, window)
    ("float32", 16, 2, 32, None), ("float32", 64, 4, 32, None), ("float32", 16, 16, 24, None),
    ("bfloat16", 64, 4, 64, None),
    ("int8", 16, 4, 32, None), ("int8", 64, 16, 32, None), ("fp8_e4m3", 16, 2, 32, None),
    ("fp8_e4m3", 64, 4, 32, None), ("fp8_e5m2", 16, 16, 32, None),
    # sliding windows: shorter than a block, than the tiles, than contexts; over codes too
    ("float32", 16, 4, 32, 5), ("float32", 64, 2, 32, 70), ("bfloat16", 16, 8, 32, 20),
    ("int8", 16, 4, 32, 7), ("fp8_e4m3", 64, 16, 32, 70), ("fp8_e5m2", 16, 2, 32, 1),
]
# with an attention logit soft-cap (Gemma 2's; 1.5 caps most of these scores): float pools
SOFT_CAP_CASES = [("float32", 16, 4, 32, None), ("float32", 64, 2, 32, 70),
                  ("bfloat16", 16, 8, 32, 20)]


@pytest.mark.parametrize("kind,bs,hq,dim,window,soft_cap",
                         [c + (None,) for c in CASES] + [c + (1.5,) for c in SOFT_CAP_CASES])
def test_prefill_and_decode_equal_dense_reference(kind, bs, hq, dim, window, soft_cap):
    """Step 1: every request's prompt as prefill chunks of one launch. Step 2: each request
    decodes its next token (contexts ending mid-block, several splits), one request continues
    its prompt over its cached prefix, a new request starts. With a window, each query over
    its last `window` slots; with a soft-cap, the scores capped."""
    rng, gen = random.Random(bs + hq), torch.Generator().manual_seed(bs * hq)
    lens = DECODE_LENS[bs]
    cont_past, cont_new, fresh = 30, 15, 19
    all_lens = lens + [cont_past + cont_new, fresh]
    cache = make_cache(kind, dim, bs, sum(cdiv(n, bs) for n in all_lens) + 2, window=window)
    blocks = list(range(cache.num_blocks))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(cdiv(n, bs))] for n in all_lens]
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    backend = new_backend(cache, soft_cap=soft_cap)

    def tokens(n, heads):
        x = torch.randn(n, heads, dim, generator=gen)
        x[torch.rand(x.shape, generator=gen) < 0.01] *= 8  # some large entries
        return x.to(device=DEVICE, dtype=dtype)

    def check(out, ref):
        tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=2e-5,
                                                                               rtol=1e-4)
        torch.testing.assert_close(out.float(), ref.float(), **tol)

    # step 1: the decoding requests' pasts and the continued request's first part
    firsts = [n - 1 for n in lens] + [cont_past]
    chunks, slots, start = [], [], 0
    for i, m in enumerate(firsts):
        if m:
            chunks.append(PrefillChunk(start, m, m, tables[i][:cdiv(m, bs)]))
            slots += slots_of(tables[i], 0, m, bs)
            start += m
    q, k, v = tokens(start, hq) * 2, tokens(start, HKV), tokens(start, HKV)
    out, _ = run_step(cache, backend, q, k, v, slots, [], [], chunks)
    for c in chunks:
        rows = slice(c.query_start, c.query_start + c.query_len)
        check(out[rows], reference(cache, q[rows], k[rows], v[rows], c.block_table, 0, window,
                                   soft_cap))

    # step 2: decodes first, then the continued request, then a new one
    nd, cont = len(lens), len(lens)
    slots = [slots_of(t, n - 1, 1, bs)[0] for t, n in zip(tables, lens)]
    slots += slots_of(tables[cont], cont_past, cont_new, bs) + slots_of(tables[-1], 0, fresh, bs)
    chunks = [PrefillChunk(nd, cont_new, cont_past + cont_new, tables[cont]),
              PrefillChunk(nd + cont_new, fresh, fresh, tables[-1])]
    total = len(slots)
    q, k, v = tokens(total, hq) * 3, tokens(total, HKV), tokens(total, HKV)  # peaked softmax
    out, meta = run_step(cache, backend, q, k, v, slots, tables[:nd], lens, chunks)
    assert meta.num_splits > 1
    for i, n in enumerate(lens):
        check(out[i:i + 1], reference(cache, q[i:i + 1], k[i:i + 1], v[i:i + 1], tables[i],
                                      n - 1, window, soft_cap))
    for c, past in zip(chunks, (cont_past, 0)):
        rows = slice(c.query_start, c.query_start + c.query_len)
        check(out[rows], reference(cache, q[rows], k[rows], v[rows], c.block_table, past,
                                   window, soft_cap))

    # the same decodes launched with more splits than the backend chooses (most of them empty
    # at these lengths) and another pipelining depth, as the GPU sweep tries
    wide = torch.empty_like(out[:nd])
    backend._decode.decode_attention(
        q[:nd], k[:nd], v[:nd], backend.paged_kv(0), meta.block_tables[:nd],
        meta.context_lens[:nd], wide, q.shape[-1] ** -0.5, num_splits=24, tile_n=16,
        num_stages=2, window=window, soft_cap=soft_cap)
    for i, n in enumerate(lens):
        check(wide[i:i + 1], reference(cache, q[i:i + 1], k[i:i + 1], v[i:i + 1], tables[i],
                                       n - 1, window, soft_cap))


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_graph_metadata_padded_batch_equals_the_unpadded_step(kind):
    """graph_decode_metadata + fill_graph_decode + forward over a batch padded past the step's
    decodes: the real rows equal the eager step's, the padded rows are zeros and write
    nothing; the next step refills the same tensors in place."""
    gen, bs, dim, hq = torch.Generator().manual_seed(5), 16, 32, 4
    eager_cache, graph_cache = make_cache(kind, dim, bs, 8), make_cache(kind, dim, bs, 8)
    past = torch.randn(8 * bs, HKV, dim, generator=gen).to(DEVICE)
    for cache in (eager_cache, graph_cache):  # the same cached past in every slot
        every = list(range(8 * bs))
        cache.write_layer(0, cache.begin_step(every, every), past, past * 0.5, past)
    eager, graph = new_backend(eager_cache), new_backend(graph_cache)
    meta = graph.graph_decode_metadata(max_batch=8, max_blocks=4)
    assert meta.slot_mapping.shape == (8,) and meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.shape == (8, 4) and meta.block_tables.dtype == torch.int32
    assert meta.context_lens.shape == (8,) and meta.context_lens.dtype == torch.int32
    storage = (meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
               meta.context_lens.data_ptr())
    tables = [[7, 2], [4, 0], [1, 5, 3]]
    for lens, batch in (([3, 17, 40], 5), ([4, 18], 3)):  # the second: fewer rows, same tensors
        n = len(lens)
        slots = [t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(tables, lens)]
        q = torch.randn(batch, hq, dim, generator=gen).to(DEVICE)
        k = torch.randn(batch, HKV, dim, generator=gen).to(DEVICE)
        v = torch.randn(batch, HKV, dim, generator=gen).to(DEVICE)
        want, _ = run_step(eager_cache, eager, q[:n], k[:n], v[:n], slots, tables[:n], lens, [])
        graph_cache.begin_step(slots, lens)
        graph.fill_graph_decode(meta, CommonAttentionMetadata(slots, n, tables[:n], lens, []),
                                batch)
        assert (meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
                meta.context_lens.data_ptr()) == storage
        assert meta.num_rows == batch
        assert meta.slot_mapping[n:batch].tolist() == [-1] * (batch - n)
        assert meta.context_lens[n:batch].tolist() == [0] * (batch - n)
        if DEVICE.type == "cuda":  # no host synchronisation in a graph step's forward
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = graph.forward(0, q, k, v, k, meta, dim ** -0.5)
        finally:
            if DEVICE.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got[:n], want, atol=1e-5, rtol=1e-4)
        assert torch.equal(got[n:], torch.zeros_like(got[n:]))
        for name, buf in cache_tensors(eager_cache).items():  # padded rows wrote nothing
            assert torch.equal(cache_tensors(graph_cache)[name], buf), name


def test_per_layer_block_tables_address_flat_layer_slices():
    """A step with per-layer block tables (each layer its own slices and context lengths, in
    flat layer-slice ids): each layer's output equals dense attention over its own slices."""
    gen, bs, dim, hq, nb = torch.Generator().manual_seed(7), 16, 32, 4, 6
    pool = make_cache("float32", dim, bs, nb, num_layers=2)
    k_flat, v_flat = pool.flat_layers()  # [2 * nb, bs, Hkv, D]
    k_flat.copy_(torch.randn(k_flat.shape, generator=gen))
    v_flat.copy_(torch.randn(v_flat.shape, generator=gen))
    # layer 0 kept 20 and 33 slots of the two requests, layer 1 (slices nb..) 9 and 40
    layer_tables = [[[0, 3], [5, 1, 2]], [[nb + 4], [nb + 0, nb + 2, nb + 5]]]
    layer_lens = [[20, 33], [9, 40]]
    backend = new_backend(pool)
    per_layer = []
    for tables, lens in zip(layer_tables, layer_lens):
        slots = slots_of(tables[0], lens[0] - 1, 1, bs) + slots_of(tables[1], lens[1] - 1, 1, bs)
        per_layer.append(CommonAttentionMetadata(slots, 2, tables, lens, []))
    meta = backend.build(CommonAttentionMetadata([0, 0], 2, [], [], [], per_layer=per_layer))
    for layer, (tables, lens) in enumerate(zip(layer_tables, layer_lens)):
        q = torch.randn(2, hq, dim, generator=gen).to(DEVICE)
        k = torch.randn(2, HKV, dim, generator=gen).to(DEVICE)
        v = torch.randn(2, HKV, dim, generator=gen).to(DEVICE)
        out = backend.forward(layer, q, k, v, k, meta, dim ** -0.5)
        for i, (table, n) in enumerate(zip(tables, lens)):
            ids = torch.tensor(table, device=DEVICE)
            keys = k_flat[ids].reshape(-1, HKV, dim)[:n]  # the new token's slot included
            values = v_flat[ids].reshape(-1, HKV, dim)[:n]
            assert torch.equal(keys[-1], k[i]) and torch.equal(values[-1], v[i])  # written
            ref = dense_reference_attention(q[i:i + 1], keys, values, dim ** -0.5)
            torch.testing.assert_close(out[i:i + 1], ref, atol=2e-5, rtol=1e-4)


def test_graph_metadata_rejects_what_it_cannot_hold():
    cache = make_cache("float32", 32, 16, 8)
    backend = new_backend(cache)
    meta = backend.graph_decode_metadata(4, 2)
    with pytest.raises(ValueError, match="between the step's 2 decodes and max_batch 4"):
        backend.fill_graph_decode(meta, CommonAttentionMetadata([1, 2], 2, [[0], [1]], [1, 1],
                                                                []), 1)
    with pytest.raises(ValueError, match="more than the graph's max_blocks 2"):
        backend.fill_graph_decode(meta, CommonAttentionMetadata([1], 1, [[0, 1, 2]], [40], []),
                                  2)
    with pytest.raises(ValueError, match="decodes only"):
        backend.fill_graph_decode(meta, CommonAttentionMetadata(
            [1, 2], 1, [[0]], [1], [PrefillChunk(1, 1, 1, [2])]), 2)
    with pytest.raises(ValueError, match="needs metadata from graph_decode_metadata"):
        backend.fill_graph_decode(backend.build(CommonAttentionMetadata(
            [1], 1, [[0]], [2], [], write_plan=torch.tensor([1]))), None, 1)
    with pytest.raises(ValueError, match="max_batch and max_blocks must be >= 1"):
        backend.graph_decode_metadata(0, 2)


def test_decode_launch_by_cache_format():
    """Codes of a 16-bit model decode in tiles of 128 keys over 16 waves of programs, the float
    pool (and any float32 model) in its prefill tile over 2; the split count fills the target,
    stays within the longest context's tiles and the kernels' MAX_SPLITS (brute force)."""
    from nanokv.kernels.triton.decode import MAX_SPLITS
    from nanokv.kernels.triton.paged_kv import FLOAT, INT8, FP8_E4M3

    launch = TritonPagedBackend.decode_launch
    assert launch(torch.bfloat16, FLOAT) == (64, 2)
    assert launch(torch.bfloat16, INT8) == launch(torch.float16, FP8_E4M3) == (128, 16)
    assert launch(torch.float32, INT8) == launch(torch.float32, FLOAT) == (32, 2)
    assert triton_paged.SPLIT_CAP == MAX_SPLITS
    backend = new_backend(make_cache("int8", 32, 16, 8))
    backend.decode_tile_n, backend.target_programs = 128, 16 * 132
    for rows in (1, 2, 16, 64, 256, 2000):
        for context in (1, 100, 128, 129, 4096, 32768):
            n = backend.decode_splits(rows, context)
            programs = rows * backend.num_kv_heads
            want = min(-(-16 * 132 // programs), -(-context // 128), MAX_SPLITS)
            assert n == max(1, want), (rows, context, n)
    assert backend.decode_splits(1, 32768) == MAX_SPLITS  # one request: every split
    assert backend.decode_splits(1, 129) == 2  # no split without a tile of keys
    assert backend.decode_splits(2000, 32768) == 1  # the GPU filled by requests alone


# ---- the GPU compiler -----------------------------------------------------------------------
def test_kernels_compile_for_a_gpu(tmp_path):
    """What the interpreter cannot check (types through loops and branches, dot shapes and
    operand types, constexpr use, registers): every kernel the backend launches for a bfloat16
    model over the float pool (also with an attention logit soft-cap) and int8 codes (each
    prefill view also with a sliding window), the
    KVQuant decode kernel over a 4-bit store and
    that store's quantize-on-write kernels (per token, per channel, and the staging and sink
    rows' copy for a bfloat16 staging and fp16 sinks), KIVI's quantize-on-write (keys per
    channel, values in groups), the read of the KVQuant blocks into a prefill's scratch cache
    (also from given staging rows) and the prefill over it in decode's view compiles to a cubin
    for sm_90 without a GPU, and none spills registers."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    done = subprocess.run([sys.executable, str(root / "scripts" / "compile_triton_kernels.py"),
                           "--quick"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    assert len(compiled) == 26, done.stdout
    assert sum(" _quantize_" in line for line in compiled) == 2, done.stdout  # KVQuant
    assert sum("kivi_quantize_blocks" in line for line in compiled) == 2, done.stdout
    assert sum("_scatter_rows_" in line for line in compiled) == 2, done.stdout
    assert sum("_kvquant_read_" in line for line in compiled) == 2, done.stdout
    # the float pool's, the codes' and the staged view's, each also with a sliding window
    assert sum("_prefill_kernel" in line for line in compiled) == 8, done.stdout
    assert sum("WINDOWED=True" in line for line in compiled) == 4, done.stdout
    capped = [line for line in compiled if "SOFT_CAP=0.0" not in line and "SOFT_CAP" in line]
    assert len(capped) == 4, done.stdout  # decode (1 split, 4) and prefill (window or not)
    spilled = [line for line in compiled if " stack 0 local 0 " not in line]
    assert not spilled, spilled  # registers spilled to local memory


# ---- the choice --------------------------------------------------------------------------------
def test_backend_choice(monkeypatch, caplog):
    """auto on CPU keeps the C kernels even under the interpreter; on CUDA it picks Triton for
    the float pool, int8 and fp8 (keys after RoPE) and the Triton KVQuant / KIVI decode for
    kivi, not for other stores; without Triton it says why and falls back."""
    from nanokv.attention.native_cpu import NativeCPUBackend
    from nanokv.attention.native_quantized import NativeQuantizedBackend
    from nanokv.layers.native_attention import NativeKernelUnavailable, load_decode_kernel

    cuda = torch.device("cuda")
    lay = KVLayout(1, HKV, 32, 16, torch.float32)
    pool = KVPool(lay, 4, CPU)
    int8 = make_kv_store("int8", lay, 4)
    try:
        load_decode_kernel()
        native = True
    except NativeKernelUnavailable:
        native = False
    assert select_backend("auto", pool, CPU)[0] is (NativeCPUBackend if native
                                                    else TorchPagedBackend)
    if native:
        assert select_backend("auto", int8, CPU)[0] is NativeQuantizedBackend
    if DEVICE.type == "cpu":  # the interpreter
        assert select_backend("triton", pool, CPU)[0] is TritonPagedBackend
    for cache in (pool, int8, make_kv_store("fp8_e5m2", lay, 4),
                  KVPool(KVLayout(1, HKV, 32, 16, torch.bfloat16), 4, CPU)):
        assert select_backend("auto", cache, cuda)[0] is TritonPagedBackend
    kivi = KIVIStore.from_settings(lay, 4, CPU, num_staging_blocks=1)
    pre_rope = make_kv_store("int8", lay, 4, pre_rope_keys=True)
    for cache in (kivi, pre_rope):
        reason, structural = TritonPagedBackend.why_not(cache, cuda)
        assert structural and "keys after RoPE" in reason
    # kivi: the Triton kernel over its codes (tests/unit/test_triton_kvquant.py)
    assert select_backend("auto", kivi, cuda)[0] is TritonQuantizedBackend
    assert select_backend("auto", pre_rope, cuda)[0] is QuantizedTorchBackend
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason, structural = TritonPagedBackend.why_not(pool, CPU)
    assert structural and "CUDA" in reason
    monkeypatch.setattr(triton_paged, "triton_unavailable",
                        lambda: "triton is not importable (ModuleNotFoundError)")
    reason, structural = TritonPagedBackend.why_not(pool, cuda)
    assert not structural and "not importable" in reason
    with caplog.at_level(logging.WARNING, logger="nanokv"):
        assert select_backend("auto", pool, cuda)[0] is TorchPagedBackend
    assert "triton not used (triton is not importable" in caplog.text


# ---- the engine ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kv,triton_backend", [
    (dict(kv_cache_dtype="auto"), TritonPagedBackend),
    (dict(kv_cache_dtype="int8"), TritonPagedBackend),
    (dict(kv_cache_dtype="kvquant", kv_quant_bits=4), TritonQuantizedBackend),
    (dict(kv_cache_dtype="kivi", kv_quant_bits=2), TritonQuantizedBackend)])
def test_engine_greedy_tokens_equal_the_default_backend(tiny_llama, kv, triton_backend,
                                                        monkeypatch):
    """Chunked prefill next to decodes, through the engine: the same greedy tokens as the
    backend auto picks on CPU (the PyTorch path on a GPU, where auto is this one); kvquant and
    kivi through the Triton KVQuant / KIVI decode (tests/unit/test_triton_kvquant.py), and
    through their Triton quantize-on-write (tests/unit/test_kvquant_triton_write.py,
    test_kivi_triton_write.py)."""
    from nanokv import LLM, SamplingParams

    prompts = [list(range(1, 40)), list(range(5, 22))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference_backend = "auto" if DEVICE.type == "cpu" else "torch"
    tokens = {}
    quantized = kv["kv_cache_dtype"] in ("kvquant", "kivi")
    writes = {"quantize_tokens": 0, "quantize_blocks": 0, "scatter_rows": 0}
    if quantized:  # count the Triton write launches
        from nanokv.kernels.triton import kivi_write, kvquant_write

        module = kvquant_write if kv["kv_cache_dtype"] == "kvquant" else kivi_write

        def counted(name, fn):
            def call(*args, **kwargs):
                writes[name] += 1
                return fn(*args, **kwargs)
            return call

        for owner, name in ((module, "quantize_blocks"), (kvquant_write, "quantize_tokens"),
                            (kvquant_write, "scatter_rows")):
            monkeypatch.setattr(owner, name, counted(name, getattr(owner, name)))
    for backend in (reference_backend, "triton"):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=16, num_kv_blocks=16,
                  max_num_batched_tokens=24, max_num_seqs=2, attention_backend=backend, **kv)
        if backend == "triton" and quantized:
            llm.engine.kv_cache.triton_write = True  # as on CUDA
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "triton":
            assert type(llm.engine.attention_backend) is triton_backend
    assert tokens["triton"] == tokens[reference_backend]
    if kv["kv_cache_dtype"] == "kvquant":  # values every step and layer; key blocks filled
        assert writes["quantize_tokens"] > 0 and writes["quantize_blocks"] > 0, writes
    if kv["kv_cache_dtype"] == "kivi":  # blocks filled, partial blocks staged
        assert writes["quantize_blocks"] > 0 and writes["scatter_rows"] > 0, writes


def test_engine_with_a_sliding_window_equals_the_default_backend(tmp_path):
    """A model with a 12-token window on every layer (Mistral's sliding_window), chunked
    prefill next to decodes and the blocks behind the window freed: the Triton kernels give
    the greedy tokens of the backend auto picks on CPU (checked against Hugging Face in
    tests/model/test_sliding_window.py)."""
    from tiny_models import build_tiny_model

    from nanokv import LLM, SamplingParams

    model = build_tiny_model(str(tmp_path / "mistral"), "mistral", tokenizer=False,
                             max_position_embeddings=256, sliding_window=12)
    prompts = [list(range(1, 40)), list(range(5, 22))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference_backend = "auto" if DEVICE.type == "cpu" else "torch"
    tokens = {}
    for backend in (reference_backend, "triton"):
        llm = LLM(model, skip_tokenizer_init=True, block_size=16, num_kv_blocks=16,
                  max_model_len=256, max_num_batched_tokens=24, max_num_seqs=2,
                  attention_backend=backend, device=DEVICE.type)
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "triton":
            assert type(llm.engine.attention_backend) is TritonPagedBackend
    assert tokens["triton"] == tokens[reference_backend]
