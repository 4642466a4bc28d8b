"""vLLM's `use_beam_search` through the `openai` client on the real server (which checks its
block accounting every step): each prompt's n choices are the offline `LLM.beam_search`'s
sequences (itself checked against Hugging Face in tests/model/test_beam_search.py), in order;
what a beam search does not apply is a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import time

import httpx
import pytest

from servers import MODEL_NAME
from nanokv import BeamSearchParams

PROMPTS = ["def add(a, b):", "The grass is green. The sky is blue. The sun"]


def _beams(offline, prompt_ids, width, max_tokens, **kwargs):
    out = offline.beam_search([prompt_ids], BeamSearchParams(beam_width=width,
                                                             max_tokens=max_tokens, **kwargs))
    return [s.tokens[len(prompt_ids):] for s in out[0].sequences]


def test_completions_choices_are_the_offline_beams(client, offline):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, n=3,
                                  extra_body={"use_beam_search": True, "return_token_ids": True,
                                              "length_penalty": 0.5})
    assert [c.index for c in r.choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS):
        choices = r.choices[3 * i:3 * i + 3]
        ids = choices[0].model_extra["prompt_token_ids"]
        assert ids == offline.tokenizer.encode(prompt)
        want = _beams(offline, ids, 3, 12, length_penalty=0.5)
        assert [c.model_extra["token_ids"] for c in choices] == want
        assert len(set(map(tuple, want))) == 3  # three different beams
        for c, tokens in zip(choices, want):
            assert c.text == offline.tokenizer.decode(tokens, skip_special_tokens=True)
            assert c.finish_reason == "length"
    prompt_tokens = sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)
    assert r.usage.prompt_tokens == prompt_tokens  # once per prompt, not per beam
    assert r.usage.completion_tokens == 6 * 12


def test_chat_choices_are_the_offline_beams(client, offline):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "The sky is"}], max_tokens=8,
        n=2, extra_body={"use_beam_search": True, "return_token_ids": True})
    ids = r.choices[0].model_extra["prompt_token_ids"]
    want = _beams(offline, ids, 2, 8)
    assert [c.model_extra["token_ids"] for c in r.choices] == want
    assert [c.message.content for c in r.choices] == [
        offline.tokenizer.decode(t, skip_special_tokens=True) for t in want]
    assert r.usage.completion_tokens == 16


def test_a_chat_stream_carries_the_beams_once_the_search_is_done(client, offline):
    """vLLM's chat streams a beam search's answer (its completions refuse stream): each
    choice's role first, then its whole text and finish reason, the usage last."""
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "The sun is"}],
                  max_tokens=6, n=3)
    whole = client.chat.completions.create(**kwargs, extra_body={"use_beam_search": True})
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True},
        extra_body={"use_beam_search": True}))
    roles = [c.choices[0].delta.role for c in chunks[:3]]
    assert roles == ["assistant"] * 3 and [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    texts, reasons = ["", "", ""], [None] * 3
    for c in chunks[3:-1]:
        choice = c.choices[0]
        texts[choice.index] += choice.delta.content or ""
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("endpoint,extra,param", [
    ("completions", {"stream": True}, "stream"),
    ("completions", {"top_p": 0.5}, "top_p"),
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"stop": ["x"]}, "stop"),
    ("completions", {"n": 11}, "n"),
    ("completions", {"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    ("chat/completions", {"top_logprobs": 2, "logprobs": True}, "logprobs"),
    ("chat/completions", {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]}, "tool_choice"),
    ("responses", {}, "use_beam_search"),
])
def test_what_beam_search_does_not_apply_is_refused(server, endpoint, extra, param):
    prompt = ({"prompt": "def add(a, b):"} if endpoint == "completions" else
              {"input": "hi"} if endpoint == "responses" else
              {"messages": [{"role": "user", "content": "hi"}]})
    body = {"model": MODEL_NAME, "max_tokens": 4, "use_beam_search": True, **prompt, **extra}
    if endpoint == "responses":
        body.pop("max_tokens")
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, headers=server.headers,
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    server.assert_healthy()


def _finished(server) -> float:
    return sum(v for (name, _), v in server.metrics().items()
               if name == "nanokv:request_success_total")


def assert_stopped_early(server, before: float) -> None:
    """After a client left a search of 200 steps of 3 beams (1 + 3 x 199 requests): the
    running step's requests aborted and nothing left, some steps ran but far from all, and no
    step starts after; the block accounting consistent (--check-invariants)."""
    idle = server.wait_idle(timeout=10)
    assert idle[("nanokv:kv_cache_usage_perc", ())] == 0
    left = _finished(server)
    assert 0 < left - before < 300
    time.sleep(0.3)
    assert _finished(server) == left
    server.assert_healthy()


def test_a_client_leaving_stops_the_search(slow_server):
    server = slow_server  # 10 ms more per step: 200 steps of 3 beams take over 2 s
    server.wait_idle()
    before = _finished(server)
    body = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 200, "n": 3,
            "ignore_eos": True, "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=server.headers, json=body,
                   timeout=httpx.Timeout(30, read=0.5))
    assert_stopped_early(server, before)


def test_a_client_leaving_a_streamed_search_stops_it(slow_server):
    server = slow_server
    server.wait_idle()
    before = _finished(server)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "def add(a, b):"}],
            "max_tokens": 200, "n": 3, "ignore_eos": True, "use_beam_search": True,
            "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", headers=server.headers,
                      json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            # the three roles' events (the blank line after the third waits for more data)
            got = [line for line, _ in zip(lines, range(5)) if line.startswith("data: ")]
            assert len(got) == 3 and all('"role":"assistant"' in line for line in got)
            time.sleep(0.3)  # some steps
        # leaving the block closes the connection mid-search
    assert_stopped_early(server, before)
