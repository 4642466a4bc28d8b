#!/usr/bin/env python
"""vLLM (CPU build) on `bench_speculative.py`'s workload: n-gram speculative decoding
(`speculative_config={"method": "ngram", ...}`), or a draft model's (`--draft-model DIR`:
`{"model": DIR, ...}`), against vLLM's decoding alone, one request at a time and a batch of
all prompts, greedy, float32, the same prompts (`make_prompts`, loaded by path: nanokv is not
installed in vLLM's venv). One engine per run (`--k 0`: no drafts).

Run with the vLLM venv made by benchmarks/setup_vllm.sh, not the project's:

    /work/.vllm-venv/bin/python benchmarks/bench_speculative_vllm.py \\
        --model /tmp/qwen3-0.6b-4l-random --k 4

Prints one JSON line on stdout (tok/s per mode, and the outputs' tokens for comparing with
nanokv's); vLLM's own logs go to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_prompts_fn():
    """bench_speculative.make_prompts, loaded by path (its nanokv imports are inside main)."""
    spec = importlib.util.spec_from_file_location("nanokv_bench_speculative",
                                                  HERE / "bench_speculative.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.make_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (0: no drafts)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--segment", type=int, default=48)
    ap.add_argument("--repeats-in-prompt", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-lookup-max", type=int, default=3)
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--draft-model", default=None, metavar="DIR",
                    help="draft tokens from this checkpoint instead of n-grams")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each mode")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: the longest prompt plus --output-len, rounded up")
    args = ap.parse_args()
    for name in ("prompts", "segment", "repeats_in_prompt", "output_len", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.k < 0 or not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
        ap.error("--k must be >= 0 and 1 <= --prompt-lookup-min <= --prompt-lookup-max")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts_fn()(vocab, args.prompts, args.segment, args.repeats_in_prompt, 0)
    longest = max(len(p) for p in prompts) + args.output_len
    spec = None if args.k == 0 else (
        {"model": args.draft_model, "num_speculative_tokens": args.k} if args.draft_model
        else {"method": "ngram", "num_speculative_tokens": args.k,
              "prompt_lookup_max": args.prompt_lookup_max,
              "prompt_lookup_min": args.prompt_lookup_min})
    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32",
              max_model_len=args.max_model_len or -(-longest // 256) * 256,
              max_num_seqs=args.prompts, enforce_eager=True, seed=0,
              speculative_config=spec)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    result = {"engine": "vllm", "k": args.k, "model": args.model,
              "draft_model": args.draft_model, "prompts": args.prompts,
              "prompt_len": len(prompts[0]), "output_len": args.output_len,
              "startup_s": startup, "modes": {}}
    total = args.prompts * args.output_len
    for mode in ("one at a time", f"batch of {args.prompts}"):
        times, outs = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            if mode == "one at a time":
                got = [llm.generate([x], params, use_tqdm=False)[0] for x in inputs]
            else:
                got = llm.generate(inputs, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            outs = [list(o.outputs[0].token_ids) for o in got]
        result["modes"][mode] = {"seconds": times, "tok_s": total / statistics.median(times),
                                 "token_ids": outs}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
