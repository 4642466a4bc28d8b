"""StreamingLLM (arXiv 2309.17453): keep the first `n_sink` tokens (attention sinks) and the most
recent ones, `budget` in all. Position only: no scores, no attention.

Kept keys keep their original RoPE rotation (keys are stored after RoPE); the original code's
re-rotation of keys into cache positions is not implemented here.
"""

from __future__ import annotations

import torch

from nanokv.policies.base import KVPolicy, LayerKV, register_policy
from nanokv.policies.scoring import edge_mask
from nanokv.validation import check_int


@register_policy("streaming")
class StreamingLLM(KVPolicy):
    """Sinks + sliding window. decode_mode "reselect": each time the newest block fills (and the
    cache would keep >= budget after losing a block) the runner reselects and compacts, so the
    window slides by whole blocks."""

    decode_mode = "reselect"

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 n_sink: int = 4) -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size)
        check_int("n_sink", n_sink, 0)
        self.n_sink = n_sink
        self._check_budget_option()

    @property
    def min_budget(self) -> int:
        return self.n_sink + 1  # the sinks and at least the newest token

    def _select(self, kv: LayerKV, budget: int) -> torch.Tensor:
        n = kv.num_tokens
        keep = edge_mask(n, self.n_sink, budget - self.n_sink, kv.keys.device)  # [n]
        return torch.nonzero(keep).squeeze(1)  # [C]
