"""/metrics parsed with prometheus_client's parser: values agree with what the test did."""

from __future__ import annotations

import math

from servers import MODEL_NAME

SHARED = "class Block:\n    def __init__(self, block_id):\n        self.block_id = block_id\n" * 2


def test_counts_exact_and_hits_after_repeated_prefix(server, client):
    m0 = server.wait_idle()
    usages = []
    for suffix in ("x = 1", "y = 2", "z = 3"):
        r = client.completions.create(model=MODEL_NAME, prompt=SHARED + suffix, max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "cache_salt": "metrics-test"})
        usages.append(r.usage)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": SHARED}], max_tokens=7,
        stream=True, stream_options={"include_usage": True}, temperature=0,
        extra_body={"ignore_eos": True})
    usages.append([c for c in stream][-1].usage)
    m1 = server.wait_idle()

    def delta(name, labels=()):
        return m1[(name, labels)] - m0.get((name, labels), 0.0)

    def class_delta(name, endpoint=None):
        """Summed over the (endpoint, request_class) series."""
        return sum(v - m0.get((n, labels), 0.0) for (n, labels), v in m1.items()
                   if n == name and (endpoint is None or ("endpoint", endpoint) in labels))

    prompt = sum(u.prompt_tokens for u in usages)
    assert delta("nanokv:prompt_tokens_total") == prompt
    assert delta("nanokv:generation_tokens_total") == 5 * 3 + 7
    assert class_delta("nanokv:prefix_cache_queries_total") == prompt
    assert class_delta("nanokv:prefix_cache_queries_total", "completions") == \
        sum(u.prompt_tokens for u in usages[:3])
    assert class_delta("nanokv:prefix_cache_queries_total", "chat_completions") == \
        usages[3].prompt_tokens
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert usages[0].prompt_tokens_details.cached_tokens == 0  # a fresh salt: cold
    assert usages[1].prompt_tokens_details.cached_tokens >= 64  # the shared prefix hit
    assert class_delta("nanokv:prefix_cache_hits_total") == cached
    assert delta("nanokv:request_success_total", (("finished_reason", "length"),)) == 4
    assert delta("nanokv:time_to_first_token_seconds_count") == 4
    assert delta("nanokv:e2e_request_latency_seconds_count") == 4
    assert delta("nanokv:inter_token_latency_seconds_count") == 4 * 3 + 6
    assert delta("nanokv:request_kv_cache_kb_count") == 4
    # vLLM's per-request histograms, and the steps' tokens: each prompt computed past its hits,
    # each output token but the last fed back (the first comes from the prefill)
    assert delta("nanokv:request_prompt_tokens_sum") == prompt
    assert delta("nanokv:request_generation_tokens_sum") == 5 * 3 + 7
    assert delta("nanokv:request_params_max_tokens_sum") == 5 * 3 + 7
    assert delta("nanokv:request_prefill_kv_computed_tokens_sum") == prompt - cached
    assert delta("nanokv:iteration_tokens_total_sum") == prompt - cached + 5 * 3 + 7 - 4
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"nanokv:request_{phase}_time_seconds_count") == 4
    assert delta("nanokv:request_time_per_output_token_seconds_count") == 4
    assert delta("nanokv:request_num_preemptions_sum") == 0

    # the windowed hit rate is the hit fraction of the recent lookups: > 0 after the hits
    rate = m1[("nanokv:prefix_cache_hit_rate", ())]
    assert not math.isnan(rate) and 0 < rate < 1
    assert m1[("nanokv:kv_cache_usage_stddev", ())] >= 0
    assert m1[("nanokv:kv_cache_usage_perc", ())] == 0


def test_request_kv_size_and_cache_config(server, client):
    m0 = server.wait_idle()
    client.completions.create(model=MODEL_NAME, prompt=[7] * 40, max_tokens=9, temperature=0,
                              extra_body={"ignore_eos": True, "cache_salt": "kv-size"})
    m1 = server.wait_idle()
    info = [labels for (name, labels) in m1 if name == "nanokv:cache_config_info"]
    assert len(info) == 1
    config = dict(info[0])
    assert config["block_size"] == "16" and config["cache_dtype"] == "float32"
    assert config["max_model_len"] == "256" and config["enable_prefix_caching"] == "true"
    # 40 prompt + 9 output tokens: the last token's K/V is never written, 48 slots = 3 blocks
    kb = 3 * int(config["bytes_per_block"]) / 1024
    assert (m1[("nanokv:request_kv_cache_kb_sum", ())]
            - m0[("nanokv:request_kv_cache_kb_sum", ())]) == kb
    for reason in ("prefix_lru", "preemption", "policy"):
        assert ("nanokv:evicted_blocks_total", (("reason", reason),)) in m1


def test_preemption_and_eviction_counters(tight_server):
    """18 blocks, two long requests: one is preempted; the blocks whose content that loses
    count as evicted (its uncached ones at once, its cached ones when reused: prefix_lru), each
    with its lifetime."""
    import asyncio

    import httpx

    m0 = tight_server.wait_idle()
    body = {"model": MODEL_NAME, "prompt": [11] * 100, "max_tokens": 120, "ignore_eos": True,
            "temperature": 0}

    async def two():
        async with httpx.AsyncClient(base_url=tight_server.url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions",
                                                 json={**body, "cache_salt": f"p{i}"})
                                          for i in range(2)))

    assert [r.status_code for r in asyncio.run(two())] == [200, 200]
    m1 = tight_server.wait_idle()
    preempted = m1[("nanokv:num_preemptions_total", ())] - m0[("nanokv:num_preemptions_total", ())]
    assert preempted > 0  # and every preemption is a finished request's
    per_request = ("nanokv:request_num_preemptions_sum", ())
    assert m1[per_request] - m0.get(per_request, 0) == preempted
    evicted = [("nanokv:evicted_blocks_total", (("reason", r),))
               for r in ("preemption", "prefix_lru", "policy")]
    lifetimes = ("nanokv:kv_block_lifetime_seconds_count", ())
    grown = sum(m1.get(k, 0) - m0.get(k, 0) for k in evicted)
    assert grown > 0 and m1[lifetimes] - m0[lifetimes] == grown
    tight_server.assert_healthy()
