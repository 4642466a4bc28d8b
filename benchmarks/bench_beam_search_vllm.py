"""vLLM's `LLM.beam_search` on the prompts of `bench_beam_search.py` (run it with a vLLM venv's
python, `benchmarks/setup_vllm.sh`): one JSON line starting with {"engine" on stdout (vLLM's logs
around it) with the median time of the whole search and each prompt's sequences (tokens after
the prompt, cumulative log-probabilities), for `bench_beam_search.py --vllm-json` to compare."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path


def make_prompts_fn():
    """bench_beam_search.make_prompts, loaded by path (its nanokv imports are inside main)."""
    spec = importlib.util.spec_from_file_location(
        "nanokv_bench_beam_search", Path(__file__).with_name("bench_beam_search.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="models/nanokv-tiny")
    ap.add_argument("--prompts", type=int, default=4, help="prompts searched together")
    ap.add_argument("--prompt-len", type=int, default=200, help="tokens per prompt")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--length-penalty", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    args = ap.parse_args()
    for name in ('prompts', 'prompt_len', 'max_tokens', 'repeats', 'kv_cache_gib'):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.beam_width <= 10:
        ap.error("--beam-width must be in [1, 10]")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts_fn()(vocab, args.prompts, args.prompt_len)
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=-(-(args.prompt_len + args.max_tokens) // 256) * 256,
              max_num_seqs=max(16, 2 * args.prompts * args.beam_width))
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                              ignore_eos=args.ignore_eos, length_penalty=args.length_penalty)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.beam_search(inputs[:1], BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
    times, outs = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.beam_search(inputs, params)
        times.append(time.perf_counter() - start)
    result = {"engine": "vllm", "model": args.model, "prompts": args.prompts,
              "prompt_len": args.prompt_len, "beam_width": args.beam_width,
              "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
              "length_penalty": args.length_penalty, "median_s": statistics.median(times),
              "times_s": times,
              "sequences": [[{"tokens": s.tokens[len(p):], "cum_logprob": s.cum_logprob}
                             for s in o.sequences] for p, o in zip(prompts, outs)]}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
