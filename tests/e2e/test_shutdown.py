"""Graceful shutdown: new requests get 503 while in-flight ones finish within
--shutdown-timeout; the rest end with an OpenAI error (streams: an error event, then [DONE]);
a subprocess server exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx

from servers import MODEL_NAME, launch_server, start_in_process, stop_server, wait_ready


def body(max_tokens: int, **kw) -> dict:
    return {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **kw}


def read_stream(r: httpx.Response) -> list:
    events = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_drain_finishes_short_requests_and_ends_long_ones(tiny_llama):
    server = start_in_process(tiny_llama, step_delay=0.01, num_kv_blocks=64)
    try:
        api = server.app.state.server
        results = {}

        def non_stream(name, max_tokens):
            results[name] = httpx.post(server.url + "/v1/completions", json=body(max_tokens),
                                       timeout=60)

        long_plain = threading.Thread(target=non_stream, args=("long", 240))
        long_plain.start()
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", server.url + "/v1/completions",
                          json=body(240, stream=True)) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first.removeprefix("data: "))["choices"]
                short = threading.Thread(target=non_stream, args=("short", 5))
                short.start()
                deadline = time.monotonic() + 10
                while api.async_engine.num_in_flight < 3:  # all three admitted
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
                drained = asyncio.run_coroutine_threadsafe(api.drain(1.0), api.loop)
                short.join(30)
                refused = c.post(server.url + "/v1/completions", json=body(4))
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "shutting_down"
                health = c.get(server.url + "/health")
                assert health.status_code == 503
                rest = [line.removeprefix("data: ") for line in lines
                        if line.startswith("data: ")]
            drained.result(30)
        long_plain.join(30)
        assert results["short"].status_code == 200  # finished within the timeout
        assert results["short"].json()["usage"]["completion_tokens"] == 5
        assert rest[-1] == "[DONE]"  # the stream ends properly ...
        error = json.loads(rest[-2])["error"]  # ... after an OpenAI error event
        assert error["code"] == "shutting_down" and "--shutdown-timeout" in error["message"]
        long = results["long"]
        assert long.status_code == 503, long.text
        assert set(long.json()) == {"error"}
        assert long.json()["error"]["code"] == "shutting_down"
        m = server.wait_idle()
        assert m[("nanokv:request_success_total", (("finished_reason", "abort"),))] == 2
    finally:
        stop_server(server)


def test_sigterm_drains_and_exits_zero(tiny_llama, tmp_path):
    server = wait_ready(launch_server(tiny_llama, str(tmp_path), "--shutdown-timeout", "0",
                                      api_key=None))
    try:
        with httpx.Client(timeout=60) as c:
            streams = [c.stream("POST", server.url + "/v1/completions",
                                json=body(240, stream=True)) for _ in range(4)]
            responses = [s.__enter__() for s in streams]
            iterators = [r.iter_lines() for r in responses]
            for it in iterators:  # each stream is running
                next(line for line in it if line.startswith("data: "))
            server.proc.send_signal(signal.SIGTERM)
            ends = []
            for it, s in zip(iterators, streams):
                rest = [line.removeprefix("data: ") for line in it if line.startswith("data: ")]
                s.__exit__(None, None, None)
                assert rest[-1] == "[DONE]", rest[-3:]
                last = json.loads(rest[-2])
                ends.append("error" if "error" in last else last["choices"][0]["finish_reason"])
        assert "error" in ends, ends  # cut at --shutdown-timeout 0, with an error event
        assert server.proc.wait(30) == 0, server.log()[-2000:]
        assert "draining" in server.log()
    finally:
        stop_server(server)
