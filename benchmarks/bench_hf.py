#!/usr/bin/env python
"""HF transformers peer benchmark: static batching on the shared synthetic workload.

All requests go in one left-padded batch through ``model.generate`` (greedy), which runs
until the longest request is done: every request gets ``max(output_len)`` tokens, but only
each request's own ``output_len`` counts as useful output (the rest is the waste of static
batching). Prints one JSON line (BenchResult).

    .venv/bin/python benchmarks/bench_hf.py --model /tmp/qwen3-0.6b-random
    python benchmarks/bench_hf.py --model M --device cuda --dtype bfloat16   # on a GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

WORKLOAD_PY = Path(__file__).resolve().parents[1] / "nanokv" / "workloads" / "workload.py"


def load_workload_module():
    spec = importlib.util.spec_from_file_location("nanokv_bench_workload", WORKLOAD_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def left_pad(requests, pad_id: int):
    import torch

    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for i, r in enumerate(requests):
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[i, width - n :] = 1
    return ids, mask


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="HF transformers static-batching peer benchmark")
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda)")
    args = ap.parse_args(argv)
    if args.num_requests < 1:
        ap.error("--num-requests must be at least 1")
    for name in ("prompt_len", "output_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            ap.error(f"--{name.replace('_', '-')} takes MIN MAX with 1 <= MIN <= MAX")

    wl = load_workload_module()

    import torch
    from transformers import AutoModelForCausalLM

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        ap.error(f"--device takes cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    print(
        f"[bench_hf] load {time.perf_counter() - t0:.1f}s, torch threads {torch.get_num_threads()}",
        file=sys.stderr,
        flush=True,
    )

    requests = wl.make_workload(
        args.num_requests,
        tuple(args.prompt_len),
        tuple(args.output_len),
        model.config.vocab_size,
        args.seed,
    )
    pad_id = model.generation_config.pad_token_id
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    if pad_id is None:
        pad_id = 0
    ids, mask = (x.to(device) for x in left_pad(requests, pad_id))
    max_new = max(r.output_len for r in requests)
    gen_kw = {"do_sample": False, "pad_token_id": pad_id, "temperature": None, "top_p": None}
    gen_kw["top_k"] = None

    with torch.inference_mode():
        # Warm-up (not timed): short prompts, a few tokens.
        t0 = time.perf_counter()
        model.generate(
            input_ids=ids[:2, -16:],
            attention_mask=mask[:2, -16:].clamp(min=1),
            max_new_tokens=4,
            min_new_tokens=4,
            **gen_kw,
        )
        sync(device)
        print(f"[bench_hf] warm-up {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            **gen_kw,
        )
        sync(device)
        elapsed = time.perf_counter() - t0

    generated = out.shape[1] - ids.shape[1]
    if generated != max_new:
        raise RuntimeError(f"generated {generated} tokens per row, wanted {max_new}")
    print(
        f"[bench_hf] batch {ids.shape[0]}x{ids.shape[1]} + {max_new} new tokens, {elapsed:.1f}s",
        file=sys.stderr,
        flush=True,
    )
    print(wl.summarize("hf", requests, elapsed).to_json(), flush=True)


if __name__ == "__main__":
    main()
