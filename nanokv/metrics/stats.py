"""Serving statistics as plain data: what one engine iteration did, what a finished request cost,
and sliding windows over time. Nothing here knows Prometheus; `nanokv/metrics/prometheus.py` is
the one exporter that reads these.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from nanokv.outputs import RequestMetrics
from nanokv.scheduler.output import SchedulerStats
from nanokv.spec.stats import SpecDecodeStats

EVICTION_REASONS = ("prefix_lru", "preemption", "policy")  # always exported, even at 0


@dataclass(frozen=True)
class CacheConfigInfo:
    """The KV cache's configuration (exported as an info metric)."""

    block_size: int
    num_blocks: int
    kv_dtype: str
    bytes_per_block: int
    enable_prefix_caching: bool
    max_model_len: int
    # every byte the KV cache holds (codes, scales, outliers, sinks, staging, slot positions)
    # over the pool's slots; 0 = not known
    bytes_per_token: float = 0.0

    @classmethod
    def from_engine(cls, engine) -> CacheConfigInfo:
        cfg = engine.config
        return cls(block_size=cfg.block_size, num_blocks=engine.block_manager.num_blocks,
                   kv_dtype=engine.kv_cache_dtype, bytes_per_block=engine.kv_bytes_per_block,
                   enable_prefix_caching=cfg.enable_prefix_caching,
                   max_model_len=cfg.max_model_len,
                   bytes_per_token=float(engine.kv_bytes_per_token))


@dataclass
class FinishedRequestStats:
    """One finished request. Its phases (vLLM's): queued = arrival to first scheduled, prefill =
    first scheduled to first token, decode = first to last token, inference = first scheduled
    to last token; None where the request never reached that point (aborted early)."""

    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float  # arrival to finish
    peak_kv_bytes: int  # bytes of the blocks the request held at its peak
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    max_tokens: int | None = None  # the request's max_tokens (None: not known)
    num_preemptions: int = 0
    queued_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None

    @classmethod
    def of(cls, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int,
           metrics: RequestMetrics, end: float, peak_kv_bytes: int, num_cached_tokens: int,
           max_tokens: int | None, num_preemptions: int) -> FinishedRequestStats:
        """From a request's timestamps (`end`: when it finished)."""
        scheduled, first, last = (metrics.first_scheduled_time, metrics.first_token_time,
                                  metrics.last_token_time)
        return cls(finish_reason, num_prompt_tokens, num_generation_tokens,
                   end - metrics.arrival_time, peak_kv_bytes, max(num_cached_tokens, 0),
                   max_tokens, num_preemptions,
                   queued_s=None if scheduled is None else scheduled - metrics.arrival_time,
                   prefill_s=None if scheduled is None or first is None else first - scheduled,
                   decode_s=None if first is None or last is None else last - first,
                   inference_s=None if scheduled is None or last is None else last - scheduled)

    @property
    def time_per_output_token_s(self) -> float | None:
        """The decode time per token after the first (vLLM's per-request TPOT); None with
        fewer than 2 tokens."""
        if self.decode_s is None or self.num_generation_tokens < 2:
            return None
        return self.decode_s / (self.num_generation_tokens - 1)


@dataclass
class IterationStats:
    """What one turn of the engine loop (commands + at most one step) did. Counters are deltas."""

    time: float  # time.monotonic() at the end of the turn
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests
    prompt_tokens: int = 0  # prompts of requests that produced their first token this turn
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0
    # the same lookups by (endpoint, request class): class -> (queried tokens, hit tokens)
    prefix_cache_by_class: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    num_preemptions: int = 0
    step_tokens: int = 0  # tokens of the turn's step batch (0: no step ran)
    evicted_blocks: dict[str, int] = field(default_factory=dict)  # reason -> blocks
    block_lifetimes_s: list[float] = field(default_factory=list)  # of the evicted blocks
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec_decode: SpecDecodeStats | None = None  # the turn's drafts (speculative decoding)
    # LoRA: (max_loras, running adapters' names, waiting adapters' names); None: LoRA off
    lora: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None


class SchedulerDeltas:
    """Turns the scheduler's cumulative counters into the per-iteration increments above."""

    def __init__(self) -> None:
        self._last: SchedulerStats | None = None

    def fill(self, snap: SchedulerStats, it: IterationStats) -> None:
        it.num_running, it.num_waiting = snap.num_running, snap.num_waiting
        it.kv_cache_usage = snap.kv_cache_usage
        last = self._last
        it.prefix_cache_queries = snap.prefix_cache_queries - (last.prefix_cache_queries
                                                               if last else 0)
        it.prefix_cache_hits = snap.prefix_cache_hits - (last.prefix_cache_hits if last else 0)
        it.num_preemptions = snap.num_preemptions - (last.num_preemptions if last else 0)
        it.step_tokens = snap.num_scheduled_tokens - (last.num_scheduled_tokens if last else 0)
        before = last.evicted_blocks if last else {}
        it.evicted_blocks = {reason: n - before.get(reason, 0)
                             for reason, n in snap.evicted_blocks.items()
                             if n != before.get(reason, 0)}
        if snap.spec_decode is not None:
            it.spec_decode = snap.spec_decode.since(last.spec_decode if last else None)
        if snap.max_loras:
            it.lora = (snap.max_loras, snap.running_lora_adapters, snap.waiting_lora_adapters)
        self._last = snap


class RatioWindow:
    """sum(numerators) / sum(denominators) of the events of the last `window_s` seconds.

    Used for the prefix-cache hit rate: one event per admitted request (hit tokens, looked-up
    tokens). NaN when the window holds no denominator (idle: no hit rate to speak of).
    """

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._events: deque[tuple[float, float, float]] = deque()
        self._num = 0.0
        self._den = 0.0

    def add(self, t: float, num: float, den: float) -> None:
        if num == 0 and den == 0:
            return
        self._events.append((t, num, den))
        self._num += num
        self._den += den

    def _prune(self, now: float) -> None:
        start = now - self.window_s
        while self._events and self._events[0][0] <= start:
            _, num, den = self._events.popleft()
            self._num -= num
            self._den -= den
        if not self._events:  # reset the float sums: no drift on long runs
            self._num = self._den = 0.0

    def ratio(self, now: float) -> float:
        self._prune(now)
        return self._num / self._den if self._den > 0 else math.nan


class TimeWeightedWindow:
    """A piecewise-constant signal (each sample holds until the next one) and its time-weighted
    mean and standard deviation over the last `window_s` seconds.

    Used for KV usage volatility: the usage is sampled after every engine turn, and an idle
    server keeps its last value, so the deviation decays to 0 when nothing changes.
    """

    def __init__(self, window_s: float, start: float, initial: float = 0.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque([(start, initial)])

    def add(self, t: float, value: float) -> None:
        if value == self._samples[-1][1]:
            return
        if t < self._samples[-1][0]:
            raise ValueError(f"samples must come in time order: {t} < {self._samples[-1][0]}")
        self._samples.append((t, value))

    def _segments(self, now: float) -> list[tuple[float, float]]:
        """(duration, value) pieces covering [max(first sample, now - window), now]."""
        start = now - self.window_s
        samples = self._samples
        while len(samples) > 1 and samples[1][0] <= start:  # keep one sample before the window
            samples.popleft()
        pieces = []
        for i, (t, v) in enumerate(samples):
            t0 = max(t, start)
            t1 = samples[i + 1][0] if i + 1 < len(samples) else now
            if t1 > t0:
                pieces.append((t1 - t0, v))
        return pieces

    def mean(self, now: float) -> float:
        pieces = self._segments(now)
        total = sum(d for d, _ in pieces)
        if total <= 0:
            return self._samples[-1][1]
        return sum(d * v for d, v in pieces) / total

    def std(self, now: float) -> float:
        pieces = self._segments(now)
        total = sum(d for d, _ in pieces)
        if total <= 0:
            return 0.0
        mean = sum(d * v for d, v in pieces) / total
        return math.sqrt(sum(d * (v - mean) ** 2 for d, v in pieces) / total)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
