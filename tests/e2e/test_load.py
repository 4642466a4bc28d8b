"""Admission control and a short bounded load test on the tight server (2 running + 2 waiting,
18 KV blocks): every request completes or is refused with 503, none is lost or hangs, and no
block leaks."""

from __future__ import annotations

import asyncio

import httpx

from nanokv.workloads.loadtest import run_load
from servers import MODEL_NAME


def test_503_with_retry_after_beyond_max_waiting(tight_server):
    tight_server.wait_idle()
    before = tight_server.metrics()[("nanokv:request_rejected_total", ())]
    body = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 200,
            "ignore_eos": True, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(base_url=tight_server.url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body)
                                          for _ in range(8)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 4 and set(codes) <= {200, 503}, codes  # 2 running + 2 waiting
    refused = [r for r in responses if r.status_code == 503]
    assert refused, "8 requests at once must overflow 2 running + 2 waiting"
    for r in refused:
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "overloaded"
    m = tight_server.wait_idle()
    assert m[("nanokv:request_rejected_total", ())] - before == len(refused)
    tight_server.assert_healthy()


def test_bounded_load_no_request_lost_no_block_leaked(tight_server):
    m0 = tight_server.wait_idle()
    result = asyncio.run(run_load(tight_server.url, MODEL_NAME, concurrency=6, duration_s=3.0,
                                  max_tokens=(4, 24), request_timeout=30, seed=1))
    print(result.format())
    assert result.failed == 0 and result.hung == 0, result.errors
    assert result.sent == result.completed + result.refused  # nothing lost
    assert result.completed > 0 and result.refused > 0  # 6 clients > 2 running + 2 waiting
    assert all(v == 0 for v in result.idle_metrics.values()), result.idle_metrics
    m1 = tight_server.metrics()

    def delta(name, labels=()):
        return m1[(name, labels)] - m0[(name, labels)]

    assert delta("nanokv:request_rejected_total") == result.refused
    finished = sum(delta("nanokv:request_success_total", (("finished_reason", r),))
                   for r in ("stop", "length"))
    assert finished == result.completed
    assert delta("nanokv:generation_tokens_total") == result.output_tokens
    assert delta("nanokv:time_to_first_token_seconds_count") == result.completed
    tight_server.assert_healthy()  # --check-invariants held whenever the engine went idle


def test_more_choices_than_the_server_holds_is_a_400(tight_server):
    """n x prompts beyond max_num_seqs + max_waiting can never be admitted: a 400 naming the
    limit, not a 503 to retry; the server stays idle and healthy."""
    tight_server.wait_idle()
    r = httpx.post(tight_server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL_NAME, "prompt": "a", "n": 5, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "at most 4 in flight" in err["message"]
    r = httpx.post(tight_server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL_NAME, "prompt": "a", "n": 4, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    tight_server.wait_idle()
    tight_server.assert_healthy()



def test_a_call_the_queue_cannot_take_whole_is_refused_whole(tight_server):
    """n = 3 with 3 of the 4 places taken: a 503 before any choice is queued, counted once as
    rejected and never as aborted requests; the 3 in flight finish."""
    m0 = tight_server.wait_idle()
    long = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 120,
            "ignore_eos": True, "temperature": 0}
    aborted = ("nanokv:request_success_total", (("finished_reason", "abort"),))

    async def scenario():
        async with httpx.AsyncClient(base_url=tight_server.url, timeout=60) as c:
            running = [asyncio.create_task(c.post("/v1/completions", json=long))
                       for _ in range(3)]
            for _ in range(500):  # until the three are in flight
                m = tight_server.metrics()
                if (m[("nanokv:num_requests_running", ())]
                        + m[("nanokv:num_requests_waiting", ())]) == 3:
                    break
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/completions", json={**long, "n": 3, "max_tokens": 2})
            return refused, await asyncio.gather(*running)

    refused, done = asyncio.run(scenario())
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert [r.status_code for r in done] == [200] * 3
    m1 = tight_server.wait_idle()
    assert m1[("nanokv:request_rejected_total", ())] - m0[("nanokv:request_rejected_total", ())] \
        == 1
    assert m1.get(aborted, 0) == m0.get(aborted, 0)
    tight_server.assert_healthy()
