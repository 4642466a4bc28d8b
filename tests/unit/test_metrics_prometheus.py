"""The exporter (nanokv/metrics/prometheus.py) read back with prometheus_client's parser."""

import math

from prometheus_client.parser import text_string_to_metric_families

from nanokv.metrics.prometheus import PrometheusExporter
from nanokv.metrics.stats import CacheConfigInfo, FinishedRequestStats, IterationStats

CONFIG = CacheConfigInfo(block_size=16, num_blocks=100, kv_dtype="float32", bytes_per_block=8256,
                         enable_prefix_caching=True, max_model_len=256)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def scrape(exporter):
    out = {}
    for family in text_string_to_metric_families(exporter.render().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_record_and_scrape():
    clock = Clock()
    e = PrometheusExporter("m", CONFIG, window_s=60.0, clock=clock)
    m = scrape(e)
    assert math.isnan(m[("nanokv:prefix_cache_hit_rate", ())])  # idle: no lookups yet
    assert m[("nanokv:kv_cache_usage_stddev", ())] == 0
    for reason in ("prefix_lru", "preemption", "policy"):
        assert m[("nanokv:evicted_blocks_total", (("reason", reason),))] == 0

    clock.t += 10
    e.record(IterationStats(
        time=clock.t, num_running=3, num_waiting=1, kv_cache_usage=0.5, prompt_tokens=40,
        generation_tokens=3, prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=1,
        evicted_blocks={"preemption": 4, "prefix_lru": 1}, block_lifetimes_s=[0.5],
        ttfts_s=[0.02, 0.03], itls_s=[0.01], finished=[
            FinishedRequestStats("length", 20, 5, 0.4, 3 * 8256),
            FinishedRequestStats("abort", 20, 1, 0.1, 8256),
            FinishedRequestStats("abort", 20, 0, 0.0, 0)]))
    clock.t += 10
    m = scrape(e)
    assert m[("nanokv:num_requests_running", ())] == 3
    assert m[("nanokv:num_requests_waiting", ())] == 1
    assert m[("nanokv:kv_cache_usage_perc", ())] == 0.5
    assert m[("nanokv:prompt_tokens_total", ())] == 40
    assert m[("nanokv:generation_tokens_total", ())] == 3
    unclassified = (("endpoint", "none"), ("request_class", "default"))
    assert m[("nanokv:prefix_cache_queries_total", unclassified)] == 40
    assert m[("nanokv:prefix_cache_hits_total", unclassified)] == 16
    assert m[("nanokv:prefix_cache_hit_rate", ())] == 0.4
    assert m[("nanokv:num_preemptions_total", ())] == 1
    assert m[("nanokv:evicted_blocks_total", (("reason", "preemption"),))] == 4
    assert m[("nanokv:evicted_blocks_total", (("reason", "prefix_lru"),))] == 1
    assert m[("nanokv:time_to_first_token_seconds_count", ())] == 2
    assert m[("nanokv:inter_token_latency_seconds_count", ())] == 1
    assert m[("nanokv:kv_block_lifetime_seconds_count", ())] == 1
    assert m[("nanokv:e2e_request_latency_seconds_count", ())] == 1  # aborted ones not timed
    assert m[("nanokv:request_success_total", (("finished_reason", "abort"),))] == 2
    assert m[("nanokv:request_success_total", (("finished_reason", "length"),))] == 1
    # peak KV per request in KB: the request that held no block is not observed
    assert m[("nanokv:request_kv_cache_kb_count", ())] == 2
    assert m[("nanokv:request_kv_cache_kb_sum", ())] == 4 * 8256 / 1024
    # usage: 0 for 10 s, then 0.5 for 10 s -> std 0.25 over the 20 s the server has lived
    assert m[("nanokv:kv_cache_usage_stddev", ())] == 0.25
    info = [labels for (name, labels) in m if name == "nanokv:cache_config_info"]
    assert dict(info[0])["block_size"] == "16" and dict(info[0])["num_blocks"] == "100"

    clock.t += 120  # the window forgets: idle hit rate, no volatility
    e.record(IterationStats(time=clock.t, kv_cache_usage=0.5))
    m = scrape(e)
    assert math.isnan(m[("nanokv:prefix_cache_hit_rate", ())])
    assert m[("nanokv:kv_cache_usage_stddev", ())] == 0


def test_new_eviction_reason_and_rejections():
    e = PrometheusExporter("m", CONFIG)
    e.record(IterationStats(time=e._clock(), evicted_blocks={"h2o": 2}))
    e.record_rejected()
    m = scrape(e)
    assert m[("nanokv:evicted_blocks_total", (("reason", "h2o"),))] == 2
    assert m[("nanokv:request_rejected_total", ())] == 1


def test_two_exporters_do_not_share_state():
    a, b = PrometheusExporter("a", CONFIG), PrometheusExporter("b", CONFIG)
    a.record(IterationStats(time=a._clock(), generation_tokens=5))
    assert scrape(b)[("nanokv:generation_tokens_total", ())] == 0


def test_prefix_cache_counters_by_request_class():
    e = PrometheusExporter("m", CONFIG)
    m = scrape(e)
    for endpoint in ("completions", "chat_completions"):  # exported from the start
        key = (("endpoint", endpoint), ("request_class", "default"))
        assert m[("nanokv:prefix_cache_queries_total", key)] == 0
    e.record(IterationStats(time=1.0, prefix_cache_queries=50, prefix_cache_hits=20,
                            prefix_cache_by_class={("chat_completions", "rag"): (30, 20),
                                                   ("completions", "default"): (20, 0)}))
    m = scrape(e)
    rag = (("endpoint", "chat_completions"), ("request_class", "rag"))
    assert m[("nanokv:prefix_cache_queries_total", rag)] == 30
    assert m[("nanokv:prefix_cache_hits_total", rag)] == 20
    total = sum(v for (name, _), v in m.items() if name == "nanokv:prefix_cache_queries_total")
    assert total == 50  # the classes add up to every lookup


def test_kv_histogram_buckets_are_whole_blocks():
    """1-, 2- and 3-block requests land in buckets of their own."""
    e = PrometheusExporter("m", CONFIG)  # 256 tokens / 16 = at most 16 blocks
    for blocks in (1, 2, 3, 3):
        e.record(IterationStats(time=1.0, finished=[
            FinishedRequestStats("length", 10, 5, 0.1, blocks * 8256)]))
    m = scrape(e)
    kb = 8256 / 1024
    bounds = sorted(float(dict(labels)["le"]) for (name, labels) in m
                    if name == "nanokv:request_kv_cache_kb_bucket")
    assert bounds[:8] == [n * kb for n in range(1, 9)]
    assert bounds[-2:] == [16 * kb, math.inf]  # max_model_len's blocks, then +Inf

    def cumulative(n):
        return m[("nanokv:request_kv_cache_kb_bucket", (("le", str(n * kb)),))]

    assert [cumulative(1), cumulative(2), cumulative(3)] == [1, 2, 4]


def test_per_request_histograms_as_vllm():
    """vLLM's per-request histograms: tokens, max_tokens, computed prompt tokens, preemptions,
    the phases and the per-request TPOT, each observed where the request has it; the step's
    tokens once per turn that ran a step."""
    from nanokv.outputs import RequestMetrics

    e = PrometheusExporter("m", CONFIG, window_s=60.0, clock=Clock())
    done = FinishedRequestStats.of("length", 30, 5, RequestMetrics(10.0, 10.5, 11.25, 13.25),
                                   13.5, 4096, 16, 5, 2)
    waited = FinishedRequestStats.of("abort", 7, 0, RequestMetrics(10.0), 12.0, 0, -1, 9, 0)
    e.record(IterationStats(time=1.0, step_tokens=37, finished=[done, waited]))
    e.record(IterationStats(time=2.0))  # a turn without a step
    m = scrape(e)

    def hist(name):
        return m[(f"nanokv:{name}_count", ())], m[(f"nanokv:{name}_sum", ())]

    assert hist("request_prompt_tokens") == (2, 37)
    assert hist("request_generation_tokens") == (2, 5)
    assert hist("request_params_max_tokens") == (2, 14)
    assert hist("request_prefill_kv_computed_tokens") == (1, 14)  # the waiting one computed none
    assert hist("request_num_preemptions") == (2, 2)
    assert hist("request_queue_time_seconds") == (1, 0.5)
    assert hist("request_prefill_time_seconds") == (1, 0.75)
    assert hist("request_decode_time_seconds") == (1, 2.0)
    assert hist("request_inference_time_seconds") == (1, 2.75)
    assert hist("request_time_per_output_token_seconds") == (1, 0.5)
    assert hist("iteration_tokens_total") == (1, 37)
    # vLLM's 1-2-5 token bounds up to max_model_len (256)
    bounds = sorted(float(dict(labels)["le"]) for (name, labels) in m
                    if name == "nanokv:request_prompt_tokens_bucket")
    assert bounds == [1, 2, 5, 10, 20, 50, 100, 200, float("inf")]
    assert m[("nanokv:request_prompt_tokens_bucket", (("le", "50.0"),))] == 2
    assert m[("nanokv:request_prompt_tokens_bucket", (("le", "5.0"),))] == 0


def test_lora_requests_info_is_one_series_of_the_current_adapters():
    """vLLM's lora_requests_info: labels max_lora and the running / waiting adapters' names;
    a change replaces the series (the old one is gone); no series while LoRA is off."""
    clock = Clock()
    e = PrometheusExporter("m", CONFIG, window_s=60.0, clock=clock)
    e.record(IterationStats(time=clock.t))
    assert not [k for k in scrape(e) if k[0] == "nanokv:lora_requests_info"]

    def info():
        return [labels for (name, labels), value in scrape(e).items()
                if name == "nanokv:lora_requests_info" and value > 0]

    e.record(IterationStats(time=clock.t, lora=(2, ("sql",), ("chat", "math"))))
    assert info() == [(("max_lora", "2"), ("running_lora_adapters", "sql"),
                       ("waiting_lora_adapters", "chat,math"))]
    e.record(IterationStats(time=clock.t, lora=(2, ("chat", "sql"), ())))
    assert info() == [(("max_lora", "2"), ("running_lora_adapters", "chat,sql"),
                       ("waiting_lora_adapters", ""))]
