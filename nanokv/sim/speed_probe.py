"""The machine's speed during a served run, from the probe the server times beside its steps.

On a shared virtual machine the same engine step takes 5-30% more or less CPU time from one few
seconds to the next (other tenants of the host share its caches, memory bandwidth and clock;
CPU time cannot show it: the thread is not waiting, each instruction just takes longer). A step
model fitted at one moment therefore mispredicts a run made minutes later by that much, and near
capacity queueing multiplies the error several times.

With `--trace-steps` the server times a fixed piece of work (`speed_work`) after every
`PROBE_EVERY`-th engine step, on its own core, and logs it (`probe_cpu`). `speed_profile`
divides a run's probe times, per window, by the calibration run's (`reference_time`): the
slowdown of the machine against the moment the step model was fitted. Replayed with the
calibrated model (`SimConfig` + `LoadProfile`), it makes the machine's measured speed an input
of the prediction, as a device's bandwidth is, instead of something fitted to the run being
predicted: the probe does the same work whatever the workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from nanokv.sim.step_log import LoadProfile, StepLogEntry


@dataclass(frozen=True)
class ProbeSample:
    t: float  # the turn's start on the trace's clock
    cpu_s: float  # CPU seconds of one run of the probe's work


def probe_samples(entries: list[StepLogEntry]) -> list[ProbeSample]:
    """The probe's samples in a step log (steps that ran it)."""
    return [ProbeSample(e.t, e.probe_cpu) for e in entries if e.probe_cpu is not None]


def window_medians(samples: list[ProbeSample], start: float, end: float,
                   window: float = 2.0) -> list[float | None]:
    """The median probe time in each `window` seconds from `start` to `end` (None: no
    sample in it). Medians, so that a probe run interrupted by the kernel counts for little."""
    if not window > 0:
        raise ValueError(f"window must be > 0 seconds, got {window}")
    if end < start:
        raise ValueError(f"the run ends ({end}) before it starts ({start})")
    buckets: list[list[float]] = [[] for _ in range(int((end - start) // window) + 1)]
    for s in samples:
        i = int((s.t - start) // window)
        if 0 <= i < len(buckets):
            buckets[i].append(s.cpu_s)
    return [median(b) if b else None for b in buckets]


def reference_time(samples: list[ProbeSample], start: float, end: float,
                   window: float = 2.0) -> float:
    """The machine's speed over a whole run (the calibration run): the mean of its windows'
    medians, as the step model fitted to the run averages over its time."""
    meds = [m for m in window_medians(samples, start, end, window) if m is not None]
    if not meds:
        raise ValueError("the step log holds no speed-probe sample (probe_cpu) in the run")
    return sum(meds) / len(meds)


def speed_profile(samples: list[ProbeSample], reference: float, start: float, end: float,
                  window: float = 2.0) -> LoadProfile:
    """The machine's slowdown against `reference`, per `window` of a run from `start` to `end`
    (the trace's clock). A window without a sample takes the previous one's factor (the first
    sampled one's at the start)."""
    if not reference > 0:
        raise ValueError(f"the reference probe time must be > 0 seconds, got {reference}")
    meds = window_medians(samples, start, end, window)
    last = next((m for m in meds if m is not None), None)
    if last is None:
        raise ValueError("the step log holds no speed-probe sample (probe_cpu) in the run")
    factors = []
    for m in meds:
        last = m if m is not None else last
        factors.append(last / reference)
    return LoadProfile(start, window, tuple(factors))


def run_speed_profile(calibration: list[StepLogEntry], run: list[StepLogEntry],
                      window: float = 2.0) -> LoadProfile | None:
    """`run`'s machine speed against `calibration`'s, from both logs' probe samples (None when
    either log has none: written before the probe was logged)."""
    ref, now = probe_samples(calibration), probe_samples(run)
    if not ref or not now:
        return None
    reference = reference_time(ref, calibration[0].t, calibration[-1].t, window)
    return speed_profile(now, reference, run[0].t, run[-1].t, window)
