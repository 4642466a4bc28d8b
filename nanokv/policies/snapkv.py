"""SnapKV (arXiv 2404.14469): score the prefix by the attention it receives from an observation
window of the last W queries, smoothed by 1-D pooling; each KV head keeps its top (C - W) prefix
tokens plus the W window tokens. Runs once, after prefill.

Score of prefix slot i for query head h: C[h, i] = sum over the W window queries j of A[h, j, i],
then pooled along i (kernel k, stride 1, padding k // 2, avg (zero padding counted, as
F.avg_pool1d) or max), then averaged over each GQA group (kvpress's order: pool, then group mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanokv.policies.base import LayerKV, register_policy
from nanokv.policies.scoring import ScoredPolicy, edge_mask
from nanokv.validation import check_choice, check_int

POOLINGS = ("avg", "max")


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """[H, m] -> [H, m]: 1-D pooling along the tokens, stride 1, padding kernel_size // 2."""
    x = scores.unsqueeze(1)  # [H, 1, m]
    pad = kernel_size // 2
    if pooling == "avg":
        x = F.avg_pool1d(x, kernel_size, stride=1, padding=pad)
    else:
        x = F.max_pool1d(x, kernel_size, stride=1, padding=pad)
    return x.squeeze(1)  # [H, m]


def snapkv_head_scores(attention: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """attention [Hq, W, n] -> [Hq, n]: pooled window scores of the n - W prefix slots; the W
    window slots get each head's maximum prefix score (they are kept anyway)."""
    num_heads, w, n = attention.shape
    prefix = n - w
    scores = attention.float().sum(1)  # [Hq, n]
    if prefix == 0:
        return scores
    pooled = pool_scores(scores[:, :prefix], kernel_size, pooling)  # [Hq, n - W]
    top = pooled.max(dim=1, keepdim=True).values  # [Hq, 1]
    return torch.cat([pooled, top.expand(num_heads, w)], dim=1)  # [Hq, n]


@register_policy("snapkv")
class SnapKV(ScoredPolicy):
    """Options: window (W, default 32), kernel_size (odd, default 5), pooling ("avg" | "max"),
    per_head (default True), n_sink (default 0). The runner passes `attention` for the last
    min(W, n) queries; budget >= W + n_sink."""

    needs_attention = True

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 window: int = 32, kernel_size: int = 5, pooling: str = "avg",
                 per_head: bool = True, n_sink: int = 0) -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size, per_head=per_head, n_sink=n_sink)
        check_int("window", window, 1)
        check_int("kernel_size", kernel_size, 1)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (padding k // 2 keeps the length), "
                             f"got {kernel_size}")
        check_choice("pooling", pooling, POOLINGS)
        self.window = window
        self.kernel_size = kernel_size
        self.pooling = pooling
        self._check_budget_option()

    @property
    def observation_window(self) -> int:
        return self.window

    @property
    def min_budget(self) -> int:
        return self.window + self.n_sink

    def head_scores(self, kv: LayerKV) -> torch.Tensor:
        w = kv.attention.shape[1]
        if w != min(self.window, kv.num_tokens):
            raise ValueError(f"SnapKV with window {self.window} needs the attention of the last "
                             f"{min(self.window, kv.num_tokens)} queries, got {w}")
        return snapkv_head_scores(kv.attention, self.kernel_size, self.pooling)  # [Hq, n]

    def protected_mask(self, n: int, budget: int) -> torch.Tensor:
        return edge_mask(n, self.n_sink, min(self.window, n))
