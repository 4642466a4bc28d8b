"""Small arithmetic shared by every subsystem."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (blocks needed for a number of slots)."""
    return -(-a // b)


def head_dim_of(hf_config) -> int:
    """A Hugging Face config's attention head size (explicit `head_dim` or hidden / heads)."""
    return (getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads)
