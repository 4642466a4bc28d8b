"""The server's time in each loop turn outside the engine step, fitted from a step log.

A served loop turn (`nanokv/server/async_engine.py`) is

    pre    add the turn's new requests, process aborts        before the step
    step   engine.step(): schedule, forward, sample; the outputs are stamped at its end
    post   deliver the outputs, record metrics and trace       after the stamps, until the
           lines, and the wait for the next turn               next turn starts

and on one core the event loop's HTTP work (parsing and validating a request, waking its
stream for every output, detokenizing and sending the response) takes its share of the same
core during all three. The step model predicts the engine thread's own time in `step`
(`fit_engine_step`: fitted to its CPU time); `ServerOverhead` predicts the rest of the turn:

    before the stamps  pre_s + pre_added_s * requests added
    after them         post_s + post_seq_s * sequences in the step + post_ended_s * requests ended
                       + arrival_s * requests added that arrived while the server was busy

All of it is fitted (non-negative least squares) to the turn's time left by the modelled
engine step, with `arrival_s` per request that arrived during the turn (its HTTP work, done
before its arrival is stamped; the replay charges it after the stamps of the turn that adds
the request, the next one, and not at all when it arrived while the server idled); the
per-turn constant is
split before / after the stamps by the measured `pre`. The turn's time is the server process's
CPU time where the log has it: the cost of the turn on a core of its own, which other
processes' load does not inflate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from nanokv.sim.step_model import StepModel, _nnls


@dataclass(frozen=True)
class ServerOverhead:
    pre_s: float = 0.0
    pre_added_s: float = 0.0
    arrival_s: float = 0.0
    post_s: float = 0.0
    post_seq_s: float = 0.0
    post_ended_s: float = 0.0

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {v}")

    def pre(self, added: int) -> float:
        return self.pre_s + self.pre_added_s * added

    def post(self, seqs: int, ended: int, arrived: int = 0) -> float:
        return (self.post_s + self.post_seq_s * seqs + self.post_ended_s * ended
                + self.arrival_s * arrived)

    def describe(self) -> str:
        return (f"server: {self.pre_s * 1e3:.3f} ms/turn + {self.pre_added_s * 1e3:.3f} ms/added "
                f"before the step, {self.arrival_s * 1e3:.3f} ms/arrival, "
                f"{self.post_s * 1e3:.3f} ms/turn + {self.post_seq_s * 1e6:.1f} us/seq + "
                f"{self.post_ended_s * 1e3:.3f} ms/ended after it")

    def to_json(self) -> str:
        return json.dumps({"kind": "server_overhead", **asdict(self)}, indent=1)


def fit_server_overhead(entries, engine: StepModel,
                        turn_seconds: dict[int, float] | None = None) -> ServerOverhead:
    """Fit to step log entries that carry `pre` and `step_dur`; `engine`: the model of the
    engine step the overhead goes with; `turn_seconds`: each step's turn time (default: the
    server process's CPU time per turn, `step_log.turn_cpu_times`, where the log has it: what
    the turn costs on a core of its own, without what other processes took of it; else the
    wall time, `step_log.turn_times`)."""
    from nanokv.sim.step_log import turn_cpu_times, turn_times

    if turn_seconds is None:
        turn_seconds = turn_cpu_times(entries) or turn_times(entries)
    timed = [e for e in entries if e.pre is not None and e.step_dur is not None]
    if len(timed) < 6:
        raise ValueError(f"fitting the server's overhead needs at least 6 steps with 'pre' and "
                         f"'step_dur' (a step log written by this version), got {len(timed)}")
    # requests that arrived during a busy turn are the ones the next turn adds
    arrived = [nxt.added if e.busy and nxt.step == e.step + 1 else 0
               for e, nxt in zip(timed, timed[1:])] + [0]
    ones = np.ones(len(timed))
    added = [e.added for e in timed]
    # all of the turn but the modelled engine step: per turn, added, sequence, ended, arrival
    rest = np.array([max(0.0, turn_seconds[e.step] - engine.step_time(e.features))
                     for e in timed])
    c = _nnls(np.c_[ones, added, [e.features.num_seqs for e in timed],
                    [e.finished for e in timed], arrived], rest)
    # which part of the per-turn time comes before the stamps: the measured `pre`'s
    before = _nnls(np.c_[ones, added], np.array([e.pre for e in timed]))[0]
    pre_s = min(float(c[0]), float(before))
    return ServerOverhead(pre_s, float(c[1]), float(c[4]), float(c[0]) - pre_s, float(c[2]),
                          float(c[3]))
