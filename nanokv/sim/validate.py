"""Validate the simulator against a real `nanokv serve` run on the shipped model.

    python -m nanokv.sim.validate --out docs/results/advisor

1. times `nanokv bench` steps on this machine and fits a step model (`StepRecorder`);
2. starts `nanokv serve models/nanokv-tiny --trace-file ...` (small pool, block size 16) and
   sends a mixed chat + RAG workload open-loop at its arrival times (token-id prompts,
   `ignore_eos`, so lengths are the workload's), polling /metrics for the running batch;
3. replays the server's own trace through the simulator with the same settings and compares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nanokv.metrics.stats import percentile
from nanokv.sim.simulator import SimConfig, Simulator
from nanokv.sim.step_model import LinearStepModel, StepRecorder
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


def fit_step_model(seed: int) -> LinearStepModel:
    from nanokv.benchmark.run import run_bench

    recorders: list[StepRecorder] = []
    opts = {k: v for k, v in ENGINE.items()}
    run_bench(MODEL, opts, 64, (96, 640), (16, 48), seed, verbose=False, progress=False,
              on_engine_ready=lambda e: recorders.append(StepRecorder(e)))
    return recorders[0].fit(source=f"nanokv bench, shipped model, {len(recorders[0].samples)} "
                                   f"steps")


async def drive(port: int, items, stop_poll: list) -> tuple[int, list[str]]:
    import httpx

    peak = 0
    errors: list[str] = []
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=600,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        async def poll():
            nonlocal peak
            while not stop_poll:
                r = await client.get("/metrics")
                m = re.search(r"^nanokv:num_requests_running\{[^}]*\} ([0-9.e+]+)$", r.text,
                              re.M)
                if m:
                    peak = max(peak, int(float(m.group(1))))
                await asyncio.sleep(0.02)

        async def one(t0: float, t: float, prompt: list[int], out: int, cls: str):
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            r = await client.post("/v1/completions", headers={"X-Request-Class": cls}, json={
                "model": MODEL, "prompt": prompt, "max_tokens": out, "temperature": 0,
                "ignore_eos": True})
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:200]}")

        poller = asyncio.create_task(poll())
        t0 = time.monotonic()
        await asyncio.gather(*(one(t0, t, p, o, c) for t, p, o, c in items))
        stop_poll.append(True)
        await poller
    return peak, errors


def serve_and_trace(items, trace_path: str, port: int) -> tuple[int, list[str]]:
    flags = []
    for k, v in ENGINE.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    cmd = [sys.executable, "-m", "nanokv.cli", "serve", MODEL, "--port", str(port),
           "--trace-file", trace_path, "--request-classes", "chat,rag", "--no-access-log",
           "--max-waiting", "4096", "--log-level", "warning", *flags]
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
        return asyncio.run(drive(port, items, []))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def real_metrics(records) -> dict:
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
            "output_tok_s": out / (end - t0), "duration_s": end - t0,
            "ttft_s": {f"p{p}": percentile(ttfts, p) for p in (50, 90, 99)},
            "tpot_s": {f"p{p}": percentile(tpots, p) for p in (50, 90, 99)},
            "e2e_s": {f"p{p}": percentile(e2e, p) for p in (50, 90, 99)}}


def compare(real: dict, sim: dict) -> list[tuple[str, float, float, str]]:
    rows = [("prefix hit rate", real["prefix_hit_rate"], sim["prefix_hit_rate"], "equal"),
            ("preemptions", real["preemptions"], sim["preemptions"], "equal"),
            ("peak running", real["peak_running"], sim["peak_running"], "equal"),
            ("output tok/s", real["output_tok_s"], sim["output_tok_s"], "15%")]
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for p in ("p50", "p90"):
            rows.append((f"{key[:-2].upper()} {p} (s)", real[key][p], sim[key][p], "15%"))
    for c in real["hit_rate_by_class"]:
        rows.append((f"hit rate {c}", real["hit_rate_by_class"][c],
                     sim["hit_rate_by_class"].get(c, float("nan")), "equal"))
    return rows


def verdict(real: float, sim: float, target: str) -> str:
    if target == "equal":
        return "equal" if abs(real - sim) < 1e-9 else f"differs by {sim - real:+.4g}"
    err = sim / real - 1 if real else float("inf")
    return f"{err:+.1%} ({'within' if abs(err) <= 0.15 else 'OUTSIDE'} 15%)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--out", default="docs/results/advisor")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(MODEL).vocab_size
    items = workload(args.num_requests, args.rate, args.seed, vocab)
    step = fit_step_model(args.seed)
    print(f"[validate] {step.describe()}", file=sys.stderr)
    trace_path = os.path.join(args.out, "validation_trace.jsonl")
    if os.path.exists(trace_path):
        os.remove(trace_path)
    with tempfile.TemporaryDirectory():
        peak, errors = serve_and_trace(items, trace_path, args.port)
    records = read_trace(trace_path)
    real = real_metrics(records)
    real["peak_running"] = peak
    cfg = SimConfig(block_size=ENGINE["block_size"], num_blocks=ENGINE["num_kv_blocks"],
                    max_num_seqs=ENGINE["max_num_seqs"],
                    max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
                    max_model_len=ENGINE["max_model_len"], check_invariants=True)
    result = Simulator(records, cfg, step).run()
    sim = result.summary()
    rows = compare(real, sim)
    with open(os.path.join(args.out, "step_model.json"), "w", encoding="utf-8") as f:
        f.write(step.to_json() + "\n")
    with open(os.path.join(args.out, "validation.json"), "w", encoding="utf-8") as f:
        json.dump({"engine": ENGINE, "num_requests": len(records), "rate": args.rate,
                   "errors": errors, "real": real, "sim": sim}, f, indent=1, default=str)
    lines = [f"| metric | real `nanokv serve` | simulated | target | result |",
             "|---|---|---|---|---|"]
    for name, r, s, target in rows:
        lines.append(f"| {name} | {r:.4g} | {s:.4g} | {target} | {verdict(r, s, target)} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "validation_table.md"), "w", encoding="utf-8") as f:
        f.write(f"{len(records)} requests at {args.rate:g} req/s, engine {ENGINE}, "
                f"step model: {step.describe()}; errors: {len(errors)}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
