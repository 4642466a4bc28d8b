"""Inverse key norm (Devoto et al., kvpress KnormPress): score -||K_i||_2, low-norm keys matter
more. No attention needed; per KV head by default."""

from __future__ import annotations

import torch

from nanokv.policies.base import LayerKV, register_policy
from nanokv.policies.scoring import ScoredPolicy


@register_policy("knorm")
class KeyNorm(ScoredPolicy):
    """Options: per_head (default True), n_sink (default 0)."""

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 per_head: bool = True, n_sink: int = 0) -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size, per_head=per_head, n_sink=n_sink)
        self._check_budget_option()

    @property
    def min_budget(self) -> int:
        return max(self.n_sink, 1)

    def head_scores(self, kv: LayerKV) -> torch.Tensor:
        return -kv.keys.float().norm(dim=-1).transpose(0, 1)  # [Hkv, n]
