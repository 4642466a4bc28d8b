#!/usr/bin/env python
"""NVIDIA kvpress's presses on nanokv's passkey prompts, for a side-by-side with `nanokv eval`.

Run with a separate virtual environment (kvpress pins transformers < 5.3), not the project's:

    python -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install kvpress==0.5.5 torch==2.13.0
    /tmp/kvpress-venv/bin/python benchmarks/vs_kvpress.py --model models/nanokv-tiny \
        --presses kvzip,snapkv,streaming,knorm --compressions 2,4 --protocols whole,question \
        --num-samples 30 --eval-seed 881000 --out docs/results/policies/kvpress.jsonl

The prompts are `nanokv.eval.tasks.passkey_sample` (loaded by path: nanokv is not installed
there) with the harness's lengths and seeds, so `nanokv eval --tasks passkey --eval-seed S
--context-tokens N --protocol P` scores the same prompts. Protocols: "whole" prefills the prompt
but its last token under the press, then the last token and the answer on the compressed cache;
"question" prefills the context (the prompt up to its question) under the press, then the
question (kvpress's pipeline). One JSON line per (press, compression, protocol) on stdout / --out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
import types
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nanokv"


def load_tasks():
    """`nanokv.eval.tasks` (and the modules it imports: passkey_formats, corpus) from the
    checkout without running `nanokv/__init__.py`, which loads the engine: the packages stand
    in as bare modules over their folders."""
    for name, folder in (("nanokv", PACKAGE), ("nanokv.eval", PACKAGE / "eval")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]
            sys.modules[name] = package
    return importlib.import_module("nanokv.eval.tasks")


def make_press(name: str, ratio: float, alpha_safeguard: float = 0.2):
    """kvpress's press `name` removing the fraction `ratio` of the cache. Head-adaptive budgets
    (AdaKV: one budget per layer shared across its KV heads by score): "adakv-snapkv" and
    "adakv-knorm" wrap the scorer in AdaKVPress (each head keeps at least `alpha_safeguard` of
    a uniform head's share); "kvzip-layerwise" is KVzip with a uniform budget per layer, shared
    across heads by score (plain "kvzip" shares one budget across layers and heads)."""
    import kvpress

    presses = {"kvzip": lambda: kvpress.KVzipPress(compression_ratio=ratio),
               "kvzip-layerwise": lambda: kvpress.KVzipPress(compression_ratio=ratio,
                                                             layerwise=True),
               "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio, window_size=32),
               "streaming": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),
               "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio)}
    for scorer in ("snapkv", "knorm"):
        presses[f"adakv-{scorer}"] = (lambda s=scorer: kvpress.AdaKVPress(
            presses[s](), alpha_safeguard=alpha_safeguard))
    if name not in presses:
        raise ValueError(f"unknown press {name!r}; available: {sorted(presses)}")
    return presses[name]()


def greedy(model, ids, split: int, press, max_new: int) -> list[int]:
    """Prefill ids[:split] under the press, then ids[split:] and `max_new` greedy tokens."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    n = ids.shape[1]
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=ids[:, :split], past_key_values=cache)
        out = model(input_ids=ids[:, split:], past_key_values=cache,
                    position_ids=torch.arange(split, n).unsqueeze(0))
        tokens = [int(out.logits[0, -1].argmax())]
        for step in range(max_new - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[n + step]]))
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="kvpress presses on nanokv's passkey prompts")
    ap.add_argument("--model", required=True)
    ap.add_argument("--presses", default="kvzip,snapkv,streaming,knorm")
    ap.add_argument("--compressions", default="2,4")
    ap.add_argument("--protocols", default="whole,question")
    ap.add_argument("--num-samples", type=int, default=30)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--eval-seed", type=int, default=0)
    ap.add_argument("--alpha-safeguard", type=float, default=0.2,
                    help="adakv-* presses: the least share of a uniform head's budget each head "
                         "keeps, in [0, 1] (default 0.2, kvpress's)")
    ap.add_argument("--full", action="store_true", help="also score the full cache")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = ap.parse_args(argv)
    if not 0.0 <= args.alpha_safeguard <= 1.0:
        ap.error(f"--alpha-safeguard must lie in [0, 1], got {args.alpha_safeguard}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpress

    tasks = load_tasks()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    samples = [tasks.passkey_sample(tokenizer, args.context_tokens - 16, seed=args.eval_seed + i)
               for i in range(args.num_samples)]
    max_new = max(len(tokenizer.encode(x.answer)) for x in samples) + 2
    settings = [("full", 1.0)] if args.full else []
    settings += [(p, float(c)) for p in args.presses.split(",") for c in
                 args.compressions.split(",")]
    lines = []
    for protocol in args.protocols.split(","):
        for press_name, compression in settings:
            t0 = time.perf_counter()
            hits = 0
            for x in samples:
                ids = tokenizer.encode(x.prompt)
                split = (len(ids) - 1 if protocol == "whole"
                         else tasks.context_length(tokenizer, x, ids))
                press = (None if press_name == "full" else
                         make_press(press_name, 1.0 - 1.0 / compression, args.alpha_safeguard))
                out = greedy(model, torch.tensor([ids]), split, press, max_new)
                hits += tasks.score(x, tokenizer.decode(out))
            line = {"engine": f"kvpress {kvpress.__version__}" if hasattr(kvpress, "__version__")
                    else "kvpress", "press": press_name, "compression": compression,
                    "protocol": protocol, "accuracy": hits / len(samples),
                    **({"alpha_safeguard": args.alpha_safeguard}
                       if press_name.startswith("adakv") else {}),
                    "num_samples": len(samples), "eval_seed": args.eval_seed,
                    "context_tokens": args.context_tokens,
                    "seconds": round(time.perf_counter() - t0, 1)}
            print(json.dumps(line), flush=True)
            lines.append(line)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
