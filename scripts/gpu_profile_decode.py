"""A torch-profiler look at a few decode steps on CUDA, with the decode graphs and without (the same
engine, its graphs set aside): wall time per step, GPU time by kernel, kernel launches per step.

    PYTHONPATH=. python scripts/gpu_profile_decode.py --model DIR --out OUT_DIR

`--requests` requests with `--prompt-len`-token random prompts are prefilled (timed), then
`--steps` decode-only steps are profiled each way (graphs only where the cache's backend takes
them). Writes OUT_DIR/profile_decode{_DTYPE}.json (the figures; the suffix for a
`--kv-cache-dtype` other than auto, then `_torch_write` with `--kvquant-write torch`) and
OUT_DIR/profile_decode{_DTYPE}_{graphs,eager}.txt (the profiler's tables); exits 2 without
CUDA (`--device cpu`: a dry run of the script's own logic).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nanokv import LLM, SamplingParams


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def decode_steps(engine, steps: int) -> list[float]:
    """Wall seconds of `steps` decode-only engine steps (each ends with its token ids on the
    host)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        sync(engine)
        times.append(time.perf_counter() - t0)
    return times


def profiled(engine, steps: int, table_path: Path) -> dict:
    """The profiler over `steps` decode steps: wall ms per step, GPU ms per step, kernel-launch
    calls per step; the profiler's table (top 40 by device time) written to table_path."""
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        times = decode_steps(engine, steps)
    events = prof.key_averages()
    sort = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
    table_path.write_text(events.table(sort_by=sort, row_limit=40))
    launches = {e.key: e.count for e in events
                if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                             "cuLaunchKernelEx", "cudaLaunchKernelExC")}
    gpu_us = sum(e.self_device_time_total for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"step_wall_ms": [round(t * 1e3, 2) for t in times],
            "gpu_ms_per_step": round(gpu_us / 1e3 / steps, 2),
            "launch_calls_per_step": {k: v / steps for k, v in launches.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the engine's --kv-cache-dtype (e.g. int8, kvquant; default auto)")
    ap.add_argument("--kvquant-write", default="kernel", choices=["kernel", "torch"],
                    help="a kvquant store's quantize-on-write: its kernels (Triton on CUDA, C "
                         "on CPU; the default) or the PyTorch path (the A/B)")
    args = ap.parse_args(argv)
    if args.kvquant_write == "torch" and args.kv_cache_dtype != "kvquant":
        ap.error("--kvquant-write torch takes --kv-cache-dtype kvquant")
    for name in ("requests", "prompt_len", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prompt_len >= 4000:
        ap.error("--prompt-len must be under 4000 (the engine's max_model_len is 4096)")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, device=args.device,
              dtype="bfloat16" if args.device == "cuda" else "float32", skip_tokenizer_init=True,
              max_num_seqs=args.requests, max_num_batched_tokens=16384, max_model_len=4096,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    if args.kvquant_write == "torch":  # eager only: the graphs were captured with the kernels
        engine.kv_cache.triton_write = engine.kv_cache.native_write = False
        engine.runner.graphs = None
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=4000 - args.prompt_len, ignore_eos=True)
    vocab = engine.hf_config.vocab_size
    for _ in range(args.requests):
        engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    t0, prefill_steps = time.perf_counter(), 0
    while engine.scheduler.waiting or any(  # prefill everything first
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
        prefill_steps += 1
    sync(engine)
    prefill_s = time.perf_counter() - t0
    decode_steps(engine, 3)  # warm
    result = {"model": args.model, "requests": args.requests, "prompt_len": args.prompt_len,
              "kv_cache_dtype": args.kv_cache_dtype, "prefill_s": round(prefill_s, 3),
              "prefill_steps": prefill_steps, "backend": engine.attention_backend.name,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    name = "profile_decode" + ("" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}")
    name += "_torch_write" if args.kvquant_write == "torch" else ""
    result["kvquant_write"] = args.kvquant_write
    graphs = engine.runner.graphs
    if graphs is not None:
        result["graphs"] = profiled(engine, args.steps, out / f"{name}_graphs.txt")
        engine.runner.graphs = None
    result["eager"] = profiled(engine, args.steps, out / f"{name}_eager.txt")
    engine.runner.graphs = graphs
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
