"""Command line: `nanokv generate | bench | serve | eval | calibrate | advise | simulate`.

Every engine option of `LLM(...)` is a flag here (`max_num_seqs` -> `--max-num-seqs`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

from nanokv.config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, EngineConfig
from nanokv.extras import MissingExtraError, extra_for_module, install_hint, require

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "models" / "nanokv-tiny")


def _block_size(value: str):
    """'auto' or an integer (its range is checked with the config)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or an integer in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
            f"got {value!r}") from None


def _json(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be JSON, e.g. '{{\"window\": 32}}' ({e}), "
                                         f"got {value!r}") from None


_CLI_TYPES = {"block_size": _block_size, "json": _json}


def _choices(spec):
    """Choices named by the config are read from their registries here (the config imports
    neither)."""
    if spec == "kv_cache_dtypes":
        from nanokv.cache.registry import KV_CACHE_DTYPES

        return KV_CACHE_DTYPES
    if spec == "attention_backends":
        from nanokv.attention.selector import backend_names

        return backend_names()
    return spec


def add_engine_args(p: argparse.ArgumentParser, default_model: bool = True) -> None:
    """One flag per EngineConfig field (`max_num_seqs` -> `--max-num-seqs`), its default and
    help taken from the field, so neither is written twice."""
    g = p.add_argument_group("engine options")
    if default_model:
        g.add_argument("--model", default=DEFAULT_MODEL,
                       help="local Hugging Face model directory (default: the shipped "
                            "models/nanokv-tiny)")
    else:
        g.add_argument("--model", required=True, help="local Hugging Face model directory")
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        meta = dict(f.metadata)
        flag = "--" + f.name.replace("_", "-")
        help_text = meta.pop("help")
        if f.default is True:
            g.add_argument(meta.pop("false_flag"), dest=f.name, action="store_false",
                           help=f"disable: {help_text}")
            continue
        if f.default is False:
            g.add_argument(flag, dest=f.name, action="store_true", help=help_text)
            continue
        kind = meta.pop("type", None)
        kwargs = dict(default=f.default, dest=f.name, help=help_text
                      + ("" if f.default is None else f" (default: {f.default})"))
        if kind is not None:
            kwargs["type"] = _CLI_TYPES.get(kind, kind)
        elif isinstance(f.default, (int, float)):
            kwargs["type"] = type(f.default)
        if "choices" in meta:
            kwargs["choices"] = _choices(meta.pop("choices"))
        kwargs.update(meta)
        g.add_argument(flag, **kwargs)
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keywords the parsed flags give (everything but the model)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name != "model"}


def token_ids_arg(text: str) -> list[int]:
    """--prompt-token-ids: comma-separated non-negative integers."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids (non-negative "
                                         f"integers, e.g. 1,2,3), got {text!r}")
    return ids


def generate_prompts(args: argparse.Namespace) -> list:
    """The prompts of `nanokv generate`, checked before the model loads: text (--prompt) and
    token ids (--prompt-token-ids), in that order; the default prompt when neither is given."""
    texts, ids = args.prompt or [], args.prompt_token_ids or []
    if any(not p for p in texts):
        raise ValueError("--prompt must not be empty")
    if args.skip_tokenizer_init and texts:
        raise ValueError("--skip-tokenizer-init loads no tokenizer, so text prompts cannot be "
                         "encoded: give prompts as --prompt-token-ids 1,2,3")
    if texts or ids:
        return [*texts, *ids]
    if args.skip_tokenizer_init:
        raise ValueError("--skip-tokenizer-init needs the prompts as --prompt-token-ids 1,2,3 "
                         "(the default prompt is text)")
    return ["def fibonacci(n):"]


def generate_lora(args: argparse.Namespace):
    """`nanokv generate --lora-path DIR`: the LoRARequest every prompt runs under (and LoRA
    turned on), else None."""
    from nanokv.lora import LoRARequest

    if args.lora_path is None:
        return None
    args.enable_lora = True
    return LoRARequest("lora", 1, args.lora_path)


def cmd_generate(args: argparse.Namespace) -> int:
    from nanokv import LLM, SamplingParams

    if args.beam_width is not None:
        return beam_generate(args)
    if args.length_penalty != 1.0:
        raise ValueError("--length-penalty ranks beam search's sequences: it needs --beam-width")
    # the sampling flags and prompts checked before the model loads
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.sampling_seed, max_tokens=args.max_tokens,
                            stop=args.stop or [], ignore_eos=args.ignore_eos)
    if params.stop and args.skip_tokenizer_init:
        raise ValueError("--stop strings are matched in the output text, which needs the "
                         "tokenizer that --skip-tokenizer-init leaves out")
    prompts = generate_prompts(args)
    lora = generate_lora(args)
    llm = LLM(args.model, **engine_options(args))
    for line in llm.engine.startup_lines:
        print(f"[nanokv] {line}", file=sys.stderr)
    note = _model_note(args.model)
    if note:
        print(f"[nanokv] {note}", file=sys.stderr)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora)
    elapsed = time.perf_counter() - t0
    for out in outs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text,
                              "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                              "cached_tokens": out.num_cached_tokens}))
        elif out.prompt is None:  # a token-id prompt
            print(f"--- prompt token ids: {out.prompt_token_ids}")
            print(f"output token ids: {out.token_ids}")
            if out.text:
                print(out.text)
        else:
            print(f"--- prompt: {out.prompt!r}")
            print(out.prompt + out.text)
            print(f"--- {len(out.token_ids)} tokens, finish: {out.finish_reason}, "
                  f"ttft {out.metrics.ttft * 1000:.0f} ms")
    n = sum(len(o.token_ids) for o in outs)
    print(f"[nanokv] {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def beam_generate(args: argparse.Namespace) -> int:
    """`nanokv generate --beam-width N`: each prompt's best sequences, best first."""
    from nanokv import LLM, BeamSearchParams

    sampling = {"--temperature": args.temperature != 0.0, "--top-k": args.top_k != -1,
                "--top-p": args.top_p != 1.0, "--sampling-seed": args.sampling_seed is not None,
                "--stop": bool(args.stop)}
    given = [flag for flag, set_ in sampling.items() if set_]
    if given:
        raise ValueError(f"{', '.join(given)} not applied by beam search (--beam-width), which "
                         f"takes --max-tokens, --ignore-eos and --length-penalty")
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                              ignore_eos=args.ignore_eos, length_penalty=args.length_penalty)
    prompts = generate_prompts(args)
    lora = generate_lora(args)
    llm = LLM(args.model, **engine_options(args))
    for line in llm.engine.startup_lines:
        print(f"[nanokv] {line}", file=sys.stderr)
    t0 = time.perf_counter()
    outs = llm.beam_search(prompts, params, lora_request=lora)
    elapsed = time.perf_counter() - t0
    tokenizer = llm.tokenizer
    for prompt, out in zip(prompts, outs):
        shown = prompt if isinstance(prompt, str) else None
        if not args.json:
            print(f"--- prompt: {prompt!r}" if shown is not None
                  else f"--- prompt token ids: {prompt}")
        for i, seq in enumerate(out.sequences):
            start = len(seq.tokens) - seq.num_generated()
            ids = seq.tokens[start:]
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else ""
            if args.json:
                print(json.dumps({"prompt": shown, "beam": i, "text": text, "token_ids": ids,
                                  "cum_logprob": seq.cum_logprob,
                                  "finish_reason": seq.finish_reason}))
            else:
                print(f"[beam {i}] cum_logprob {seq.cum_logprob:.3f}, {len(ids)} tokens, "
                      f"finish: {seq.finish_reason}: {text if tokenizer else ids}")
    print(f"[nanokv] beam search of width {args.beam_width} in {elapsed:.2f} s", file=sys.stderr)
    return 0


def _model_note(model_dir: str) -> str | None:
    marker = Path(model_dir) / "RANDOM_WEIGHTS"
    if marker.exists():
        return "this model has RANDOM weights (a demo stand-in): its text is meaningless"
    return None


def check_output_file(flag: str, path: str | None) -> None:
    """Refuse, before any work, an output file whose directory does not exist."""
    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{flag}: the directory of {path!r} does not exist")


def cmd_bench(args: argparse.Namespace) -> int:
    from nanokv.workloads.run import run_bench

    check_output_file("--step-model-out", args.step_model_out)

    recorders = []

    def attach(engine):
        from nanokv.sim.step_model import StepRecorder

        recorders.append(StepRecorder(engine))

    result = run_bench(args.model, engine_options(args), args.num_requests,
                       tuple(args.prompt_len), tuple(args.output_len), args.workload_seed,
                       verbose=not args.json, temperature=args.temperature,
                       on_engine_ready=attach if args.step_model_out else None)
    print(result.to_json() if args.json else _format_result(result))
    if args.step_model_out:
        fitted = recorders[0].fit(source=f"nanokv bench {args.model}, "
                                         f"{len(recorders[0].samples)} steps")
        with open(args.step_model_out, "w", encoding="utf-8") as f:
            f.write(fitted.to_json() + "\n")
        print(f"[nanokv] step model: {fitted.describe()} -> {args.step_model_out}",
              file=sys.stderr)
    return 0


def _format_result(r) -> str:
    ttft = f"{r.ttft_median_s * 1000:.0f} ms" if r.ttft_median_s is not None else "-"
    tpot = f"{r.tpot_median_s * 1000:.1f} ms" if r.tpot_median_s is not None else "-"
    return (f"requests {r.num_requests}, output tokens {r.output_tokens}, "
            f"elapsed {r.elapsed_s:.2f} s\n"
            f"output throughput {r.output_tok_s:.1f} tok/s, total {r.total_tok_s:.1f} tok/s\n"
            f"median TTFT {ttft}, median TPOT {tpot}, peak KV blocks {r.peak_kv_blocks}, "
            f"peak running {r.peak_running}, preemptions {r.num_preemptions}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanokv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompt-token-ids", action="append", type=token_ids_arg, metavar="IDS",
                   help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable; the "
                        "way to prompt with --skip-tokenizer-init)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--beam-width", type=int, default=None,
                   help="beam search of this width (1-10; vLLM's LLM.beam_search): prints each "
                        "prompt's best sequences; takes --max-tokens, --ignore-eos and "
                        "--length-penalty, not the sampling flags nor --stop")
    g.add_argument("--length-penalty", type=float, default=1.0,
                   help="with --beam-width: sequences ranked by cumulative log-probability / "
                        "length ** this")
    g.add_argument("--lora-path", default=None, metavar="DIR",
                   help="run every prompt under this LoRA adapter (a PEFT directory; turns on "
                        "--enable-lora)")
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
    b.add_argument("--step-model-out", default=None, metavar="FILE",
                   help="time every step and write the fitted step-time model (JSON) for "
                        "nanokv simulate / advise --step-model")
    b.set_defaults(func=cmd_bench)

    for module, hook in (("nanokv.server.cli", "add_serve_parser"),
                         ("nanokv.eval.cli", "add_eval_parser"),
                         ("nanokv.quant.cli", "add_calibrate_parser"),
                         ("nanokv.sim.cli", "add_advise_parser")):
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
    except OSError as e:  # a file named on the command line: missing, unreadable, unwritable
        print(f"nanokv: error: {e.strerror or e}: {e.filename}" if e.filename
              else f"nanokv: error: {e}", file=sys.stderr)
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
