"""The server's time in each loop turn outside the engine step, fitted from a step log.

A served loop turn (`nanokv/server/async_engine.py`) is

    pre    add the turn's new requests, process aborts        before the step
    step   engine.step(): schedule, forward, sample; the outputs are stamped at its end
    post   deliver the outputs, record metrics and trace       after the stamps, until the
           lines, and the wait for the next turn               next turn starts

and on one core the event loop's HTTP work (parsing requests, building responses) takes its
share of the same core during all three. A step model predicts `step` from the step's shape
(`nanokv/sim/step_model.py`); `ServerOverhead` predicts the rest from what the turn did:

    pre  = pre_s  + pre_added_s * requests added
    post = post_s + post_seq_s * sequences in the step + post_ended_s * requests ended

Both are fitted (non-negative least squares) to the log's `pre`, `step_dur` and turn times. Only
`pre + step` delays the stamps (TTFT, TPOT); `post` delays the next turn.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from nanokv.sim.step_model import _nnls


@dataclass(frozen=True)
class ServerOverhead:
    pre_s: float = 0.0
    pre_added_s: float = 0.0
    post_s: float = 0.0
    post_seq_s: float = 0.0
    post_ended_s: float = 0.0

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {v}")

    def pre(self, added: int) -> float:
        return self.pre_s + self.pre_added_s * added

    def post(self, seqs: int, ended: int) -> float:
        return self.post_s + self.post_seq_s * seqs + self.post_ended_s * ended

    def describe(self) -> str:
        return (f"server: {self.pre_s * 1e3:.3f} ms + {self.pre_added_s * 1e3:.3f} ms/added "
                f"before the step, {self.post_s * 1e3:.3f} ms + {self.post_seq_s * 1e6:.1f} "
                f"us/seq + {self.post_ended_s * 1e3:.3f} ms/ended after it")

    def to_json(self) -> str:
        return json.dumps({"kind": "server_overhead", **asdict(self)}, indent=1)


def fit_server_overhead(entries, turn_seconds: dict[int, float]) -> ServerOverhead:
    """Fit to step log entries that carry `pre` and `step_dur`; `turn_seconds`: each step's
    turn time (`step_log.turn_times`: to the next turn's start while the server stayed busy)."""
    timed = [e for e in entries if e.pre is not None and e.step_dur is not None]
    if len(timed) < 3:
        raise ValueError(f"fitting the server's overhead needs at least 3 steps with 'pre' and "
                         f"'step_dur' (a step log written by this version), got {len(timed)}")
    pre = np.array([e.pre for e in timed])
    post = np.array([max(0.0, turn_seconds[e.step] - e.pre - e.step_dur) for e in timed])
    ones = np.ones(len(timed))
    a = _nnls(np.c_[ones, [e.added for e in timed]], pre)
    b = _nnls(np.c_[ones, [e.features.num_seqs for e in timed],
                    [e.finished for e in timed]], post)
    return ServerOverhead(float(a[0]), float(a[1]), float(b[0]), float(b[1]), float(b[2]))
