"""`nanokv calibrate`: learn KVQuant codebooks and thresholds, pick a precision, write the JSON.

Hooked into `nanokv.cli.build_parser` with
    add_calibrate_parser(sub, add_engine_args, engine_options)
Of the engine options it uses --model, --tokenizer, --block-size (the calibration block size;
auto -> the engine's auto rule for --max-model-len or the model's length), --num-threads and
--seed; the engine measure passes the others to its engines except those its protocol sets
(nanokv/quant/engine_measure.py OWN_OPTIONS); it warns about options it does not use.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DEFAULT_OUTPUT = "kv_calibration.json"
HF_OPTIONS = {"tokenizer", "block_size", "max_model_len", "num_threads", "seed"}


def add_calibrate_parser(subparsers, add_engine_args, engine_options) -> argparse.ArgumentParser:
    from nanokv.quant.calibrate import MEASURES

    c = subparsers.add_parser(
        "calibrate", help="calibrate KV-cache quantization (KVQuant codebooks, outlier "
                          "thresholds, bit width measured through the engine's own store) and "
                          "write --kv-quant-config JSON")
    add_engine_args(c)
    g = c.add_argument_group("calibration")
    g.add_argument("--text", action="append", default=None,
                   help="calibration / evaluation text file (repeatable); default: held-out "
                        "files of the Python standard library (the evaluation windows are then "
                        "`nanokv eval`'s first perplexity windows, the calibration tokens follow "
                        "them)")
    g.add_argument("--output", default=DEFAULT_OUTPUT, help="calibration JSON to write")
    g.add_argument("--num-samples", type=int, default=8,
                   help="calibration sequences (default: 8)")
    g.add_argument("--seq-len", type=int, default=512,
                   help="tokens per calibration sequence, >= the block size (default: 512)")
    g.add_argument("--eval-samples", type=int, default=8,
                   help="evaluation windows each candidate is measured on (default: 8)")
    g.add_argument("--eval-seq-len", type=int, default=2048,
                   help="tokens per evaluation window (default: 2048)")
    g.add_argument("--context-fraction", type=float, default=0.75,
                   help="share of each evaluation window read as context, in (0, 1); the "
                        "tokens after it are scored (as `nanokv eval`'s perplexity task; "
                        "default: 0.75)")
    g.add_argument("--measure", choices=MEASURES, default="engine",
                   help="how candidates are measured. engine: the nanokv engine with the "
                        "candidate's real KV store, decode-like (the window prefilled in chunks "
                        "of --chunk-size tokens, each reading the earlier chunks back from the "
                        "store); simulated: the fast estimate, K/V quantized and dequantized "
                        "inside the Hugging Face model, each window in one pass (harsher than "
                        "the engine); both: decided on the engine's numbers, the simulated "
                        "estimate recorded next to each (default: engine)")
    g.add_argument("--chunk-size", type=int, default=32,
                   help="engine measure: tokens per prefill step (the engine's "
                        "max_num_batched_tokens); smaller is closer to token-by-token decoding "
                        "(default: 32)")
    g.add_argument("--bits", type=int, nargs="+", default=[4],
                   help="candidate widths; the lowest passing one is chosen (default: 4)")
    g.add_argument("--codebook-bits", type=int, nargs="+", default=[2, 3, 4],
                   help="widths to learn nuq codebooks for, of 2 3 4; must cover --bits "
                        "(default: 2 3 4)")
    g.add_argument("--outlier-fraction", type=float, default=0.01,
                   help="share of key / value entries kept in fp16 as outliers, in [0, 0.2] "
                        "(default: 0.01)")
    g.add_argument("--num-sink-tokens", type=int, default=1,
                   help="first tokens of a request kept in fp16, >= 0 (default: 1)")
    g.add_argument("--max-ppl-increase", type=float, default=3.0, metavar="PERCENT",
                   help="a candidate passes when its perplexity rises by at most this percent "
                        "of the full-precision baseline's, in (0, 100] (default: 3; relative "
                        "because KVQuant's '+0.2 perplexity' was written for models near "
                        "perplexity 6, about +3%%, and an absolute bound means something else "
                        "on every model)")
    g.add_argument("--max-kl", type=float, default=None, metavar="NATS",
                   help="and, when given, its mean KL divergence to the full-precision "
                        "next-token distributions is at most this (nats per scored token, > 0)")
    g.add_argument("--kmeans-iters", type=int, default=50,
                   help="Fisher-weighted k-means iterations per codebook (default: 50)")
    g.add_argument("--no-nuq", action="store_true", help="uniform grids instead of codebooks")
    g.add_argument("--per-token-keys", action="store_true", help="ablation: keys per token")
    g.add_argument("--json", action="store_true", help="print the decision as one JSON line")

    def run(args: argparse.Namespace) -> int:
        return cmd_calibrate(args, engine_options, add_engine_args)

    c.set_defaults(func=run)
    return c


def _unused_engine_options(args, engine_options, add_engine_args) -> list[str]:
    from nanokv.quant.engine_measure import OWN_OPTIONS

    probe = argparse.ArgumentParser()
    add_engine_args(probe)
    defaults = engine_options(probe.parse_args([]))
    given = engine_options(args)
    if args.measure == "simulated":
        unused = set(given) - HF_OPTIONS
    else:
        unused = set(OWN_OPTIONS) - HF_OPTIONS
    return sorted(k for k in unused if given[k] != defaults.get(k))


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


def token_batches(token_ids: list[int], num_samples: int, seq_len: int, eval_samples: int,
                  eval_seq_len: int):
    """[eval_samples] windows of eval_seq_len tokens first, then the calibration ids
    [num_samples, seq_len] from the tokens that follow (no overlap)."""
    import torch

    evals, calib = eval_samples * eval_seq_len, num_samples * seq_len
    if len(token_ids) < evals + calib:
        raise ValueError(f"the text has {len(token_ids)} tokens; {evals + calib} are needed "
                         f"({eval_samples} x {eval_seq_len} to evaluate + {num_samples} x "
                         f"{seq_len} to calibrate): give more text or fewer / shorter samples")
    windows = [token_ids[i * eval_seq_len:(i + 1) * eval_seq_len] for i in range(eval_samples)]
    calib_ids = torch.tensor(token_ids[evals:evals + calib]).view(num_samples, seq_len)
    return calib_ids, windows


def _token_ids(args, tokenizer) -> tuple[list[int], str]:
    """The text's token ids: --text files, else `nanokv eval`'s held-out windows (the same
    tokens as its perplexity task) followed by the next ones."""
    if args.text:
        text, name = load_texts(args.text, 0)
        return tokenizer.encode(text, add_special_tokens=False), name
    from nanokv.eval.harness import heldout_windows

    calib = args.num_samples * args.seq_len
    count = args.eval_samples + math.ceil(calib / args.eval_seq_len)
    windows = heldout_windows(tokenizer, count, args.eval_seq_len)
    return [t for w in windows for t in w], "python-stdlib-heldout"


def _check_counts(args) -> None:
    for name in ("num_samples", "seq_len", "eval_samples", "eval_seq_len", "kmeans_iters"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def cmd_calibrate(args: argparse.Namespace, engine_options, add_engine_args) -> int:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nanokv.config import auto_block_size
    from nanokv.quant.calibrate import CalibrationSettings, calibrate

    _check_counts(args)
    from nanokv.cli import check_output_file

    check_output_file("--output", args.output)  # before the calibration, not after it
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
        nuq=not args.no_nuq, max_ppl_increase=args.max_ppl_increase, max_kl=args.max_kl,
        measure=args.measure, chunk_size=args.chunk_size,
        context_fraction=args.context_fraction, kmeans_iters=args.kmeans_iters, seed=args.seed)
    if args.seq_len < block_size:
        raise ValueError(f"--seq-len ({args.seq_len}) must be >= the block size ({block_size})")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    token_ids, text_name = _token_ids(args, tokenizer)
    calib_ids, windows = token_batches(token_ids, args.num_samples, args.seq_len,
                                       args.eval_samples, args.eval_seq_len)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    # progress: calibration forward passes (activations and Fisher information), then one
    # unit per evaluation window measured; the total grows with every candidate the rule tries
    per_candidate = args.eval_samples * (2 if args.measure == "both" else 1)
    bar = tqdm(total=args.num_samples + per_candidate * (1 + len(args.bits)),
               desc="calibrate: activations", unit="pass", dynamic_ncols=True)
    fitting = [True]

    def count_forward(_module, _inputs) -> None:
        if fitting[0]:
            bar.update(1)

    def on_window() -> None:
        if bar.n >= bar.total:
            bar.total += per_candidate
        bar.update(1)

    def log(line: str) -> None:
        if line.startswith("learning codebooks"):
            fitting[0] = False
            bar.set_description("calibrate: codebooks")
        elif not fitting[0]:
            bar.set_description(f"calibrate: {args.measure} measure")
        if not args.json:
            with tqdm.external_write_mode():
                print(f"[nanokv] {line}", file=sys.stderr)

    handle = model.register_forward_pre_hook(count_forward)
    try:
        calib = calibrate(model, calib_ids, windows, settings, model_path=args.model,
                          text_name=text_name, engine_options=engine_options(args), log=log,
                          on_window=on_window)
    finally:
        handle.remove()
        bar.close()
    calib.save(args.output)
    if args.json:
        print(json.dumps({"output": args.output, **calib.to_json()["decision"],
                          "baseline_perplexity": calib.baseline_perplexity}))
    else:
        print(report(calib, args.output))
    return 0


def report(calib, output: str) -> str:
    """The trials as text: each candidate's measurement (and the simulated estimate beside it
    with --measure both), then the decision."""
    d = calib.decision
    lines = [f"baseline perplexity {calib.baseline_perplexity:.4f} "
             f"({calib.settings['measure']} measure)"]
    for t in calib.trials:
        c = t.candidate
        line = (f"  {c.kv_cache_dtype:8s} bits={c.bits} layers={c.layer_bits} "
                f"ppl={t.perplexity:.4f} {t.increase:+.3f}% kl={t.kl:.5f} top1={t.top1:.3f}")
        if t.simulated is not None:
            line += (f" | simulated ppl={t.simulated.perplexity:.4f} "
                     f"{t.simulated.increase:+.3f}% kl={t.simulated.kl:.5f}")
        lines.append(line)
    lines += [f"decision: {d.candidate.kv_cache_dtype} bits={d.candidate.bits} "
              f"layer_bits={d.candidate.layer_bits} ({d.reason})", f"wrote {output}"]
    return "\n".join(lines)
