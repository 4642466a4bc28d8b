"""How long each simulated loop turn takes: the step model (plus, when given, the server's time
outside the step), or a served run's own turn times, or the model scaled by the machine's
measured slowdown at the simulated time."""

from __future__ import annotations

from nanokv.sim.server_overhead import ServerOverhead
from nanokv.sim.step_model import StepFeatures, StepModel


class StepClock:
    def __init__(self, model: StepModel, step_times: dict[int, float] | None = None,
                 load_profile=None, first_step: int = 0,
                 overhead: ServerOverhead | None = None) -> None:
        """step_times: a served run's turn times by its step index (recorded admission);
        load_profile: a `nanokv.sim.step_log.LoadProfile` scaling the model's times by the
        machine's slowdown at the simulated time; first_step: the served run's index of the
        replay's step 0; overhead: the server's time before and after each engine step."""
        self.model = model
        self.step_times = step_times
        self.load_profile = load_profile
        self.first_step = first_step
        self.overhead = overhead

    def _factor(self, now: float) -> float:
        return 1.0 if self.load_profile is None else self.load_profile.factor(now)

    def turn(self, f: StepFeatures, step: int, now: float, added: int,
             arrived: int = 0) -> tuple[float, float]:
        """(seconds from the turn's start until its outputs are stamped, seconds after that
        before the next turn, without the ended requests' share: `ended`) of the replay's step
        `step` (features `f`, `added` requests added before it, `arrived` of them while the
        server was busy) starting at simulated `now`."""
        if self.step_times is not None:
            try:
                return self.step_times[self.first_step + step], 0.0
            except KeyError:
                raise ValueError(f"the step log has no step {self.first_step + step}: the "
                                 f"replay left the served run's steps") from None
        k = self._factor(now)
        t = self.model.step_time(f) * k
        if self.overhead is None:
            return t, 0.0
        return (t + self.overhead.pre(added) * k,
                self.overhead.post(f.num_seqs, 0, arrived, added) * k)

    def ended(self, n: int, now: float) -> float:
        """The server's time for `n` requests ending in a turn (delivery, trace lines)."""
        if self.overhead is None or self.step_times is not None or not n:
            return 0.0
        return self.overhead.post_ended_s * n * self._factor(now)

    def step_time(self, f: StepFeatures, step: int, now: float) -> float:
        """A whole turn that adds and ends no request (fast-forwarded decodes)."""
        stamp, post = self.turn(f, step, now, 0)
        return stamp + post
