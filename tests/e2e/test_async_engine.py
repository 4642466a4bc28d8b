"""The engine loop in-process: one thread steps the engine, asyncio streams read; aborts free
blocks at once; admission is bounded; the idle loop sleeps. And the real app under in-process
uvicorn for the server-side request timeout."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from nanokv import LLM, SamplingParams
from nanokv.server.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from servers import MODEL_NAME, OFFLINE_OPTIONS, start_in_process, stop_server

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_seqs=2, **OFFLINE_OPTIONS)


def idle_and_consistent(engine) -> bool:
    engine.check_invariants()
    return (not engine.has_unfinished_requests()
            and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks)


def test_streams_equal_offline_and_abort_frees_blocks(llm):
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    refs = llm.generate(prompts, GREEDY)
    engine = llm.engine
    a = AsyncLLMEngine(engine, max_waiting=4)
    a.start()
    try:
        async def run():
            async def one(p):
                ids = []
                async with a.open(engine.make_request(p, GREEDY)) as stream:
                    async for out in stream:
                        ids += out.new_token_ids
                return ids

            got = await asyncio.gather(*(one(p) for p in prompts))
            # abort mid-stream: leave the block after the first output
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            async with a.open(engine.make_request([5] * 30, long)) as stream:
                first = await stream.__anext__()
                assert not first.finished
            return got

        got = asyncio.run(run())
        assert got == [r.token_ids for r in refs]
        deadline = time.monotonic() + 5
        while a.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.num_in_flight == 0
    finally:
        a.shutdown()
    assert idle_and_consistent(engine)


def test_admission_is_bounded_and_idle_loop_sleeps(llm):
    engine = llm.engine
    a = AsyncLLMEngine(engine, max_waiting=1)  # 2 running + 1 waiting
    a.start()
    try:
        async def run():
            long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            streams = [a.open(engine.make_request([5, 6, 7], long)) for _ in range(3)]
            with pytest.raises(QueueFullError, match="capacity"):
                a.open(engine.make_request([5, 6, 7], long))
            for s in streams:
                s.close()

        asyncio.run(run())
        deadline = time.monotonic() + 5
        while a.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        steps = a.num_steps
        cpu = time.process_time()
        time.sleep(0.3)
        assert a.num_steps == steps  # idle: no step
        assert time.process_time() - cpu < 0.05  # the engine thread blocks, it does not spin
    finally:
        a.shutdown()
    assert idle_and_consistent(engine)

    async def after_shutdown():
        with pytest.raises(EngineDeadError):
            a.open(engine.make_request([1, 2], GREEDY))

    asyncio.run(after_shutdown())


def test_server_side_timeout_aborts(tiny_llama):
    server = start_in_process(tiny_llama, step_delay=0.01, num_kv_blocks=64,
                              settings=dict(request_timeout=0.3))
    try:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 250,
                "ignore_eos": True, "temperature": 0}  # 250 steps of > 10 ms: > 2.5 s
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"code":"timeout"' in lines[-2] and lines[-1] == "data: [DONE]"
        server.wait_idle(timeout=5)
        server.assert_healthy()
    finally:
        stop_server(server)
    assert idle_and_consistent(server.app.state.server.engine)
