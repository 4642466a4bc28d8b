"""Tiny random-weight Hugging Face checkpoints the tests build themselves (no downloads)."""

from __future__ import annotations

import os

import torch

VOCAB = 256


def build_tiny_model(out_dir: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Write a tiny random HF checkpoint (float32 safetensors + config) and return its path."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, eos_token_id=VOCAB - 1, bos_token_id=0)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(tie_word_embeddings=False, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen3":
        common.setdefault("head_dim", 32)
        cfg = Qwen3Config(tie_word_embeddings=True, **common)
        model = Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # a larger init than HF's default makes the logits peaked, so greedy ties are rare
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model = model.to(torch.float32).eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
