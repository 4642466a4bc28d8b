"""Sliding windows and scheduler deltas (nanokv/metrics/stats.py): plain data, no server."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanokv.metrics.stats import (FinishedRequestStats, IterationStats, RatioWindow,
                                  SchedulerDeltas, TimeWeightedWindow, percentile)
from nanokv.outputs import RequestMetrics
from nanokv.scheduler.output import SchedulerStats


def test_ratio_window_is_the_hit_fraction_of_the_window():
    w = RatioWindow(10.0)
    assert math.isnan(w.ratio(0.0))  # nothing looked up: no rate
    w.add(1.0, 30, 100)
    w.add(5.0, 0, 100)
    assert w.ratio(5.0) == pytest.approx(0.15)
    assert w.ratio(11.5) == pytest.approx(0.0)  # the first event left the window
    assert math.isnan(w.ratio(15.0))  # both gone: idle
    w.add(16.0, 0, 0)  # an empty event changes nothing
    assert math.isnan(w.ratio(16.0))


def test_time_weighted_std_of_a_square_wave():
    w = TimeWeightedWindow(10.0, start=0.0, initial=0.0)
    w.add(5.0, 1.0)  # 0 for 5 s, then 1 for 5 s: mean 0.5, std 0.5
    assert w.mean(10.0) == pytest.approx(0.5)
    assert w.std(10.0) == pytest.approx(0.5)
    # 15 s later only the value 1 is in the window: no volatility
    assert w.std(25.0) == pytest.approx(0.0)
    assert w.mean(25.0) == pytest.approx(1.0)


def test_time_weighted_window_weights_by_duration():
    w = TimeWeightedWindow(100.0, start=0.0, initial=0.2)
    w.add(90.0, 0.8)  # 0.2 for 90 s, 0.8 for 10 s
    mean = 0.2 * 0.9 + 0.8 * 0.1
    assert w.mean(100.0) == pytest.approx(mean)
    assert w.std(100.0) == pytest.approx(math.sqrt(0.9 * (0.2 - mean) ** 2
                                                   + 0.1 * (0.8 - mean) ** 2))
    with pytest.raises(ValueError, match="time order"):
        w.add(50.0, 0.1)
    with pytest.raises(ValueError, match="window_s"):
        TimeWeightedWindow(0, start=0.0)


@given(st.lists(st.tuples(st.floats(0.01, 5.0), st.floats(0.0, 1.0)), min_size=1, max_size=30),
       st.floats(1.0, 50.0))
def test_time_weighted_std_matches_a_dense_resampling(steps, window):
    """Oracle: sample the piecewise-constant signal on a fine grid and take the plain std."""
    w = TimeWeightedWindow(window, start=0.0, initial=0.0)
    t, times = 0.0, []
    for dt, v in steps:
        t += dt
        w.add(t, v)
        times.append((t, v))
    now = t + 1.0
    start = max(0.0, now - window)
    n = 4000
    grid = [start + (now - start) * (i + 0.5) / n for i in range(n)]

    def value_at(x):
        value = 0.0
        for ti, vi in times:
            if ti <= x:
                value = vi
        return value

    xs = [value_at(x) for x in grid]
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)
    assert w.std(now) == pytest.approx(std, abs=0.02)
    assert w.mean(now) == pytest.approx(mean, abs=0.02)


def _snap(**kw):
    base = dict(num_running=1, num_waiting=2, num_free_blocks=5, num_total_blocks=10,
                kv_cache_usage=0.5, num_preemptions=0, num_scheduled_tokens=0,
                prefix_cache_queries=0, prefix_cache_hits=0, evicted_blocks={})
    return SchedulerStats(**{**base, **kw})


def test_scheduler_deltas_turn_totals_into_increments():
    d = SchedulerDeltas()
    it = IterationStats(time=0.0)
    d.fill(_snap(prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1,
                 num_scheduled_tokens=40, evicted_blocks={"preemption": 3}), it)
    assert (it.prefix_cache_queries, it.prefix_cache_hits, it.num_preemptions) == (10, 4, 1)
    assert it.step_tokens == 40
    assert it.evicted_blocks == {"preemption": 3}
    assert (it.num_running, it.num_waiting, it.kv_cache_usage) == (1, 2, 0.5)
    it = IterationStats(time=1.0)
    d.fill(_snap(prefix_cache_queries=25, prefix_cache_hits=4, num_preemptions=1,
                 num_scheduled_tokens=43, evicted_blocks={"preemption": 3, "prefix_lru": 2}), it)
    assert (it.prefix_cache_queries, it.prefix_cache_hits, it.num_preemptions) == (15, 0, 0)
    assert it.step_tokens == 3
    assert it.evicted_blocks == {"prefix_lru": 2}


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 90) == 90


def test_finished_request_phases_from_its_timestamps():
    """vLLM's phases: queued = arrival..scheduled, prefill = scheduled..first token, decode =
    first..last token, inference = scheduled..last token; per-request TPOT = decode / (tokens
    - 1). A request aborted before a point has no phase that needs it."""
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.25,
                       last_token_time=13.25, finished_time=13.5)
    f = FinishedRequestStats.of("length", 30, 5, m, 13.5, 4096, 16, 5, 2)
    assert (f.queued_s, f.prefill_s, f.decode_s, f.inference_s) == (0.5, 0.75, 2.0, 2.75)
    assert f.e2e_latency_s == 3.5 and f.time_per_output_token_s == 0.5
    assert (f.num_cached_tokens, f.max_tokens, f.num_preemptions) == (16, 5, 2)
    waiting = FinishedRequestStats.of("abort", 30, 0, RequestMetrics(arrival_time=10.0), 12.0,
                                      0, -1, 5, 0)
    assert (waiting.queued_s, waiting.prefill_s, waiting.decode_s, waiting.inference_s) == \
        (None, None, None, None)
    assert waiting.num_cached_tokens == 0 and waiting.time_per_output_token_s is None
    one = FinishedRequestStats.of("length", 30, 1, RequestMetrics(10.0, 10.5, 11.0, 11.0), 11.0,
                                  0, 0, 1, 0)
    assert one.decode_s == 0.0 and one.time_per_output_token_s is None
