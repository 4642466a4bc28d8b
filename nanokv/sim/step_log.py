"""A served run's engine steps: when each started, how long its loop turn took, what was in it.

`nanokv serve --trace-file T --trace-steps S` writes one JSON line per engine step to S:

    {"step": 812, "t": 31.204518, "dur": 0.021433, "busy": true, "tokens": 9, "seqs": 8,
     "decodes": 8, "decode_context": 2931, "prefill_pairs": 0, "prefill_context": 0,
     "running": 8, "preempted": 0, "added": 1, "finished": 2, "pre": 0.000210,
     "step_dur": 0.019870, "step_cpu": 0.019530, "proc_cpu0": 20.411203, "proc_cpu1": 20.432991,
     "probe_cpu": 0.0001912}

`t` is the turn's start on the trace's clock (the request lines' `t`), `dur` the whole loop turn
(adding the turn's requests, the step, delivering its outputs, metrics), `busy` whether requests
were left unfinished at its end (then the next turn starts at once). `added` and `finished`
count the requests the turn added and ended (finished or aborted), `pre` is the time from the
turn's start to the engine step's, `step_dur` the engine step's own time (the outputs are
stamped at its end) and `step_cpu` the engine thread's CPU time in it (without what other
threads and processes took of the core meanwhile); the rest of the turn is the server's:
delivery, metrics, and the HTTP work the event loop did meanwhile on the same core
(`nanokv/sim/server_overhead.py`). `proc_cpu0` / `proc_cpu1` are the server process's CPU time
(all its threads) at the turn's start and end: a turn's CPU time, HTTP work included, without
what other processes took (`turn_cpu_times`). `probe_cpu` (every `PROBE_EVERY`-th step): the
CPU time of a fixed piece of work the engine thread ran right after the step
(`nanokv/sim/speed_work.py`), the machine's speed at that moment (`speed_probe.py`); it is
part of the turn, not of the step.

The request lines carry the step they were added before (`step`) and the order of admission
(`order`), so a replay can add each request exactly where the server did
(`SimConfig(admission="recorded")`).

From this log a step model is fitted: of the whole turn (`fit_step_log`), or of the engine step
alone (`fit_engine_step`) next to the server's overhead (`fit_server_overhead`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from nanokv.sim.speed_work import speed_work
from nanokv.sim.step_model import LinearStepModel, StepFeatures

PROBE_EVERY = 4  # steps between two runs of the machine-speed probe


@dataclass(frozen=True)
class StepLogEntry:
    step: int
    t: float  # turn start, seconds on the trace's clock
    dur: float  # the turn's duration, seconds
    busy: bool  # requests were unfinished at the turn's end
    features: StepFeatures
    running: int  # requests running after the step was scheduled
    preempted: int
    added: int = 0  # requests the turn added (before the step)
    finished: int = 0  # requests the turn ended
    pre: float | None = None  # turn start to the engine step's start (older logs: None)
    step_dur: float | None = None  # the engine step alone, seconds (older logs: None)
    step_cpu: float | None = None  # the engine thread's CPU seconds in the step
    proc_cpu0: float | None = None  # the server process's CPU seconds at the turn's start
    proc_cpu1: float | None = None  # ... and at its end
    probe_cpu: float | None = None  # CPU seconds of the machine-speed probe after the step

    def to_json(self) -> str:
        f = self.features
        d = {"step": self.step, "t": round(self.t, 6), "dur": round(self.dur, 6),
             "busy": self.busy, "tokens": f.num_tokens, "seqs": f.num_seqs,
             "decodes": f.num_decodes, "decode_context": f.decode_context,
             "prefill_pairs": f.prefill_pairs, "prefill_context": f.prefill_context,
             "running": self.running, "preempted": self.preempted, "added": self.added,
             "finished": self.finished}
        if self.pre is not None and self.step_dur is not None:
            d["pre"] = round(self.pre, 6)
            d["step_dur"] = round(self.step_dur, 6)
        for k in ("step_cpu", "proc_cpu0", "proc_cpu1"):
            if getattr(self, k) is not None:
                d[k] = round(getattr(self, k), 6)
        if self.probe_cpu is not None:
            d["probe_cpu"] = round(self.probe_cpu, 7)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> StepLogEntry:
        d = json.loads(line)
        f = StepFeatures(d["tokens"], d["seqs"], d["decodes"], d["decode_context"],
                         d["prefill_pairs"], d["prefill_context"])
        opt = {k: None if d.get(k) is None else float(d[k])
               for k in ("pre", "step_dur", "step_cpu", "proc_cpu0", "proc_cpu1", "probe_cpu")}
        return cls(int(d["step"]), float(d["t"]), float(d["dur"]), bool(d["busy"]), f,
                   int(d["running"]), int(d["preempted"]), int(d.get("added", 0)),
                   int(d.get("finished", 0)), **opt)


class StepLogWriter:
    """Wraps an engine's `scheduler.schedule` and `step` (on the instance) to see each step's
    shape and time; the server's loop calls `begin_turn` / `end_turn` around every turn,
    `admitted` for every request it adds and `ended` for every request that ends. Engine thread
    only."""

    def __init__(self, path: str | None, start: float) -> None:
        self.start = start  # the trace's clock: time.monotonic() at 0
        self.step = 0  # index of the next step
        self.order = 0  # admissions so far
        self._turn_t = self._turn_cpu = 0.0
        self._cpu_start = time.process_time()
        self._added = self._ended = 0
        self._step_t: float | None = None
        self._step_dur: float | None = None
        self._step_cpu: float | None = None
        self._probe_cpu: float | None = None
        self._probe = speed_work() if path is not None else None
        self._pending: tuple[StepFeatures, int, int] | None = None
        self._file = None
        if path is not None:
            try:
                self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - see close()
            except OSError as e:
                raise ValueError(f"cannot open the step log {path!r}: {e}") from e

    def attach(self, engine) -> None:
        scheduler = engine.scheduler
        schedule, step = scheduler.schedule, engine.step

        def logged_schedule():
            out = schedule()
            if not out.is_empty:
                self._pending = (StepFeatures.of(out.scheduled), len(scheduler.running),
                                 len(out.preempted_request_ids))
            return out

        def timed_step():
            self._step_t, cpu = time.monotonic(), time.thread_time()
            try:
                return step()
            finally:
                self._step_dur = time.monotonic() - self._step_t
                self._step_cpu = time.thread_time() - cpu
                # only after a step that gets a log line (not after an empty schedule)
                if (self._probe is not None and self._pending is not None
                        and self.step % PROBE_EVERY == 0):
                    c0 = time.thread_time()
                    self._probe()
                    self._probe_cpu = time.thread_time() - c0

        scheduler.schedule = logged_schedule
        engine.step = timed_step

    def begin_turn(self) -> None:
        self._turn_t = time.monotonic()
        self._turn_cpu = time.process_time() - self._cpu_start
        self._added = self._ended = 0
        self._step_t = self._step_dur = self._step_cpu = self._probe_cpu = None

    def admitted(self) -> tuple[int, int]:
        """(the step this request is added before, its admission order)."""
        self.order += 1
        self._added += 1
        return self.step, self.order - 1

    def ended(self) -> None:
        """A request finished or was aborted in this turn."""
        self._ended += 1

    def end_turn(self, busy: bool) -> None:
        if self._pending is None:
            return
        features, running, preempted = self._pending
        self._pending = None
        end = time.monotonic()
        if self._file is not None:
            entry = StepLogEntry(self.step, self._turn_t - self.start, end - self._turn_t,
                                 busy, features, running, preempted, self._added,
                                 self._ended, None if self._step_t is None
                                 else self._step_t - self._turn_t, self._step_dur,
                                 self._step_cpu, self._turn_cpu,
                                 time.process_time() - self._cpu_start, self._probe_cpu)
            self._file.write(entry.to_json() + "\n")
            self._file.flush()
        self.step += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_step_log(path: str) -> list[StepLogEntry]:
    entries = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    entries.append(StepLogEntry.from_json(line))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a step log line: {e}") from e
    if not entries:
        raise ValueError(f"{path} holds no steps")
    entries.sort(key=lambda e: e.step)
    return entries


def turn_times(entries: list[StepLogEntry]) -> dict[int, float]:
    """Seconds from each step's turn start to the next turn's start when the server stayed busy
    (the loop's own gaps count), else the turn's duration."""
    out = {}
    for e, nxt in zip(entries, entries[1:] + [None]):
        busy_next = nxt is not None and e.busy and nxt.step == e.step + 1
        out[e.step] = max(nxt.t - e.t, e.dur) if busy_next else e.dur
    return out


def turn_cpu_times(entries: list[StepLogEntry]) -> dict[int, float] | None:
    """The server process's CPU seconds from each step's turn start to the next turn's start
    when the server stayed busy, else to the turn's end (None: a log without them)."""
    if any(e.proc_cpu0 is None or e.proc_cpu1 is None for e in entries):
        return None
    out = {}
    for e, nxt in zip(entries, entries[1:] + [None]):
        busy_next = nxt is not None and e.busy and nxt.step == e.step + 1
        out[e.step] = (nxt.proc_cpu0 if busy_next else e.proc_cpu1) - e.proc_cpu0
    return out


def fit_step_log(entries: list[StepLogEntry], source: str = "",
                 load_window: float | None = 2.0, iterations: int = 20,
                 cpu: bool = False) -> LinearStepModel:
    """A linear step model fitted to a served run's own turn times (`cpu`: to the server
    process's CPU time in each turn instead, `turn_cpu_times`; then without load windows).

    On a machine shared with other work the turn times carry the machine's slowdown of the
    moment, and it is confounded with the step's shape (the batch fills up exactly while the
    machine is slow). With `load_window`, the model and a slowdown factor per window of that
    many seconds are fitted together (alternating: the model to the times divided by their
    window's factor, each factor as measured / modelled over its window), and the model is
    then scaled so that its times add up to the measured busy time: the machine's average
    speed, the step's shape from the variation within windows. `load_profile` gives the
    factors back relative to the returned model."""
    times = turn_cpu_times(entries) if cpu else turn_times(entries)
    if times is None:
        raise ValueError("cpu=True needs a step log with the server's CPU time per turn "
                         "(proc_cpu0, proc_cpu1)")
    y = [times[e.step] for e in entries]
    source = source or f"served run, {len(entries)} steps"
    if load_window is None or cpu:
        return LinearStepModel.fit(list(zip((e.features for e in entries), y)), source)
    if load_window <= 0:
        raise ValueError(f"load_window must be > 0, got {load_window}")
    start = entries[0].t
    win = [int((e.t - start) // load_window) for e in entries]
    factor = [1.0] * (max(win) + 1)
    for _ in range(iterations):
        model = LinearStepModel.fit([(e.features, t / factor[w])
                                     for e, t, w in zip(entries, y, win)], source)
        pred = [model.step_time(e.features) for e in entries]
        sums = [[0.0, 0.0] for _ in factor]
        for t, p, w in zip(y, pred, win):
            sums[w][0] += t
            sums[w][1] += p
        factor = [m / p if p > 0 else 1.0 for m, p in sums]
    k = sum(y) / max(sum(pred), 1e-12)
    return model.scaled(k, f"{source}, load fitted per {load_window:g} s")


@dataclass(frozen=True)
class LoadProfile:
    """How much slower than a step model the machine ran, by window of the trace's clock: on a
    machine shared with other work, step times swing by several times within seconds, which no
    model of the step's shape can predict. Replaying this profile separates that swing from the
    simulator's own error (validation); it says nothing about another machine."""

    start: float
    window: float
    factors: tuple[float, ...]

    def factor(self, t: float) -> float:
        i = int((t - self.start) // self.window)
        return self.factors[min(max(i, 0), len(self.factors) - 1)]


def load_profile(entries: list[StepLogEntry], model=None, window: float = 2.0) -> LoadProfile:
    """Measured turn time / `model`'s time over each window's steps (1.0 where none ran).
    Without a model: turn wall time / the server process's CPU time in the turns, the slowdown
    other processes caused, measured rather than fitted (a log with `proc_cpu0/1`)."""
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    times = turn_times(entries)
    cpu = turn_cpu_times(entries) if model is None else None
    if model is None and cpu is None:
        raise ValueError("a load profile without a model needs a step log with the server's "
                         "CPU time per turn (proc_cpu0, proc_cpu1)")
    start = entries[0].t
    sums: dict[int, list[float]] = {}
    for e in entries:
        s = sums.setdefault(int((e.t - start) // window), [0.0, 0.0])
        s[0] += times[e.step]
        s[1] += cpu[e.step] if cpu is not None else model.step_time(e.features)
    n = max(sums) + 1
    return LoadProfile(start, window, tuple(
        sums[i][0] / sums[i][1] if i in sums and sums[i][1] > 0 else 1.0 for i in range(n)))


def fit_engine_step(entries: list[StepLogEntry], source: str = "") -> LinearStepModel:
    """A linear step model of the engine step alone, for use with the server's overhead fitted
    to the same log (`nanokv.sim.server_overhead.fit_server_overhead`): to the engine thread's
    CPU time in each step (`step_cpu`) when the log has it, else to the step's wall time. The
    CPU time leaves out what the server's other threads (HTTP) and other processes took of the
    core meanwhile; the server's overhead accounts for the first."""
    timed = [(e.features, e.step_cpu if e.step_cpu is not None else e.step_dur)
             for e in entries if e.step_dur is not None]
    if len(timed) < len(entries):
        raise ValueError(f"{len(entries) - len(timed)} of {len(entries)} steps lack 'step_dur' "
                         f"(a step log written before it was logged): fit_step_log fits the "
                         f"whole turn instead")
    return LinearStepModel.fit(timed, source or f"engine steps of a served run, {len(timed)} "
                                                f"steps")
