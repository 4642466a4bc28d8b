#!/usr/bin/env python
"""Write N random LoRA adapters of a checkpoint in PEFT's format (adapter_config.json,
adapter_model.safetensors with PEFT's tensor names), for the LoRA benchmarks (no download: any
checkpoint, e.g. benchmarks/make_qwen3_0_6b.py's). Adapter i is seeded with i; every decoder
layer's q/k/v, o, gate/up and down projections are adapted at --rank.

    python benchmarks/make_lora_adapters.py --model /tmp/qwen3-0.6b-4l-random --count 4 \\
        --rank 16 --out /tmp/lora-adapters
    # -> /tmp/lora-adapters/adapter0 ... adapter3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """projection -> (in, out) features of a Llama-family config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_adapter(model: Path, out: Path, rank: int, alpha: float, std: float, seed: int,
                  targets: tuple[str, ...] = PROJECTIONS) -> None:
    """An adapter of `targets` in every decoder layer, A and B of normal entries of `std`."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    shapes = projection_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            fan_in, fan_out = shapes[name]
            tensors[f"{key}.lora_A.weight"] = std * torch.randn(rank, fan_in, generator=gen)
            tensors[f"{key}.lora_B.weight"] = std * torch.randn(fan_out, rank, generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets),
        "base_model_name_or_path": str(model)}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--std", type=float, default=0.02,
                    help="standard deviation of A's and B's random entries")
    args = ap.parse_args()
    if args.count < 1 or args.rank < 1 or args.std <= 0:
        ap.error("--count and --rank must be >= 1, --std > 0")
    for i in range(args.count):
        write_adapter(args.model, args.out / f"adapter{i}", args.rank, args.alpha, args.std, i)
    print(f"{args.count} adapters of rank {args.rank} in {args.out}")


if __name__ == "__main__":
    main()
