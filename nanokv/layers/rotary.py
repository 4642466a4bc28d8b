"""Rotary position embedding (RoPE), rotate-half layout as in Hugging Face Llama/Qwen."""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: "
                         f"{list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    # the scaled variants follow transformers' reference formulas exactly
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions); applied to q and k in place of copies."""

    def __init__(self, hf_config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.hf_config, self.head_dim, self.max_positions = hf_config, head_dim, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        # the last step's positions and their cos/sin rows: every layer of a forward pass
        # rotates at the same positions, so the rows are gathered once per step
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if torch.empty(0).device.type != "meta":  # built under a meta context: loader builds
            self.build_tables(torch.device("cpu"))

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the tables on `device` (after the model was materialised there)."""
        self._rows = None
        inv_freq, scaling = rope_inv_freq(self.hf_config, self.head_dim)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, rot_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rot_dim]
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)
        self.rot_dim = emb.shape[-1]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] -> rotated q, k."""
        if self._rows is None or self._rows[0] is not positions or self._rows[1].dtype != q.dtype:
            cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, rot_dim]
            sin = self.sin[positions].unsqueeze(1).to(q.dtype)
            self._rows = (positions, cos, sin)
        _, cos, sin = self._rows
        return apply_rotary(q, cos, sin, self.rot_dim), apply_rotary(k, cos, sin, self.rot_dim)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [n, H, D] (keys stored before RoPE) rotated to positions [n]."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [n, 1, rot_dim]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        return apply_rotary(x, cos, sin, self.rot_dim)

    def unrotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `rotate`: x [n, H, D] rotated by positions [n] -> before RoPE. The
        tables may carry an attention scaling s (cos = s cos t): divide by s^2 too."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [n, 1, rot_dim]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        norm = cos * cos + sin * sin  # s^2
        return apply_rotary(x, cos / norm, -sin / norm, self.rot_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int):
    if rot_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
