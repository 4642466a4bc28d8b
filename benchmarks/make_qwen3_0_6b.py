#!/usr/bin/env python
"""Build a Qwen3-0.6B-shaped model with random weights, for benchmarks.

The shapes are the published Qwen3-0.6B config; the weights are random (seeded), stored in
float32 safetensors, so no download is needed. No tokenizer: the benchmarks use token ids.

    python benchmarks/make_qwen3_0_6b.py --out /tmp/qwen3-0.6b-random
    python benchmarks/make_qwen3_0_6b.py --layers 8 --out /tmp/qwen3-0.6b-8l-random

--layers keeps the width, heads and vocabulary and stacks fewer decoder layers: a shallower
Qwen3 shape whose KV cache per token shrinks with the depth (the long-context peer preset of
benchmarks/run_peers.sh uses 8 layers, so one engine's run fits a few minutes on 2 cores).

--sliding-window N makes every layer attend over its newest N tokens (use_sliding_window, with
max_window_layers 0); the same seed gives the same weights with or without it:

    python benchmarks/make_qwen3_0_6b.py --layers 4 --sliding-window 512 --out /tmp/qwen3-4l-sw512
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# Published Qwen3-0.6B config (Qwen/Qwen3-0.6B config.json).
QWEN3_0_6B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_cache": True,
}
ROPE_THETA = 1000000.0

GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def build(
    out: Path,
    seed: int,
    init_std: float,
    layers: int = QWEN3_0_6B["num_hidden_layers"],
    sliding_window: int | None = None,
) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
    torch.manual_seed(seed)
    bad_window = isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
    if sliding_window is not None and (bad_window or sliding_window < 1):
        raise ValueError(f"sliding_window must be an integer >= 1, got {sliding_window!r}")
    shape = {**QWEN3_0_6B, "num_hidden_layers": layers, "max_window_layers": layers}
    if sliding_window is not None:  # every layer: Qwen's sliding layers start at max_window_layers
        shape.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
    config = Qwen3Config(
        **shape,
        initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    t0 = time.perf_counter()
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)

    # Readers written for transformers 4.x (and vLLM) look for a top-level rope_theta.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", ROPE_THETA)
    cfg.setdefault("rope_scaling", None)
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")

    # Sanity: logits of a short random prompt should be finite and moderate.
    with torch.inference_mode():
        ids = torch.randint(0, 10000, (1, 16), generator=torch.Generator().manual_seed(seed))
        logits = model(ids).logits
    print(
        f"saved {n_params / 1e6:.1f}M params to {out} in {time.perf_counter() - t0:.1f}s; "
        f"logits std {logits.std().item():.3f}, max |logit| {logits.abs().max().item():.2f}"
    )
    assert torch.isfinite(logits).all(), "non-finite logits"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/qwen3-0.6b-random"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--init-std",
        type=float,
        default=0.02,
        help="std of the normal init of linear/embedding weights (default 0.02)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=QWEN3_0_6B["num_hidden_layers"],
        help="decoder layers, >= 1 (default 28, the published shape; fewer keeps the width, "
        "heads and vocabulary)",
    )
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="every layer attends over its newest N tokens, N >= 1 (default: the whole context, "
        "as the published model)",
    )
    args = ap.parse_args()
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.sliding_window is not None and args.sliding_window < 1:
        ap.error(f"--sliding-window must be >= 1, got {args.sliding_window}")
    build(args.out, args.seed, args.init_std, args.layers, args.sliding_window)


if __name__ == "__main__":
    main()
