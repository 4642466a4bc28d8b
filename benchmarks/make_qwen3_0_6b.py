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

--shape qwen3-30b-a3b builds the published Qwen3-30B-A3B mixture of experts instead (hidden
2048, 32 query / 4 KV heads of 128, 128 experts of width 768 per layer, 8 per token): with
--layers 2 about 1.9B parameters (7.5 GB in float32), for the MoE peer run
(docs/results/moe/):

    python benchmarks/make_qwen3_0_6b.py --shape qwen3-30b-a3b --layers 2 --out /tmp/qwen3-moe-2l

--shape gemma3-1b builds Gemma 3 1B's published text decoder (Gemma3ForCausalLM: 26 layers,
every sixth full attention and the others a 512-token window, 1.0B parameters) for the Gemma 3
peer run (docs/results/gemma3/); --sliding-window sets its window.

--shape gemma2-2b builds Gemma 2 2B's published decoder (Gemma2ForCausalLM: 26 layers, a
4096-token window on every other one, attention and final logit soft-caps 50 and 30, 2.6B
parameters) for the Gemma 2 peer run (docs/results/gemma2/); --sliding-window sets its window.

--shape qwen3-1.7b builds the published Qwen3-1.7B (hidden 2048, MLP 6144, 28 layers, tied
embedding: 1.72B parameters, 6.9 GB in float32), for the int8 load-memory run
(docs/results/int8_weights/load_memory.md).
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

# Published Qwen3-30B-A3B config (Qwen/Qwen3-30B-A3B config.json), its fields that differ.
QWEN3_30B_A3B = {
    **QWEN3_0_6B,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "max_window_layers": 48,
}
# Published Qwen3-1.7B config (Qwen/Qwen3-1.7B config.json), its fields that differ.
QWEN3_1_7B = {**QWEN3_0_6B, "hidden_size": 2048, "intermediate_size": 6144}
# Published Gemma 3 1B config (google/gemma-3-1b-it config.json): its text decoder, every sixth
# layer full attention, the others a 512-token window, each kind with its RoPE base
GEMMA3_1B = {
    "vocab_size": 262144,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
}
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
# Published Gemma 2 2B config (google/gemma-2-2b config.json): a 4096-token window on every
# other layer (the first sliding), one RoPE, soft-capped attention scores and logits
GEMMA2_2B = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 2,
    "eos_token_id": [1, 107],
    "pad_token_id": 0,
}
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-1.7b": QWEN3_1_7B, "qwen3-30b-a3b": QWEN3_30B_A3B,
          "gemma3-1b": GEMMA3_1B, "gemma2-2b": GEMMA2_2B}

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
    layers: int | None = None,
    sliding_window: int | None = None,
    shape_name: str = "qwen3-0.6b",
) -> None:
    """layers None: the shape's own depth."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if shape_name not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape_name!r}")
    published = SHAPES[shape_name]
    layers = published["num_hidden_layers"] if layers is None else layers
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
    torch.manual_seed(seed)
    bad_window = isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
    if sliding_window is not None and (bad_window or sliding_window < 1):
        raise ValueError(f"sliding_window must be an integer >= 1, got {sliding_window!r}")
    if shape_name.startswith("gemma3"):  # every sixth layer full, as the published pattern
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                 for i in range(layers)]
        window = published["sliding_window"] if sliding_window is None else sliding_window
        config_cls, model_cls = Gemma3TextConfig, Gemma3ForCausalLM
        config = Gemma3TextConfig(**{**published, "num_hidden_layers": layers,
                                     "sliding_window": window}, layer_types=types,
                                  initializer_range=init_std, rope_parameters=GEMMA3_ROPE)
    elif shape_name.startswith("gemma2"):  # every other layer sliding, the first among them
        from transformers import Gemma2Config, Gemma2ForCausalLM

        types = ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]
        window = published["sliding_window"] if sliding_window is None else sliding_window
        config_cls, model_cls = Gemma2Config, Gemma2ForCausalLM
        config = Gemma2Config(**{**published, "num_hidden_layers": layers,
                                 "sliding_window": window}, layer_types=types,
                              initializer_range=init_std,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        shape = {**published, "num_hidden_layers": layers, "max_window_layers": layers}
        if sliding_window is not None:  # every layer (from max_window_layers on: all)
            shape.update(use_sliding_window=True, sliding_window=sliding_window,
                         max_window_layers=0)
        moe = "num_experts" in shape
        config_cls, model_cls = ((Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe
                                 else (Qwen3Config, Qwen3ForCausalLM))
        config = config_cls(
            **shape,
            initializer_range=init_std,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        )
    t0 = time.perf_counter()
    model = model_cls(config).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)

    # Readers written for transformers 4.x (and vLLM) look for a top-level rope_theta.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    gemma = shape_name.startswith("gemma")
    if not gemma:
        cfg.setdefault("rope_theta", ROPE_THETA)
        cfg.setdefault("rope_scaling", None)
    elif shape_name.startswith("gemma2"):
        cfg.setdefault("rope_theta", 10000.0)
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    generation = GENERATION_CONFIG if not gemma else {
        "bos_token_id": 2, "eos_token_id": published["eos_token_id"], "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

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
        "--shape",
        choices=sorted(SHAPES),
        default="qwen3-0.6b",
        help="the published config to copy (default qwen3-0.6b; qwen3-1.7b: the next dense "
        "size, 1.7B parameters; qwen3-30b-a3b: the mixture of experts; gemma3-1b: Gemma 3 1B's "
        "text decoder, every sixth layer full, the others a 512-token window; gemma2-2b: Gemma "
        "2 2B, a 4096-token window on every other layer, soft-capped attention)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers, >= 1 (default: the published depth, 28 or 48; fewer keeps the "
        "width, heads, experts and vocabulary)",
    )
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="every layer (gemma3: every sliding layer) attends over its newest N tokens, N >= 1 "
        "(default as the published model: the whole context; gemma3 512)",
    )
    args = ap.parse_args()
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.sliding_window is not None and args.sliding_window < 1:
        ap.error(f"--sliding-window must be >= 1, got {args.sliding_window}")
    build(args.out, args.seed, args.init_std, args.layers, args.sliding_window, args.shape)


if __name__ == "__main__":
    main()
