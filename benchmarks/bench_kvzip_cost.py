#!/usr/bin/env python
"""Prefill cost of KVzip's reconstruction pass against the prompt's own prefill.

    .venv/bin/python benchmarks/bench_kvzip_cost.py --num-prompts 3 --chunk-sizes 2048,512

Passkey prompts of --context-tokens on the shipped model, one request at a time: the full-cache
prefill time (time to first token), then with kvzip at 4x the same plus the reconstruction pass
(PolicyStats: its tokens and seconds, scoring included). One JSON line per setting.
"""

from __future__ import annotations

import argparse
import json
import time

from nanokv import LLM, SamplingParams
from nanokv.eval import tasks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/nanokv-tiny")
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--chunk-sizes", default="2048,512")
    ap.add_argument("--seed", type=int, default=990000)
    args = ap.parse_args(argv)
    params = SamplingParams(temperature=0, max_tokens=2)  # 1: finished before compression
    settings = [None] + [int(c) for c in args.chunk_sizes.split(",")]
    for chunk in settings:
        kw = {} if chunk is None else dict(kv_policy="kvzip", kv_compression_ratio=0.75,
                                           kv_policy_options={"chunk_size": chunk})
        llm = LLM(args.model, max_model_len=args.context_tokens + 64, block_size=32, **kw)
        samples = [tasks.passkey_sample(llm.tokenizer, args.context_tokens - 16,
                                        seed=args.seed + i) for i in range(args.num_prompts)]
        llm.generate([samples[0].prompt], params, use_tqdm=False)  # warm-up
        stats = llm.engine.policies.stats
        base_tokens, base_seconds = stats.reconstruction_tokens, stats.reconstruction_seconds
        t0 = time.perf_counter()
        prompt_tokens = 0
        for x in samples:  # one at a time: the time is this request's alone
            out, = llm.generate([x.prompt], params, use_tqdm=False)
            prompt_tokens += len(out.prompt_token_ids)
        total = time.perf_counter() - t0
        recon = stats.reconstruction_seconds - base_seconds
        print(json.dumps({"policy": "full" if chunk is None else "kvzip 4x",
                          "chunk_size": chunk, "prompts": len(samples),
                          "prompt_tokens": prompt_tokens,
                          "reconstruction_tokens": stats.reconstruction_tokens - base_tokens,
                          "seconds_per_prompt": round(total / len(samples), 3),
                          "reconstruction_seconds_per_prompt": round(recon / len(samples), 3)}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
