"""The attention-backend contract.

A backend owns one way of computing attention over the engine's KV cache. It is chosen once, at
start-up (`selector.select_backend`), and then every step goes

    metadata = backend.build(common)                       # once per step, all layers
    out = backend.forward(layer, q, k, v, k_pre, metadata, scale)   # per layer

`forward` writes the step's new K/V into the cache (through the KV cache's `write_layer`, or its
own in-place write) and returns the attention output. q: [T, Hq, D] and k: [T, Hkv, D] after
RoPE, k_pre: the keys before RoPE (a store may keep those), v: [T, Hkv, D]; out: [T, Hq, D].

Each backend says why it cannot serve a KV cache on a device (`why_not`): None when it can,
else (reason, structural) where structural means "not made for this cache or device" (no
warning when auto passes it over) rather than "made for it but not usable here" (a failed build,
an unsupported dtype: auto warns).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from nanokv.attention.common import CommonAttentionMetadata


class AttentionBackend(ABC):
    name: ClassVar[str] = ""  # the attention_backend option that selects it
    description: ClassVar[str] = ""  # for the start-up log

    def __init__(self, kv_cache, device: torch.device) -> None:
        self.kv_cache = kv_cache
        self.device = device

    @classmethod
    @abstractmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        """None when this backend can serve `kv_cache` on `device`, else (reason, structural)."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata):
        """This backend's metadata for the step (device tensors made here, once)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_pre: torch.Tensor, metadata, scale: float) -> torch.Tensor:
        """Write the layer's new K/V, attend; returns [T, Hq, D]."""
