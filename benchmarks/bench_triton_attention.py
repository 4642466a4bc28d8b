"""One layer's attention step on CUDA: the Triton backend (paged cache read in place) against the
PyTorch backend (blocks gathered into padded copies, masked SDPA), measured in the same run.

Shapes: Qwen3-0.6B's attention (16 query heads, 8 KV heads, head dim 128), block size 16,
bfloat16, the issue's workload: --requests decodes with contexts drawn from 200..2048 tokens
(prompt 100-1024 plus output 100-1024), and a prefill step of --prefill-chunks chunks of
--chunk-len tokens, half of them over a cached prefix. Caches: the float pool, int8 / fp8
stores (the PyTorch path dequantizes the blocks it reads), and a KVQuant 4-bit store (keys
before RoPE): for it the attention alone, without the write (its blocks take their slots once,
in order, so the write is not repeated): decode, the Triton kernel over the codes against the
PyTorch path; prefill, the Triton backend's (prefixes decoded into a scratch cache, then the
paged prefill kernel) against the PyTorch path's (each chunk's prefix dequantized, masked SDPA),
their outputs compared first. Each timing covers the backend's
`build` (the step's metadata, once per step) plus one layer's `forward` (write + attention);
median of --repeats rounds after a warm-up, every method once per round in turn. Reported
alongside: the decode's effective read bandwidth (the KV bytes the requests' contexts hold /
time).

    PYTHONPATH=. python benchmarks/bench_triton_attention.py --out docs/results/gpu

`--sweep-contexts` times the decode attention alone instead (--inner calls back to back a round:
at one request a call is bound by Python's launch cost, about 0.1-0.15 ms), and with
`--sweep-variants` each kernel's launch settings around the backend's defaults.

`--device cpu` with TRITON_INTERPRET=1 dry-runs the script's logic on tiny shapes (no figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanokv.attention.common import CommonAttentionMetadata, PrefillChunk  # noqa: E402
from nanokv.attention.quantized import QuantizedTorchBackend  # noqa: E402
from nanokv.attention.torch_paged import TorchPagedBackend  # noqa: E402
from nanokv.attention.triton_paged import TritonPagedBackend  # noqa: E402
from nanokv.attention.triton_quantized import TritonQuantizedBackend  # noqa: E402
from nanokv.cache.kv_pool import KVLayout, KVPool  # noqa: E402
from nanokv.kernels.triton.decode import MAX_SPLITS  # noqa: E402
from nanokv.layers.rotary import RotaryEmbedding  # noqa: E402
from nanokv.quant import KVQuantConfig, KVQuantStore, make_kv_store  # noqa: E402
from nanokv.layers.attention import dense_reference_attention  # noqa: E402
from nanokv.quant.attention import (  # noqa: E402
    quantized_paged_attention,
    read_staged_pasts,
    reference_quantized_attention,
)
from nanokv.utils import cdiv  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fns: dict, repeats: int, device: torch.device, inner: int = 1) -> dict:
    """Median seconds per call, rounds taking every fn in turn after one warm-up each; a round
    times `inner` calls back to back between two synchronisations."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            times[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(t) for name, t in times.items()}


class _Rope:
    rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}


def make_cache(kind: str, layout: KVLayout, num_blocks: int, device: torch.device,
               max_position: int, staging: int):
    if kind == "auto":
        return KVPool(layout, num_blocks, device)
    if kind == "kvquant":
        store = KVQuantStore(layout, num_blocks, KVQuantConfig(bits=4),
                             num_staging_blocks=staging, device=device)
        store.rotary = RotaryEmbedding(_Rope(), layout.head_dim, max_position)
        store.rotary.build_tables(device)
        return store
    return make_kv_store(kind, layout, num_blocks, device)


def step_fn(backend_cls, cache, common, q, k, v, device, max_position: int):
    backend = backend_cls(cache, device)
    scale = q.shape[-1] ** -0.5
    positions = [s % max_position for s in common.slot_mapping]  # (RoPE of pre-RoPE keys)

    def run():
        common.write_plan = cache.begin_step(common.slot_mapping, positions)
        backend.forward(0, q, k, v, k, backend.build(common), scale)
    return run


def cached_past(common) -> list[tuple[list[int], int]]:
    """(block table, cached slots before this step) of each request of the step."""
    return [(t, n - 1) for t, n in zip(common.decode_block_tables, common.decode_context_lens)] \
        + [(c.block_table, c.context_len - c.query_len) for c in common.prefills]


def fill_past(store, common, max_position: int, gen, device) -> None:
    """Write each request's cached tokens (a decode's all but its last, a prefill chunk's
    prefix) through the store, in slot order (a KVQuant block fills in order; its partial last
    block is staged). `gen` is a generator on `device` (the values are drawn there)."""
    bs = store.layout.block_size
    slots = [t[j // bs] * bs + j % bs for t, n in cached_past(common) for j in range(n)]
    heads, dim = store.layout.num_kv_heads, store.layout.head_dim
    for start in range(0, len(slots), 65536):
        part = slots[start:start + 65536]
        plan = store.begin_step(part, [s % max_position for s in part])
        k, v = (torch.randn(len(part), heads, dim, generator=gen, device=device)
                .to(store.layout.dtype) for _ in range(2))
        store.write_layer(0, plan, k, v, k)


def decode_only_fns(store, common, q, k, v, device) -> dict:
    """The decode attention alone (no write: a KVQuant block takes its slots once, in order):
    the PyTorch path (dequantize, then attend) and the Triton kernel over the codes."""
    scale = q.shape[-1] ** -0.5
    common.write_plan = SimpleNamespace(slot_mapping=torch.empty(0, dtype=torch.long,
                                                                 device=device))
    meta = QuantizedTorchBackend(store, device).build(common).by_window[None]
    return {"torch": lambda: quantized_paged_attention(q, k, v, None, store, 0, meta, None,
                                                       scale, store.rope),
            "triton": sweep_fn(store, common.decode_block_tables, common.decode_context_lens,
                               q, k, v, device)}


def prefill_only_fns(store, common, q, k, v, device) -> dict:
    """A KVQuant store's prefill attention alone: the PyTorch path (each chunk's blocks
    dequantized, then decode's view over them) and the Triton backend's (the blocks decoded
    into a scratch cache, then the paged prefill kernel over every chunk), each step's metadata
    included. The chunks' K/V are written once first (decode's view reads them back), the
    pasts' partial blocks read as staged before that write. Their outputs are compared once
    first."""
    scale = q.shape[-1] ** -0.5
    positions = [p.context_len - p.query_len + j for p in common.prefills
                 for j in range(p.query_len)]
    common.write_plan = plan = store.begin_step(common.slot_mapping, positions)
    torch_backend, triton_backend = QuantizedTorchBackend(store, device), \
        TritonQuantizedBackend(store, device)
    meta = torch_backend.build(common).by_window[None]
    staged_pasts = read_staged_pasts(store, 0, meta.prefills, plan, store.rope)
    pre = triton_backend.prefill_chunks(common)
    triton_backend.read_staged_pasts(0, pre)
    store.write_layer(0, plan, k, v, k)

    def torch_path():
        meta = torch_backend.build(common).by_window[None]
        return quantized_paged_attention(q, k, v, None, store, 0, meta, plan, scale, store.rope,
                                         None, staged_pasts)

    def triton_path():
        out = torch.empty_like(q)
        triton_backend.attend_prefill(0, q, k, v, k, plan.positions, pre, out, scale)
        return out

    error = (triton_path().float() - torch_path().float()).abs().max().item()
    print(json.dumps({"kvquant_prefill_max_abs_diff": error}))
    if not error < 0.05:  # bf16 outputs of unit-scale attention
        raise SystemExit(f"the Triton prefill over the KVQuant store differs from the PyTorch "
                         f"path by {error}")
    return {"torch": torch_path, "triton": triton_path}


def decode_step(args, rng, num_blocks) -> tuple[CommonAttentionMetadata, int]:
    """Requests with random contexts in their own shuffled blocks; returns the step and the
    number of cached tokens it reads."""
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    lens = [rng.randint(args.min_context, args.max_context) for _ in range(args.requests)]
    tables = [[blocks.pop() for _ in range(cdiv(n, args.block_size))] for n in lens]
    slots = [t[(n - 1) // args.block_size] * args.block_size + (n - 1) % args.block_size
             for t, n in zip(tables, lens)]
    return CommonAttentionMetadata(slots, len(lens), tables, lens, []), sum(lens)


def prefill_step(args, rng, blocks: range) -> CommonAttentionMetadata:
    """Chunks of --chunk-len tokens, every other one over a cached prefix as long, in their
    own shuffled blocks out of `blocks`."""
    blocks = list(blocks)
    rng.shuffle(blocks)
    bs, n = args.block_size, args.chunk_len
    chunks, slots = [], []
    for c in range(args.prefill_chunks):
        past = n if c % 2 else 0  # half continue a prompt over their cached prefix
        table = [blocks.pop() for _ in range(cdiv(past + n, bs))]
        chunks.append(PrefillChunk(c * n, n, past + n, table))
        slots += [table[j // bs] * bs + j % bs for j in range(past, past + n)]
    return CommonAttentionMetadata(slots, 0, [], [], chunks)


def reference_decode(cache, tables, lens, q, k, v, scale) -> torch.Tensor:
    """The oracle of each request's decode: its past read back from the cache (a quantized
    store's dequantized, `reference_quantized_attention`), its own token from k, v, dense
    attention in float64 (`dense_reference_attention`): [B, Hq, D] float32."""
    bs, out = cache.layout.block_size, []
    for b, (table, n) in enumerate(zip(tables, lens)):
        qb, kb, vb = (x[b:b + 1].float() for x in (q, k, v))  # [1, H, D]
        if isinstance(cache, KVPool):
            ids = torch.tensor(table[:cdiv(n, bs)], dtype=torch.long, device=q.device)
            kc, vc = (x[ids].reshape(-1, *x.shape[2:])[:n - 1].float()  # [n - 1, Hkv, D]
                      for x in cache.layer(0))
            out.append(dense_reference_attention(qb, torch.cat([kc, kb]), torch.cat([vc, vb]),
                                                 scale)[0])
        else:
            out.append(reference_quantized_attention(qb, kb, vb, cache, 0, table, n - 1, scale,
                                                     cache.rope)[0])
    return torch.stack(out)


def sweep_fn(cache, tables, lens, q, k, v, device, variant: dict | None = None):
    """The Triton decode attention alone over `cache` (no write; the own token from k, v).
    variant: launch settings in place of the backend's own (num_splits, num_warps, num_stages;
    tile_n for the float / int8 / fp8 kernel, unroll for the KVQuant / KIVI one)."""
    scale = q.shape[-1] ** -0.5
    bs = cache.layout.block_size
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
    common = CommonAttentionMetadata(slots, len(lens), tables, lens, [])
    common.write_plan = torch.empty(0, dtype=torch.long, device=device)
    out = torch.empty_like(q)
    quantized = isinstance(cache, KVQuantStore)
    backend = (TritonQuantizedBackend if quantized else TritonPagedBackend)(cache, device)
    step = backend.build(common)
    launch = {"num_splits": step.num_splits, "num_warps": backend.num_warps,
              "num_stages": backend.num_stages,
              **({"unroll": backend.unroll} if quantized else {"tile_n": backend.decode_tile_n}),
              **(variant or {})}
    if quantized:
        views = backend.layer_views(0)

        def run():
            backend._kernels.kvquant_decode_attention(
                q, k, v, views, step.block_tables, step.context_lens, out, scale,
                launch["num_splits"], launch["num_warps"], launch["num_stages"],
                launch["unroll"])
            return out
        return run
    kv = backend.paged_kv(0)

    def run():
        backend._decode.decode_attention(q, k, v, kv, step.block_tables, step.context_lens, out,
                                         scale, launch["num_splits"], launch["tile_n"],
                                         launch["num_warps"], launch["num_stages"])
        return out
    return run


def launch_variants(cache) -> list[dict]:
    """The launch settings --sweep-variants tries beside the backend's own: other split counts,
    the compiler's pipelining depth (num_stages; Triton's default is 3, 1 none), the warps, the
    float / int8 / fp8 kernel's key tile, and a few combinations of them (variants equal to the
    default launch are timed too: a measure of the noise)."""
    variants = [{"num_splits": n} for n in (3, 16, 32, MAX_SPLITS)]
    variants += [{"num_stages": n} for n in (1, 2)]
    if isinstance(cache, KVQuantStore):  # and blocks a loop iteration (unroll)
        return variants + [{"num_warps": w} for w in (2, 8)] + [
            {"unroll": 2}, {"unroll": 2, "num_warps": 8}, {"unroll": 4, "num_warps": 8},
            {"unroll": 2, "num_splits": 32}]
    return variants + [{"tile_n": t} for t in (64, 128, 256)] + [
        {"num_warps": 8}, {"tile_n": 256, "num_warps": 8}, {"tile_n": 64, "num_stages": 1},
        {"tile_n": 64, "num_stages": 1, "num_splits": 32}, {"tile_n": 128, "num_splits": 3},
        {"tile_n": 128, "num_warps": 8, "num_stages": 1}]


def time_variants(args, caches, tables, n, c, device, dtype, gen) -> list[dict]:
    """Each cache's launch variants at n requests x c tokens against its own default launch,
    measured in the same rounds."""
    part = [t[:cdiv(c, args.block_size)] for t in tables[:n]]
    lens = [c] * n
    q, k, v = (torch.randn(n, h, args.head_dim, generator=gen, device=device).to(dtype)
               for h in (args.q_heads, args.kv_heads, args.kv_heads))
    rows = []
    for kind, cache in caches.items():
        fns = {"default": sweep_fn(cache, part, lens, q, k, v, device)}
        for variant in launch_variants(cache):
            name = " ".join(f"{key}={value}" for key, value in variant.items())
            fns[name] = sweep_fn(cache, part, lens, q, k, v, device, variant)
        want = fns["default"]().clone()
        t = timed(fns, args.repeats, device, args.inner)
        for name, fn in fns.items():
            rows.append({"kv_cache_dtype": kind, "requests": n, "context": c, "launch": name,
                         "triton_ms": t[name] * 1e3, "vs_default": t[name] / t["default"],
                         "max_abs_diff_vs_default": (fn().float() - want.float()).abs().max()
                         .item()})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_sweep(args, device, dtype, rng, gen) -> None:
    """Decode attention alone, every request at the same context length, for each batch size
    and length: each cache's Triton kernel against the float pool's, measured in the same
    rounds; outputs checked against a dense float32 reference read back from the cache."""
    bs, n_max, c_max = args.block_size, max(args.sweep_requests), max(args.sweep_contexts)
    per_request = cdiv(c_max, bs)
    layout = KVLayout(1, args.kv_heads, args.head_dim, bs, dtype)
    num_blocks = n_max * per_request + 1
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(per_request)] for _ in range(n_max)]
    full = CommonAttentionMetadata([], n_max, tables, [c_max] * n_max, [])
    caches = {}
    for kind in args.kv_dtypes:  # every request's first c_max - 1 tokens, written once
        caches[kind] = make_cache(kind, layout, num_blocks, device, c_max, n_max)
        fill_past(caches[kind], full, c_max, gen, device)
    scale = args.head_dim ** -0.5
    rows = []
    for n in args.sweep_requests:
        for c in args.sweep_contexts:
            part = [t[:cdiv(c, bs)] for t in tables[:n]]
            lens = [c] * n
            q, k, v = (torch.randn(n, h, args.head_dim, generator=gen, device=device).to(dtype)
                       for h in (args.q_heads, args.kv_heads, args.kv_heads))
            fns = {kind: sweep_fn(cache, part, lens, q, k, v, device)
                   for kind, cache in caches.items()}
            errors = {}
            for kind, cache in caches.items():  # also the warm-up (compiles)
                want = reference_decode(cache, part, lens, q, k, v, scale)
                errors[kind] = (fns[kind]().float() - want).abs().max().item()
            t = timed(fns, args.repeats, device, args.inner)
            base = t.get(args.kv_dtypes[0])
            for kind, cache in caches.items():
                per_token = cache.nbytes / (cache.num_blocks * bs)
                row = {"kv_cache_dtype": kind, "requests": n, "context": c,
                       "triton_ms": t[kind] * 1e3, "vs_first": t[kind] / base,
                       "cache_bytes_per_token": per_token,
                       "read_GBps": per_token * n * c / t[kind] / 1e9,
                       "max_abs_err": errors[kind]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    first = args.kv_dtypes[0]
    lines = [f"| KV cache | requests | context | Triton decode ms | time vs {first} | "
             "cache bytes/token | GB/s | max abs err vs dense |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kv_cache_dtype']} | {r['requests']} | {r['context']} | "
                     f"{r['triton_ms']:.4f} | {r['vs_first']:.2f}x | "
                     f"{r['cache_bytes_per_token']:.0f} | {r['read_GBps']:.0f} | "
                     f"{r['max_abs_err']:.1e} |")
    print("\n".join(lines))
    write_results(args, device, "triton_decode_sweep", rows, lines)
    if not args.sweep_variants:
        return
    variants = []
    for n in sorted({min(args.sweep_requests), n_max}):
        variants += time_variants(args, caches, tables, n, c_max, device, dtype, gen)
    lines = ["| KV cache | requests | context | launch | Triton decode ms | time vs default | "
             "max abs diff vs default |", "|---|---|---|---|---|---|---|"]
    for r in variants:
        lines.append(f"| {r['kv_cache_dtype']} | {r['requests']} | {r['context']} | "
                     f"{r['launch']} | {r['triton_ms']:.4f} | {r['vs_default']:.2f}x | "
                     f"{r['max_abs_diff_vs_default']:.1e} |")
    print("\n".join(lines))
    write_results(args, device, "triton_launch_variants", variants, lines)


def write_results(args, device, name: str, rows: list, lines: list) -> None:
    if not args.out:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv[1:], "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else "cpu (interpreter)", "torch": torch.__version__}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-context", type=int, default=200)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prefill-chunks", type=int, default=16)
    p.add_argument("--chunk-len", type=int, default=512)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-dtypes", nargs="+", default=["auto", "int8", "fp8_e4m3", "kvquant"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--inner", type=int, default=None, metavar="N",
                   help="with --sweep-contexts: calls timed back to back in each round (default "
                   "10 on CUDA, 1 on CPU)")
    p.add_argument("--out", default=None, help="directory for triton_attention.{json,md} "
                   "(triton_decode_sweep.{json,md} with --sweep-contexts)")
    p.add_argument("--sweep-contexts", type=int, nargs="+", default=None, metavar="TOKENS",
                   help="instead of the step above: the Triton decode attention alone at each "
                   "of these context lengths, every request the same length, each cache "
                   "against the float pool (e.g. 1024 4096 16384 32768)")
    p.add_argument("--sweep-requests", type=int, nargs="+", default=[1, 16], metavar="N",
                   help="with --sweep-contexts: the batch sizes (default 1 16)")
    p.add_argument("--sweep-variants", action="store_true",
                   help="with --sweep-contexts: also each kernel's launch settings around its "
                   "defaults (splits up to 64, pipelining depth, warps; the key tile, or the "
                   "KVQuant kernel's blocks an iteration) at the longest context, for the "
                   "fewest and the most requests (triton_launch_variants.{json,md})")
    args = p.parse_args(argv)
    for name in ("requests", "min_context", "max_context", "prefill_chunks", "chunk_len",
                 "q_heads", "kv_heads", "head_dim", "block_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.min_context > args.max_context:
        p.error("--min-context must not exceed --max-context")
    if args.q_heads % args.kv_heads:
        p.error("--q-heads must be a multiple of --kv-heads")
    if args.sweep_contexts and min(args.sweep_contexts + args.sweep_requests) < 1:
        p.error("--sweep-contexts and --sweep-requests take positive numbers")
    if args.inner is not None and args.inner < 1:
        p.error("--inner must be at least 1")
    if args.sweep_variants and not args.sweep_contexts:
        p.error("--sweep-variants needs --sweep-contexts")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (--device cpu with TRITON_INTERPRET=1 dry-runs the logic)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("on CPU the Triton kernels need TRITON_INTERPRET=1")
    args.inner = args.inner or (10 if device.type == "cuda" else 1)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    device_gen = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.sweep_contexts:
        return decode_sweep(args, device, dtype, rng, device_gen)
    layout = KVLayout(1, args.kv_heads, args.head_dim, args.block_size, dtype)
    per_request = cdiv(args.max_context, args.block_size)
    decode_blocks = args.requests * per_request
    num_blocks = decode_blocks + args.prefill_chunks * 2 * cdiv(args.chunk_len, args.block_size)
    decode, tokens = decode_step(args, rng, decode_blocks)  # the two steps' blocks disjoint
    prefill = prefill_step(args, rng, range(decode_blocks, num_blocks))

    def qkv(t):
        shapes = ((t, args.q_heads), (t, args.kv_heads), (t, args.kv_heads))
        return [torch.randn(*s, args.head_dim, generator=gen).to(device, dtype) for s in shapes]

    rows = []
    max_position = args.max_context + args.chunk_len
    for kind in args.kv_dtypes:
        cache = make_cache(kind, layout, num_blocks, device, max_position,
                           args.requests + args.prefill_chunks)
        elem = 1 if kind != "auto" else torch.empty(0, dtype=dtype).element_size()
        read = 2 * tokens * args.kv_heads * (args.head_dim * elem + (4 if kind != "auto" else 0))
        reference = TorchPagedBackend if kind == "auto" else QuantizedTorchBackend
        triton_cls = TritonPagedBackend
        if kind == "kvquant":
            fill_past(cache, decode, max_position, device_gen, device)
            fill_past(cache, prefill, max_position, device_gen, device)
        for name, common in (("decode", decode), ("prefill", prefill)):
            q, k, v = qkv(len(common.slot_mapping))
            fns = {"torch": step_fn(reference, cache, common, q, k, v, device, max_position),
                   "triton": step_fn(triton_cls, cache, common, q, k, v, device, max_position)}
            if kind == "kvquant":
                make = decode_only_fns if name == "decode" else prefill_only_fns
                fns = make(cache, common, q, k, v, device)
            t = timed(fns, args.repeats, device)
            row = {"kv_cache_dtype": kind, "step": name, "torch_ms": t["torch"] * 1e3,
                   "triton_ms": t["triton"] * 1e3, "speedup": t["torch"] / t["triton"]}
            if name == "decode" and kind != "kvquant":
                row["triton_read_GBps"] = read / t["triton"] / 1e9
            rows.append(row)
            print(json.dumps(row))
    lines = ["| KV cache | step | PyTorch ms | Triton ms | speed-up | Triton decode read GB/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        gbps = f"{r['triton_read_GBps']:.0f}" if "triton_read_GBps" in r else "-"
        lines.append(f"| {r['kv_cache_dtype']} | {r['step']} | {r['torch_ms']:.3f} | "
                     f"{r['triton_ms']:.3f} | {r['speedup']:.2f}x | {gbps} |")
    print("\n".join(lines))
    write_results(args, device, "triton_attention", rows, lines)


if __name__ == "__main__":
    main()
