"""`nanokv serve --trace-file / --trace-steps`: one valid line per request with keyed hashes only
(no text, no token ids), and one line per engine step that accounts for every computed token."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from servers import MODEL_NAME, start_in_process, stop_server

from nanokv.sim.step_log import read_step_log
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
