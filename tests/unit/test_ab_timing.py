"""benchmarks/ab_timing.py: the sides called in turn with the order swapped each round, each
call timed on the given clock, and the per-pair ratios' median and quartiles."""

import pytest

from benchmark_scripts import load_benchmark


def test_sides_alternate_and_each_call_is_timed():
    ab = load_benchmark("ab_timing")
    calls, now = [], [0.0]
    cost = {"before": 2.0, "after": 1.0}

    def run(side):
        calls.append(side)
        now[0] += cost[side]

    times = ab.time_in_turn(run, 4, clock=lambda: now[0])
    assert calls == ["before", "after", "after", "before"] * 2
    assert times == {"before": [2.0] * 4, "after": [1.0] * 4}


def test_ratio_summary_is_after_over_before_per_pair():
    ab = load_benchmark("ab_timing")
    times = {"before": [1.0, 2.0, 4.0, 1.0, 1.0], "after": [1.0, 1.0, 1.0, 2.0, 3.0]}
    got = ab.ratio_summary(times)  # ratios 1, 0.5, 0.25, 2, 3
    assert got["ratio_median"] == 1.0
    assert got["ratio_q1"] <= 1.0 <= got["ratio_q3"]
    assert got["ratio_q1"] == pytest.approx(0.375) and got["ratio_q3"] == pytest.approx(2.5)
