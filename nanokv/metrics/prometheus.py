"""The one Prometheus exporter: reads the plain stats of nanokv/metrics/stats.py.

Names follow vLLM's under the `nanokv:` prefix where vLLM has one; counters gain `_total` in the
exposition (`nanokv:prompt_tokens` -> `nanokv:prompt_tokens_total`). Every series carries a
`model_name` label. The sliding-window gauges are computed when Prometheus scrapes, so an idle
server's volatility decays and its hit rate becomes NaN (no lookups, no rate) instead of freezing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, Info, generate_latest)

from nanokv.metrics.stats import (EVICTION_REASONS, CacheConfigInfo, FinishedRequestStats,
                                  IterationStats, RatioWindow, TimeWeightedWindow)
from nanokv.spec.stats import SpecDecodeStats
from nanokv.utils import cdiv

PREFIX = "nanokv:"
FINISH_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LIFETIME_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                    1800.0, 3600.0, 7200.0)
KV_KB_BUCKETS = tuple(4.0 ** k for k in range(13))  # 1 KB .. 16 GiB, x4 (block size unknown)
# vLLM's: a request's phases, tokens per step, preemptions per request
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
REQUEST_PHASES = {  # request_<phase>_time_seconds
    "queue": "Arrival to first scheduled (waiting), per request.",
    "prefill": "First scheduled to first token, per request.",
    "decode": "First token to last token, per request.",
    "inference": "First scheduled to last token (running), per request.",
}
# the prefix-cache counters' (endpoint, request_class) series that exist from the start
PRESET_REQUEST_CLASSES = (("completions", "default"), ("chat_completions", "default"))
UNCLASSIFIED = ("none", "default")  # lookups recorded without a class


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's bounds of its per-request token
    histograms)."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max(max_model_len, 1):
                return tuple(bounds)
            bounds.append(m * scale)
        scale *= 10


def kv_block_counts(max_blocks: int, linear: int = 8, growth: float = 1.5) -> list[int]:
    """Bucket bounds in blocks: 1, 2, ..., linear, then x growth up to max_blocks."""
    counts = list(range(1, min(linear, max_blocks) + 1))
    while counts[-1] < max_blocks:
        counts.append(min(max_blocks, max(counts[-1] + 1, round(counts[-1] * growth))))
    return counts


def kv_kb_buckets(c: CacheConfigInfo) -> tuple[float, ...]:
    """The KV-per-request histogram's bounds: whole numbers of blocks in KB, so 1-, 2- and
    3-block requests land in buckets of their own (a request's KV is whole blocks)."""
    if c.bytes_per_block <= 0 or c.block_size <= 0 or c.max_model_len <= 0:
        return KV_KB_BUCKETS
    max_blocks = cdiv(c.max_model_len, c.block_size)
    return tuple(n * c.bytes_per_block / 1024 for n in kv_block_counts(max_blocks))


class PrometheusExporter:
    """Owns a private CollectorRegistry (no global state); `record` is called by the engine
    thread, `render` by the HTTP handler (prometheus_client's metrics are thread-safe, the
    windows are guarded by a lock)."""

    def __init__(self, model_name: str, cache_config: CacheConfigInfo, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._hit_window = RatioWindow(window_s)
        self._usage_window = TimeWeightedWindow(window_s, start=clock())
        self.model_name = name = model_name
        r, m = self.registry, ["model_name"]

        def gauge(metric, doc):
            return Gauge(PREFIX + metric, doc, m, registry=r).labels(name)

        def counter(metric, doc):
            return Counter(PREFIX + metric, doc, m, registry=r).labels(name)

        def histogram(metric, doc, buckets):
            return Histogram(PREFIX + metric, doc, m, buckets=buckets, registry=r).labels(name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "KV-cache usage: fraction of blocks held by requests (1 = full).")
        self.hit_rate = gauge("prefix_cache_hit_rate",
                              f"Prefix-cache hit rate over the last {window_s:g} s: hit tokens / "
                              f"looked-up prompt tokens (NaN without lookups).")
        self.hit_rate.set_function(self._hit_rate_now)
        self.usage_stddev = gauge("kv_cache_usage_stddev",
                                  f"KV memory usage volatility: time-weighted standard deviation "
                                  f"of kv_cache_usage_perc over the last {window_s:g} s.")
        self.usage_stddev.set_function(self._usage_stddev_now)

        classes = m + ["endpoint", "request_class"]
        self._queries_family = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache, by "
            "endpoint and request class (the X-Request-Class header, else 'default').",
            classes, registry=r)
        self._hits_family = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache, by "
            "endpoint and request class.", classes, registry=r)
        self.queries: dict[tuple[str, str], Counter] = {}
        self.hits: dict[tuple[str, str], Counter] = {}
        for key in PRESET_REQUEST_CLASSES:
            self._class_counters(key)
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that finished "
                                                      "their prefill.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.rejected = counter("request_rejected",
                                "Requests refused with 503 because the queue was full.")
        evicted = Counter(PREFIX + "evicted_blocks",
                          "KV blocks evicted, by reason: prefix_lru (a cached block reused for "
                          "new content), preemption (blocks of a preempted request), policy (a "
                          "KV policy dropped them).", m + ["reason"], registry=r)
        self.evicted = {reason: evicted.labels(name, reason) for reason in EVICTION_REASONS}
        self._evicted_family = evicted
        success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                          m + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(name, reason) for reason in FINISH_REASONS}
        self._success_family = success

        self.ttft = histogram("time_to_first_token_seconds",
                              "Time to first token, from arrival.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Request latency from arrival to its last token (not aborted).",
                             E2E_BUCKETS)
        self.block_lifetime = histogram("kv_block_lifetime_seconds",
                                        "Allocation-to-eviction lifetime of evicted KV blocks.",
                                        LIFETIME_BUCKETS)
        tokens = request_token_buckets(cache_config.max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt tokens of each finished request.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of each finished request.", tokens)
        self.request_max_tokens = histogram("request_params_max_tokens",
                                            "The max_tokens parameter of each finished request.",
                                            tokens)
        self.request_prefill_kv_computed = histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens each finished request computed "
            "(not served from the prefix cache).", tokens)
        self.request_preemptions = histogram("request_num_preemptions",
                                             "Times each finished request was preempted.",
                                             PREEMPTION_BUCKETS)
        self.step_tokens = histogram("iteration_tokens_total",
                                     "Tokens of each engine step (prefill chunks + decodes).",
                                     STEP_TOKEN_BUCKETS)
        self.phase_time = {phase: histogram(f"request_{phase}_time_seconds", doc, PHASE_BUCKETS)
                           for phase, doc in REQUEST_PHASES.items()}
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Decode time per output token after the first, per "
                                      "request.", ITL_BUCKETS)
        self.request_kv_kb = histogram("request_kv_cache_kb",
                                       "KV cache per request in KB (1024 bytes): the bytes of "
                                       "the blocks a request held at its peak; buckets "
                                       "are whole numbers of blocks.",
                                       kv_kb_buckets(cache_config))

        # speculative decoding's counters (totals, by draft position), made on first use
        self._spec: tuple | None = None
        self._lora_info = Gauge(  # vLLM's vllm:lora_requests_info: one series, the current
            PREFIX + "lora_requests_info", "LoRA adapters (enable_lora): max_lora, and the "
            "adapters of the running and the waiting requests (comma-separated names); the "
            "value is when they last changed (Unix seconds).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self._lora_labels: tuple[str, str, str] | None = None
        self._spec_positions: list = []

        c = cache_config
        Info(PREFIX + "cache_config", "KV cache configuration.", registry=r).info({
            "model_name": name, "block_size": str(c.block_size), "num_blocks": str(c.num_blocks),
            "cache_dtype": c.kv_dtype, "bytes_per_block": str(c.bytes_per_block),
            "bytes_per_token": f"{c.bytes_per_token:.2f}",
            "enable_prefix_caching": str(c.enable_prefix_caching).lower(),
            "max_model_len": str(c.max_model_len)})

    # ---- engine thread -------------------------------------------------------------------------
    def record(self, it: IterationStats) -> None:
        self.running.set(it.num_running)
        self.waiting.set(it.num_waiting)
        self.kv_usage.set(it.kv_cache_usage)
        with self._lock:
            self._usage_window.add(it.time, it.kv_cache_usage)
            self._hit_window.add(it.time, it.prefix_cache_hits, it.prefix_cache_queries)
        by_class = it.prefix_cache_by_class
        if not by_class and (it.prefix_cache_queries or it.prefix_cache_hits):
            by_class = {UNCLASSIFIED: (it.prefix_cache_queries, it.prefix_cache_hits)}
        for key, (queries, hits) in by_class.items():
            q, h = self._class_counters(key)
            if queries:
                q.inc(queries)
            if hits:
                h.inc(hits)
        for counter, n in ((self.preemptions, it.num_preemptions),
                           (self.prompt_tokens, it.prompt_tokens),
                           (self.generation_tokens, it.generation_tokens)):
            if n:
                counter.inc(n)
        for reason, n in it.evicted_blocks.items():
            if reason not in self.evicted:
                self.evicted[reason] = self._evicted_family.labels(
                    self.model_name, reason)
            self.evicted[reason].inc(n)
        for t in it.ttfts_s:
            self.ttft.observe(t)
        for t in it.itls_s:
            self.itl.observe(t)
        for t in it.block_lifetimes_s:
            self.block_lifetime.observe(t)
        if it.step_tokens:
            self.step_tokens.observe(it.step_tokens)
        if it.spec_decode is not None and it.spec_decode.num_drafts:
            self._record_spec(it.spec_decode)
        if it.lora is not None:
            labels = (str(it.lora[0]), ",".join(it.lora[1]), ",".join(it.lora[2]))
            if labels != self._lora_labels:
                if self._lora_labels is not None:
                    self._lora_info.remove(*self._lora_labels)
                self._lora_info.labels(*labels).set_to_current_time()
                self._lora_labels = labels
        for f in it.finished:
            if f.finish_reason not in self.success:
                self.success[f.finish_reason] = self._success_family.labels(
                    self.model_name, f.finish_reason)
            self.success[f.finish_reason].inc()
            if f.finish_reason != "abort":
                self.e2e.observe(f.e2e_latency_s)
            self._observe_request(f)
            if f.peak_kv_bytes > 0:
                self.request_kv_kb.observe(f.peak_kv_bytes / 1024)

    def _record_spec(self, spec: SpecDecodeStats) -> None:
        """vLLM's spec_decode counters: verification steps with drafts, their draft tokens,
        the accepted ones, and accepted ones by draft position."""
        if self._spec is None:
            r, m, name = self.registry, ["model_name"], self.model_name
            self._spec = tuple(Counter(PREFIX + metric, doc, m, registry=r).labels(name) for
                               metric, doc in (
                                   ("spec_decode_num_drafts", "Speculative decoding: request "
                                    "steps that verified draft tokens."),
                                   ("spec_decode_num_draft_tokens", "Draft tokens verified."),
                                   ("spec_decode_num_accepted_tokens", "Draft tokens accepted "
                                    "(outputs without a step of their own).")))
            per_position = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                   "Draft tokens accepted, by position in the draft (0: the "
                                   "first).", m + ["position"], registry=r)
            self._spec_positions = [per_position.labels(name, str(i))
                                    for i in range(spec.num_speculative_tokens)]
        for counter, n in zip(self._spec, (spec.num_drafts, spec.num_draft_tokens,
                                           spec.num_accepted_tokens)):
            if n:
                counter.inc(n)
        for counter, n in zip(self._spec_positions, spec.accepted_per_position):
            if n:
                counter.inc(n)

    def _observe_request(self, f: FinishedRequestStats) -> None:
        """The per-request histograms (vLLM's): every finished request, aborted ones too, each
        phase where the request reached it."""
        self.request_prompt_tokens.observe(f.num_prompt_tokens)
        self.request_generation_tokens.observe(f.num_generation_tokens)
        if f.queued_s is not None:  # scheduled: it computed its prompt past the hits
            self.request_prefill_kv_computed.observe(f.num_prompt_tokens - f.num_cached_tokens)
        self.request_preemptions.observe(f.num_preemptions)
        if f.max_tokens is not None:
            self.request_max_tokens.observe(f.max_tokens)
        for histogram, seconds in ((self.phase_time["queue"], f.queued_s),
                                   (self.phase_time["prefill"], f.prefill_s),
                                   (self.phase_time["decode"], f.decode_s),
                                   (self.phase_time["inference"], f.inference_s),
                                   (self.request_tpot, f.time_per_output_token_s)):
            if seconds is not None:
                histogram.observe(seconds)

    def _class_counters(self, key: tuple[str, str]) -> tuple[Counter, Counter]:
        if key not in self.queries:
            self.queries[key] = self._queries_family.labels(self.model_name, *key)
            self.hits[key] = self._hits_family.labels(self.model_name, *key)
        return self.queries[key], self.hits[key]

    def record_rejected(self) -> None:
        self.rejected.inc()

    # ---- scrape --------------------------------------------------------------------------------
    def _hit_rate_now(self) -> float:
        with self._lock:
            return self._hit_window.ratio(self._clock())

    def _usage_stddev_now(self) -> float:
        with self._lock:
            return self._usage_window.std(self._clock())

    def render(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST
