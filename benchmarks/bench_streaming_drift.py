#!/usr/bin/env python
"""How far a quantized cache's kept keys drift from the model's as StreamingLLM's window slides.

    .venv/bin/python benchmarks/bench_streaming_drift.py --kv-cache-dtype kvquant --bits 4

One request of --prompt random tokens (keys before RoPE and values from a normal distribution)
written through a KV store of the given kind, compressed to --budget by StreamingLLM
(`plan_compression` + `apply_plan`, as the engine's policy runner does), then --slides times: one
more block of tokens written, and the window slid by one block, either by re-selecting and
compacting (`slide="token"`: every kept token after the sinks moves and is re-written) or by
freeing the oldest block after the sinks' block (`slide="block"`: nothing moves). After each
slide: the largest error of the kept keys (layer 0, rotated) relative to the largest true key,
in the sinks' block (block 0) and in the other blocks. One JSON line per slide mode.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from nanokv.cache.kv_cache import KVCacheOptions
from nanokv.cache.layout import KVLayout
from nanokv.cache.registry import kv_cache_settings
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.policies.apply import plan_compression
from nanokv.policies.base import PolicyConfig
from nanokv.utils import cdiv


class _RopeConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": 1e6}


def run(args, slide: str) -> list[float]:
    bs, heads, dim, layers = args.block_size, args.kv_heads, args.head_dim, args.layers
    layout = KVLayout(layers, heads, dim, bs, torch.float32)
    options = KVCacheOptions(args.kv_cache_dtype, max_num_seqs=1, kv_quant_bits=args.bits)
    # (the registry refuses --bits for a kind without bit widths, naming the kinds that have them)
    kind, settings = kv_cache_settings(options, layout)
    if args.kvquant_sinks is not None:  # KVQuant's full-precision first positions
        settings["config"] = settings["config"].replace(num_sink_tokens=args.kvquant_sinks)
    max_pos = args.prompt + (args.slides + 1) * bs
    rotary = RotaryEmbedding(_RopeConfig(), dim, max_pos)
    rotary.build_tables(torch.device("cpu"))
    num_blocks = cdiv(max_pos, bs) + 2
    store = kind.create(layout, num_blocks, torch.device("cpu"), settings, rotary=rotary)
    rope = getattr(store, "rope", None)
    gen = torch.Generator().manual_seed(args.seed)
    free = list(range(num_blocks))[::-1]
    table: list[int] = []
    held: list[int] = []  # the position each slot of the request holds
    true_keys: dict[int, torch.Tensor] = {}  # position -> layer 0's key after RoPE [Hkv, D]

    def write(count: int) -> None:
        first = len(true_keys)
        positions = list(range(first, first + count))
        slots = []
        for j in range(len(held), len(held) + count):
            if j // bs >= len(table):
                table.append(free.pop())
            slots.append(table[j // bs] * bs + j % bs)
        plan = store.begin_step(slots, positions)
        pos = torch.tensor(positions)
        for layer in range(layers):
            k_pre = torch.randn(count, heads, dim, generator=gen)  # [T, Hkv, D]
            v = torch.randn(count, heads, dim, generator=gen)
            k = rotary.rotate(pos, k_pre)
            store.write_layer(layer, plan, k, v, k_pre)
            if layer == 0:
                true_keys.update(zip(positions, k))
        held.extend(positions)

    def drop_blocks(indexes: list[int]) -> None:
        for i in sorted(indexes, reverse=True):
            store.release([table[i]])
            free.append(table.pop(i))
            del held[i * bs:(i + 1) * bs]

    policy = PolicyConfig("streaming", args.budget,
                          options={"n_sink": args.n_sink, "slide": slide}).build(block_size=bs)

    def compact() -> None:
        request = SimpleNamespace(num_cached_slots=len(held), block_table=table, request_id="r")
        view = store.policy_view(request)
        plan = plan_compression(policy, view.layers, view.block_table, len(held),
                                budget=args.budget)
        store.apply_plan(request, plan, view)
        kept = plan.kept[0].tolist()
        held[:] = [held[i] for i in kept]
        drop_blocks(list(range(plan.num_blocks, len(table))))

    write(args.prompt)
    compact()
    errors = []
    for _ in range(args.slides):
        write(bs - len(held) % bs)  # the newest block fills
        if slide == "token":
            compact()
        else:
            index = policy.block_to_evict(None, len(held), args.budget)
            if index is not None:
                drop_blocks([index])
        k, _ = store.read(0, table, len(held), rope)  # [n, Hkv, D]
        ref = torch.stack([true_keys[p] for p in held])
        err = (k - ref).abs().amax(dim=(1, 2)) / ref.abs().max()  # [n] per slot
        errors.append((round(float(err[:bs].max()), 4), round(float(err[bs:].max()), 4),
                       round(float(err[:args.n_sink].max()), 4) if args.n_sink else 0.0))
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-cache-dtype", default="kvquant")
    ap.add_argument("--bits", type=int, default=None,
                    help="kvquant / kivi bits (default: the kind's own)")
    ap.add_argument("--prompt", type=int, default=120)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--slides", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kvquant-sinks", type=int, default=None,
                    help="KVQuant's num_sink_tokens, the first positions kept at full precision "
                         "(default: the store's, 1)")
    args = ap.parse_args(argv)
    if args.prompt <= args.budget:
        ap.error(f"--prompt ({args.prompt}) must exceed --budget ({args.budget})")
    if args.kvquant_sinks is not None and (args.kv_cache_dtype != "kvquant"
                                           or not 0 <= args.kvquant_sinks <= args.block_size):
        ap.error(f"--kvquant-sinks needs --kv-cache-dtype kvquant and a value in [0, "
                 f"--block-size ({args.block_size})]")
    for slide in ("token", "block"):
        errors = run(args, slide)
        print(json.dumps({"kv_cache_dtype": args.kv_cache_dtype, "bits": args.bits,
                          "slide": slide, "budget": args.budget, "n_sink": args.n_sink,
                          "kvquant_sinks": args.kvquant_sinks,
                          "sinks_block_error": [e[0] for e in errors],
                          "other_blocks_error": [e[1] for e in errors],
                          "sinks_error": [e[2] for e in errors]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
