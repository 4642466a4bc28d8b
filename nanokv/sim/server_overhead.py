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
    after them         post_s + post_added_s * requests added + post_seq_s * sequences in the
                       step + post_ended_s * requests ended
                       + arrival_s * requests added that arrived while the server was busy

All of it is fitted (non-negative least squares) to the turn's time outside the engine step:
the process's CPU time in the turn minus the engine thread's own CPU time in the step where the
log has both, else the turn's time minus the modelled step. It has `arrival_s` per request
that arrived during the turn (its HTTP work, done before its arrival is stamped; the replay
charges it after the stamps of the turn that adds the request, the next one, and not at all
when it arrived while the server idled). The per-turn and per-added costs are split before /
after the stamps by the measured `pre` (on this CPU nearly all of a new request's cost lands
after them: 0.02 ms of it comes before). The turn's time
is the server process's CPU time where the log has it: the cost of the turn on a core of its
own, which other processes' load does not inflate.
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
    post_added_s: float = 0.0

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {v}")

    def pre(self, added: int) -> float:
        return self.pre_s + self.pre_added_s * added

    def post(self, seqs: int, ended: int, arrived: int = 0, added: int = 0) -> float:
        return (self.post_s + self.post_added_s * added + self.post_seq_s * seqs
                + self.post_ended_s * ended + self.arrival_s * arrived)

    def describe(self) -> str:
        return (f"server: {self.pre_s * 1e3:.3f} ms/turn + {self.pre_added_s * 1e3:.3f} ms/added "
                f"before the step, {self.arrival_s * 1e3:.3f} ms/arrival, "
                f"{self.post_s * 1e3:.3f} ms/turn + {self.post_added_s * 1e3:.3f} ms/added + "
                f"{self.post_seq_s * 1e6:.1f} us/seq + "
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

    cpu = turn_cpu_times(entries) if turn_seconds is None else None
    if turn_seconds is None:
        turn_seconds = cpu or turn_times(entries)
    timed = [e for e in entries if e.pre is not None and e.step_dur is not None]
    # with the process's CPU time per turn, the engine thread's own CPU time in the step is
    # what the step took of it: the rest is measured, not left over by the model (which, with
    # negative leftovers clipped at 0, read the overhead 15-30% high)
    measured = cpu is not None and all(e.step_cpu is not None for e in timed)
    if len(timed) < 6:
        raise ValueError(f"fitting the server's overhead needs at least 6 steps with 'pre' and "
                         f"'step_dur' (a step log written by this version), got {len(timed)}")
    # requests that arrived during a busy turn are the ones the next turn adds
    arrived = [nxt.added if e.busy and nxt.step == e.step + 1 else 0
               for e, nxt in zip(timed, timed[1:])] + [0]
    ones = np.ones(len(timed))
    added = [e.added for e in timed]
    # all of the turn but the engine step: per turn, added, sequence, ended, arrival
    rest = np.array([turn_seconds[e.step] - (e.step_cpu if measured else
                                             engine.step_time(e.features)) for e in timed])
    c = _nnls(np.c_[ones, added, [e.features.num_seqs for e in timed],
                    [e.finished for e in timed], arrived], rest)
    # which part of the per-turn and per-added time comes before the stamps: the measured
    # `pre`'s
    before = _nnls(np.c_[ones, added], np.array([e.pre for e in timed]))
    pre_s, pre_added_s = min(float(c[0]), float(before[0])), min(float(c[1]), float(before[1]))
    return ServerOverhead(pre_s, pre_added_s, float(c[4]), float(c[0]) - pre_s, float(c[2]),
                          float(c[3]), float(c[1]) - pre_added_s)
