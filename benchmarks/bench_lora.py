#!/usr/bin/env python
"""Serving with LoRA adapters, nanokv or vLLM (CPU build) on the same workload: a batch of
random-id prompts, greedy, float32, generated under no adapter, one adapter for all, and the
adapters in turn (request i under adapter i mod N; max_loras N), each timed --repeats times
after a warm-up. `--lora off` starts the engine without LoRA (the base model's speed).

Runs in either venv (the engine is imported in main): nanokv's

    .venv/bin/python benchmarks/bench_lora.py --engine nanokv --model M --adapters DIR/adapter*

and vLLM's (benchmarks/setup_vllm.sh)

    /work/.vllm-venv/bin/python benchmarks/bench_lora.py --engine vllm --model M ...

Prints one JSON line on stdout: per scenario the seconds of each run, output tok/s at the
median, and the output tokens (to compare engines); the engine's logs go to stderr.
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


def make_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


class NanokvEngine:
    def __init__(self, args, max_model_len: int) -> None:
        from nanokv import LLM
        from nanokv.lora import LoRARequest

        self.request_class = LoRARequest
        options = dict(dtype="float32", max_model_len=max_model_len, skip_tokenizer_init=True,
                       max_num_seqs=args.requests, num_threads=args.num_threads, seed=0)
        if args.lora == "on":
            options.update(enable_lora=True, max_loras=len(args.adapters),
                           max_lora_rank=args.max_lora_rank)
        self.llm = LLM(args.model, **options)

    def generate(self, prompts, max_tokens, loras):
        from nanokv import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class VllmEngine:
    def __init__(self, args, max_model_len: int) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        self.request_class = LoRARequest
        options = dict(dtype="float32", max_model_len=max_model_len, skip_tokenizer_init=True,
                       max_num_seqs=args.requests, enforce_eager=True, seed=0)
        if args.lora == "on":
            options.update(enable_lora=True, max_loras=len(args.adapters),
                           max_lora_rank=args.max_lora_rank)
        self.llm = LLM(model=args.model, **options)

    def generate(self, prompts, max_tokens, loras):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 lora_request=loras, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("nanokv", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapters", nargs="+", required=True, metavar="DIR",
                    help="PEFT adapter directories (benchmarks/make_lora_adapters.py)")
    ap.add_argument("--lora", choices=("on", "off"), default="on",
                    help="off: the engine without LoRA, the base scenario only")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--num-threads", type=int, default=None, help="nanokv's torch threads")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    args = ap.parse_args()
    for name in ("requests", "prompt_len", "output_len", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, args.requests, args.prompt_len)
    max_model_len = -(-(args.prompt_len + args.output_len) // 256) * 256
    t0 = time.perf_counter()
    engine = (NanokvEngine if args.engine == "nanokv" else VllmEngine)(args, max_model_len)
    startup = time.perf_counter() - t0
    adapters = [engine.request_class(f"adapter{i}", i + 1, path)
                for i, path in enumerate(args.adapters)]
    scenarios = {"base": [None] * len(prompts)}
    if args.lora == "on":
        scenarios["one adapter"] = [adapters[0]] * len(prompts)
        scenarios[f"{len(adapters)} adapters"] = [adapters[i % len(adapters)]
                                                  for i in range(len(prompts))]
    result = {"engine": args.engine, "lora": args.lora, "model": args.model,
              "requests": args.requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "adapters": len(adapters),
              "startup_s": startup, "scenarios": {}}
    total = args.requests * args.output_len
    for index, (name, loras) in enumerate(scenarios.items()):
        engine.generate(prompts[:2], 4, loras[:2])  # warm-up (adapters loaded)
        times, outs = [], None
        for run_index in range(args.repeats):
            # each run's prompts differ from every other run's by their first token: no
            # prefix-cache hits across runs and scenarios (both engines cache prefixes)
            shift = 1 + index * args.repeats + run_index
            run = [[(p[0] + shift) % vocab, *p[1:]] for p in prompts]
            start = time.perf_counter()
            outs = engine.generate(run, args.output_len, loras)
            times.append(time.perf_counter() - start)
        result["scenarios"][name] = {"seconds": times, "tok_s": total / statistics.median(times),
                                     "token_ids": outs}
        print(f"{args.engine} {name}: {total / statistics.median(times):.1f} tok/s",
              file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
