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


def nanokv_bench():
    """bench_beam_search.py loaded by path (its nanokv imports are inside main): its prompts
    and its flags."""
    spec = importlib.util.spec_from_file_location(
        "nanokv_bench_beam_search", Path(__file__).with_name("bench_beam_search.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    bench = nanokv_bench()
    ap = argparse.ArgumentParser(description=__doc__)
    bench.add_search_args(ap)
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    args = ap.parse_args()
    bench.check_search_args(ap, args, ("kv_cache_gib",))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = bench.make_prompts(vocab, args.prompts, args.prompt_len)
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
