"""What a simulation measured: per request, and aggregated over the run (`RunTally` collects
while the replay runs; `SimResult` is the summary)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from nanokv.metrics.stats import percentile
from nanokv.sim.sim_config import SimConfig


@dataclass
class RequestResult:
    cls: str
    arrival: float
    prompt_len: int
    output_len: int
    cached: int
    first_token: float | None
    finish: float
    peak_blocks: int
    preemptions: int
    aborted: bool = False  # its client aborted it at `finish`

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.output_len < 2 or self.aborted:
            return None
        return (self.finish - self.first_token) / (self.output_len - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.aborted else self.finish - self.arrival


@dataclass
class SimResult:
    config: SimConfig
    step_model: str
    num_requests: int
    num_rejected: int
    num_aborted: int  # by their clients (counted in num_requests)
    num_steps: int
    duration_s: float  # first arrival to last finish, simulated
    wall_s: float  # how long the simulation took
    prefix_hit_rate: float
    hit_rate_by_class: dict[str, float]
    hit_rate_over_time: list[tuple[float, float]]  # (window start, hit rate of its arrivals)
    peak_running: int
    mean_running: float  # time-weighted
    peak_kv_usage: float
    mean_kv_usage: float
    preemptions: int
    recomputed_tokens: int
    evicted_blocks: dict[str, int]
    kv_bytes_per_request: dict[str, float]  # mean, p50, p90 of the peak bytes held
    ttft_s: dict[str, float | None]  # p50, p90, p99
    tpot_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    output_tok_s: float
    total_tok_s: float
    requests_per_s: float
    # while requests wait (the batch is full: max_num_seqs or the KV pool), what is served:
    # the configuration's capacity, if the run was saturated long enough to measure it
    saturated_s: float = 0.0
    capacity_req_s: float | None = None
    capacity_tok_s: float | None = None
    requests: list[RequestResult] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "num_requests", "num_rejected", "num_aborted", "num_steps", "duration_s", "wall_s",
            "prefix_hit_rate", "hit_rate_by_class", "peak_running", "mean_running",
            "peak_kv_usage", "mean_kv_usage", "preemptions", "recomputed_tokens",
            "evicted_blocks", "kv_bytes_per_request", "ttft_s", "tpot_s", "e2e_s",
            "output_tok_s", "total_tok_s", "requests_per_s", "saturated_s", "capacity_req_s",
            "capacity_tok_s")}
        d["step_model"] = self.step_model
        return d


def _pcts(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


class RunTally:
    """Time-weighted running requests and KV usage, peaks, the saturated time (requests
    waiting) and its sampled tokens, and the finished requests."""

    def __init__(self) -> None:
        self.done: list[RequestResult] = []
        self.rejected = 0
        self.running_area = self.usage_area = 0.0
        self.peak_running, self.peak_usage = 0, 0.0
        self.saturated_s, self.saturated_tokens = 0.0, 0

    def steps(self, running: int, usage: float, seconds: float, saturated: bool,
              sampled: int, peaks: bool = True) -> None:
        """One step, or a fast-forwarded run of equal ones (`peaks` False: the run's first
        step counted them), of `seconds` in all."""
        self.running_area += running * seconds
        self.usage_area += usage * seconds
        if peaks:
            self.peak_running = max(self.peak_running, running)
            self.peak_usage = max(self.peak_usage, usage)
        if saturated:
            self.saturated_s += seconds
            self.saturated_tokens += sampled

    def result(self, config: SimConfig, step_model: str, num_steps: int, t0: float,
               preemptions: int, recomputed_tokens: int, evicted_blocks: dict[str, int],
               wall: float) -> SimResult:
        done, cfg = self.done, config
        end = max((r.finish for r in done), default=t0)
        duration = max(end - t0, 1e-12)
        queries = sum(r.prompt_len for r in done)
        hits = sum(r.cached for r in done)
        by_cls: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        by_win: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for r in done:
            by_cls[r.cls][0] += r.cached
            by_cls[r.cls][1] += r.prompt_len
            w = by_win[int((r.arrival - t0) // cfg.window_s)]
            w[0] += r.cached
            w[1] += r.prompt_len
        kv = [r.peak_blocks * cfg.bytes_per_block for r in done]
        out_tokens = sum(r.output_len for r in done)
        sat_s, sat_tok = self.saturated_s, self.saturated_tokens
        return SimResult(
            config=cfg, step_model=step_model, num_requests=len(done),
            num_rejected=self.rejected, num_aborted=sum(r.aborted for r in done),
            num_steps=num_steps, duration_s=duration, wall_s=wall,
            prefix_hit_rate=hits / queries if queries else math.nan,
            hit_rate_by_class={c: h / q for c, (h, q) in sorted(by_cls.items()) if q},
            hit_rate_over_time=[(t0 + k * cfg.window_s, h / q)
                                for k, (h, q) in sorted(by_win.items()) if q],
            peak_running=self.peak_running, mean_running=self.running_area / duration,
            peak_kv_usage=self.peak_usage, mean_kv_usage=self.usage_area / duration,
            preemptions=preemptions, recomputed_tokens=recomputed_tokens,
            evicted_blocks=evicted_blocks,
            kv_bytes_per_request={"mean": sum(kv) / len(kv) if kv else 0.0,
                                  "p50": percentile(kv, 50) or 0.0,
                                  "p90": percentile(kv, 90) or 0.0},
            ttft_s=_pcts([r.ttft for r in done if r.ttft is not None]),
            tpot_s=_pcts([r.tpot for r in done if r.tpot is not None]),
            e2e_s=_pcts([r.e2e for r in done if r.e2e is not None]),
            output_tok_s=out_tokens / duration,
            total_tok_s=(out_tokens + queries) / duration,
            requests_per_s=len(done) / duration, saturated_s=sat_s,
            # requests/s from the token rate: counting the requests that finish while others
            # wait would miss the batch's fill-up, a larger share for a larger batch
            capacity_req_s=(sat_tok / sat_s / (out_tokens / len(done))
                            if sat_s > 0 and out_tokens else None),
            capacity_tok_s=sat_tok / sat_s if sat_s > 0 else None, requests=done)
