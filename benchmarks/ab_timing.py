"""Timing two builds of a kernel in one process, shared by the A/B tools (`ab_kvquant_decode.py`,
`ab_panel_linear.py`): the sides called in turn, ABAB then BABA by rounds (in one process the
second of two back-to-back calls is favoured), and the median and quartiles of the per-pair
ratios after / before."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

SIDES = ("before", "after")


def time_in_turn(run: Callable[[str], object], rounds: int,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of `run(side)` for each side, `rounds` calls each, the order swapped each round."""
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(rounds):
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            t0 = clock()
            run(side)
            times[side].append(clock() - t0)
    return times


def ratio_summary(times: dict[str, list[float]]) -> dict[str, float]:
    """The per-pair ratios after / before: their median and quartiles (at least 2 pairs)."""
    ratios = [a / b for a, b in zip(times["after"], times["before"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"ratio_median": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3}
