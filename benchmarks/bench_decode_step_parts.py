"""Where a decode step's time goes over each KV cache dtype: the KV write and the decode attention
against the whole step, on one model.

Runs `--requests` prompts of `--prompt-len` random token ids through the engine twice (1 output
token, then 1 + `--decode-steps`); the difference is the decode steps alone. The store's
`write_layer` and the attention backend's decode are timed by wrapping them (CPU time of the
calling thread: run with OMP_NUM_THREADS=1 and --num-threads 1, so a shared machine's other
processes do not count). Over the float pool the backend's `forward` (its write included) is
what is timed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_decode_step_parts.py \\
        --model models/nanokv-tiny --kv-cache-dtypes auto int8 kvquant \\
        --kv-quant-config docs/results/kvquant/kv_calibration.json
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanokv import LLM, SamplingParams  # noqa: E402
from nanokv.attention.native_cpu import NativeCPUBackend  # noqa: E402
from nanokv.attention.native_quantized import NativeQuantizedBackend  # noqa: E402
from nanokv.quant.store import QuantizedKVStore  # noqa: E402

SPENT: dict[str, float] = collections.defaultdict(float)


def timed(cls, name: str, key: str) -> None:
    """Wrap cls.name so its thread CPU time adds up under `key`."""
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            SPENT[key] += time.thread_time() - t0

    setattr(cls, name, wrapper)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/nanokv-tiny")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "int8", "kvquant"])
    p.add_argument("--kv-quant-bits", type=int, default=4)
    p.add_argument("--kv-quant-config", default=None)
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--requests", type=int, default=9)
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args(argv)
    timed(QuantizedKVStore, "write_layer", "write")
    timed(NativeQuantizedBackend, "decode", "attention")
    timed(NativeCPUBackend, "forward", "attention with its write (float pool)")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]
    for kv in args.kv_cache_dtypes:
        extra = {}
        if kv in ("kvquant", "kivi"):
            extra["kv_quant_bits"] = args.kv_quant_bits
        if kv == "kvquant" and args.kv_quant_config:
            extra["kv_quant_config"] = args.kv_quant_config
        llm = LLM(args.model, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory,
                  block_size=args.block_size, max_num_seqs=args.requests,
                  num_threads=args.num_threads, enable_prefix_caching=False, **extra)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        spent = {}
        for n in (1, 1 + args.decode_steps):
            SPENT.clear()
            t0 = time.thread_time()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            spent[n] = (time.thread_time() - t0, dict(SPENT))
        (short, short_parts), (long, long_parts) = spent[1], spent[1 + args.decode_steps]
        total = long - short
        parts = ", ".join(f"{k} {long_parts[k] - short_parts.get(k, 0):.2f} s "
                          f"({(long_parts[k] - short_parts.get(k, 0)) / total:.0%})"
                          for k in long_parts)
        print(f"{kv}: {args.decode_steps} decode steps of {args.requests} requests "
              f"{total:.2f} s; {parts}")


if __name__ == "__main__":
    main()
