"""The validation's machinery without serving: the load monitor's readings against the kernel's
own accounting, the report's verdicts from hand-made runs, and the option checks."""

from __future__ import annotations

import os
import time

import pytest

from nanokv.sim import machine_load, validation_report
from nanokv.sim.machine_load import LoadWindow


def test_process_cpu_time_matches_the_kernels_accounting():
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn CPU so that the readings move
        pass
    t = os.times()
    got = machine_load._proc_cpu_seconds(os.getpid())
    assert got == pytest.approx(t.user + t.system, abs=0.05)
    cpu = sorted(os.sched_getaffinity(0))[0]
    a = machine_load._core_busy_seconds(cpu)
    assert machine_load._core_busy_seconds(cpu) >= a > 0
    with pytest.raises(ValueError, match="cpu"):
        machine_load._core_busy_seconds(10_000)


def test_monitor_samples_windows_and_the_summary_flags_other_load():
    with machine_load.LoadMonitor(os.getpid(), sorted(os.sched_getaffinity(0))[0],
                                  window=0.1) as m:
        time.sleep(0.6)
    assert len(m.windows) >= 2 and all(w.seconds > 0 for w in m.windows)
    quiet = [LoadWindow(0, 2, 0.5, 0.98, 1.0, 0.02), LoadWindow(2, 2, 0.6, 1.0, 1.0, 0.0)]
    s = machine_load.summarize(quiet)
    assert s["disturbed"] is False and s["others_share_max"] == 0.02
    assert s["server_share_mean"] == pytest.approx(0.99)
    busy = quiet + [LoadWindow(4, 2, 3.0, 0.6, 1.0, 0.4)]
    assert machine_load.summarize(busy)["disturbed"] is True
    assert machine_load.summarize([])["disturbed"] is None
    with pytest.raises(ValueError, match="window"):
        machine_load.LoadMonitor(os.getpid(), 0, window=0)


def _run(ttft_real: float, ttft_sim: float) -> dict:
    metrics = {"prefix_hit_rate": 0.5, "preemptions": 1, "peak_running": 8,
               "output_tok_s": 100.0, "ttft_s": {"p50": ttft_real, "p90": 2.0},
               "tpot_s": {"p50": 0.01, "p90": 0.02}, "e2e_s": {"p50": 1.0, "p90": 3.0}}
    sim = dict(metrics, ttft_s={"p50": ttft_sim, "p90": 2.0})
    return {"seed": 0, "load": 0.7, "rate": 14.0, "capacity_req_s": 20.0, "num_requests": 9,
            "steps": 50, "errors": [], "steps_differing_from_served": 0,
            "load_monitor": machine_load.summarize([LoadWindow(0, 2, 0.5, 1.0, 1.0, 0.0)]),
            "models": {"calibrated": {"engine_step": "m", "server": "s"},
                       "same-run": {"engine_step": "m", "server": "s"}},
            "speed_factors": [0.9, 1.0, 1.1],
            "real": metrics, "sim": {c: sim for c in validation_report.COLUMNS}}


def test_report_marks_misses_beyond_15_percent(tmp_path):
    import json

    for name, run in (("validation_seed0_u70.json", _run(1.0, 1.10)),
                      ("validation_seed1_u70.json", _run(1.0, 1.20))):
        run["seed"] = int(name[15])
        (tmp_path / name).write_text(json.dumps(run))
    (tmp_path / "README.md").write_text(f"head\n{validation_report.BEGIN}\nold\n"
                                        f"{validation_report.END}\ntail\n")
    validation_report.write_report(str(tmp_path))
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "\nold\n" not in text
    assert "**calibrated**: 13 of 14 timed metrics within 15%; misses: seed 1, 70% load: " \
           "TTFT p50 ms +20%." in text
    assert "| TTFT p50 ms | 1e+03 |" in text and "1.1e+03 (+10%) |" in text
    assert "1.2e+03 (+20%) **x** |" in text
    assert "equal to the real run in every run" in text
    assert "**calibrated + speed**: 13 of 14" in text and "| 0.90 / 1.00 / 1.10 |" in text
    # runs logged before the speed probe: no such column, no such verdict
    for name in ("validation_seed0_u70.json", "validation_seed1_u70.json"):
        run = json.loads((tmp_path / name).read_text())
        del run["sim"]["calibrated + speed"], run["speed_factors"]
        (tmp_path / name).write_text(json.dumps(run))
    validation_report.write_report(str(tmp_path))
    text = (tmp_path / "README.md").read_text()
    assert "calibrated + speed" not in text and "**calibrated**: 13 of 14" in text


def test_validate_rejects_bad_options():
    from nanokv.sim.validate import main

    with pytest.raises(ValueError, match="--seeds takes integers"):
        main(["--seeds", "one"])
    with pytest.raises(ValueError, match="loads must be > 0"):
        main(["--loads", "0"])
    with pytest.raises(ValueError, match="num-requests must be >= 10"):
        main(["--num-requests", "3"])
    cpu = sorted(os.sched_getaffinity(0))[0]
    with pytest.raises(ValueError, match="must differ"):
        main(["--server-cpu", str(cpu), "--client-cpu", str(cpu)])
    with pytest.raises(ValueError, match="not one of"):
        main(["--server-cpu", "10000"])


def test_ramped_calibration_keeps_the_requests_and_steps_the_rate():
    from nanokv.sim.validate import ramped

    items = [(float(i), [i, i + 1], 4, "chat") for i in range(12)]  # one request a second
    out = ramped(items, [0.25, 0.5, 1.0])
    assert [x[1:] for x in out] == [x[1:] for x in items]  # same requests, same order
    gaps = [b[0] - a[0] for a, b in zip(out, out[1:])]
    # four requests per phase, each request's gap before it scaled by its phase's fraction
    assert gaps == pytest.approx([4.0] * 3 + [2.0] * 4 + [1.0] * 4)
    assert ramped(items, [1.0]) == items
    with pytest.raises(ValueError, match="> 0"):
        ramped(items, [0.5, 0.0])


def test_validate_rejects_a_bad_calibration_ramp():
    from nanokv.sim.validate import main

    with pytest.raises(ValueError, match="--calibration-ramp"):
        main(["--calibration-ramp", "fast"])
    with pytest.raises(ValueError, match=r"--calibration-ramp needs fractions in \(0, 10\]"):
        main(["--calibration-ramp", "0.5,-1"])


def test_report_splits_the_prediction_by_load_and_shows_the_engines_drift(tmp_path):
    import json

    below, above = _run(1.0, 1.05), _run(1.0, 1.40)
    above.update(load=1.3, seed=1, engine_vs_model=0.934)
    for name, run in (("validation_seed0_u70.json", below), ("validation_seed1_u130.json", above)):
        (tmp_path / name).write_text(json.dumps(run))
    (tmp_path / "README.md").write_text(f"{validation_report.BEGIN}\n{validation_report.END}\n")
    validation_report.write_report(str(tmp_path))
    text = (tmp_path / "README.md").read_text()
    assert "**calibrated**: 13 of 14 timed metrics within 15%" in text
    assert "  - at 70% load: 7 of 7 within 15%\n" in text
    assert "  - at 130% load: 6 of 7 within 15%\n" in text
    assert "| 0.934 |" in text and text.index("**calibrated**:") < text.index(
        "**calibrated + speed**:")


def test_report_shows_the_real_engine_against_itself(tmp_path):
    """Repeats of a measured run (the same trace served again) get their own columns, each
    metric's difference from the first real run, and a verdict of their own; the replays are
    still judged against the first run."""
    import json

    run = _run(1.0, 1.05)
    again = json.loads(json.dumps(run["real"]))
    again["ttft_s"]["p50"] = 1.3  # +30%: a miss of the real engine against itself
    again["output_tok_s"] = 95.0  # -5%
    run["real_repeats"] = [{"real": again, "load_monitor": run["load_monitor"]}]
    (tmp_path / "validation_seed0_u70.json").write_text(json.dumps(run))
    (tmp_path / "README.md").write_text(f"{validation_report.BEGIN}\n{validation_report.END}\n")
    validation_report.write_report(str(tmp_path))
    text = (tmp_path / "README.md").read_text()
    assert ("**the real engine served the same trace again**: 6 of 7 timed metrics within 15% "
            "of its first run; misses: seed 0, 70% load (repeat 1): TTFT p50 ms +30%.") in text
    assert "| metric | real | real again (1) | recorded |" in text
    assert "| TTFT p50 ms | 1e+03 | 1.3e+03 (+30%) **x** | 1.05e+03 (+5%) |" in text
    assert "| output tok/s | 100 | 95 (-5%) | 100 (+0%) |" in text
    assert "**calibrated**: 7 of 7 timed metrics within 15%." in text
    assert ("**calibrated** against the span of the real runs of each trace: 7 of 7 timed "
            "metrics within 15% of it.") in text
    # a prediction beyond the span: TTFT p50 real 1.0 and 1.3, predicted 1.6 (+23% of 1.3)
    run["sim"]["calibrated"]["ttft_s"] = {"p50": 1.6, "p90": 2.0}
    assert validation_report.span_verdict([run], "calibrated").endswith(
        "6 of 7 timed metrics within 15% of it; misses: seed 0, 70% load: TTFT p50 ms +23% "
        "beyond the span.")
    run["sim"]["calibrated"]["ttft_s"] = {"p50": 0.8, "p90": 2.0}  # -20% of 1.0: a miss
    assert "TTFT p50 ms -20% beyond the span" in validation_report.span_verdict([run],
                                                                              "calibrated")
    run["sim"]["calibrated"]["ttft_s"] = {"p50": 1.45, "p90": 2.0}  # +12% of 1.3: within
    assert "7 of 7" in validation_report.span_verdict([run], "calibrated")
    assert validation_report.repeat_errors(run)[0]["TTFT p50 ms"] == pytest.approx(0.3)
    # runs without repeats: no such column, no such verdict
    del run["real_repeats"]
    (tmp_path / "validation_seed0_u70.json").write_text(json.dumps(run))
    validation_report.write_report(str(tmp_path))
    text = (tmp_path / "README.md").read_text()
    assert "real again" not in text and "served the same trace again" not in text
    assert "span of the real runs" not in text


def test_validate_rejects_bad_real_repeats():
    from nanokv.sim.validate import main

    with pytest.raises(ValueError, match="--real-repeats must be >= 1, got 0"):
        main(["--real-repeats", "0"])
