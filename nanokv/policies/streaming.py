"""StreamingLLM (arXiv 2309.17453): keep the first `n_sink` tokens (attention sinks) and the most
recent ones, `budget` in all. Position only: no scores, no attention.

While decoding, the window slides one block each time the newest block fills (and the cache
would keep >= budget after losing a block), in one of two ways (option `slide`):
  "token" (default)  reselect and compact: exactly n_sink sinks and the newest tokens. Every
                     kept token after the sinks moves by one block: the blocks after the
                     sinks' block are copied whole (exact), but a quantized cache re-writes,
                     and rounds again, the sinks' block at each slide. With per-channel block
                     statistics (KVQuant, KIVI) its sinks' error grows slide after slide
                     (docs/results/policies/compaction_memory.md), unless the cache keeps them
                     at full precision (KVQuant's num_sink_tokens >= n_sink)
  "block"            free the oldest block after the sink blocks, in place: nothing moves or is
                     rounded again, for any cache; the blocks holding the sinks stay whole (up
                     to B - 1 more old tokens than n_sink, kept for good)

Kept keys keep their original RoPE rotation (keys are stored after RoPE); the original code's
re-rotation of keys into cache positions is not implemented here.
"""

from __future__ import annotations

import torch

from nanokv.policies.base import KVPolicy, LayerKV, register_policy
from nanokv.policies.scoring import edge_mask
from nanokv.utils import cdiv
from nanokv.validation import check_choice, check_int

SLIDES = ("token", "block")


@register_policy("streaming")
class StreamingLLM(KVPolicy):
    """Sinks + sliding window. Options: n_sink (default 4), slide ("token" or "block", see the
    module docstring)."""

    decode_mode = "reselect"

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 n_sink: int = 4, slide: str = "token") -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size)
        check_int("n_sink", n_sink, 0)
        check_choice("slide", slide, SLIDES)
        self.n_sink = n_sink
        self.slide = slide
        if slide == "block":
            self.decode_mode = "evict_block"  # frees a block in place; no scores needed
            self.needs_block_scores = False
        self._check_budget_option()

    @property
    def min_budget(self) -> int:
        return self.n_sink + 1  # the sinks and at least the newest token

    def _select(self, kv: LayerKV, budget: int) -> torch.Tensor:
        n = kv.num_tokens
        keep = edge_mask(n, self.n_sink, budget - self.n_sink, kv.keys.device)  # [n]
        return torch.nonzero(keep).squeeze(1)  # [C]

    # ---- decode (slide="block") ----------------------------------------------------------------
    def block_to_evict(self, block_scores: torch.Tensor | None, num_slots: int,
                       budget: int) -> int | None:
        """The oldest block after the blocks holding the sinks, when the newest block just
        filled and losing one block leaves >= budget slots; never the newest block. Scores are
        not read."""
        if not self.should_evict_on_decode(num_slots, budget):
            return None
        first = cdiv(self.n_sink, self.block_size)  # blocks 0 .. first-1 hold the sinks
        return first if first < cdiv(num_slots, self.block_size) - 1 else None
