"""In-process A/B of the KVQuant decode kernel (or, `--store`, the int8 / fp8 one): the C
library built from two checkouts' csrc/ (`--before`, `--after`) called in turn on the same
store, one thread.

On a shared VM the float32 kernel's time moves by tens of percent between runs minutes apart,
so a before/after pair of `bench_decode_attention.py` runs can hide a 10-15% change. Here both
libraries attend the same cached blocks in one process, alternating call by call (ABAB, then
BABA), and the figure is the median of the per-pair ratios after / before. The two libraries
must share `KVQuantLayer`'s layout (the struct `native_quant_attention.py` passes); each is
built as `build_library` builds it (cached by source). The store is written by this checkout's
Python (and its C write path).

    .venv/bin/python benchmarks/ab_kvquant_decode.py --before /tmp/base --contexts 4096 16384

where /tmp/base holds the earlier commit's tree (`git worktree add /tmp/base <commit>`).
Prints one line per (requests, context, bits): each side's median microseconds per cached token
and the ratio's median and quartiles; --out writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_decode_attention as bda  # noqa: E402
from ab_timing import ratio_summary, time_in_turn  # noqa: E402
import nanokv.layers.native_quant_attention as nqa  # noqa: E402
from nanokv.attention.common import CommonAttentionMetadata  # noqa: E402
from nanokv.attention.native_quantized import NativeQuantizedBackend  # noqa: E402
from nanokv.layers.native_build import LazyLibrary  # noqa: E402
from nanokv.layers.rotary import RotaryEmbedding  # noqa: E402

KERNEL = Path("nanokv/layers/csrc/quant_decode_attention.c")
STORES = ("kvquant", "int8", "fp8_e4m3", "fp8_e5m2")  # the per-token stores: the same library


def ab_pair(args, libs: dict, requests: int, context: int, bits: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    shape = SimpleNamespace(kv_heads=args.kv_heads, head_dim=args.head_dim,
                            block_size=args.block_size)
    per = bda.cdiv(context, args.block_size)
    tables = [list(range(r * per, (r + 1) * per)) for r in range(requests)]
    q = torch.randn(requests, args.q_heads, args.head_dim, generator=gen)
    k_new = torch.randn(requests, args.kv_heads, args.head_dim, generator=gen)
    v_new = torch.randn(requests, args.kv_heads, args.head_dim, generator=gen)
    rotary = RotaryEmbedding(bda._RopeConfig(), args.head_dim, context + 16)
    store = bda.make_store(shape, args.store, bits, requests * per + 1, requests, rotary)
    bda.fill(store, context, requests, gen)
    common = CommonAttentionMetadata([0] * requests, requests, tables, [context] * requests, [])
    common.write_plan = SimpleNamespace(slot_mapping=torch.empty(0, dtype=torch.long))
    backend = NativeQuantizedBackend(store, torch.device("cpu"))
    call = partial(backend.decode, 0, q, k_new, v_new, backend.build(common).decodes[None],
                   args.head_dim ** -0.5)
    outs = {}
    own = nqa._LIBRARY  # put back afterwards: the A/B libraries lack the switches' typing
    call()  # the layers' structs (and their RoPE layout) built with this checkout's library
    try:
        for side, lib in libs.items():  # a warm-up each, and the outputs compared
            nqa._LIBRARY = lib
            outs[side] = call().clone()

        def run(side: str) -> None:
            nqa._LIBRARY = libs[side]
            call()

        times = time_in_turn(run, args.rounds, time.thread_time)
    finally:
        nqa._LIBRARY = own
    per_token = {side: statistics.median(ts) * 1e6 / (requests * context)
                 for side, ts in times.items()}
    return {"store": args.store, "requests": requests, "context": context, "bits": bits,
            "before_us_per_token": per_token["before"], "after_us_per_token": per_token["after"],
            **ratio_summary(times),
            "max_abs_diff": (outs["after"] - outs["before"]).abs().max().item()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="checkout whose csrc/ is the baseline")
    p.add_argument("--after", default=str(ROOT), help="checkout under test (default: this one)")
    p.add_argument("--requests", type=int, nargs="+", default=[1])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--bits", type=int, nargs="+", default=[4], choices=[2, 3, 4],
                   help="KVQuant's code widths (ignored by the per-token stores)")
    p.add_argument("--store", default="kvquant", choices=list(STORES),
                   help="the KV store whose kernel is timed (default kvquant)")
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=40, help="calls of each side (>= 4)")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    for name in ("requests", "contexts"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} must be positive integers")
    if args.rounds < 4:
        p.error("--rounds must be at least 4 (the ratio's quartiles)")
    if min(args.q_heads, args.kv_heads, args.head_dim, args.block_size) < 1 \
            or args.q_heads % args.kv_heads:
        p.error("--q-heads, --kv-heads, --head-dim, --block-size must be positive, and "
                "--q-heads a multiple of --kv-heads")
    sources = {side: Path(getattr(args, side)) / KERNEL for side in ("before", "after")}
    for side, src in sources.items():
        if not src.is_file():
            p.error(f"--{side}: {src} not found (give a checkout of this repository)")
    if os.environ.get("OMP_NUM_THREADS") != "1":
        p.error("run with OMP_NUM_THREADS=1 (one thread: the CPU time of the calling thread)")
    torch.set_num_threads(1)
    libs = {side: LazyLibrary(src, nqa.type_kernels) for side, src in sources.items()}
    rows = []
    for bits in (args.bits if args.store == "kvquant" else [None]):
        for requests in args.requests:
            for context in args.contexts:
                r = ab_pair(args, libs, requests, context, bits)
                rows.append(r)
                kind = f"{bits}-bit" if bits else args.store
                print(f"{requests} x {context}, {kind}: before {r['before_us_per_token']:.3f}"
                      f" us/token, after {r['after_us_per_token']:.3f}; after / before "
                      f"{r['ratio_median']:.3f} (quartiles {r['ratio_q1']:.3f}-"
                      f"{r['ratio_q3']:.3f}); max |after - before| {r['max_abs_diff']:.1e}",
                      flush=True)
    if args.out:
        meta = {"argv": sys.argv[1:], "before": args.before, "after": args.after}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
