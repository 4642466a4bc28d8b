"""The validation section of docs/results/advisor/README.md, written from the JSON files that
`nanokv.sim.validate` leaves there (between the markers below; the rest of the README is kept).

    python -m nanokv.sim.validation_report docs/results/advisor
"""

from __future__ import annotations

import glob
import json
import os
import sys

BEGIN = "<!-- validation:begin (written by python -m nanokv.sim.validation_report) -->"
END = "<!-- validation:end -->"
TARGET = 0.15
COLUMNS = ("recorded", "same-run", "calibrated", "calibrated + speed", "no overhead",
           "+3% steps", "+measured load")
EXACT = [("prefix hit rate", "prefix_hit_rate", None), ("preemptions", "preemptions", None),
         ("peak running", "peak_running", None)]
TIMED = [("output tok/s", "output_tok_s", None, 1),
         ("TTFT p50 ms", "ttft_s", "p50", 1e3), ("TTFT p90 ms", "ttft_s", "p90", 1e3),
         ("TPOT p50 ms", "tpot_s", "p50", 1e3), ("TPOT p90 ms", "tpot_s", "p90", 1e3),
         ("E2E p50 ms", "e2e_s", "p50", 1e3), ("E2E p90 ms", "e2e_s", "p90", 1e3)]


def _get(d: dict, key: str, sub: str | None):
    return d[key][sub] if sub else d[key]


def _num(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _relative(real: dict, other: dict) -> dict[str, float]:
    """Relative difference (other / real - 1) of each timed metric."""
    out = {}
    for label, key, sub, _ in TIMED:
        r, o = _get(real, key, sub), _get(other, key, sub)
        if r and o is not None:
            out[label] = o / r - 1
    return out


def errors(run: dict, column: str) -> dict[str, float]:
    """Relative error (simulated / real - 1) of each timed metric in one column."""
    return _relative(run["real"], run["sim"][column])


def repeat_errors(run: dict) -> list[dict[str, float]]:
    """Relative difference (repeat / first - 1) of each timed metric, per real repeat of the
    run (the same trace served again)."""
    return [_relative(run["real"], rep["real"]) for rep in run.get("real_repeats", [])]


def _columns(run: dict) -> list[str]:
    """The replays a run has (runs logged before the speed probe lack "calibrated + speed")."""
    return [c for c in COLUMNS if c in run["sim"]]


def run_table(run: dict) -> str:
    columns = _columns(run)
    repeats = [rep["real"] for rep in run.get("real_repeats", [])]
    again = [f"real again ({k + 1})" for k in range(len(repeats))]
    lines = ["| metric | real | " + " | ".join(again + columns) + " |",
             "|---" * (len(columns) + len(again) + 2) + "|"]
    for label, key, sub in EXACT:
        real = _get(run["real"], key, sub)
        cells = [_num(_get(rep, key, sub)) for rep in repeats]
        cells += [_num(_get(run["sim"][c], key, sub)) for c in columns]
        lines.append(f"| {label} | {_num(real)} | " + " | ".join(cells) + " |")
    for label, key, sub, scale in TIMED:
        real = _get(run["real"], key, sub)
        cells = []
        for value in [_get(rep, key, sub) for rep in repeats] + [
                _get(run["sim"][c], key, sub) for c in columns]:
            err = value / real - 1
            mark = "" if abs(err) <= TARGET else " **x**"
            cells.append(f"{value * scale:.3g} ({err:+.0%}){mark}")
        lines.append(f"| {label} | {real * scale:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_table(runs: list[dict]) -> str:
    lines = ["| run | offered req/s | calibrated capacity | load avg (mean / max) | "
             "server's share of its core | others on that core (mean / max) | "
             "turn wall / server CPU | machine speed vs calibration (min / mean / max) | "
             "engine CPU vs calibrated model | disturbed | calibration run: others max |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m, c = r["load_monitor"], r.get("calibration_load") or {}
        ratio = "-" if r.get("wall_per_cpu") is None else f"{r['wall_per_cpu']:.2f}"
        f = r.get("speed_factors")
        speed = "-" if not f else f"{min(f):.2f} / {sum(f) / len(f):.2f} / {max(f):.2f}"
        drift = "-" if r.get("engine_vs_model") is None else f"{r['engine_vs_model']:.3f}"
        calib = "-" if not c.get("windows") else (
            f"{c['others_share_max']:.1%}{' (**disturbed**)' if c['disturbed'] else ''}")
        if not m.get("windows"):
            lines.append(f"| {_name(r)} | {r['rate']:.1f} | {r['capacity_req_s']:.1f} | - | - "
                         f"| - | {ratio} | {speed} | {drift} | not measured | {calib} |")
            continue
        lines.append(
            f"| {_name(r)} | {r['rate']:.1f} | {r['capacity_req_s']:.1f} | "
            f"{m['loadavg_1m_mean']:.2f} / {m['loadavg_1m_max']:.2f} | "
            f"{m['server_share_mean']:.0%} | {m['others_share_mean']:.1%} / "
            f"{m['others_share_max']:.1%} | {ratio} | {speed} | {drift} | "
            f"{'**yes**' if m['disturbed'] else 'no'} | {calib} |")
    return "\n".join(lines)


def _name(r: dict) -> str:
    return f"seed {r['seed']}, {r['load']:.0%} load"


def _count(checks) -> tuple[int, int, list[str]]:
    """(within, total, the misses' texts) of (within, text) pairs."""
    checks = list(checks)
    return (sum(ok for ok, _ in checks), len(checks), [text for ok, text in checks if not ok])


def _tally(runs: list[dict], column: str) -> tuple[int, int, list[str]]:
    """(metrics within the target, metrics, the misses) of a replay over runs."""
    return _count((abs(err) <= TARGET, f"{_name(r)}: {label} {err:+.0%}")
                  for r in runs for label, err in errors(r, column).items())


def verdict(runs: list[dict], column: str) -> str:
    within, total, misses = _tally(runs, column)
    text = f"**{column}**: {within} of {total} timed metrics within 15%"
    return text + (f"; misses: {'; '.join(misses)}." if misses else ".")


def repeat_verdict(runs: list[dict]) -> str:
    """The real engine against itself: the same traces served again, each timed metric's
    difference from the first run (the one every replay is compared with)."""
    within, total, misses = _count(
        (abs(err) <= TARGET, f"{_name(r)} (repeat {k + 1}): {label} {err:+.0%}")
        for r in runs for k, errs in enumerate(repeat_errors(r)) for label, err in errs.items())
    text = (f"**the real engine served the same trace again**: {within} of {total} timed "
            f"metrics within 15% of its first run")
    return text + (f"; misses: {'; '.join(misses)}." if misses else ".")


def _span_checks(r: dict, column: str):
    """(within, text) per timed metric of one run with repeats: the replay within 15% below
    the lowest real run to 15% above the highest"""
    reals = [r["real"]] + [rep["real"] for rep in r.get("real_repeats", [])]
    if len(reals) < 2:
        return
    for label, key, sub, _ in TIMED:
        values = [_get(x, key, sub) for x in reals]
        sim = _get(r["sim"][column], key, sub)
        if sim is None or not all(values):
            continue
        lo, hi = min(values), max(values)
        gap = sim / hi - 1 if sim > hi else sim / lo - 1
        yield (lo * (1 - TARGET) <= sim <= hi * (1 + TARGET),
               f"{_name(r)}: {label} {gap:+.0%} beyond the span")


def span_verdict(runs: list[dict], column: str) -> str:
    """A replay against the span of the real runs of the same trace (the first and its
    repeats): a metric counts when it lies within 15% below the lowest to 15% above the
    highest, the target widened by no more than the real engine's own spread."""
    within, total, misses = _count(c for r in runs for c in _span_checks(r, column))
    text = (f"**{column}** against the span of the real runs of each trace: {within} of "
            f"{total} timed metrics within 15% of it")
    return text + (f"; misses: {'; '.join(misses)}." if misses else ".")


def report(out_dir: str) -> str:
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "validation_seed*_u*.json"))):
        with open(path, encoding="utf-8") as f:
            runs.append(json.load(f))
    if not runs:
        raise ValueError(f"{out_dir} holds no validation_seed*_u*.json (run "
                         f"python -m nanokv.sim.validate first)")
    runs.sort(key=lambda r: (r["load"], r["seed"]))
    disturbed = [r for r in runs if r["load_monitor"].get("disturbed")]
    parts = ["### Machine load during the runs", "",
             "Other processes' share of the server's core is the core's busy time minus the "
             "server process's CPU time, per 2 s window; a run where it passes 5% in any window "
             "is flagged as disturbed. Turn wall / server CPU: the served turns' wall time over "
             "the server process's CPU time in them (1.00 on a core of its own). Machine "
             "speed: the server's speed probe per 2 s window over the calibration run's "
             "(above 1: the same work took longer than when the model was fitted; "
             "`nanokv/sim/speed_probe.py`). Engine CPU vs calibrated model: the engine "
             "thread's CPU time over the run's steps divided by what the calibrated model "
             "predicts for the same steps (above 1: the engine ran slower than when it was "
             "calibrated; the drift no prediction made beforehand can know).", "",
             load_table(runs), ""]
    if disturbed:
        parts += [f"**{len(disturbed)} of {len(runs)} runs were disturbed** by other processes "
                  f"on the server's core: their timing errors include that load, which no step "
                  f"model predicts.", ""]
    parts += ["### Verdict (timed metrics: output tok/s, TTFT / TPOT / E2E p50 and p90)", ""]
    for column in ("calibrated", "calibrated + speed", "same-run", "no overhead", "+3% steps",
                   "+measured load", "recorded"):
        if not all(column in r["sim"] for r in runs):
            continue
        parts.append(f"- {verdict(runs, column)}")
        if column == "calibrated" and len({r["load"] for r in runs}) > 1:  # the prediction
            for load in sorted({r["load"] for r in runs}):
                within, total, _ = _tally([r for r in runs if r["load"] == load], column)
                parts.append(f"  - at {load:.0%} load: {within} of {total} within 15%")
    if any(r.get("real_repeats") for r in runs):
        parts.append(f"- {repeat_verdict(runs)}")
        parts.append(f"- {span_verdict(runs, 'calibrated')}")
    quiet = [r for r in runs if r["load_monitor"].get("disturbed") is False
             and (r.get("calibration_load") or {}).get("disturbed") is False]
    if quiet and len(quiet) < len(runs):
        parts.append(f"- runs whose measured and calibration runs were both undisturbed "
                     f"({len(quiet)}): {verdict(quiet, 'calibrated')}")
    exact = all(r["sim"]["recorded"][k] == r["real"][k] for r in runs
                for k in ("prefix_hit_rate", "preemptions", "peak_running"))
    shapes = sum(r["steps_differing_from_served"] for r in runs)
    parts += [f"- recorded admission: hit rate, preemptions and peak running "
              f"{'equal to the real run in every run' if exact else '**not all equal**'}; "
              f"{shapes} of {sum(r['steps'] for r in runs)} replayed steps differ in shape "
              f"from the served ones.", ""]
    for r in runs:
        models = r["models"]["calibrated"]
        parts += [f"### {_name(r)}: {r['rate']:.1f} req/s, {r['num_requests']} requests, "
                  f"{r['steps']} steps, {len(r['errors'])} errors", "",
                  f"Calibrated: {models['engine_step']}; {models['server']}. "
                  f"Same-run: {r['models']['same-run']['engine_step']}; "
                  f"{r['models']['same-run']['server']}.", "", run_table(r), ""]
    return "\n".join(parts)


def write_report(out_dir: str) -> str:
    path = os.path.join(out_dir, "README.md")
    text = report(out_dir)
    with open(path, encoding="utf-8") as f:
        readme = f.read()
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"{path} lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = readme.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m nanokv.sim.validation_report DIR")
    print(write_report(sys.argv[1]))
