"""`nanokv advise` and `nanokv simulate` (hooked into nanokv/cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from nanokv.layers.int8_weights import QUANTIZATIONS
from nanokv.sim.synthetic import WORKLOADS


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1 (argparse names the flag when this raises)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None


def _positive_floats(text: str) -> tuple[float, ...]:
    """Comma-separated finite numbers > 0."""
    values = _floats(text)
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers > 0, got {text!r}")
    return values


def _single(parse, what: str):
    """An argparse type of one value from a comma-separated one (`parse`)."""
    def one(text: str):
        values = parse(text)
        if len(values) != 1:
            raise argparse.ArgumentTypeError(f"expected one {what}, got {text!r}")
        return values[0]
    return one


_positive_int = _single(_ints, "integer >= 1")
_positive_float = _single(_positive_floats, "number > 0")


def _kv_dtypes(text: str) -> tuple[str, ...]:
    from nanokv.cache.registry import KV_CACHE_DTYPES

    values = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in values if d not in KV_CACHE_DTYPES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"unknown kv_cache_dtype {bad or text!r}; allowed: "
                                         f"{', '.join(KV_CACHE_DTYPES)}")
    return values


def _add_common(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a trace file (nanokv serve --trace-file)")
    src.add_argument("--workload", choices=WORKLOADS, help="a synthetic trace of this shape")
    p.add_argument("--num-requests", type=_positive_int, default=2000,
                   help="requests of the synthetic workload (default 2000)")
    p.add_argument("--rate", type=_positive_float, default=10.0,
                   help="mean arrival rate of the synthetic workload, requests/s (default 10)")
    p.add_argument("--workload-seed", type=int, default=0,
                   help="seed of the synthetic workload's lengths and arrivals (default 0)")
    p.add_argument("--save-trace", default=None, metavar="FILE",
                   help="also write the synthetic trace to FILE")
    p.add_argument("--model-config", required=True, metavar="DIR",
                   help="directory with the model's Hugging Face config.json (no weights read); "
                        "a sliding window on every layer (Mistral, Qwen's windowed configs) is "
                        "replayed as the engine runs it: the blocks behind each request's "
                        "window freed after every step, no KV policy")
    p.add_argument("--kv-memory", required=True, help="KV cache memory, e.g. 80GiB")
    p.add_argument("--device", default="h200",
                   help="roofline step model of this device: h200, h100, a100, l40s, cpu "
                        "(default h200)")
    p.add_argument("--step-model", default=None, metavar="FILE",
                   help="a fitted step model (nanokv bench --step-model-out) instead of "
                        "--device")
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="fit the step model and the server's time around each step to a "
                        "served run's step log (nanokv serve --trace-steps) instead of "
                        "--device")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="default: min(the model's, 8192)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                   help="token budget of a step (default 8192)")
    p.add_argument("--compute-dtype", default=None, choices=("bfloat16", "float16",
                                                             "float32"),
                   help="the model's weight and activation dtype in the step model (default "
                        "bfloat16; float32 with --quantization int8, the only one it takes)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="the engine's --quantization: int8 weights, read at one byte a "
                        "parameter by the roofline step model (default: none, the compute "
                        "dtype's bytes)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def add_advise_parser(sub, add_engine_args=None, engine_options=None) -> None:
    a = sub.add_parser("advise", help="size a deployment: simulate a trace over block sizes, "
                                      "KV dtypes, max_num_seqs and KV policies")
    _add_common(a)
    a.add_argument("--block-sizes", type=_ints, default=(16, 32, 64, 128, 256, 512, 1024),
                   help="comma-separated block sizes to try (default 16,32,...,1024)")
    a.add_argument("--kv-dtypes", type=_kv_dtypes, default=("auto", "fp8", "kvquant"),
                   help="comma-separated kv_cache_dtype values (default auto,fp8,kvquant)")
    a.add_argument("--max-num-seqs", type=_ints, default=(64, 128, 256, 512),
                   help="comma-separated max_num_seqs values to try (default 64,128,256,512)")
    a.add_argument("--compressions", type=_floats, default=(0.5, 0.75),
                   help="KV policy compression ratios to try (kvpress convention: 0.75 = 4x)")
    a.add_argument("--eviction-ratios", type=_floats, default=(0.2,),
                   help="pool-pressure eviction ratios to try (PagedEviction's eviction_ratio)")
    a.add_argument("--rates", type=_positive_floats, default=(),
                   help="synthetic workloads only: also simulate the recommendation at these "
                        "arrival rates (req/s) and say where the KV pool becomes the bottleneck")
    a.add_argument("--out", default=None, help="directory for advise.md, advise.json, plot")
    a.set_defaults(func=cmd_advise)

    s = sub.add_parser("simulate", help="replay a trace through the block manager and "
                                        "scheduler with a step-time model (no weights)")
    _add_common(s)
    s.add_argument("--block-size", type=_positive_int, default=256,
                   help="KV block size in tokens (default 256)")
    s.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache dtype, as the engine's --kv-cache-dtype (default auto)")
    s.add_argument("--max-num-seqs-sim", dest="max_num_seqs", type=_positive_int, default=256,
                   help="most requests running at once in the simulated engine (default 256)")
    s.add_argument("--compression-ratio", type=float, default=None,
                   help="a KV policy cutting each prompt's cache by this fraction, in [0, 1) "
                        "(default: none)")
    s.add_argument("--eviction-ratio", type=float, default=None,
                   help="PagedEviction's pool-pressure mode: evict blocks while pool usage is "
                        "above 1 - this, in (0, 1] (default: none)")
    s.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="the pool in blocks (a served run's --num-kv-blocks) instead of what "
                        "--kv-memory holds")
    s.add_argument("--admission", choices=("arrival", "recorded"), default="arrival",
                   help="arrival: requests join the first step after they arrive (default); "
                        "recorded: at the step the serving engine added them (a served trace)")
    s.set_defaults(func=cmd_simulate)


def _load(args):
    import torch

    from nanokv.config import parse_memory
    from nanokv.sim.advise import AdviseSettings, model_layer_windows, model_window
    from nanokv.sim.step_model import DEVICES, LinearStepModel, ModelShape
    from nanokv.sim.synthetic import WorkloadShape, generate
    from nanokv.sim.trace import read_trace, write_trace

    model = ModelShape.load(args.model_config)
    max_len = args.max_model_len or min(model.max_position_embeddings, 8192)
    if max_len > model.max_position_embeddings:  # as the engine refuses it
        raise ValueError(f"--max-model-len {max_len} is beyond the model's "
                         f"max_position_embeddings {model.max_position_embeddings}")
    fitted = device = overhead = None
    if args.step_model and args.step_log:
        raise ValueError("give --step-model or --step-log, not both")
    if args.step_model:
        fitted = LinearStepModel.load(args.step_model)
    elif args.step_log:
        from nanokv.sim.server_overhead import fit_server_overhead
        from nanokv.sim.step_log import (fit_engine_step, fit_step_log, read_step_log)

        log = read_step_log(args.step_log)
        if all(e.step_dur is not None and e.pre is not None for e in log):
            # the engine step and the server's time around it, each from what it depends on
            fitted = fit_engine_step(log, f"step log {args.step_log}")
            overhead = fit_server_overhead(log, fitted)
        else:  # a log without the split: whole turns, the machine's load fitted per window
            fitted = fit_step_log(log, f"step log {args.step_log}")
    elif args.device not in DEVICES:
        raise ValueError(f"--device must be one of {sorted(DEVICES)}, got {args.device!r}")
    else:
        device = DEVICES[args.device]

    def make(rate: float):
        return generate(args.workload, args.num_requests, rate, args.workload_seed,
                        WorkloadShape(max_model_len=max_len))

    if args.trace:
        records = read_trace(args.trace)
    else:
        records = make(args.rate)
        if args.save_trace:
            write_trace(args.save_trace, records)
    settings = AdviseSettings(model=model, kv_memory=parse_memory(args.kv_memory),
                              device=device, fitted=fitted, overhead=overhead,
                              compute_dtype=getattr(torch, args.compute_dtype or (
                                  "float32" if args.quantization else "bfloat16")),
                              quantization=args.quantization,
                              max_model_len=max_len,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              sliding_window=model_window(args.model_config, max_len),
                              layer_windows=model_layer_windows(args.model_config, max_len))
    return records, settings, make


def cmd_simulate(args: argparse.Namespace) -> int:
    from nanokv.sim.advise import Candidate, evaluate

    from dataclasses import replace

    c = Candidate(args.block_size, args.kv_cache_dtype, args.max_num_seqs,
                  args.compression_ratio, args.eviction_ratio)  # checked before any work
    records, settings, _ = _load(args)
    settings = replace(settings, admission=args.admission, num_blocks=args.num_kv_blocks)
    o = evaluate(records, settings, c)
    print(json.dumps({"num_blocks": o.num_blocks, "bytes_per_token": o.bytes_per_token,
                      **o.result.summary()}, indent=1, default=str))
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from nanokv.sim import advise as adv

    if args.rates and args.trace:  # before any work
        raise ValueError("--rates needs --workload (a trace has its own arrival times)")
    records, settings, make = _load(args)
    kv_dtypes, left_out = adv.engine_kv_dtypes(args.model_config, args.kv_dtypes)
    if left_out:
        print(f"[advise] {left_out}", file=sys.stderr)
    settings = replace(settings, block_sizes=args.block_sizes,
                       kv_dtypes=kv_dtypes,
                       max_num_seqs=args.max_num_seqs, compressions=args.compressions,
                       eviction_ratios=args.eviction_ratios)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    outcomes = adv.sweep(records, settings,
                         progress=lambda msg: print(f"[advise] {msg}", file=sys.stderr))
    step = outcomes[0].result.step_model
    src = args.trace or (f"synthetic {args.workload}, {args.num_requests} requests at "
                         f"{args.rate:g} req/s, seed {args.workload_seed}")
    text = [f"# nanokv advise: {src}", "",
            f"model {args.model_config}, KV memory {args.kv_memory}, step model: {step}", "",
            adv.table(outcomes), "", "**Recommendation.** " + adv.recommend(outcomes)]
    best = adv.recommended(outcomes)[0].candidate  # what the report recommends
    rows = []
    if args.rates:
        rows = adv.pool_bottleneck(make, settings, best, list(args.rates))
        text += ["", f"## Offered load, {best.block_size} / {best.kv_dtype} / max_num_seqs "
                     f"{best.max_num_seqs} / {best.policy}", "",
                 adv.bottleneck_table(rows, best.max_num_seqs)]
    report = "\n".join(text)
    print(report)
    if args.out:
        with open(os.path.join(args.out, "advise.md"), "w", encoding="utf-8") as f:
            f.write(report + "\n")
        with open(os.path.join(args.out, "advise.json"), "w", encoding="utf-8") as f:
            json.dump({"source": src, "outcomes": [
                {"candidate": asdict(o.candidate), "num_blocks": o.num_blocks,
                 "bytes_per_token": o.bytes_per_token, "capacity_req_s": o.capacity_req_s,
                 "capacity_tok_s": o.capacity_tok_s, "arrivals_compressed": o.compression,
                 "at_capacity": o.saturated.summary() if o.saturated else None,
                 **o.result.summary()}
                for o in outcomes],
                "rates": [{"rate": rate, **r.summary()} for rate, r in rows]},
                f, indent=1, default=str)
        adv.plot(outcomes, os.path.join(args.out, "block_size.png"), src)
    return 0
