"""Command line: `nanokv generate | bench | serve | eval | calibrate`.

Every engine option of `LLM(...)` is a flag here (`max_num_seqs` -> `--max-num-seqs`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path

from nanokv.config import ATTENTION_BACKENDS, DEVICES, DTYPES, LINEAR_BACKENDS
from nanokv.extras import MissingExtraError, extra_for_module, install_hint, require
from nanokv.quant.registry import KV_CACHE_DTYPES

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "models" / "nanokv-tiny")


def _block_size(value: str):
    return value if value == "auto" else int(value)


def add_engine_args(p: argparse.ArgumentParser, default_model: bool = True) -> None:
    g = p.add_argument_group("engine options")
    if default_model:
        g.add_argument("--model", default=DEFAULT_MODEL,
                       help="local Hugging Face model directory (default: the shipped "
                            "models/nanokv-tiny)")
    else:
        g.add_argument("--model", required=True, help="local Hugging Face model directory")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer; prompts must be token ids, outputs carry no text")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype; auto = the checkpoint's where the device has native "
                        "support, else float32")
    g.add_argument("--device", default="auto", choices=DEVICES)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's)")
    g.add_argument("--block-size", type=_block_size, default="auto",
                   help="tokens per KV block, 16..1024, or auto (128 below 2k context, 256 up "
                        "to 32k, 512 above, 1024 above 100k)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size: bytes or with a unit, e.g. 4GiB, 512MiB")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                   help="without --kv-cache-memory: fraction of the memory left after weights "
                        "and activations (default 0.9; on CPU at most 4 GiB); the pool is "
                        "capped at what max_num_seqs full-length requests need")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact KV pool size in blocks (overrides the memory budget)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="token budget of one step (prefill chunks + decodes)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="disable chunked prefill (a prompt must fit one step)")
    g.add_argument("--seed", type=int, default=0, help="engine seed (unseeded sampling)")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                   help="auto: oneDNN-packed weights on CPU (fast path), torch F.linear "
                        "elsewhere; torch: the reference path")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="decode attention on CPU. auto: the C kernel (built on first use with "
                        "$CC, cached in $NANOKV_CACHE_DIR or ~/.cache/nanokv) when it builds and "
                        "the KV cache is float32, else torch; native: the kernel or an error; "
                        "torch: the PyTorch reference path")
    g.add_argument("--kv-policy", default=None,
                   help="KV policy (streaming, h2o, snapkv, pyramidkv, knorm, paged_eviction, "
                        "kvcrush); default: full cache")
    g.add_argument("--kv-budget", type=int, default=None, help="tokens a request keeps")
    g.add_argument("--kv-compression-ratio", type=float, default=None,
                   help="or: fraction of a request's tokens removed, in [0, 1)")
    g.add_argument("--kv-policy-options", type=json.loads, default=None,
                   help='the policy\'s options as JSON, e.g. \'{"window": 32}\'')
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the float pool, compute dtype), int8 / fp8 "
                        "(= fp8_e4m3) / fp8_e5m2 (one scale per token and head), kvquant "
                        "(2-4 bit KVQuant: per-channel pre-RoPE keys, outliers, sinks)")
    g.add_argument("--kv-quant-bits", type=int, default=None, choices=(2, 3, 4),
                   help="kvquant code width (default: the calibration's decision, else 4)")
    g.add_argument("--kv-quant-config", default=None, metavar="FILE",
                   help="kvquant calibration JSON written by `nanokv calibrate` (codebooks, "
                        "key outlier thresholds, per-layer widths)")
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def engine_options(args: argparse.Namespace) -> dict:
    return dict(
        tokenizer=args.tokenizer, skip_tokenizer_init=args.skip_tokenizer_init,
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill, seed=args.seed,
        num_threads=args.num_threads, linear_backend=args.linear_backend,
        attention_backend=args.attention_backend,
        kv_policy=args.kv_policy, kv_budget=args.kv_budget,
        kv_compression_ratio=args.kv_compression_ratio,
        kv_policy_options=args.kv_policy_options, kv_cache_dtype=args.kv_cache_dtype,
        kv_quant_bits=args.kv_quant_bits, kv_quant_config=args.kv_quant_config)


def cmd_generate(args: argparse.Namespace) -> int:
    from nanokv import LLM, SamplingParams

    llm = LLM(args.model, **engine_options(args))
    for line in llm.engine.startup_lines:
        print(f"[nanokv] {line}", file=sys.stderr)
    note = _model_note(args.model)
    if note:
        print(f"[nanokv] {note}", file=sys.stderr)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.sampling_seed, max_tokens=args.max_tokens,
                            stop=args.stop or [], ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["def fibonacci(n):"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for out in outs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text,
                              "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                              "cached_tokens": out.num_cached_tokens}))
        else:
            print(f"--- prompt: {out.prompt!r}")
            print(out.prompt + out.text)
            print(f"--- {len(out.token_ids)} tokens, finish: {out.finish_reason}, "
                  f"ttft {out.metrics.ttft * 1000:.0f} ms")
    n = sum(len(o.token_ids) for o in outs)
    print(f"[nanokv] {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def _model_note(model_dir: str) -> str | None:
    marker = Path(model_dir) / "RANDOM_WEIGHTS"
    if marker.exists():
        return "this model has RANDOM weights (a demo stand-in): its text is meaningless"
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    from nanokv.benchmark.run import run_bench

    result = run_bench(args.model, engine_options(args), args.num_requests,
                       tuple(args.prompt_len), tuple(args.output_len), args.workload_seed,
                       verbose=not args.json, temperature=args.temperature)
    print(result.to_json() if args.json else _format_result(result))
    return 0


def _format_result(r) -> str:
    ttft = f"{r.ttft_median_s * 1000:.0f} ms" if r.ttft_median_s is not None else "-"
    tpot = f"{r.tpot_median_s * 1000:.1f} ms" if r.tpot_median_s is not None else "-"
    return (f"requests {r.num_requests}, output tokens {r.output_tokens}, "
            f"elapsed {r.elapsed_s:.2f} s\n"
            f"output throughput {r.output_tok_s:.1f} tok/s, total {r.total_tok_s:.1f} tok/s\n"
            f"median TTFT {ttft}, median TPOT {tpot}, peak KV blocks {r.peak_kv_blocks}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanokv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per output")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="throughput benchmark on random token-id prompts "
                                     "(nano-vLLM's workload, scaled down)")
    add_engine_args(b)
    b.add_argument("--num-requests", type=int, default=16)
    b.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    b.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    b.add_argument("--workload-seed", type=int, default=0, help="seed of the random workload")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request, >= 0 (default 0: greedy, as the "
                        "peer scripts; nano-vLLM's own bench samples at 0.6)")
    b.add_argument("--json", action="store_true", help="print one JSON line")
    b.set_defaults(func=cmd_bench)

    for module, hook in (("nanokv.server.cli", "add_serve_parser"),
                         ("nanokv.eval.cli", "add_eval_parser"),
                         ("nanokv.quant.cli", "add_calibrate_parser")):
        try:
            add = getattr(importlib.import_module(module), hook)
        except ModuleNotFoundError as e:
            if e.name != module:  # a real import error inside the module must surface
                raise
            continue
        add(sub, add_engine_args, engine_options)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            require("serve", "nanokv serve")
        return args.func(args)
    except (ValueError, MissingExtraError) as e:
        print(f"nanokv: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = extra_for_module(e.name)
        if extra is None:
            raise
        print(f"nanokv: error: nanokv {args.command} needs {e.name}, from the [{extra}] extra: "
              f"{install_hint(extra)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
