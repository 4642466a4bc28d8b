"""How long each simulated step takes: the step model, or a served run's own turn times, or the
model scaled by the machine's measured slowdown at the simulated time."""

from __future__ import annotations

from nanokv.sim.step_model import StepFeatures, StepModel


class StepClock:
    def __init__(self, model: StepModel, step_times: dict[int, float] | None = None,
                 load_profile=None, first_step: int = 0) -> None:
        """step_times: a served run's turn times by its step index (recorded admission);
        load_profile: a `nanokv.sim.step_log.LoadProfile` scaling the model's times by the
        machine's slowdown at the simulated time; first_step: the served run's index of the
        replay's step 0."""
        self.model = model
        self.step_times = step_times
        self.load_profile = load_profile
        self.first_step = first_step

    def step_time(self, f: StepFeatures, step: int, now: float) -> float:
        """Seconds of the replay's step `step` (features `f`) starting at simulated `now`."""
        if self.step_times is not None:
            try:
                return self.step_times[self.first_step + step]
            except KeyError:
                raise ValueError(f"the step log has no step {self.first_step + step}: the "
                                 f"replay left the served run's steps") from None
        if self.load_profile is not None:
            return self.model.step_time(f) * self.load_profile.factor(now)
        return self.model.step_time(f)
