"""Causal attention over the step's own K/V, with no KV cache: the activation-profiling pass
that runs before the pool exists (one prefill chunk, nothing written)."""

from __future__ import annotations

import torch

from nanokv.attention.backend import AttentionBackend
from nanokv.layers.attention import attend


class NoCacheBackend(AttentionBackend):
    name = "no_cache"
    description = "causal attention over the step's own tokens (profiling)"
    supports_soft_cap = True

    def __init__(self, device: torch.device, soft_cap: float | None = None) -> None:
        super().__init__(None, device, soft_cap)

    @classmethod
    def why_not(cls, kv_cache, device):
        return ("it keeps no cache", True) if kv_cache is not None else None

    def build(self, common) -> None:
        return None

    def forward(self, layer, q, k, v, k_pre, metadata, scale) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
        vh = v.transpose(0, 1).unsqueeze(0)
        o = attend(qh, kh, vh, scale, self.soft_cap, causal=True)
        return o.squeeze(0).transpose(0, 1)  # [T, Hq, D]
