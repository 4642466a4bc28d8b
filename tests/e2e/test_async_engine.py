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


def test_a_kv_policy_failure_fails_its_stream_only(llm, monkeypatch):
    """A KV policy raising on one request: its reader gets the error, the other stream gets
    every token, the loop keeps serving, nothing stays allocated."""
    from nanokv.engine.policy_runner import PolicyRunner
    from nanokv.policies.base import PolicyConfig

    original = PolicyRunner.compress

    def compress(self, request):
        if request.request_id == "bad":
            raise ValueError("simulated policy failure")
        return original(self, request)

    monkeypatch.setattr(PolicyRunner, "compress", compress)
    engine = llm.engine
    policy = PolicyConfig("snapkv", budget=40)
    prompt = list(range(3, 63))
    expected = llm.generate_requests([engine.make_request(prompt, GREEDY, kv_policy=policy)],
                                     use_tqdm=False)[0].token_ids
    plain = llm.generate([prompt], GREEDY)[0].token_ids  # before the loop thread owns the engine
    a = AsyncLLMEngine(engine, max_waiting=4)
    a.start()
    try:
        async def read(request):
            ids = []
            async with a.open(request) as stream:
                async for out in stream:
                    ids += out.new_token_ids
            return ids

        async def run():
            bad = engine.make_request(prompt, GREEDY, kv_policy=policy, request_id="bad")
            good = engine.make_request(prompt, GREEDY, kv_policy=policy, request_id="good")
            return await asyncio.gather(read(bad), read(good), return_exceptions=True)

        bad, good = asyncio.run(run())
        assert isinstance(bad, RuntimeError) and "simulated policy failure" in str(bad)
        assert good == expected
        assert asyncio.run(read(engine.make_request(prompt, GREEDY))) == plain
    finally:
        a.shutdown()
    assert idle_and_consistent(engine)


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
