"""Decode attention time of one layer: the float32 C kernel vs the quantized C kernels vs the
PyTorch dequantize-then-attend path, measured in the same run.

For each (requests, context) pair: a Qwen3-0.6B-shaped layer (16 query heads, 8 KV heads, head
dim 128, by default), block size 256, every request with `context` cached slots in its own
consecutive blocks. Timed per call (one layer, one decode step, the step's metadata built
beforehand), median of --repeats rounds after one warm-up, every method once per round (in turn,
so other processes' load falls on all alike):

  float32           nanokv.layers.native_attention.native_decode_attention over a float32 pool
  <dtype> native    the quantized store's C kernel (backend `native`, NativeQuantizedBackend)
  <dtype> torch     quantized_paged_attention (backend `torch`: dequantize the blocks, then SDPA),
                    only where requests x context <= --torch-max-slots (its float copy of the
                    whole context costs memory)

Stores are filled through their own write path (KVQuant: real statistics, outliers, sinks,
staged partial blocks; KIVI: its partial block staged) for the first request; the other
requests get copies of its blocks (`copy_blocks`) at their own addresses, so every request is
read from memory.

    .venv/bin/python benchmarks/bench_decode_attention.py --requests 1 16 \\
        --contexts 1024 4096 16384 32768 --max-slots 262144 --repeats 5 --num-threads 2 \\
        --out docs/results/kvquant

Ratios are to float32 in the same run (the machine is shared: absolute times are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from types import SimpleNamespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanokv.attention.common import CommonAttentionMetadata  # noqa: E402
from nanokv.attention.native_quantized import NativeQuantizedBackend  # noqa: E402
from nanokv.attention.quantized import QuantizedTorchBackend  # noqa: E402
from nanokv.cache.kv_pool import KVLayout  # noqa: E402
from nanokv.layers.native_attention import build_decode_runs, native_decode_attention  # noqa
from nanokv.layers.rotary import RotaryEmbedding  # noqa: E402
from nanokv.quant import KVQuantConfig, KVQuantStore, make_kv_store  # noqa: E402
from nanokv.quant.attention import quantized_paged_attention  # noqa: E402
from nanokv.quant.kivi_store import KIVIStore  # noqa: E402
from nanokv.utils import cdiv  # noqa: E402

STORES = [("int8", "int8", None), ("fp8_e4m3", "fp8_e4m3", None), ("fp8_e5m2", "fp8_e5m2", None),
          ("kvquant 4-bit", "kvquant", 4), ("kvquant 3-bit", "kvquant", 3),
          ("kvquant 2-bit", "kvquant", 2), ("kivi 4-bit", "kivi", 4), ("kivi 2-bit", "kivi", 2)]


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


class _RopeConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}


def timed_round_robin(fns: dict, repeats: int, clock=time.perf_counter) -> dict:
    """Median seconds of each fn over `repeats` rounds after one warm-up each; the rounds take
    every fn in turn, so load from other processes falls on all of them alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def make_store(args, dtype: str, bits: int | None, num_blocks: int, num_requests: int,
               rotary: RotaryEmbedding):
    layout = KVLayout(1, args.kv_heads, args.head_dim, args.block_size, torch.float32)
    if dtype == "kvquant":
        store = KVQuantStore(layout, num_blocks, KVQuantConfig(bits=bits),
                             num_staging_blocks=num_requests + 1)
    elif dtype == "kivi":
        store = KIVIStore.from_settings(layout, num_blocks, "cpu", bits=bits,
                                        num_staging_blocks=num_requests + 1)
    else:
        store = make_kv_store(dtype, layout, num_blocks)
    store.rotary = rotary
    return store


def fill(store, context: int, num_requests: int, gen: torch.Generator) -> list[list[int]]:
    """Request 0 written through the store in chunks; the others copies of its blocks."""
    per = cdiv(context, store.block_size)
    heads, dim = store.layout.num_kv_heads, store.layout.head_dim
    tables = [list(range(r * per, (r + 1) * per)) for r in range(num_requests)]
    chunk = 4096
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        slots = list(range(start, start + n))  # request 0: blocks 0..per-1
        plan = store.plan_write(slots, slots)
        k = torch.randn(n, heads, dim, generator=gen)
        store.write(0, plan, k, torch.randn(n, heads, dim, generator=gen))
    for r in range(1, num_requests):
        store.copy_blocks([(j, tables[r][j]) for j in range(per)])
    return tables


def bench_pair(args, num_requests: int, context: int, rotary, log) -> dict:
    gen = torch.Generator().manual_seed(0)
    hq, hkv, dim, bs = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    scale = dim ** -0.5
    per = cdiv(context, bs)
    num_blocks = num_requests * per + 1
    tables = [list(range(r * per, (r + 1) * per)) for r in range(num_requests)]
    lens = [context] * num_requests
    q = torch.randn(num_requests, hq, dim, generator=gen)
    k_new = torch.randn(num_requests, hkv, dim, generator=gen)
    v_new = torch.randn(num_requests, hkv, dim, generator=gen)
    row = {"requests": num_requests, "context": context}

    k_pool = torch.randn(num_blocks, bs, hkv, dim, generator=gen)
    v_pool = torch.randn(num_blocks, bs, hkv, dim, generator=gen)
    runs = build_decode_runs(tables, lens, bs)
    fns = {"float32": lambda: native_decode_attention(q, k_pool, v_pool, runs, scale)}
    common = CommonAttentionMetadata([0] * num_requests, num_requests, tables, lens, [])
    # nothing is written in the timed calls: an empty write plan
    common.write_plan = SimpleNamespace(slot_mapping=torch.empty(0, dtype=torch.long))
    keep = []
    for label, dtype, bits in STORES:
        if label not in args.stores:
            continue
        store = make_store(args, dtype, bits, num_blocks, num_requests, rotary)
        fill(store, context, num_requests, gen)
        native = NativeQuantizedBackend(store, torch.device("cpu"))
        step = native.build(common).decodes[None]
        fns[f"{label} native"] = partial(native.decode, 0, q, k_new, v_new, step, scale)
        if num_requests * context <= args.torch_max_slots:
            meta = QuantizedTorchBackend(store, torch.device("cpu")).build(common).by_window[None]
            fns[f"{label} torch"] = partial(quantized_paged_attention, q, k_new, v_new, None,
                                            store, 0, meta, None, scale, store.rope)
        keep.append(store)
    row.update(timed_round_robin(fns, args.repeats, CLOCKS[args.clock]))
    log(f"  {num_requests} x {context}: " + ", ".join(
        f"{name} {t * 1e3:.2f} ms" for name, t in row.items() if isinstance(t, float)))
    return row


def markdown(rows: list[dict]) -> list[str]:
    labels = [label for label, _, _ in STORES if any(f"{label} native" in r for r in rows)]
    head = "| requests x context | float32 ms | " + " | ".join(
        f"{lb} native ms (vs f32) | {lb} torch ms (vs f32)" for lb in labels) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(labels))]
    for r in rows:
        f32 = r["float32"]
        cells = [f"{r['requests']} x {r['context']}", f"{f32 * 1e3:.2f}"]
        for lb in labels:
            for kind in ("native", "torch"):
                t = r.get(f"{lb} {kind}")
                cells.append("-" if t is None else f"{t * 1e3:.2f} ({t / f32:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--max-slots", type=int, default=262144,
                   help="skip (requests, context) pairs with more cached slots than this")
    p.add_argument("--torch-max-slots", type=int, default=65536)
    p.add_argument("--stores", nargs="+", default=[label for label, _, _ in STORES],
                   choices=[label for label, _, _ in STORES], metavar="STORE",
                   help="which stores to time (default: all): "
                        + ", ".join(repr(label) for label, _, _ in STORES))
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: elapsed time; thread: CPU time of the calling thread (not the "
                        "time other processes held the core; one thread only: run with "
                        "OMP_NUM_THREADS=1 --num-threads 1)")
    p.add_argument("--out", default=None, help="directory for decode_attention.{json,md}")
    args = p.parse_args(argv)
    if args.clock == "thread" and (args.num_threads != 1
                                   or os.environ.get("OMP_NUM_THREADS") != "1"):
        p.error("--clock thread measures one thread: use it with --num-threads 1 and "
                "OMP_NUM_THREADS=1 in the environment")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    rotary = RotaryEmbedding(_RopeConfig(), args.head_dim, max(args.contexts) + 16)
    rows = []
    t0 = time.perf_counter()
    for n in args.requests:
        for context in args.contexts:
            if n * context > args.max_slots:
                print(f"  {n} x {context}: skipped (> --max-slots {args.max_slots})")
                continue
            rows.append(bench_pair(args, n, context, rotary, print))
    lines = markdown(rows)
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"argv": sys.argv[1:], "threads": torch.get_num_threads(), "clock": args.clock,
                "machine": platform.machine(), "total_s": time.perf_counter() - t0}
        (out / "decode_attention.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                              indent=1))
        (out / "decode_attention.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
