"""What decode's view costs a prefill over a quantized KV cache, two ways, medians of --repeats:

  attention   one prefill chunk's attention, `nanokv.quant.decode_view.decode_view_attention`
              (every earlier token as the store holds it, per token or staged by block) next to
              `chunk_over_prefix` over the same context (the chunk attending to itself fresh:
              the float pool's path, and the quantized path's before decode's view), for
              chunk lengths x cached pasts, on a model shape's heads (default Qwen3-0.6B's:
              16 query heads, 8 KV heads, head dim 128); with --window W, each token over its
              newest W (the float pool's path then `window_attention`)
  engine      whole prompts through the engine (max_tokens 1: prefill only) per
              kv_cache_dtype, prompt tok/s and the ratio to float32 measured in the same run

    .venv/bin/python benchmarks/bench_quant_prefill.py --model models/nanokv-tiny \\
        --prompts 8 --prompt-len 1536 --repeats 3 --num-threads 2
    # a model with a sliding window on every layer (its config's), and the attention's window
    .venv/bin/python benchmarks/bench_quant_prefill.py --model /tmp/qwen3-4l-std08-sw512 \\
        --window 512 --chunks 3072 --pasts 0 --prompts 1 --prompt-len 3072 --block-size 256

float32 compute; random inputs (attention) and random token-id prompts (engine, prefix
caching off).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanokv import LLM, SamplingParams  # noqa: E402
from nanokv.layers.attention import chunk_over_prefix, window_attention  # noqa: E402

ENGINE_SETTINGS = [("float32", {}), ("int8", dict(kv_cache_dtype="int8")),
                   ("kvquant 4-bit", dict(kv_cache_dtype="kvquant", kv_quant_bits=4)),
                   ("kivi 2-bit", dict(kv_cache_dtype="kivi", kv_quant_bits=2))]


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_rows(args) -> list[str]:
    from nanokv.quant.decode_view import decode_view_attention

    hq, hkv, d = args.heads
    gen = torch.Generator().manual_seed(0)
    rows = ["| chunk | past | block size | store | decode's view ms | chunk fresh ms | ratio |",
            "|---|---|---|---|---|---|---|"]
    for length in args.chunks:
        for past in args.pasts:
            total = past + length
            q = torch.randn(length, hq, d, generator=gen)
            k_new, v_new = (torch.randn(length, hkv, d, generator=gen) for _ in range(2))
            k_fin, v_fin = (torch.randn(total, hkv, d, generator=gen) for _ in range(2))
            qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
            if args.window is not None:  # the float pool's windowed prefill over [past; chunk]
                kh, vh = (torch.cat([x[:past], y]).transpose(0, 1).unsqueeze(0)
                          for x, y in ((k_fin, k_new), (v_fin, v_new)))  # [1, Hkv, past + L, D]
                fresh = partial(window_attention, qh, kh, vh, past, args.window, d ** -0.5)
            elif past:
                fresh = partial(chunk_over_prefix, qh, k_fin[:past], v_fin[:past], k_new, v_new,
                                d ** -0.5)
            else:
                fresh = partial(F.scaled_dot_product_attention, qh,
                                k_new.transpose(0, 1).unsqueeze(0),
                                v_new.transpose(0, 1).unsqueeze(0), is_causal=True,
                                scale=d ** -0.5, enable_gqa=True)
            t_fresh = median_time(fresh, args.repeats)
            bs = args.block_size
            start = past // bs * bs
            for label in ("per token", "staged"):
                staged = None if label == "per token" else (
                    torch.randn(total - start, hkv, d, generator=gen),
                    torch.randn(total - start, hkv, d, generator=gen))
                t = median_time(partial(decode_view_attention, q, k_new, v_new, k_fin, v_fin,
                                        staged, past, bs, d ** -0.5, args.window), args.repeats)
                rows.append(f"| {length} | {past} | {bs} | {label} | {t * 1e3:.2f} | "
                            f"{t_fresh * 1e3:.2f} | {t / t_fresh:.2f}x |")
    return rows


def engine_rows(args) -> list[str]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = ["| setting | prompt tok/s | vs float32 |", "|---|---|---|"]
    base = None
    for label, kv in ENGINE_SETTINGS:
        llm = LLM(args.model, skip_tokenizer_init=True, enable_prefix_caching=False,
                  block_size=args.block_size, max_model_len=args.prompt_len + 1,
                  max_num_batched_tokens=args.max_num_batched_tokens, **kv)
        t = median_time(partial(llm.generate, prompts, params, use_tqdm=False), args.repeats)
        rate = args.prompts * args.prompt_len / t
        base = base or rate
        rows.append(f"| {label} | {rate:.0f} | {rate / base:.2f}x |")
        del llm
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/nanokv-tiny")
    p.add_argument("--heads", type=int, nargs=3, default=[16, 8, 128],
                   metavar=("HQ", "HKV", "D"), help="the attention shape (Qwen3-0.6B's)")
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--pasts", type=int, nargs="+", default=[0, 4096])
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--window", type=int, default=None,
                   help="attention part: a sliding window of this many tokens (default none)")
    p.add_argument("--skip", choices=["attention", "engine"], default=None)
    args = p.parse_args(argv)
    for name in ("repeats", "num_threads", "prompts", "prompt_len", "block_size",
                 "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    hq, hkv, d = args.heads
    if min(args.heads) < 1 or hq % hkv:
        p.error(f"--heads: HQ, HKV, D must be >= 1 and HQ a multiple of HKV, got {args.heads}")
    if min(args.chunks) < 1 or min(args.pasts) < 0:
        p.error("--chunks must be >= 1 and --pasts >= 0")
    if args.window is not None and args.window < 1:
        p.error(f"--window must be >= 1, got {args.window}")
    torch.set_num_threads(args.num_threads)
    window = "" if args.window is None else f", attention window {args.window}"
    print(f"torch {torch.__version__}, {args.num_threads} threads, float32{window}")
    if args.skip != "attention":
        print("\n".join(attention_rows(args)))
    if args.skip != "engine":
        print("\n".join(engine_rows(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
