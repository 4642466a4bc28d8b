#!/usr/bin/env python
"""Transient memory and time of one KV-policy compaction over a quantized KV cache.

    .venv/bin/python benchmarks/bench_compaction_memory.py --tokens 16384 --policy knorm

One request of --tokens random K/V in a KVQuant store of the given shape (default: Qwen3-0.6B's
28 layers, 8 KV heads of 128, float32 layout, blocks of 16), written through the store as the
engine does, with the C backend's block reader installed. Then the policy runner's steps of a
compaction to half: `policy_view`, `plan_compression`, `apply_plan`. Reported: the peak RSS
growth over the compaction (the process's high-water mark, so run one setting per process), the
store's bytes, the dense float K/V of the request (what a view of dense copies of every layer
holds), and the seconds of planning and of applying. One thread. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from types import SimpleNamespace

import torch

from nanokv.attention.native_quantized import NativeQuantizedBackend
from nanokv.cache.layout import KVLayout
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.policies.apply import plan_compression
from nanokv.policies.base import PolicyConfig
from nanokv.quant import KVQuantConfig, KVQuantStore


class _RopeConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="the request's cached tokens")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8))
    ap.add_argument("--policy", default="knorm", choices=("knorm", "streaming"),
                    help="knorm: scattered per-head tokens; streaming: sinks + recent window")
    args = ap.parse_args(argv)
    if args.tokens < 4 * args.block_size:
        ap.error(f"--tokens must be at least 4 blocks ({4 * args.block_size})")
    torch.set_num_threads(1)
    n, bs, heads, dim = args.tokens, args.block_size, args.kv_heads, args.head_dim
    layout = KVLayout(args.layers, heads, dim, bs, torch.float32)
    store = KVQuantStore(layout, n // bs + 4, KVQuantConfig(bits=args.bits), num_staging_blocks=1)
    store.rotary = RotaryEmbedding(_RopeConfig(), dim, n + bs)
    store.rotary.build_tables(torch.device("cpu"))
    NativeQuantizedBackend(store, torch.device("cpu"))  # installs the C block reader
    table = list(range(-(-n // bs)))
    gen = torch.Generator().manual_seed(0)
    for start in range(0, n, 1024):  # written in chunks, as prefill chunks would be
        pos = list(range(start, min(n, start + 1024)))
        plan = store.begin_step([table[j // bs] * bs + j % bs for j in pos], pos)
        for layer in range(args.layers):
            k_pre = torch.randn(len(pos), heads, dim, generator=gen)  # [T, Hkv, D]
            v = torch.randn(len(pos), heads, dim, generator=gen)
            store.write_layer(layer, plan, store.rotary.rotate(torch.tensor(pos), k_pre), v,
                              k_pre)
    request = SimpleNamespace(num_cached_slots=n, block_table=table, request_id="r")
    options = {"n_sink": 4} if args.policy == "streaming" else {}
    policy = PolicyConfig(args.policy, n // 2, options=options).build(block_size=bs)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.perf_counter()
    view = store.policy_view(request)
    plan = plan_compression(policy, view.layers, view.block_table, n, budget=n // 2)
    t1 = time.perf_counter()
    store.apply_plan(request, plan, view)
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dense = 2 * args.layers * n * heads * dim * 4
    print(json.dumps({
        "tokens": n, "layers": args.layers, "kv_heads": heads, "head_dim": dim,
        "block_size": bs, "bits": args.bits, "policy": args.policy,
        "peak_rss_growth_gib": round((peak - base) / 2**20, 3),
        "store_gib": round(store.nbytes / 2**30, 3), "dense_kv_gib": round(dense / 2**30, 3),
        "plan_s": round(t1 - t0, 3), "apply_s": round(t2 - t1, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
