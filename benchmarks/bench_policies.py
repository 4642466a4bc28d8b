"""Memory benchmark for KV policies: at a fixed KV pool, long requests with and without each
policy. Reports peak concurrency, preemptions, recomputed tokens, output and decode throughput,
and the time policies spend selecting/compacting (KVCrush's overhead against its base scorer).

    .venv/bin/python benchmarks/bench_policies.py --model models/nanokv-tiny \\
        --num-requests 16 --prompt-len 1536 --output-len 128 --num-kv-blocks 48

Medians over --repeats runs; every setting runs on the same seeded workload in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanokv import LLM, SamplingParams  # noqa: E402
from nanokv.workloads.workload import make_workload  # noqa: E402

# (label, kv_policy, options); compression is applied to every policy but "full"/"pool"
SETTINGS = [
    ("full", None, {}),
    ("streaming", "streaming", {}),
    ("knorm", "knorm", {}),
    ("h2o", "h2o", {}),
    ("snapkv", "snapkv", {"window": 32}),
    ("pyramidkv", "pyramidkv", {"window": 32}),
    ("kvcrush_snapkv_r0.25", "kvcrush",
     {"base": "snapkv", "base_options": {"window": 32}, "kvcrush_ratio": 0.25}),
    ("paged_eviction", "paged_eviction", {}),
    ("paged_eviction pool-pressure", "paged_eviction",
     {"eviction_ratio": 0.2, "importance_threshold": 0.1}),
]


def run_setting(args, label, policy, options, workload) -> dict:
    opts = dict(block_size=args.block_size, max_model_len=args.prompt_len + args.output_len + 8,
                num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.num_requests,
                max_num_batched_tokens=args.max_num_batched_tokens, dtype="float32",
                skip_tokenizer_init=True, enable_prefix_caching=False)
    if policy is not None:
        opts.update(kv_policy=policy, kv_policy_options=options)
        if "pool-pressure" not in label:
            opts["kv_compression_ratio"] = 1.0 - 1.0 / args.compression
    llm = LLM(args.model, **opts)
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in workload]
    for r, p in zip(workload, params):
        engine.add_request(r.prompt_token_ids, p)
    peak_running = peak_blocks = 0
    decode_time = 0.0
    decode_tokens = 0
    final_blocks = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        final_blocks += [o.kv_blocks_at_finish for o in outs if o.finished]
        dt = time.perf_counter() - s0
        running = engine.scheduler.running
        if running and all(r.num_output_tokens > 0 for r in running):  # a pure decode step
            decode_time += dt
            decode_tokens += len(outs)
        peak_running = max(peak_running, len(running))
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(r.output_len for r in workload)
    engine.check_invariants()
    # what one shared block table for all layers would hold at the end: the largest layer's
    # budget decides (differs from the blocks held only for per-layer budgets, PyramidKV)
    shared_table_blocks = None
    if policy is not None and "pool-pressure" not in label:
        prompt = workload[0].prompt_len
        budgets = engine.policies.default.layer_budgets(prompt, engine.layout.num_layers)
        shared_table_blocks = -(-(max(budgets) + workload[0].output_len - 1) // args.block_size)
    return {
        "setting": label, "compression": 1.0 if policy is None or "pool" in label
        else args.compression,
        "elapsed_s": elapsed, "output_tok_s": out_tokens / elapsed,
        "decode_tok_s": decode_tokens / decode_time if decode_time else None,
        "peak_running": peak_running, "peak_blocks": peak_blocks,
        "preemptions": engine.scheduler.num_preemptions,
        "recomputed_tokens": engine.scheduler.num_recomputed_tokens,
        "policy_seconds": engine.policies.stats.seconds,
        "compress_seconds": engine.policies.stats.compress_seconds,
        "evicted_blocks": dict(engine.block_manager.stats.evicted_blocks),
        "blocks_per_request_at_finish": statistics.median(final_blocks),
        "shared_table_blocks_per_request": shared_table_blocks,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/nanokv-tiny")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=48,
                   help="fixed pool; full-cache requests need ceil((prompt+output)/B) each")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--compression", type=float, default=4.0)
    p.add_argument("--settings", default=None, help="comma-separated labels (default: all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    workload = make_workload(args.num_requests, (args.prompt_len, args.prompt_len),
                             (args.output_len, args.output_len), vocab, args.seed)
    chosen = SETTINGS if args.settings is None else [
        s for s in SETTINGS if s[0] in args.settings.split(",")]
    results = []
    for label, policy, options in chosen:
        runs = [run_setting(args, label, policy, options, workload) for _ in range(args.repeats)]
        med = dict(runs[0])
        for key in ("elapsed_s", "output_tok_s", "decode_tok_s", "policy_seconds",
                    "compress_seconds"):
            vals = [r[key] for r in runs if r[key] is not None]
            med[key] = statistics.median(vals) if vals else None
        results.append(med)
        print(json.dumps(med), flush=True)
    print()
    print("| setting | compression | peak running | peak blocks | blocks / request at finish "
          "(one shared table would hold) | preemptions | recomputed tokens | output tok/s | "
          "decode tok/s | policy time / elapsed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        dec = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
        print(f"| {r['setting']} | {r['compression']:g}x | {r['peak_running']} | "
              f"{r['peak_blocks']} | {r['blocks_per_request_at_finish']:g} "
              f"({r['shared_table_blocks_per_request'] or '-'}) | "
              f"{r['preemptions']} | {r['recomputed_tokens']} | "
              f"{r['output_tok_s']:.1f} | {dec} | "
              f"{100 * r['policy_seconds'] / r['elapsed_s']:.2f}% |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
