"""`nanokv serve --trace-file / --trace-steps`: one valid line per request with keyed hashes only
(no text, no token ids), and one line per engine step that accounts for every computed token."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from servers import MODEL_NAME, start_in_process, stop_server

from nanokv.sim.step_log import PROBE_EVERY, read_step_log
from nanokv.sim.trace import TraceRecord, read_trace

PROMPT = "The block manager hands out fixed-size blocks of the KV cache. " * 4


@pytest.fixture(scope="module")
def traced(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    trace, steps = str(d / "trace.jsonl"), str(d / "steps.jsonl")
    s = start_in_process(tiny_llama, num_kv_blocks=64,
                         settings=dict(trace_file=trace, trace_steps_file=steps))
    token_ids = []
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for i in range(3):  # the same prompt: later ones hit the prefix cache
                r = c.post("/v1/completions", json={
                    "model": MODEL_NAME, "prompt": PROMPT + f"Question {i}?", "max_tokens": 7,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
            r = c.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Which blocks are shared?"}]})
            assert r.status_code == 200, r.text
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [5, 6, 7] * 12,
                                                "max_tokens": 3, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            token_ids = [5, 6, 7] * 12
        s.wait_idle()
    finally:
        stop_server(s)
    with open(trace, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line]
    return lines, read_trace(trace), read_step_log(steps), token_ids


def test_one_line_per_request_with_hashes_only(traced):
    lines, records, _, token_ids = traced
    assert len(lines) == len(records) == 5
    allowed = set(TraceRecord.__dataclass_fields__) - {"cls", "extra"} | {"class"}
    for line in lines:
        d = json.loads(line)
        assert set(d) <= allowed, set(d) - allowed
        assert all(isinstance(h, str) and re.fullmatch(r"[0-9a-f]{16}", h) for h in d["hashes"])
        assert len(d["hashes"]) == (d["prompt_len"] + d["output_len"]) // d["hash_block_size"]
        # no list but the hashes, no free text: nothing of the content can be in the line
        assert [k for k, v in d.items() if isinstance(v, (list, dict))] == ["hashes"]
        strings = {k: v for k, v in d.items() if isinstance(v, str)}
        assert set(strings) <= {"finish", "class", "salt"}, strings
        assert d["finish"] == "length"
        assert d["class"].split("/")[0] in ("completions", "chat_completions")
    text = "\n".join(lines)
    assert "block manager" not in text and "Question" not in text and "shared?" not in text
    assert "5, 6, 7" not in text and "[5,6,7" not in text and token_ids
    hits = [r.cached for r in sorted(records, key=lambda r: r.t)][:3]
    assert hits[0] == 0 and hits[1] >= 32 and hits[2] >= 32  # the shared prompt's full blocks
    first = [r.hashes[:2] for r in sorted(records, key=lambda r: r.t)][:3]
    assert first[0] == first[1] == first[2]  # equal prefixes, equal hashes


def test_step_log_accounts_for_every_token(traced):
    _, records, log, _ = traced
    assert [e.step for e in log] == list(range(log[0].step, log[0].step + len(log)))
    computed = sum(e.features.num_tokens for e in log)
    assert computed == sum(r.prompt_len - r.cached + r.output_len - 1 for r in records)
    assert all(e.dur > 0 for e in log) and all(a.t <= b.t for a, b in zip(log, log[1:]))
    steps = {e.step for e in log}
    assert all(r.step in steps for r in records)
    assert sorted(r.order for r in records) == list(range(len(records)))
    assert max(e.running for e in log) == 1  # sent one after another
    # the machine-speed probe ran after every PROBE_EVERY-th step, and only then
    assert all((e.probe_cpu is not None) == (e.step % PROBE_EVERY == 0) for e in log)
    assert all(e.probe_cpu > 0 for e in log if e.probe_cpu is not None)


def test_client_aborts_are_traced_and_replay_exactly(tiny_llama, tmp_path):
    """One request at a time. A streaming client disconnects mid-answer; a second client gives up
    while its request still waits behind it. The trace marks both aborted (when, before which
    step, the tokens produced, max_tokens), and the recorded replay aborts them before those
    steps, so every replayed step has the served step's shape; replayed as if they had run to
    the tokens they had, the waiting one would be computed and the steps would differ."""
    from dataclasses import replace

    from nanokv.sim.simulator import SimConfig, Simulator
    from nanokv.sim.step_log import turn_times
    from nanokv.sim.step_model import LinearStepModel

    trace, steps = str(tmp_path / "trace.jsonl"), str(tmp_path / "steps.jsonl")
    s = start_in_process(tiny_llama, step_delay=0.01, num_kv_blocks=64, max_model_len=512,
                         max_num_seqs=1,
                         settings=dict(trace_file=trace, trace_steps_file=steps))
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 150, "temperature": 0,
            "ignore_eos": True}
    try:
        engine = s.app.state.server.async_engine.engine
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200, r.read()
                chunks = 0
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunks += 1
                    if chunks == 3:  # queued behind the stream: its client gives up first
                        with pytest.raises(httpx.ReadTimeout):
                            c.post("/v1/completions", timeout=0.2,
                                   json={**body, "prompt": PROMPT + "And then?"})
                    if chunks == 6:
                        break  # leaving the block closes the connection mid-stream
            s.wait_idle()
            after = c.post("/v1/completions", json={**body, "max_tokens": 3})
            assert after.status_code == 200, after.text
        s.wait_idle()
    finally:
        stop_server(s)
    records, log = read_trace(trace), read_step_log(steps)
    assert [r.finish for r in records] == ["abort", "abort", "length"]
    streamed, queued, last = records
    for r in (streamed, queued):
        assert r.aborted and r.max_tokens == 150
        assert r.t < r.abort_t <= r.t + r.e2e_s + 1e-5  # each rounded to 1 us
        assert r.step <= r.abort_step <= log[-1].step
    assert 6 <= streamed.output_len < 150 and streamed.step < streamed.abort_step
    assert queued.output_len == 0 and queued.ttft_s is None
    assert streamed.abort_t > queued.abort_t  # the queued client gave up first
    assert last.cached >= 192  # the aborted stream's prompt blocks stayed cached
    sched, bm = engine.scheduler, engine.block_manager
    cfg = SimConfig(block_size=bm.block_size, num_blocks=bm.num_blocks,
                    max_num_seqs=sched.max_num_seqs,
                    max_num_batched_tokens=sched.max_num_batched_tokens,
                    max_model_len=sched.max_model_len, admission="recorded")
    for ff in (False, True):
        sim = Simulator(records, replace(cfg, fast_forward=ff, check_invariants=not ff),
                        LinearStepModel(step=1e-3), record_decisions=True,
                        step_times=turn_times(log))
        res = sim.run()
        assert sim.features == [e.features for e in log]
        assert res.num_aborted == 2 and res.num_requests == 3
        assert sorted((r.arrival, r.output_len, r.cached) for r in res.requests) == sorted(
            (r.t, r.output_len, r.cached) for r in records)
    plain = [replace(r, abort_t=None, abort_step=None, max_tokens=None) for r in records]
    sim = Simulator(plain, cfg, LinearStepModel(step=1e-3), record_decisions=True)
    sim.run()
    assert len(sim.features) > len(log)  # the queued request's prefill was never served
