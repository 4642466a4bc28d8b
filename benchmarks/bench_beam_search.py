"""Beam search time and results: nanokv's `LLM.beam_search` against Hugging Face's
`generate(num_beams=...)` in the same run (with --ignore-eos, where the two searches are the
same: their sequences are compared too) and, from `bench_beam_search_vllm.py`'s JSON line
(--vllm-json), vLLM's `LLM.beam_search` on the same prompts (sequences compared; its time is
from its own run). Prints one JSON line; medians of --repeats whole searches.

    .venv/bin/python benchmarks/bench_beam_search.py --ignore-eos --hf
    /work/.vllm-venv/bin/python benchmarks/bench_beam_search_vllm.py --ignore-eos > v.txt
    .venv/bin/python benchmarks/bench_beam_search.py --ignore-eos --vllm-json v.txt
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time


def make_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` token ids drawn at random (ids below 10 left out: specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def add_search_args(ap: argparse.ArgumentParser) -> None:
    """The flags this script and bench_beam_search_vllm.py share (the same search)."""
    ap.add_argument("--model", default="models/nanokv-tiny")
    ap.add_argument("--prompts", type=int, default=4, help="prompts searched together")
    ap.add_argument("--prompt-len", type=int, default=200, help="tokens per prompt")
    ap.add_argument("--beam-width", type=int, default=4, help="1-10")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--length-penalty", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)


def check_search_args(ap: argparse.ArgumentParser, args, positive: tuple[str, ...] = ()):
    """The shared flags' ranges (and the caller's own `positive` ones): ap.error otherwise."""
    for name in ("prompts", "prompt_len", "max_tokens", "repeats", *positive):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.beam_width <= 10:
        ap.error("--beam-width must be in [1, 10]")


def vllm_result(path: str) -> dict:
    """The JSON line of bench_beam_search_vllm.py's output (vLLM's logs around it)."""
    with open(path) as f:
        for line in f:
            if line.startswith('{"engine"'):
                return json.loads(line)
    raise ValueError(f"{path} holds no line starting with {{\"engine\"")


def compare(ours: list[list[dict]], theirs: list[list[dict]]) -> dict:
    """How many prompts have the same sequences in the same order, and the largest difference
    of a cumulative log-probability where they do."""
    same, diff = 0, 0.0
    for a, b in zip(ours, theirs):
        if [s["tokens"] for s in a] == [s["tokens"] for s in b]:
            same += 1
            diff = max(diff, max(abs(x["cum_logprob"] - y["cum_logprob"]) for x, y in zip(a, b)))
    return {"prompts_same": same, "prompts": len(ours), "max_cum_logprob_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_search_args(ap)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hf", action="store_true",
                    help="also time Hugging Face's beam search (needs --ignore-eos)")
    ap.add_argument("--vllm-json", help="bench_beam_search_vllm.py's output, to compare")
    args = ap.parse_args()
    check_search_args(ap, args, ("num_threads", "block_size"))
    if args.hf and not args.ignore_eos:
        ap.error("--hf needs --ignore-eos (Hugging Face's search ends beams differently)")

    import torch

    from nanokv import LLM, BeamSearchParams

    torch.set_num_threads(args.num_threads)
    vocab = json.loads(open(f"{args.model}/config.json").read())["vocab_size"]
    prompts = make_prompts(vocab, args.prompts, args.prompt_len)
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                              ignore_eos=args.ignore_eos, length_penalty=args.length_penalty)
    llm = LLM(args.model, num_threads=args.num_threads, block_size=args.block_size,
              max_num_seqs=max(16, 2 * args.prompts * args.beam_width))
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
    times, outs = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.beam_search(prompts, params)
        times.append(time.perf_counter() - start)
    sequences = [[{"tokens": s.tokens[len(p):], "cum_logprob": s.cum_logprob}
                  for s in o.sequences] for p, o in zip(prompts, outs)]
    result = {"model": args.model, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "beam_width": args.beam_width, "max_tokens": args.max_tokens,
              "ignore_eos": args.ignore_eos, "length_penalty": args.length_penalty,
              "num_threads": args.num_threads, "block_size": args.block_size,
              "nanokv": {"median_s": statistics.median(times), "times_s": times}}
    del llm, outs
    gc.collect()
    if args.hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        ids = torch.tensor(prompts)  # [prompts, prompt_len]: one length, no padding
        hf_times, got = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            with torch.no_grad():
                got = hf.generate(ids, attention_mask=torch.ones_like(ids),
                                  num_beams=args.beam_width,
                                  num_return_sequences=args.beam_width,
                                  max_new_tokens=args.max_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0,
                                  length_penalty=args.length_penalty, early_stopping=False,
                                  output_scores=True, return_dict_in_generate=True)
            hf_times.append(time.perf_counter() - start)
        w = args.beam_width
        theirs = [[{"tokens": got.sequences[i * w + j, args.prompt_len:].tolist(),
                    # HF divides by the generated length only
                    "cum_logprob": float(got.sequences_scores[i * w + j])
                    * args.max_tokens ** args.length_penalty} for j in range(w)]
                  for i in range(args.prompts)]
        result["hf"] = {"median_s": statistics.median(hf_times), "times_s": hf_times,
                        **compare(sequences, theirs)}
        result["hf_over_nanokv"] = result["hf"]["median_s"] / result["nanokv"]["median_s"]
    if args.vllm_json:
        theirs = vllm_result(args.vllm_json)
        result["vllm"] = {"median_s": theirs["median_s"], "times_s": theirs["times_s"],
                          **compare(sequences, theirs["sequences"])}
        result["vllm_over_nanokv"] = result["vllm"]["median_s"] / result["nanokv"]["median_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
