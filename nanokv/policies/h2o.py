"""H2O (arXiv 2306.14048): heavy hitters by accumulated attention plus a recent window.

Score of slot i for query head h: s[h, i] = sum over the observed queries t of A[h, t, i]
(the queries the runner passes: the last W, W = all prompt queries by default), averaged over each
GQA group. With normalize=True s is divided by the number of observed queries that could see slot
i (min(W, n - i)), which removes the bias toward early tokens (kvpress ObservedAttentionPress).
Budget C = recent (floor(C * recent_fraction), newest slots) + heavy (the rest, best scores);
paper defaults heavy 10% + recent 10% of the sequence = recent_fraction 0.5.
"""

from __future__ import annotations

import math

import torch

from nanokv.policies.base import LayerKV, register_policy
from nanokv.policies.scoring import ScoredPolicy, edge_mask
from nanokv.validation import check_int


def h2o_head_scores(attention: torch.Tensor, normalize: bool) -> torch.Tensor:
    """attention [Hq, W, n] -> accumulated scores [Hq, n]."""
    _, w, n = attention.shape
    scores = attention.float().sum(1)  # [Hq, n]
    if normalize:
        seen_by = (n - torch.arange(n, device=attention.device)).clamp(max=w)  # [n]
        scores = scores / seen_by
    return scores


@register_policy("h2o")
class H2O(ScoredPolicy):
    """Options: recent_fraction (default 0.5), normalize (default False), window (queries
    observed; None = all prompt queries), per_head (default True), n_sink (default 0).
    decode_mode "reselect": when the newest block fills, the runner passes the attention of (at
    least) the queries since the last selection and compacts again."""

    needs_attention = True
    decode_mode = "reselect"

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 recent_fraction: float = 0.5, normalize: bool = False,
                 window: int | None = None, per_head: bool = True, n_sink: int = 0) -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size, per_head=per_head, n_sink=n_sink)
        if isinstance(recent_fraction, bool) or not isinstance(recent_fraction, (int, float)) \
                or not 0 <= recent_fraction < 1:
            raise ValueError(f"recent_fraction must be in [0, 1), got {recent_fraction!r}")
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize must be True or False, got {normalize!r}")
        if window is not None:
            check_int("window", window, 1)
        self.recent_fraction = recent_fraction
        self.normalize = normalize
        self.window = window
        self._check_budget_option()

    @property
    def observation_window(self) -> int | None:
        return self.window

    def num_recent(self, budget: int) -> int:
        return math.floor(budget * self.recent_fraction)

    @property
    def min_budget(self) -> int:
        b = max(self.n_sink, 1)
        while self.n_sink + self.num_recent(b) > b:
            b += 1
        return b

    def head_scores(self, kv: LayerKV) -> torch.Tensor:
        return h2o_head_scores(kv.attention, self.normalize)  # [Hq, n]

    def protected_mask(self, n: int, budget: int) -> torch.Tensor:
        return edge_mask(n, self.n_sink, self.num_recent(budget))
