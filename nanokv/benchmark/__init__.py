"""Benchmark helpers: synthetic workloads and result records (pure Python, no torch)."""

from nanokv.benchmark.workload import BenchRequest, BenchResult, make_workload, summarize

__all__ = ["BenchRequest", "BenchResult", "make_workload", "summarize"]
