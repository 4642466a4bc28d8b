"""`nanokv calibrate`: learn KVQuant codebooks and thresholds, pick a precision, write the JSON.

Hooked into `nanokv.cli.build_parser` with
    add_calibrate_parser(sub, add_engine_args, engine_options)
Of the engine options it uses --model, --tokenizer, --block-size (the calibration block size;
auto -> the engine's auto rule for --max-model-len or the model's length), --num-threads and
--seed; it warns about the others when they are changed, since calibration does not use them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_OUTPUT = "kv_calibration.json"


def add_calibrate_parser(subparsers, add_engine_args, engine_options) -> argparse.ArgumentParser:
    c = subparsers.add_parser(
        "calibrate", help="calibrate KV-cache quantization (KVQuant codebooks, outlier "
                          "thresholds, bit width by perplexity) and write --kv-quant-config JSON")
    add_engine_args(c)
    g = c.add_argument_group("calibration")
    g.add_argument("--text", action="append", default=None,
                   help="calibration / evaluation text file (repeatable); default: held-out "
                        "files of the Python standard library")
    g.add_argument("--output", default=DEFAULT_OUTPUT, help="calibration JSON to write")
    g.add_argument("--num-samples", type=int, default=8, help="calibration sequences")
    g.add_argument("--eval-samples", type=int, default=4, help="perplexity sequences")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    g.add_argument("--bits", type=int, nargs="+", default=[4],
                   help="candidate widths; the lowest passing one is chosen (default: 4)")
    g.add_argument("--codebook-bits", type=int, nargs="+", default=[2, 3, 4])
    g.add_argument("--outlier-fraction", type=float, default=0.01)
    g.add_argument("--num-sink-tokens", type=int, default=1)
    g.add_argument("--max-ppl-increase", type=float, default=0.2)
    g.add_argument("--kmeans-iters", type=int, default=50)
    g.add_argument("--no-nuq", action="store_true", help="uniform grids instead of codebooks")
    g.add_argument("--per-token-keys", action="store_true", help="ablation: keys per token")
    g.add_argument("--json", action="store_true", help="print the decision as one JSON line")

    def run(args: argparse.Namespace) -> int:
        return cmd_calibrate(args, engine_options, add_engine_args)

    c.set_defaults(func=run)
    return c


def _unused_engine_options(args, engine_options, add_engine_args) -> list[str]:
    probe = argparse.ArgumentParser()
    add_engine_args(probe)
    defaults = engine_options(probe.parse_args([]))
    used = {"tokenizer", "block_size", "max_model_len", "num_threads", "seed"}
    given = engine_options(args)
    return sorted(k for k, v in given.items() if k not in used and v != defaults.get(k))


def load_texts(paths: list[str] | None, min_chars: int) -> tuple[str, str]:
    """(text, a name for it): the given files, or held-out stdlib files until min_chars."""
    if paths:
        return "\n\n".join(Path(p).read_text(encoding="utf-8", errors="replace")
                           for p in paths), ",".join(paths)
    try:
        from nanokv.eval.corpus import heldout_files, read_text
    except ImportError:  # pragma: no cover - the corpus module ships with nanokv
        raise ValueError("no --text given and nanokv.eval.corpus is unavailable") from None
    parts, size = [], 0
    for path in heldout_files():
        parts.append(read_text(path))
        size += len(parts[-1])
        if size >= min_chars:
            break
    return "\n\n".join(parts), "python-stdlib-heldout"


def token_batches(token_ids: list[int], num_samples: int, eval_samples: int, seq_len: int):
    """Consecutive [num_samples, seq_len] calibration then [eval_samples, seq_len] eval ids."""
    import torch

    need = (num_samples + eval_samples) * seq_len
    if len(token_ids) < need:
        raise ValueError(f"the text has {len(token_ids)} tokens; {need} are needed "
                         f"(({num_samples} + {eval_samples}) x {seq_len}): give more text or "
                         f"fewer / shorter samples")
    ids = torch.tensor(token_ids[:need]).view(num_samples + eval_samples, seq_len)
    return ids[:num_samples], ids[num_samples:]


def cmd_calibrate(args: argparse.Namespace, engine_options, add_engine_args) -> int:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nanokv.config import auto_block_size
    from nanokv.quant.calibrate import CalibrationSettings, calibrate

    for name in _unused_engine_options(args, engine_options, add_engine_args):
        print(f"[nanokv] calibrate ignores engine option {name}", file=sys.stderr)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    block_size = args.block_size
    if block_size == "auto":
        hf_cfg = AutoConfig.from_pretrained(args.model)
        block_size = auto_block_size(args.max_model_len
                                     or getattr(hf_cfg, "max_position_embeddings", 2048))
    settings = CalibrationSettings(
        candidate_bits=tuple(args.bits), codebook_bits=tuple(args.codebook_bits),
        block_size=block_size, outlier_fraction=args.outlier_fraction,
        num_sink_tokens=args.num_sink_tokens, per_channel_keys=not args.per_token_keys,
        nuq=not args.no_nuq, max_ppl_increase=args.max_ppl_increase,
        kmeans_iters=args.kmeans_iters, seed=args.seed)
    if args.seq_len < block_size:
        raise ValueError(f"--seq-len ({args.seq_len}) must be >= the block size ({block_size})")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    need = (args.num_samples + args.eval_samples) * args.seq_len
    text, text_name = load_texts(args.text, min_chars=need * 6)
    calib_ids, eval_ids = token_batches(tokenizer.encode(text), args.num_samples,
                                        args.eval_samples, args.seq_len)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    # progress in model forward passes: one per calibration sequence (activations and Fisher
    # information), then one per eval sequence for each precision tried; the bar grows when
    # the mixed-precision fallback tries more than the baseline and each candidate width
    bar = tqdm(total=args.num_samples + args.eval_samples * (1 + len(args.bits)),
               desc="calibrate", unit="fwd", dynamic_ncols=True)

    bar.set_description("calibrate: activations")

    def count_forward(_module, _inputs) -> None:
        if bar.n == args.num_samples:
            bar.set_description("calibrate: perplexity")
        if bar.n >= bar.total:
            bar.total += args.eval_samples
        bar.update(1)

    def log(line: str) -> None:
        if line.startswith("learning codebooks"):
            bar.set_description("calibrate: codebooks")
        if not args.json:
            with tqdm.external_write_mode():
                print(f"[nanokv] {line}", file=sys.stderr)

    handle = model.register_forward_pre_hook(count_forward)
    try:
        calib = calibrate(model, calib_ids, eval_ids, settings, model_path=args.model,
                          text_name=text_name, log=log)
    finally:
        handle.remove()
        bar.close()
    calib.save(args.output)
    d = calib.decision
    if args.json:
        print(json.dumps({"output": args.output, **calib.to_json()["decision"],
                          "baseline_perplexity": calib.baseline_perplexity}))
    else:
        print(f"baseline perplexity {calib.baseline_perplexity:.4f}")
        for t in calib.trials:
            print(f"  {t.candidate.kv_cache_dtype:8s} bits={t.candidate.bits} "
                  f"layers={t.candidate.layer_bits} ppl={t.perplexity:.4f} "
                  f"delta={t.delta:+.4f}")
        print(f"decision: {d.candidate.kv_cache_dtype} bits={d.candidate.bits} "
              f"layer_bits={d.candidate.layer_bits} ({d.reason})")
        print(f"wrote {args.output}")
    return 0
