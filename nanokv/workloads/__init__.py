"""Workloads and the drivers that run them, kept out of the engine's import path: synthetic
request sets and result records (workload.py, pure Python, shared with the peer scripts in
benchmarks/), `nanokv bench` over the offline engine (run.py) and the server load tester
(loadtest.py, needs the [serve] extra)."""

from nanokv.workloads.workload import BenchRequest, BenchResult, make_workload, summarize

__all__ = ["BenchRequest", "BenchResult", "make_workload", "summarize"]
