"""What real clients send: vLLM's benchmark client (both backends, its exact request shapes),
the `openai` client's usual patterns, n > 1, logprobs and penalties against the offline engine,
and the limits that keep one huge request from stalling everyone else."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from servers import MODEL_NAME
from nanokv import SamplingParams
from nanokv.engine.chat import ChatRenderer

PROMPT = "def add(a, b):\n    return"


def sse_events(r: httpx.Response) -> list:
    """The data events of a stream, as vLLM's benchmark client reads them."""
    out = []
    for line in r.iter_lines():
        line = line.strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def greedy(offline, prompt, n, **kw):
    (out,) = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                       ignore_eos=True, **kw))
    return out


def test_vllm_bench_completions_request(server, offline):
    """`vllm bench serve --backend openai`: repetition_penalty 1.0, logprobs null, usage."""
    payload = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0.0,
               "repetition_penalty": 1.0, "max_tokens": 12, "logprobs": None, "best_of": 1,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers,
                      json=payload, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == greedy(offline, PROMPT, 12).text
    assert events[-2]["usage"]["completion_tokens"] == 12


def test_vllm_bench_chat_request(server, offline):
    """`vllm bench serve --backend openai-chat`: content as a list of text parts."""
    payload = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPT}]}], "temperature": 0.0, "max_completion_tokens": 10,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers,
                      json=payload, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if e["choices"])
    ids = ChatRenderer(offline.tokenizer).token_ids([{"role": "user", "content": PROMPT}])
    assert text == greedy(offline, ids, 10).text
    assert events[-2]["usage"]["completion_tokens"] == 10


def test_openai_client_usual_fields_and_history(client):
    """Bookkeeping fields and no-op values are accepted; a history built with
    message.model_dump() (refusal: null, ...) goes back in."""
    first = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=first, max_completion_tokens=6, temperature=0, seed=3,
        store=False, metadata={"team": "kv"}, service_tier="auto", prompt_cache_key="k1",
        safety_identifier="user-1", modalities=["text"], reasoning_effort="low", user="u",
        response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0, n=1,
        top_p=1, logit_bias={},
        extra_body={"min_p": 0, "skip_special_tokens": True, "repetition_penalty": 1.0,
                    "top_k": 0})
    assert r.choices[0].finish_reason in ("stop", "length")
    history = first + [r.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=4)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 8
    assert chunks[-1].usage.completion_tokens == 8


def test_n_choices(client, offline):
    ref = greedy(offline, PROMPT, 6)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [ref.text] * 3
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)  # the prompt counts once
    assert r.usage.completion_tokens == 18
    sampled = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=4, max_tokens=12,
        temperature=1.0, seed=11, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = [c.token_ids for c in sampled.choices]
    assert len({tuple(x) for x in ids}) > 1  # seeded choices draw with seed + index
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=4, max_tokens=12,
        temperature=1.0, seed=11, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.token_ids for c in again.choices] == ids
    streamed = list(client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "x = 1"], max_tokens=5, n=2, stream=True,
        temperature=0, extra_body={"ignore_eos": True}))
    texts = {}
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert sorted(texts) == [0, 1, 2, 3] and texts[0] == texts[1] == greedy(
        offline, PROMPT, 5).text


def test_logprobs_equal_the_models_distribution(client, offline):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True,
                                                          "return_token_ids": True})
    choice = r.choices[0]
    out = choice.token_ids
    prompt_ids = offline.tokenizer.encode(PROMPT)
    (ref,) = offline.generate([prompt_ids + out[:-1]], SamplingParams(
        temperature=0, max_tokens=1, return_prompt_logits=True))
    lp = torch.log_softmax(ref.prompt_logits.float(), -1)[len(prompt_ids) - 1:]  # [5, vocab]
    expected = [float(lp[k, t]) for k, t in enumerate(out)]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    for k, top in enumerate(choice.logprobs.top_logprobs):
        assert max(top.values()) == pytest.approx(expected[k], abs=1e-4)  # greedy: the top
        assert 1 <= len(top) <= 3  # tokens that decode alike share a key
    # each token's text is its part of the completion's text, which its offset indexes
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert "".join(tokens) == choice.text == offline.tokenizer.decode(out)
    assert all(choice.text[o:o + len(t)] == t for t, o in zip(tokens, offsets))
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    # streamed (however the server groups steps into chunks): the same tokens and offsets
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                                         temperature=0, logprobs=3, stream=True,
                                         extra_body={"ignore_eos": True})
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [o for c in chunks for o in c.text_offset] == offsets
    assert [t for c in chunks for t in c.tokens] == choice.logprobs.tokens

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        logprobs=True, top_logprobs=2, temperature=0.7, seed=5)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_penalties_and_min_p_equal_offline(client, offline):
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    ref = greedy(offline, PROMPT, 24, **kw)
    assert ref.token_ids != greedy(offline, PROMPT, 24).token_ids  # the penalties bite
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
        frequency_penalty=0.5, presence_penalty=0.25,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].token_ids == ref.token_ids
    (sampled,) = offline.generate([PROMPT], SamplingParams(temperature=0.8, min_p=0.2, seed=9,
                                                           max_tokens=10, ignore_eos=True))
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10,
                                  temperature=0.8, seed=9,
                                  extra_body={"min_p": 0.2, "ignore_eos": True})
    assert r.choices[0].text == sampled.text


def test_request_class_labels_the_hit_counters(server, client):
    m0 = server.wait_idle()
    prompt = "import os\nimport sys\n" * 8
    for _ in range(2):
        client.with_options(default_headers={"X-Request-Class": "rag"}).completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "cls"})
    m1 = server.wait_idle()
    key = (("endpoint", "completions"), ("request_class", "rag"))
    queries = m1[("nanokv:prefix_cache_queries_total", key)] - m0.get(
        ("nanokv:prefix_cache_queries_total", key), 0)
    hits = m1[("nanokv:prefix_cache_hits_total", key)] - m0.get(
        ("nanokv:prefix_cache_hits_total", key), 0)
    assert queries > 0 and 0 < hits < queries  # the second request hit the first's blocks


def test_body_over_limit_is_413_before_reading(server):
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * 5_000_000})
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", headers={**server.headers,
                   "Content-Type": "application/json"}, content=big, timeout=60)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert "4000000" in err["message"] and "--max-body-bytes" in err["message"]

    def chunks():  # no Content-Length: counted while it is read
        for _ in range(50):
            yield b" " * 100_000

    r = httpx.post(server.url + "/v1/completions", headers={**server.headers,
                   "Content-Type": "application/json"}, content=chunks(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 20
    server.assert_healthy()


def test_prompt_over_char_limit_is_400_without_tokenizing(tight_server):
    """The default limit is 64 characters per context token (256 x 64 here)."""
    t0 = time.monotonic()
    r = httpx.post(tight_server.url + "/v1/completions",
                   json={"model": MODEL_NAME, "prompt": "a b " * 250_000}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and "--max-prompt-chars" in err["message"]
    assert "16384" in err["message"]
    assert time.monotonic() - t0 < 5


def test_big_prompt_does_not_stall_other_clients(server):
    """A 2.5 MB prompt is tokenized (seconds) in the worker thread while /health and other
    completions keep answering."""
    big = "def add(a, b):\n    return a + b\n" * 78_000
    result = {}

    def send_big():
        t0 = time.monotonic()
        result["r"] = httpx.post(server.url + "/v1/completions", headers=server.headers,
                                 json={"model": MODEL_NAME, "prompt": big}, timeout=120)
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=send_big)
    thread.start()
    time.sleep(0.3)  # the body is sent and being tokenized
    latencies, completed = [], 0
    with httpx.Client(timeout=30, headers=server.headers) as c:
        while thread.is_alive():
            t0 = time.monotonic()
            assert c.get(server.url + "/health").status_code == 200
            r = c.post(server.url + "/v1/completions",
                       json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
            latencies.append(time.monotonic() - t0)
            completed += 1
    thread.join()
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "tokens" in r.json()["error"]["message"]  # it was tokenized, then refused
    if result["seconds"] > 1.5:  # long enough to have stalled the others before
        assert completed >= 3, (completed, result["seconds"])
        # a stall would hold another client for most of the big prompt's time; on a busy
        # machine a small request alone may take a second
        assert max(latencies) < max(1.0, result["seconds"] / 3), (max(latencies),
                                                                   result["seconds"])
    server.wait_idle()
