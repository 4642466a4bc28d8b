#!/usr/bin/env python
"""vLLM (CPU build) peer benchmark on the shared synthetic workload.

Run with the vLLM venv made by benchmarks/setup_vllm.sh, not the project's:

    /work/.vllm-venv/bin/python benchmarks/bench_vllm.py --model /tmp/qwen3-0.6b-random

Prints one JSON line (BenchResult) on stdout; vLLM's own logs go to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

WORKLOAD_PY = Path(__file__).resolve().parents[1] / "nanokv" / "workloads" / "workload.py"


def load_workload_module():
    """Load nanokv/workloads/workload.py by path (the nanokv package is not installed here)."""
    spec = importlib.util.spec_from_file_location("nanokv_bench_workload", WORKLOAD_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while building classes
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="vLLM CPU peer benchmark")
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (default: vLLM's)",
    )
    ap.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (vLLM's kv_cache_memory_bytes, which its CPU worker "
        "honours); replaces --kv-cache-gib",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM torch.compile the model (inductor; ~10+ min startup on 2 cores). "
        "Default is enforce_eager=True.",
    )
    ap.add_argument(
        "--reserved-cpus",
        type=int,
        default=0,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU: cores kept off the worker's OpenMP pool. vLLM "
        "reserves one by default, which on a 2-core machine halves its compute; 0 here.",
    )
    args = ap.parse_args(argv)
    if args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes < 1:
        ap.error(f"--kv-cache-memory-bytes must be >= 1, got {args.kv_cache_memory_bytes}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        ap.error(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    return args


class SchedulerWatch:
    """Peak running requests and preemptions, from the stats vLLM's engine core sends with
    every step (SchedulerStats.num_running_reqs after the step, IterationStats'
    preempted requests). Added to the offline engine's stat-logger list, which `LLM` builds
    when stats are on but takes no loggers of its own for."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.peak_running = 0
        self.preemptions = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            self.peak_running = max(self.peak_running, scheduler_stats.num_running_reqs)
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.kv_cache_memory_bytes is None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    else:  # the legacy variable would override kv_cache_memory_bytes
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(args.reserved_cpus))
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")

    wl = load_workload_module()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    if args.kv_cache_memory_bytes is not None:
        extra["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=not args.compile,
        seed=0,
        disable_log_stats=False,  # keeps per-request timestamps (RequestOutput.metrics)
        **extra,
    )
    watch = SchedulerWatch()
    manager = getattr(llm.llm_engine, "logger_manager", None)
    if manager is not None and isinstance(getattr(manager, "stat_loggers", None), list):
        manager.stat_loggers.append(watch)
    else:
        watch = None
        print(
            "[bench_vllm] no stat loggers: peak running and preemptions not reported",
            file=sys.stderr,
            flush=True,
        )
    startup_s = time.perf_counter() - t0
    print(f"[bench_vllm] startup {startup_s:.1f}s", file=sys.stderr, flush=True)

    vocab = llm.llm_engine.model_config.get_vocab_size()
    requests = wl.make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed
    )
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
        for r in requests
    ]

    # Warm-up (not timed): a couple of short requests through prefill and decode.
    t0 = time.perf_counter()
    llm.generate(
        prompts[:2],
        [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)] * 2,
        use_tqdm=False,
    )
    # The warm-up's prompts would be prefix-cache hits in the timed run (nanokv's bench resets
    # its prefix cache after its warm-up too).
    llm.reset_prefix_cache()
    print(f"[bench_vllm] warm-up {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    if watch is not None:
        watch.reset()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0

    ttfts, tpots = [], []
    for req, out in zip(requests, outputs):
        got = len(out.outputs[0].token_ids)
        if got != req.output_len:
            raise RuntimeError(f"request {out.request_id}: {got} tokens, wanted {req.output_len}")
        m = getattr(out, "metrics", None)  # v1 RequestStateStats, when stats are on
        if m is not None and getattr(m, "first_token_latency", 0.0) > 0:
            ttfts.append(m.first_token_latency)
            if req.output_len > 1 and m.last_token_ts > m.first_token_ts > 0:
                tpots.append((m.last_token_ts - m.first_token_ts) / (req.output_len - 1))

    result = wl.summarize(
        "vllm",
        requests,
        elapsed,
        ttfts_s=ttfts or None,
        tpots_s=tpots or None,
        peak_running=watch.peak_running if watch is not None else None,
        num_preemptions=watch.preemptions if watch is not None else None,
    )
    print(result.to_json(), flush=True)


if __name__ == "__main__":
    main()
