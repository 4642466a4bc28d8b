#!/usr/bin/env python
"""Speculative decoding (n-gram drafts, or a draft model's with --draft-model) against decoding
alone, and Hugging Face transformers' prompt lookup decoding (`generate(prompt_lookup_num_tokens=
k)`) or assisted generation (`generate(assistant_model=draft)`, k tokens a step, no confidence
cut) against its own greedy decoding, in the same run: output tokens per second, greedy, one
request at a time (the latency case drafts are for) and a batch of all prompts at once (nanokv).

The workload copies: each prompt is a random segment of --segment tokens said --repeats-in-prompt
times, then its first half again, so a model that continues the pattern copies text it has
seen (code editing, quoting, summaries). Whether it does is the model's: the acceptance rate is
reported next to the speed. Every nanokv output is checked equal to decoding alone's.

    .venv/bin/python benchmarks/bench_speculative.py --model models/nanokv-tiny
    .venv/bin/python benchmarks/bench_speculative.py --model /tmp/qwen3-0.6b-4l-random \\
        --num-threads 2 --out docs/results/speculative
    # a draft model (benchmarks/make_draft_pair.py makes a pair that agrees often)
    .venv/bin/python benchmarks/bench_speculative.py --model /tmp/draft-pair/target \\
        --draft-model /tmp/draft-pair/draft --repeats-in-prompt 1 --num-threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path


def make_prompts(vocab: int, count: int, segment: int, repeats: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        seg = [rng.randrange(10, vocab - 10) for _ in range(segment)]
        prompts.append(seg * repeats + seg[:segment // 2])
    return prompts


def time_nanokv(llm, prompts, params, batched: bool) -> tuple[float, list[list[int]]]:
    """Seconds to generate every prompt's output (one at a time, or all at once) and the
    outputs."""
    start = time.perf_counter()
    if batched:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def hf_assistant(path: str, k: int):
    """transformers' assistant model for assisted generation: k draft tokens every step (its
    constant schedule), no early stop on low confidence (as the engines' drafts)."""
    import torch
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


def time_hf(model, prompts, output_len: int, lookup: dict) -> tuple[float, list[list[int]]]:
    import torch

    start = time.perf_counter()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=0, **lookup)
            outs.append(out[0, len(p):].tolist())
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/nanokv-tiny")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--segment", type=int, default=48, help="tokens of a prompt's segment")
    ap.add_argument("--repeats-in-prompt", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8],
                    help="num_speculative_tokens values to time")
    ap.add_argument("--prompt-lookup-max", type=int, default=3)
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--per-batch-size", type=json.loads, default=None,
                    help="num_speculative_tokens_per_batch_size for every k, JSON, e.g. "
                         "'[[1, 1, 8], [2, 64, 0]]' (k capped by the batch size's entry)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each setting")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--kv-cache-memory", default="512MiB", help="each engine's KV pool")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="every nanokv engine's KV cache (auto, int8, fp8, kvquant, kivi)")
    ap.add_argument("--draft-model", default=None, metavar="DIR",
                    help="draft tokens from this checkpoint (speculative_config's \"model\"; "
                         "transformers' assisted generation) instead of n-grams")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None, help="directory for speculative.{json,md}")
    args = ap.parse_args()
    for name in ("prompts", "segment", "repeats_in_prompt", "output_len", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.k) < 1 or not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
        ap.error("--k must be >= 1 and 1 <= --prompt-lookup-min <= --prompt-lookup-max")

    import torch

    from nanokv import LLM, SamplingParams

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    options = dict(num_threads=args.num_threads, max_num_seqs=args.prompts,
                   kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    total = args.prompts * args.output_len
    rows, results = [], {"model": args.model, "draft_model": args.draft_model,
                         "prompts": args.prompts,
                         "output_len": args.output_len, "per_batch_size": args.per_batch_size,
                         "kv_cache_dtype": args.kv_cache_dtype,
                         "settings": []}
    prompts, reference, base = None, None, {}
    for k in [None, *args.k]:  # one engine at a time: each holds its own weights and pool
        method = "draft" if args.draft_model else "ngram"
        name = "nanokv" if k is None else f"nanokv {method} k={k}"
        spec = None if k is None else (
            {"model": args.draft_model, "num_speculative_tokens": k} if args.draft_model
            else {"method": "ngram", "num_speculative_tokens": k,
                  "prompt_lookup_max": args.prompt_lookup_max,
                  "prompt_lookup_min": args.prompt_lookup_min})
        if spec is not None and args.per_batch_size is not None:
            spec["num_speculative_tokens_per_batch_size"] = args.per_batch_size
        llm = LLM(args.model, speculative_config=spec, **options)
        if prompts is None:
            prompts = make_prompts(llm.engine.hf_config.vocab_size, args.prompts, args.segment,
                                   args.repeats_in_prompt, 0)
            results.update(prompt_len=len(prompts[0]), torch_threads=torch.get_num_threads())
        for batched in (False, True):
            time_nanokv(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=4), batched)
            stats = llm.engine.scheduler.spec_stats
            before = stats.copy() if stats else None
            times = []
            for _ in range(args.repeats):
                seconds, outs = time_nanokv(llm, prompts, params, batched)
                times.append(seconds)
                reference = reference or outs
                if outs != reference:
                    raise SystemExit(f"{name}: outputs differ from decoding alone's")
            median = statistics.median(times)
            base.setdefault(batched, median)
            rate = stats.since(before).acceptance_rate if stats else None
            mode = f"batch of {args.prompts}" if batched else "one at a time"
            rows.append((mode, name, total / median, base[batched] / median, rate))
            results["settings"].append({"mode": mode, "engine": name, "k": k,
                                        "seconds": times, "tok_s": total / median,
                                        "vs_plain": base[batched] / median,
                                        "acceptance_rate": rate})
        del llm
        gc.collect()
    rows.sort(key=lambda r: r[0] != "one at a time")
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        base = None
        for k in [None, *args.k]:
            if k is None:
                lookup = {}
            elif args.draft_model:
                lookup = {"assistant_model": hf_assistant(args.draft_model, k)}
            else:
                lookup = {"prompt_lookup_num_tokens": k,
                          "max_matching_ngram_size": args.prompt_lookup_max}
            time_hf(hf, prompts[:1], 4, lookup)
            times = []
            for _ in range(args.repeats):
                seconds, outs = time_hf(hf, prompts, args.output_len, lookup)
                times.append(seconds)
            same = outs == reference
            del outs
            median = statistics.median(times)
            base = base or median
            how = "assisted" if args.draft_model else "prompt lookup"
            name = "HF transformers" + ("" if k is None else f" {how} k={k}")
            rows.append(("one at a time", name, total / median, base / median,
                         None if same else "tokens differ"))
            results["settings"].append({"mode": "one at a time", "engine": name, "k": k,
                                        "seconds": times, "tok_s": total / median,
                                        "vs_plain": base / median,
                                        "same_tokens_as_nanokv": same})
    lines = ["| mode | engine | output tok/s | vs its own decoding alone | draft acceptance |",
             "|---|---|---|---|---|"]
    for mode, name, tok_s, ratio, rate in rows:
        acc = "-" if rate is None else rate if isinstance(rate, str) else f"{rate:.0%}"
        lines.append(f"| {mode} | {name} | {tok_s:.1f} | {ratio:.2f}x | {acc} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "speculative.json").write_text(json.dumps(results, indent=2))
        (out / "speculative.md").write_text(
            f"model {args.model}, draft model {args.draft_model}, "
            f"{args.prompts} prompts of {len(prompts[0])} tokens, "
            f"{args.output_len} output tokens, greedy, torch threads "
            f"{results['torch_threads']}, medians of {args.repeats}, KV cache "
            f"{args.kv_cache_dtype}, "
            f"num_speculative_tokens_per_batch_size {args.per_batch_size}\n\n{table}\n")


if __name__ == "__main__":
    main()
