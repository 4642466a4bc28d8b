"""The machine-speed probe: window medians, the profile against the calibration run's speed, and
the step log's probe samples."""

from __future__ import annotations

import pytest

from nanokv.sim.speed_probe import (ProbeSample, probe_samples, reference_time,
                                    run_speed_profile, speed_profile, window_medians)
from nanokv.sim.step_log import StepLogEntry
from nanokv.sim.step_model import StepFeatures
from nanokv.sim.speed_work import speed_work


def _samples(times_by_window: list[list[float]], window: float = 2.0) -> list[ProbeSample]:
    out = []
    for w, times in enumerate(times_by_window):
        for i, cpu in enumerate(times):
            out.append(ProbeSample(w * window + (i + 0.5) * window / (len(times) + 1), cpu))
    return out


def test_window_medians_ignore_a_spike_and_report_empty_windows():
    samples = _samples([[1.0, 1.1, 9.0], [], [2.0, 2.0]])
    assert window_medians(samples, 0.0, 5.9) == [1.1, None, 2.0]
    # samples outside the run do not count
    assert window_medians(samples + [ProbeSample(-1.0, 5.0), ProbeSample(99.0, 5.0)],
                          0.0, 5.9) == [1.1, None, 2.0]


def test_profile_is_the_slowdown_against_the_reference_with_gaps_filled():
    reference = reference_time(_samples([[1.0], [3.0]]), 0.0, 3.9)  # mean of window medians
    assert reference == pytest.approx(2.0)
    run = [ProbeSample(10.5, 2.4), ProbeSample(14.5, 1.8)]  # nothing in [12, 14)
    profile = speed_profile(run, reference, 10.0, 15.0)
    assert profile.start == 10.0 and profile.window == 2.0
    assert profile.factors == pytest.approx((1.2, 1.2, 0.9))
    assert profile.factor(13.0) == pytest.approx(1.2) and profile.factor(14.9) == pytest.approx(0.9)
    # a run whose first windows are empty takes the first sampled window's factor
    assert speed_profile([ProbeSample(14.5, 3.0)], 2.0, 10.0, 15.0).factors == (1.5, 1.5, 1.5)


def test_profile_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="window must be > 0"):
        window_medians([], 0.0, 1.0, window=0)
    with pytest.raises(ValueError, match="ends .* before it starts"):
        window_medians([], 2.0, 1.0)
    with pytest.raises(ValueError, match="no speed-probe sample"):
        reference_time([ProbeSample(50.0, 1.0)], 0.0, 10.0)
    with pytest.raises(ValueError, match="reference probe time must be > 0"):
        speed_profile([ProbeSample(0.5, 1.0)], 0.0, 0.0, 1.0)


def _entry(step: int, t: float, probe: float | None) -> StepLogEntry:
    return StepLogEntry(step, t, 0.01, True, StepFeatures(1, 1, 1, 10), 1, 0, probe_cpu=probe)


def test_run_profile_from_two_step_logs_and_json_round_trip():
    calibration = [_entry(i, 0.1 * i, 0.002 if i % 4 == 0 else None) for i in range(40)]
    run = [_entry(i, 0.1 * i, 0.003 if i % 4 == 0 else None) for i in range(40)]
    run = [StepLogEntry.from_json(e.to_json()) for e in run]
    assert [s.cpu_s for s in probe_samples(run)] == [0.003] * 10
    profile = run_speed_profile(calibration, run)
    assert profile is not None and profile.factors == pytest.approx((1.5, 1.5))
    # logs written before the probe: no profile
    assert run_speed_profile(calibration, [_entry(0, 0.0, None)]) is None
    assert "probe_cpu" not in _entry(1, 0.0, None).to_json()


def test_speed_work_repeats_the_same_work():
    work = speed_work()
    assert work() == work()
