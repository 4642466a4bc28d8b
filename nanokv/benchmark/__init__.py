"""Benchmarks of nanokv, kept out of the engine's import path: synthetic workloads and result
records (workload.py, pure Python, shared with the peer scripts in benchmarks/), `nanokv bench`
(run.py) and the server load tester (loadtest.py, needs the [serve] extra)."""

from nanokv.benchmark.workload import BenchRequest, BenchResult, make_workload, summarize

__all__ = ["BenchRequest", "BenchResult", "make_workload", "summarize"]
