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

    before the stamps  pre_s + (pre_added_s + arrival_s) * requests added
    after them         post_s + post_seq_s * sequences in the step + post_ended_s * requests ended

`pre_*` is fitted to the measured `pre`; the rest to the turn's remaining time (turn - pre -
modelled step), with `arrival_s` per request that arrived during the turn (its HTTP work; the
replay charges it to the turn that adds the request, the next one). Non-negative least squares.
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
        return self.pre_s + (self.pre_added_s + self.arrival_s) * added

    def post(self, seqs: int, ended: int) -> float:
        return self.post_s + self.post_seq_s * seqs + self.post_ended_s * ended

    def describe(self) -> str:
        return (f"server: {self.pre_s * 1e3:.3f} ms/turn + {self.pre_added_s * 1e3:.3f} ms/added "
                f"before the step, {self.arrival_s * 1e3:.3f} ms/arrival, "
                f"{self.post_s * 1e3:.3f} ms/turn + {self.post_seq_s * 1e6:.1f} us/seq + "
                f"{self.post_ended_s * 1e3:.3f} ms/ended after it")

    def to_json(self) -> str:
        return json.dumps({"kind": "server_overhead", **asdict(self)}, indent=1)


def fit_server_overhead(entries, turn_seconds: dict[int, float],
                        engine: StepModel) -> ServerOverhead:
    """Fit to step log entries that carry `pre` and `step_dur`; `turn_seconds`: each step's
    turn time (`step_log.turn_times`: to the next turn's start while the server stayed busy);
    `engine`: the model of the engine step the overhead goes with."""
    timed = [e for e in entries if e.pre is not None and e.step_dur is not None]
    if len(timed) < 6:
        raise ValueError(f"fitting the server's overhead needs at least 6 steps with 'pre' and "
                         f"'step_dur' (a step log written by this version), got {len(timed)}")
    # requests that arrived during a busy turn are the ones the next turn adds
    arrived = [nxt.added if e.busy and nxt.step == e.step + 1 else 0
               for e, nxt in zip(timed, timed[1:])] + [0]
    pre = np.array([e.pre for e in timed])
    rest = np.array([max(0.0, turn_seconds[e.step] - e.pre - engine.step_time(e.features))
                     for e in timed])
    ones = np.ones(len(timed))
    a = _nnls(np.c_[ones, [e.added for e in timed]], pre)
    b = _nnls(np.c_[ones, [e.features.num_seqs for e in timed], [e.finished for e in timed],
                    arrived], rest)
    return ServerOverhead(float(a[0]), float(a[1]), float(b[3]), float(b[0]), float(b[1]),
                          float(b[2]))
