"""Validate the simulator against a real `nanokv serve` run on the shipped model.

    python -m nanokv.sim.validate --out docs/results/advisor

1. a calibration run: `nanokv serve --trace-file --trace-steps` under another seed of the same
   workload, right before the measured run (same machine load); a step model is fitted to its
   step log;
2. the measured run: the server writes its trace and step log while a mixed chat + RAG workload
   is sent open-loop at its arrival times (token-id prompts, `ignore_eos`, so lengths are the
   workload's);
3. the trace is replayed five ways and compared with what the server measured:
   recorded    the server's own step boundaries (admission="recorded") and turn times: checks
               the replay's accounting (every step's shape must equal the served one);
   same-run    recorded step boundaries, step model fitted to this run's step log (together
               with the machine's slowdown per 2 s window, `fit_step_log`; the model alone);
   predicted   arrival-time admission (what `nanokv advise` does), same-run step model;
   +load       as predicted, each step's time scaled by the machine's slowdown in that window
               (`LoadProfile`: the other work on a shared machine, replayed);
   calibrated  arrival-time admission, step model of the calibration run.

`--replay-only` recomputes the tables from the files an earlier run left in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nanokv.metrics.stats import percentile
from nanokv.sim.simulator import SimConfig, Simulator
from nanokv.sim.step_log import fit_step_log, load_profile, read_step_log, turn_times
from nanokv.sim.synthetic import WorkloadShape, generate_requests
from nanokv.sim.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "nanokv-tiny")
ENGINE = dict(block_size=16, num_kv_blocks=160, max_num_seqs=8, max_num_batched_tokens=512,
              max_model_len=1024)
CHAT = WorkloadShape(system_prompts=4, system_len=(128, 384), user_len=(16, 64),
                     output_len=(16, 48), max_model_len=1024)
RAG = WorkloadShape(system_len=(48, 64), documents=24, document_len=(64, 192),
                    documents_per_request=2, user_len=(16, 48), output_len=(16, 48),
                    max_model_len=1024)


def workload(n: int, rate: float, seed: int, vocab: int) -> list[tuple[float, list[int], int, str]]:
    """Half chat, half RAG, merged by arrival; segment ids hashed into the vocabulary."""
    items = [(t, p, len(o), "chat") for t, p, o, _, _ in
             generate_requests("chat", n // 2, rate / 2, seed, CHAT)]
    items += [(t, p, len(o), "rag") for t, p, o, _, _ in
              generate_requests("rag", n - n // 2, rate / 2, seed + 1, RAG)]
    items.sort(key=lambda x: x[0])
    return [(t, [(x * 2654435761 >> 7) % (vocab - 16) + 8 for x in p], out, cls)
            for t, p, out, cls in items]


async def drive(port: int, items) -> list[str]:
    import httpx

    errors: list[str] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        async def one(t0: float, t: float, prompt: list[int], out: int, cls: str):
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            r = await client.post("/v1/completions", headers={"X-Request-Class": cls}, json={
                "model": MODEL, "prompt": prompt, "max_tokens": out, "temperature": 0,
                "ignore_eos": True})
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:200]}")

        t0 = time.monotonic()
        await asyncio.gather(*(one(t0, t, p, o, c) for t, p, o, c in items))
    return errors


def serve_and_trace(items, trace_path: str, steps_path: str, port: int) -> list[str]:
    for path in (trace_path, steps_path):
        if os.path.exists(path):
            os.remove(path)
    flags = []
    for k, v in ENGINE.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    cmd = [sys.executable, "-m", "nanokv.cli", "serve", MODEL, "--port", str(port),
           "--trace-file", trace_path, "--trace-steps", steps_path,
           "--request-classes", "chat,rag", "--no-access-log", "--max-waiting", "4096",
           "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("the server did not start")
        return asyncio.run(drive(port, items))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def real_metrics(records, log) -> dict:
    t0 = min(r.t for r in records)
    end = max(r.t + r.e2e_s for r in records)
    out = sum(r.output_len for r in records)
    q = sum(r.prompt_len for r in records)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_len - 1) for r in records
             if r.ttft_s is not None and r.output_len > 1]
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    e2e = [r.e2e_s for r in records]
    by_cls: dict[str, list[int]] = {}
    for r in records:
        h = by_cls.setdefault(r.cls, [0, 0])
        h[0] += r.cached
        h[1] += r.prompt_len
    return {"prefix_hit_rate": sum(r.cached for r in records) / q,
            "hit_rate_by_class": {c: h / n for c, (h, n) in sorted(by_cls.items())},
            "preemptions": sum(r.preemptions for r in records),
            "peak_running": max(e.running for e in log), "num_steps": len(log),
            "output_tok_s": out / (end - t0), "duration_s": end - t0,
            "ttft_s": {f"p{p}": percentile(ttfts, p) for p in (50, 90, 99)},
            "tpot_s": {f"p{p}": percentile(tpots, p) for p in (50, 90, 99)},
            "e2e_s": {f"p{p}": percentile(e2e, p) for p in (50, 90, 99)}}


ROWS = [("prefix hit rate", "prefix_hit_rate", None, "equal"),
        ("preemptions", "preemptions", None, "equal"),
        ("peak running", "peak_running", None, "equal"),
        ("engine steps", "num_steps", None, "-"),
        ("output tok/s", "output_tok_s", None, "15%"),
        ("TTFT p50 (s)", "ttft_s", "p50", "15%"), ("TTFT p90 (s)", "ttft_s", "p90", "15%"),
        ("TPOT p50 (s)", "tpot_s", "p50", "15%"), ("TPOT p90 (s)", "tpot_s", "p90", "15%"),
        ("E2E p50 (s)", "e2e_s", "p50", "15%"), ("E2E p90 (s)", "e2e_s", "p90", "15%")]


def _get(d: dict, key: str, sub: str | None):
    v = d[key]
    return v[sub] if sub else v


def cell(real: float, sim: float, target: str) -> str:
    if target in ("equal", "-"):
        if abs(real - sim) < 1e-9:
            return f"{sim:.4g} (equal)"
        diff = sim - real
        return f"{sim:.4g} ({diff:+.4g})"
    err = sim / real - 1 if real else float("inf")
    return f"{sim:.4g} ({err:+.1%}{'' if abs(err) <= 0.15 else ' OUTSIDE'})"


def table(real: dict, sims: dict[str, dict]) -> str:
    names = list(sims)
    lines = ["| metric | real `nanokv serve` | " + " | ".join(names) + " | target |",
             "|---" * (len(names) + 3) + "|"]
    for label, key, sub, target in ROWS:
        r = _get(real, key, sub)
        cells = [cell(r, _get(sims[n], key, sub), target) for n in names]
        lines.append(f"| {label} | {r:.4g} | " + " | ".join(cells) + f" | {target} |")
    for c in real["hit_rate_by_class"]:
        r = real["hit_rate_by_class"][c]
        cells = [cell(r, sims[n]["hit_rate_by_class"].get(c, float("nan")), "equal")
                 for n in names]
        lines.append(f"| hit rate {c} | {r:.4g} | " + " | ".join(cells) + " | equal |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--calibration-requests", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--out", default="docs/results/advisor")
    ap.add_argument("--tag", default="", help="suffix of the output files")
    ap.add_argument("--replay-only", action="store_true",
                    help="do not serve: replay the trace and step logs already in --out")
    ap.add_argument("--load-window", type=float, default=2.0,
                    help="seconds per window of the machine's measured slowdown, fitted with "
                         "the step model and replayed by +load (default 2)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(MODEL).vocab_size
    out = lambda name: os.path.join(args.out, name.format(args.tag))  # noqa: E731
    # 1. calibration run, right before the measured one
    calib_items = workload(args.calibration_requests, args.rate, args.seed + 1000, vocab)
    calib_steps = out("calibration_steps{}.jsonl")
    if not args.replay_only:
        serve_and_trace(calib_items, out("calibration_trace{}.jsonl"), calib_steps, args.port)
    calibrated = fit_step_log(read_step_log(calib_steps),
                              f"calibration run before, {args.calibration_requests} requests",
                              args.load_window)
    # 2. the measured run
    items = workload(args.num_requests, args.rate, args.seed, vocab)
    trace_path, steps_path = out("validation_trace{}.jsonl"), out("validation_steps{}.jsonl")
    if args.replay_only:
        with open(out("validation{}.json"), encoding="utf-8") as f:
            errors = json.load(f)["errors"]
    else:
        errors = serve_and_trace(items, trace_path, steps_path, args.port + 1)
    records, log = read_trace(trace_path), read_step_log(steps_path)
    real = real_metrics(records, log)
    same_run = fit_step_log(log, f"this run's step log, {len(log)} steps", args.load_window)
    # 3. replays
    base = dict(block_size=ENGINE["block_size"], num_blocks=ENGINE["num_kv_blocks"],
                max_num_seqs=ENGINE["max_num_seqs"],
                max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
                max_model_len=ENGINE["max_model_len"])
    recorded = SimConfig(**base, admission="recorded")
    arrival = SimConfig(**base, check_invariants=True)
    replay = Simulator(records, recorded, same_run, record_decisions=True,
                       step_times=turn_times(log))
    runs = {"recorded": replay.run(),
            "same-run": Simulator(records, recorded, same_run).run(),
            "predicted": Simulator(records, arrival, same_run).run(),
            "+load": Simulator(records, arrival, same_run,
                               load_profile=load_profile(log, same_run, args.load_window)).run(),
            "calibrated": Simulator(records, arrival, calibrated).run()}
    mismatched = sum(a != b.features for a, b in zip(replay.features, log)) + abs(
        len(replay.features) - len(log))
    sims = {name: r.summary() for name, r in runs.items()}
    text = table(real, sims)
    print(text)
    models = {"same-run": same_run.describe(), "calibrated": calibrated.describe()}
    with open(out("step_model{}.json"), "w", encoding="utf-8") as f:
        f.write(same_run.to_json() + "\n")
    with open(out("step_model_calibration{}.json"), "w", encoding="utf-8") as f:
        f.write(calibrated.to_json() + "\n")
    with open(out("validation{}.json"), "w", encoding="utf-8") as f:
        json.dump({"engine": ENGINE, "num_requests": len(records), "rate": args.rate,
                   "seed": args.seed, "errors": errors, "step_models": models,
                   "steps_differing_from_served": mismatched, "real": real, "sim": sims},
                  f, indent=1, default=str)
    with open(out("validation_table{}.md"), "w", encoding="utf-8") as f:
        f.write(f"{len(records)} requests at {args.rate:g} req/s (seed {args.seed}), engine "
                f"{ENGINE}; errors: {len(errors)}; recorded replay: {mismatched} of {len(log)} "
                f"steps differ in shape from the served run's\n\n"
                f"- same-run / predicted: {models['same-run']}\n"
                f"- calibrated: {models['calibrated']}\n\n{text}\n")
    print(f"steps differing from the served run: {mismatched}; models: {models}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
