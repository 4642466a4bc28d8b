"""KV cache dtypes at a fixed memory budget: how many long requests run at once, and how fast.

For each kv_cache_dtype setting (auto = the float32 pool, int8, fp8_e4m3, fp8_e5m2, kvquant at
4 / 3 / 2 bits) with the same `--kv-cache-memory`:

  pool blocks      the engine's pool at that budget (the store's real bytes per block; kvquant
                   also pays a fixed staging cost of one full-precision key block per
                   max_num_seqs, so its max_num_seqs is set to the concurrency it can hold)
  max concurrent   the largest N with N x ceil((prompt + output) / block_size) blocks in the
                   pool, then CHECKED: N requests of --prompt-len + --output-len run with
                   max_num_seqs = N; the peak number running and the preemptions are reported
                   (0 preemptions and peak = N confirm it)
  decode tok/s     output tokens / wall time of the pure decode steps (every running request
                   past its prompt) of that run, median over --repeats runs
  same-batch       decode tok/s with --same-batch requests (default: the float pool's
                   concurrency) for every dtype: the per-step cost of reading the quantized cache

    .venv/bin/python benchmarks/bench_kv_dtypes.py --model models/nanokv-tiny \\
        --kv-cache-memory 64MiB --prompt-len 1536 --output-len 128 --repeats 3 \\
        --kv-quant-config docs/results/kvquant/kv_calibration.json --out docs/results/kvquant

Random token-id prompts (nanokv.workloads.workload, seeded), ignore_eos, prefix caching off,
float32 compute, one process, settings run one after the other.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanokv import LLM, SamplingParams  # noqa: E402
from nanokv.workloads.workload import make_workload  # noqa: E402
from nanokv.cache.kv_cache import KVCacheOptions  # noqa: E402
from nanokv.cache.layout import KVLayout  # noqa: E402
from nanokv.cache.registry import kv_cache_settings  # noqa: E402
from nanokv.config import parse_memory  # noqa: E402

# (label, kv_cache_dtype, kvquant bits)
SETTINGS = [
    ("float32", "auto", None),
    ("int8", "int8", None),
    ("fp8_e4m3", "fp8_e4m3", None),
    ("fp8_e5m2", "fp8_e5m2", None),
    ("kvquant 4-bit", "kvquant", 4),
    ("kvquant 3-bit", "kvquant", 3),
    ("kvquant 2-bit", "kvquant", 2),
    ("kivi 4-bit", "kivi", 4),
    ("kivi 2-bit", "kivi", 2),
]


def _engine_options(args, dtype: str, bits: int | None, max_num_seqs: int) -> dict:
    opts = dict(dtype="float32", block_size=args.block_size,
                max_model_len=args.prompt_len + args.output_len + 8,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, skip_tokenizer_init=True,
                enable_prefix_caching=False, num_threads=args.num_threads, seed=args.seed,
                kv_cache_dtype=dtype)
    if dtype == "kvquant":
        opts.update(kv_quant_bits=bits, kv_quant_config=args.kv_quant_config)
    elif dtype == "kivi":
        opts.update(kv_quant_bits=bits)
    return opts


def pool_blocks(args, dtype: str, bits: int | None, max_num_seqs: int) -> int:
    """The blocks the engine's pool gets at --kv-cache-memory (the engine's own arithmetic on
    the KV cache kind's spec: (budget - fixed bytes) // bytes per block), without loading the
    model."""
    cfg_json = json.loads((Path(args.model) / "config.json").read_text())
    dim = cfg_json.get("head_dim") or cfg_json["hidden_size"] // cfg_json["num_attention_heads"]
    layers, heads = cfg_json["num_hidden_layers"], cfg_json["num_key_value_heads"]
    layout = KVLayout(layers, heads, dim, args.block_size, torch.float32)
    budget = parse_memory(args.kv_cache_memory)
    opts = _engine_options(args, dtype, bits, max_num_seqs)
    kind, settings = kv_cache_settings(
        KVCacheOptions(dtype, max_num_seqs, opts.get("kv_quant_bits"),
                       opts.get("kv_quant_config")), layout)
    spec = kind.spec(layout, settings)
    return max(0, budget - spec.fixed_bytes) // spec.bytes_per_block


def max_concurrency(args, dtype: str, bits: int | None) -> tuple[int, int]:
    """(N, pool blocks at max_num_seqs = N): the most requests that fit whole in the pool."""
    per_request = -(-(args.prompt_len + args.output_len) // args.block_size)
    n = 1
    while n < 4096 and pool_blocks(args, dtype, bits, n + 1) // per_request >= n + 1:
        n += 1
    return n, pool_blocks(args, dtype, bits, n)


def run_once(args, dtype: str, bits: int | None, num_requests: int, max_num_seqs: int) -> dict:
    llm = LLM(args.model, **_engine_options(args, dtype, bits, max_num_seqs))
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    workload = make_workload(num_requests, (args.prompt_len, args.prompt_len),
                             (args.output_len, args.output_len), vocab, args.seed)
    for r in workload:
        engine.add_request(r.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=r.output_len,
                                          ignore_eos=True))
    peak_running = peak_blocks = 0
    decode_time, decode_tokens, steps = 0.0, 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        sched = engine.scheduler  # a pure decode step: nothing waits, every request decodes
        decode_only = not sched.waiting and all(r.num_output_tokens > 0 for r in sched.running)
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        running = sched.running
        if decode_only and outs:
            decode_time += dt
            decode_tokens += len(outs)
            steps += 1
        peak_running = max(peak_running, len(running))
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
    elapsed = time.perf_counter() - t0
    engine.check_invariants()
    return {"num_blocks": engine.kv_cache.num_blocks, "peak_running": peak_running,
            "peak_blocks": peak_blocks, "preemptions": engine.scheduler.num_preemptions,
            "decode_tok_s": decode_tokens / decode_time if decode_time else None,
            "decode_steps": steps, "elapsed_s": elapsed,
            "bytes_per_block": engine.kv_bytes_per_block,
            "kv_cache_bytes": engine.kv_cache_bytes}


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r[key] is not None]
    return statistics.median(vals) if vals else None


def bench(args, settings, log=print, on_result=None) -> list[dict]:
    results = []
    same_batch = args.same_batch
    for label, dtype, bits in settings:
        n, blocks = max_concurrency(args, dtype, bits)
        repeats = args.repeats
        if dtype == "kvquant" and args.kvquant_repeats is not None:
            repeats = args.kvquant_repeats
        runs = [run_once(args, dtype, bits, n, n) for _ in range(repeats)]
        if runs[0]["num_blocks"] != blocks:
            log(f"[bench] note: {label}: engine pool {runs[0]['num_blocks']} blocks, "
                f"computed {blocks}")
        if same_batch is None:  # the float pool's concurrency (the first setting)
            same_batch = n
        same = None
        if args.same_batch_runs and same_batch <= n:
            same = _median([run_once(args, dtype, bits, same_batch, same_batch)
                            for _ in range(repeats)], "decode_tok_s")
        row = {"setting": label, "kv_cache_dtype": dtype, "bits": bits,
               "num_blocks": runs[0]["num_blocks"],
               "bytes_per_token": runs[0]["bytes_per_block"] / args.block_size,
               "kv_cache_bytes": runs[0]["kv_cache_bytes"], "max_concurrent": n,
               "peak_running": max(r["peak_running"] for r in runs),
               "peak_blocks": max(r["peak_blocks"] for r in runs),
               "preemptions": max(r["preemptions"] for r in runs),
               "decode_tok_s": _median(runs, "decode_tok_s"),
               "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
               "decode_steps": runs[0]["decode_steps"], "repeats": repeats,
               "elapsed_s": _median(runs, "elapsed_s"),
               "same_batch": same_batch, "same_batch_decode_tok_s": same}
        results.append(row)
        log(json.dumps(row))
        if on_result is not None:
            on_result(results)
    return results


def markdown(results: list[dict], args) -> str:
    ref = next((r for r in results if r["kv_cache_dtype"] == "auto"), results[0])

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    lines = [f"| kv_cache_dtype | bytes / token | pool blocks ({args.kv_cache_memory}) | "
             f"max concurrent ({args.prompt_len}+{args.output_len}) | peak running | "
             f"preemptions | vs float32 | decode tok/s (at max concurrent) | vs float32 | "
             f"decode tok/s at batch {ref['same_batch']} | vs float32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        dec = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        same = ("-" if r["same_batch_decode_tok_s"] is None
                else f"{r['same_batch_decode_tok_s']:.1f}")
        lines.append(
            f"| {r['setting']} | {r['bytes_per_token']:.1f} | {r['num_blocks']} | "
            f"{r['max_concurrent']} | {r['peak_running']} | {r['preemptions']} | "
            f"{ratio(r['max_concurrent'], ref['max_concurrent'])} | {dec} | "
            f"{ratio(r['decode_tok_s'], ref['decode_tok_s'])} | {same} | "
            f"{ratio(r['same_batch_decode_tok_s'], ref['same_batch_decode_tok_s'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/nanokv-tiny")
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-quant-config", default=None,
                   help="kvquant calibration file (codebooks); default: uniform kvquant")
    p.add_argument("--settings", default=None,
                   help=f"comma-separated labels, run in this order (default all): "
                        f"{[s[0] for s in SETTINGS]}; float32 is the reference of the ratios, "
                        "the first setting's concurrency the default --same-batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kvquant-repeats", type=int, default=None,
                   help="repeats of the kvquant settings (default: --repeats); their decode "
                        "steps dequantize every block read, the slow part on a CPU")
    p.add_argument("--same-batch", type=int, default=None,
                   help="batch of the same-batch decode runs (default: the float pool's "
                        "concurrency)")
    p.add_argument("--no-same-batch-runs", dest="same_batch_runs", action="store_false")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write bench.md and bench.json here")
    args = p.parse_args(argv)
    by_label = {s[0]: s for s in SETTINGS}
    wanted = [] if args.settings is None else args.settings.split(",")
    unknown = [w for w in wanted if w not in by_label]
    if unknown:
        p.error(f"unknown setting(s) {unknown}; allowed: {list(by_label)}")
    chosen = SETTINGS if args.settings is None else [by_label[w] for w in wanted]
    t0 = time.perf_counter()
    command = ".venv/bin/python benchmarks/bench_kv_dtypes.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    def save(results: list[dict], done: bool) -> None:  # after every setting: partial results
        if not args.out:
            return
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(
            {"command": command, "args": vars(args), "complete": done, "results": results},
            indent=1) + "\n")
        state = "" if done else (f" (PARTIAL: {len(results)} of {len(chosen)} settings "
                                 "done so far)")
        md = [f"# KV cache dtypes at a fixed {args.kv_cache_memory} KV budget: "
              f"`{args.model}`{state}",
              "", f"Requests of {args.prompt_len} random prompt tokens + {args.output_len} "
              f"output tokens (ignore_eos), block size {args.block_size}, float32 compute, "
              f"{args.num_threads} thread(s) on {platform.machine()} CPU, prefix caching off. "
              "Max concurrent = the most requests whose whole length fits in the pool at this "
              "budget (kvquant: with max_num_seqs = that number, since its fixed staging "
              "grows with it), run with max_num_seqs = N: peak running and preemptions are "
              "what the engine did. Decode tok/s: output tokens / wall time of the pure "
              f"decode steps, median of {args.repeats} runs (kvquant: "
              f"{args.kvquant_repeats or args.repeats}). The last two columns run every "
              "dtype at the float pool's batch size: the per-step cost of reading a quantized "
              "cache (decode attention: the C kernels of backend `native` where the store has "
              "one, see bench_decode_attention.py).", "", markdown(results, args), "",
              "## Command", "", "```bash", command, "```", "",
              f"Total time {time.perf_counter() - t0:.0f} s.", ""]
        (out / "bench.md").write_text("\n".join(md))

    results = bench(args, chosen, on_result=lambda rs: save(rs, False))
    save(results, True)
    print(markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
