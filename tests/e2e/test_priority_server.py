"""The request's `priority` through the server and the `openai` SDK: under
`--scheduling-policy priority` it orders admission; under fcfs it is accepted and ignored (as
vLLM 0.32); a non-integer is a 400 naming the field; vLLM's X-Vllm-Priority header overrides
it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from nanokv.scheduler.scheduler import Scheduler
from servers import MODEL_NAME, start_in_process, stop_server


@pytest.fixture(scope="module")
def priority_server(tiny_llama):
    s = start_in_process(tiny_llama, step_delay=0.01, max_num_seqs=1, num_kv_blocks=32,
                         scheduling_policy="priority")
    yield s
    stop_server(s)


@pytest.fixture()
def admitted(monkeypatch):
    """(request id, priority) in the order the scheduler first schedules them."""
    order, schedule = [], Scheduler.schedule

    def recording(self):
        out = schedule(self)
        seen = {rid for rid, _ in order}
        order.extend((s.request_id, self.requests[s.request_id].priority)
                     for s in out.scheduled if s.request_id not in seen)
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    return order


def sdk(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_priority_reaches_the_scheduler(priority_server, admitted):
    r = sdk(priority_server).completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4,
                                                temperature=0, extra_body={"priority": 1})
    assert r.choices[0].finish_reason == "length"
    assert [p for _, p in admitted] == [1]


def test_waiting_requests_admitted_by_priority(priority_server, admitted):
    client = sdk(priority_server)
    done = []

    def send(priority, max_tokens):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"p{priority}"}],
            max_tokens=max_tokens, temperature=0, extra_body={"priority": priority,
                                                              "ignore_eos": True})
        done.append(priority)

    first = threading.Thread(target=send, args=(5, 80))
    first.start()
    while not admitted:
        time.sleep(0.005)
    threads = [threading.Thread(target=send, args=(p, 2)) for p in (3, -1, 0)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # distinct arrivals, all while the first still runs
    for t in [first, *threads]:
        t.join(60)
    assert sorted(done) == [-1, 0, 3, 5]
    assert [p for _, p in admitted] == [5, -1, 0, 3]


@pytest.mark.parametrize("header,body,seen", [("2", 1, 2), ("-3", None, -3),
                                               ("x", 4, 4), ("1.5", None, 0)])
def test_the_priority_header_overrides_the_body(priority_server, admitted, header, body, seen):
    """vLLM's X-Vllm-Priority: an integer overrides the body's priority, another value is
    ignored."""
    extra = {"priority": body} if body is not None else {}
    r = sdk(priority_server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body=extra, extra_headers={"X-Vllm-Priority": header})
    assert r.choices[0].finish_reason in ("length", "stop")
    assert [p for _, p in admitted] == [seen]


@pytest.mark.parametrize("value", ["1", 1.5, True, None])
def test_non_integer_priority_is_a_400(priority_server, value):
    r = httpx.post(priority_server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "priority": value})
    assert r.status_code == 400, r.text
    assert "priority" in r.text


def test_fcfs_server_accepts_and_ignores_priority(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3,
                                  temperature=0, extra_body={"priority": 7})
    assert len(r.choices[0].text) > 0 or r.choices[0].finish_reason == "length"
