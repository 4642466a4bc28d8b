"""What an engine's scheduler hands the runner, recorded for the tests."""


def record_decode_rows(engine, monkeypatch) -> list:
    """A list that collects every scheduled chunk of `engine` that goes as decode rows
    (`ScheduledRequest.decode_rows`) from now on."""
    routed = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        routed.extend(s for s in out.scheduled if s.decode_rows)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    return routed
