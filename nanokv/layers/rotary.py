"""Rotary position embedding (RoPE), rotate-half layout as in Hugging Face Llama/Qwen."""

from __future__ import annotations

import torch
from torch import nn

from nanokv.layers import native_elementwise

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(hf_config, head_dim: int,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type. layer_type: the
    layers' kind whose RoPE this is, where the config keeps one per kind (Gemma 3's
    `rope_parameters` = {"sliding_attention": ..., "full_attention": ...})."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None:
        if layer_type not in params:
            raise ValueError(f"rope_parameters has no entry for {layer_type!r} layers; it has "
                             f"{sorted(params)}")
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: "
                         f"{list(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial is not None and partial != 1:
        # Hugging Face's Llama / Mistral / Qwen2 / Qwen3 rotate the whole head: they ignore the
        # factor with the default RoPE and fail with the scaled ones
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported: these "
                         f"architectures rotate the whole head; supported: 1.0")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                   / head_dim))
        return inv_freq, 1.0
    # the scaled variants follow transformers' reference formulas exactly
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention_scaling = (init(hf_config, torch.device("cpu")) if layer_type is None
                                   else init(hf_config, torch.device("cpu"),
                                             layer_type=layer_type))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions); applied to q and k in place of copies."""

    def __init__(self, hf_config, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> None:
        """layer_type: this RoPE's layers, where the config keeps one per kind (`rope_inv_freq`)."""
        super().__init__()
        self.hf_config, self.head_dim, self.max_positions = hf_config, head_dim, max_positions
        self.layer_type = layer_type
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        # the last step's positions and their cos/sin rows: every layer of a forward pass
        # rotates at the same positions, so the rows are gathered once per step
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._checked: torch.Tensor | None = None  # the last positions `norm_rope` checked
        self.native = False  # norm_rope through the C kernel (use_native_elementwise sets it)
        if torch.empty(0).device.type != "meta":  # built under a meta context: loader builds
            self.build_tables(torch.device("cpu"))

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the tables on `device` (after the model was materialised there)."""
        self._rows = self._checked = None
        inv_freq, scaling = rope_inv_freq(self.hf_config, self.head_dim, self.layer_type)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, rot_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rot_dim]
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)
        self.rot_dim = emb.shape[-1]

    def _step_rows(self, positions: torch.Tensor, dtype: torch.dtype):
        """The cos / sin rows [T, 1, rot_dim] of a step's positions, gathered once per step."""
        if self._rows is None or self._rows[0] is not positions or self._rows[1].dtype != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, rot_dim]
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            self._rows = (positions, cos, sin)
        return self._rows[1], self._rows[2]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] -> rotated q, k."""
        cos, sin = self._step_rows(positions, q.dtype)
        return apply_rotary(q, cos, sin, self.rot_dim), apply_rotary(k, cos, sin, self.rot_dim)

    def norm_rope(self, positions: torch.Tensor, x: torch.Tensor, norm=None,
                  keep_pre: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, H, D] normed per head by `norm` (an RMSNorm over D, or None), then rotated.
        Returns (rotated, with keep_pre the normed heads before RoPE: what a store that keeps
        pre-RoPE keys writes; else None). With `native` set and float32 CPU inputs one pass of
        the C kernel (`native_elementwise.head_norm_rope`), else the PyTorch modules."""
        weight = None if norm is None else norm.weight
        if (self.native and native_elementwise.fits_heads(x, self.cos, positions)
                and self.cos.dtype == x.dtype and (weight is None or weight.dtype == x.dtype)):
            if self._checked is not positions:  # once per step: every layer shares them
                if positions.numel() and not (0 <= int(positions.min())
                                              and int(positions.max()) < self.cos.shape[0]):
                    raise IndexError(f"RoPE positions must lie in [0, {self.cos.shape[0]})")
                self._checked = positions
            eps = 0.0 if norm is None else norm.eps
            rotated, pre = native_elementwise.head_norm_rope(
                x, positions, self.cos, self.sin, weight, eps,
                keep_pre=keep_pre and norm is not None)
            if keep_pre and norm is None:  # nothing normed: the input is the pre-RoPE head
                pre = x
            return rotated, pre
        normed = x if norm is None else norm(x)
        cos, sin = self._step_rows(positions, x.dtype)
        return apply_rotary(normed, cos, sin, self.rot_dim), (normed if keep_pre else None)

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


def halves_repeat(table: torch.Tensor) -> bool:
    """Whether a rotate-half cos / sin table [positions, rot_dim] repeats its first half (as
    `cat(freqs, freqs)` makes it; a kernel may then read that half only)."""
    half = table.shape[-1] // 2
    return bool(torch.equal(table[:, :half], table[:, half:]))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int):
    if rot_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
