"""PyramidKV (arXiv 2406.02069): SnapKV scores with a per-layer budget that shrinks linearly
from the bottom layer to the top one. Runs once, after prefill.

With kbar the average budget of the prefix part (the requested budget minus the reserved
window and sinks, as PyramidKV's code reserves the window), min = kbar / beta, max = 2 kbar - min,
layer l keeps k_l = max - l (max - min) / (L - 1) prefix tokens plus the reserved ones. The k_l
are rounded to integers by largest remainder so that they sum to exactly L * budget and stay
non-increasing; they therefore AVERAGE TO THE REQUESTED BUDGET. A layer whose budget exceeds the
sequence keeps everything (then the average falls below the budget).

Against kvpress 0.5.5's PyramidKVPress: it builds the pyramid over the whole budget (window
included), caps the top layer at n - window and raises the bottom one to keep the average, and
falls back to the same budget in every layer whenever the smallest layer's share (about
budget / beta) would be below its window; here every layer reserves its window, so the pyramid
always applies.
"""

from __future__ import annotations

import math

from nanokv.policies.base import register_policy
from nanokv.policies.snapkv import SnapKV
from nanokv.validation import check_int


def check_beta(beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) \
            or beta < 1:
        raise ValueError(f"beta must be a finite number >= 1 (min = kbar / beta), got {beta!r}")


def pyramid_budgets(budget: int, num_layers: int, beta: float = 20.0,
                    reserved: int = 0) -> list[int]:
    """Per-layer budgets (layer 0 first, non-increasing) averaging exactly to `budget`."""
    check_int("budget", budget, 1)
    check_int("num_layers", num_layers, 1)
    check_int("reserved", reserved, 0)
    check_beta(beta)
    if budget < reserved:
        raise ValueError(f"budget {budget} is below the {reserved} reserved window/sink tokens")
    kbar = budget - reserved
    if num_layers == 1:
        return [budget]
    low = kbar / beta
    high = 2 * kbar - low
    step = (high - low) / (num_layers - 1)
    real = [high - layer * step for layer in range(num_layers)]
    floors = [math.floor(r + 1e-9) for r in real]
    missing = num_layers * kbar - sum(floors)
    # largest fractional part first; ties to the lower layer, which keeps the list non-increasing
    order = sorted(range(num_layers), key=lambda layer: (-(real[layer] - floors[layer]), layer))
    for layer in order[:missing]:
        floors[layer] += 1
    return [f + reserved for f in floors]


@register_policy("pyramidkv")
class PyramidKV(SnapKV):
    """SnapKV options plus beta (default 20). `layer_budgets(n, L)` gives each layer's budget;
    call `select(kv_of_layer_l, budgets[l])`."""

    per_layer_budgets = True

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 window: int = 32, kernel_size: int = 5, pooling: str = "avg",
                 per_head: bool = True, n_sink: int = 0, beta: float = 20.0) -> None:
        check_beta(beta)
        self.beta = beta
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size, window=window, kernel_size=kernel_size,
                         pooling=pooling, per_head=per_head, n_sink=n_sink)

    def layer_budgets(self, num_tokens: int, num_layers: int) -> list[int]:
        check_int("num_layers", num_layers, 1)
        kbar = self.resolve_budget(num_tokens)
        if kbar >= num_tokens:
            return [num_tokens] * num_layers
        reserved = min(self.window, num_tokens) + self.n_sink
        budgets = pyramid_budgets(kbar, num_layers, self.beta, reserved)
        return [min(b, num_tokens) for b in budgets]
