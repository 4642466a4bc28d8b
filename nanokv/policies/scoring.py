"""Score-based selection shared by the policies: GQA averaging, deterministic top-k, protected
(sink / window) tokens, and `ScoredPolicy`, the base of every policy that ranks tokens by a score
(SnapKV, PyramidKV, H2O, key norm) and that KVCrush can wrap.

Ties are broken toward the OLDER token (lower slot index) everywhere, so results are deterministic.
"""

from __future__ import annotations

import abc

import torch

from nanokv.policies.base import KVPolicy, LayerKV
from nanokv.validation import check_int


def gqa_mean(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[Hq, ...] query-head scores -> [Hkv, ...]: the mean over each GQA group (query heads
    h*g .. h*g + g - 1 share KV head h, as in `repeat_interleave`)."""
    hq = scores.shape[0]
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {num_kv_heads} KV heads")
    return scores.reshape(num_kv_heads, hq // num_kv_heads, *scores.shape[1:]).mean(1)  # [Hkv, ...]


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores along the last dim, ties to the lower index, returned in
    ascending index order. scores: [..., n] -> [..., k] int64."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [..., n]
    return torch.sort(order[..., :k], dim=-1).values


def edge_mask(n: int, first: int, last: int, device=None) -> torch.Tensor:
    """[n] bool: True for the first `first` and the last `last` slots."""
    idx = torch.arange(n, device=device)
    return (idx < first) | (idx >= n - last)


def select_with_protected(scores: torch.Tensor, budget: int,
                          protected: torch.Tensor) -> torch.Tensor:
    """Keep every protected slot plus the best-scoring others, `budget` in all.

    scores: [n] (shared) or [Hkv, n] (per head); protected: [n] bool. Returns [C] or [Hkv, C],
    ascending. Raises ValueError when the protected slots alone exceed the budget.
    """
    n_protected = int(protected.sum())
    if n_protected > budget:
        raise ValueError(f"{n_protected} protected tokens (sinks + window) exceed the budget "
                         f"{budget}; raise the budget or shrink the sinks / window")
    free = torch.nonzero(~protected).squeeze(1)  # [n - P] candidate slots
    best = free[top_k_indices(scores[..., free], budget - n_protected)]  # [..., C - P]
    fixed = torch.nonzero(protected).squeeze(1)  # [P]
    fixed = fixed.expand(*scores.shape[:-1], n_protected)  # [..., P]
    return torch.sort(torch.cat([fixed, best], dim=-1), dim=-1).values  # [..., C]


class ScoredPolicy(KVPolicy):
    """A policy that ranks tokens by a per-head score and keeps the top ones plus protected slots.

    Subclasses implement `head_scores(kv)` -> [H, n] (H = query heads for attention scorers, KV
    heads otherwise; higher = more important) and `protected_mask(n, budget)`. Options common to
    all: `per_head` (True: each KV head keeps its own C tokens, `[Hkv, C]`; False: one set `[C]`
    from the scores averaged over KV heads) and `n_sink` (first slots always kept).
    """

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 per_head: bool = True, n_sink: int = 0) -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size)
        if not isinstance(per_head, bool):
            raise ValueError(f"per_head must be True or False, got {per_head!r}")
        check_int("n_sink", n_sink, 0)
        self.per_head = per_head
        self.n_sink = n_sink

    @abc.abstractmethod
    def head_scores(self, kv: LayerKV) -> torch.Tensor:
        """[H, n] float scores, H = Hq (attention scorers) or Hkv."""

    def protected_mask(self, n: int, budget: int) -> torch.Tensor:
        """[n] bool: slots kept whatever their score (default: the sinks)."""
        return edge_mask(n, self.n_sink, 0)

    def token_scores(self, kv: LayerKV) -> torch.Tensor:
        """[Hkv, n]: head scores averaged within each GQA group."""
        return gqa_mean(self.head_scores(kv), kv.num_kv_heads)

    def selection_scores(self, kv: LayerKV) -> torch.Tensor:
        """What is ranked: [Hkv, n] when per_head, else [n] (mean over KV heads)."""
        s = self.token_scores(kv)
        return s if self.per_head else s.mean(0)

    def _select(self, kv: LayerKV, budget: int) -> torch.Tensor:
        protected = self.protected_mask(kv.num_tokens, budget).to(kv.keys.device)
        return select_with_protected(self.selection_scores(kv), budget, protected)
