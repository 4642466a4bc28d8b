"""Stored responses (`--responses-store-size`) through the `openai` SDK: a response continued
by `previous_response_id` answers as the chat completion of the whole conversation does (the
oracle: /v1/chat/completions on the same server, the earlier answer as the assistant turn, the
earlier instructions left out); retrieve, delete and input_items (the SDK's pager); the oldest
response dropped past the store's size; `store: false` keeps nothing; background responses
polled to the foreground answer and cancelled with their blocks freed; the refusals."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import BadRequestError, NotFoundError

from servers import MODEL_NAME, start_in_process, stop_server
from test_responses_api import ASK, _chat, _client

STORE_SIZE = 4


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = start_in_process(tiny_llama, max_model_len=1024, step_delay=0.01,
                         settings=dict(responses_store_size=STORE_SIZE,
                                       enable_auto_tool_choice=True, tool_call_parser="hermes"))
    yield s
    stop_server(s)


def _create(server, **kwargs):
    return _client(server).responses.create(model=MODEL_NAME, temperature=0, **kwargs)


def test_previous_response_id_continues_the_conversation(server):
    first = _create(server, input=ASK, instructions="Be brief", max_output_tokens=10)
    assert first.store is True and first.previous_response_id is None
    second = _create(server, input="and more", previous_response_id=first.id,
                     instructions="Answer in French", max_output_tokens=10)
    assert second.previous_response_id == first.id
    # the earlier instructions are not carried over (OpenAI's rule); the answer is the turn
    chat = _chat(server, [{"role": "system", "content": "Answer in French"},
                          {"role": "user", "content": ASK},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "and more"}], max_tokens=10)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # a third turn continues the second's whole conversation, streamed
    events = list(_client(server).responses.create(
        model=MODEL_NAME, input="last", previous_response_id=second.id, temperature=0,
        max_output_tokens=10, stream=True))
    third = events[-1].response
    chat = _chat(server, [{"role": "user", "content": ASK},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "and more"},
                          {"role": "assistant", "content": second.output_text},
                          {"role": "user", "content": "last"}], max_tokens=10)
    assert third.output_text == chat.choices[0].message.content
    # a streamed response is stored as its response.completed shows it
    assert _client(server).responses.retrieve(third.id).model_dump() == third.model_dump()


def test_function_calls_and_their_outputs_continue_a_stored_response(server):
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["rome", "oslo"]}},
        "required": ["city"], "additionalProperties": False}}]
    first = _create(server, input=ASK, tools=tools, tool_choice="required",
                    max_output_tokens=200,
                    extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    calls = [i for i in first.output if i.type == "function_call"]
    assert calls and first.status == "completed", first.output
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "-3 C"}
               for c in calls]
    second = _create(server, input=outputs, previous_response_id=first.id, tools=tools,
                     tool_choice="none", max_output_tokens=6)
    chat = _chat(server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.output_text, "tool_calls": [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        *[{"role": "tool", "tool_call_id": c.call_id, "content": "-3 C"} for c in calls]],
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
               for t in tools], tool_choice="none", max_tokens=6)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


def test_retrieve_delete_and_input_items(server):
    client = _client(server)
    items = [{"role": "user", "content": "one"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "two", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "three"}]}]
    r = _create(server, input=items, max_output_tokens=3)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    listed = list(client.responses.input_items.list(r.id, order="asc", limit=2))  # 2 pages
    assert [(i.role, i.content[0].text) for i in listed] == [
        ("user", "one"), ("assistant", "two"), ("user", "three")]
    assert len({i.id for i in listed}) == 3
    page = client.responses.input_items.list(r.id, limit=1)  # newest first by default
    assert page.data[0].id == listed[-1].id and page.has_more
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: _create(server, input="x", previous_response_id=r.id)):
        with pytest.raises(NotFoundError) as e:
            call()
        assert r.id in e.value.body["message"]


def test_the_oldest_response_goes_past_the_store_size_and_store_false_keeps_none(server):
    client = _client(server)
    unstored = _create(server, input=ASK, max_output_tokens=2, store=False)
    assert unstored.store is False
    made = [_create(server, input=f"{ASK} {i}", max_output_tokens=2).id
            for i in range(STORE_SIZE + 1)]
    for rid in [unstored.id, made[0]]:
        with pytest.raises(NotFoundError):
            client.responses.retrieve(rid)
    assert [client.responses.retrieve(rid).id for rid in made[1:]] == made[1:]


def _poll(client, rid, timeout=60.0):
    end = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress") or time.monotonic() > end:
            return r
        time.sleep(0.05)


def test_a_background_response_is_polled_to_the_foreground_answer(server):
    client = _client(server)
    kwargs = dict(input=ASK, max_output_tokens=12, extra_body={"ignore_eos": True},
                  top_logprobs=1, include=["message.output_text.logprobs"])
    started = _create(server, background=True, **kwargs)
    assert started.status in ("queued", "in_progress") and started.background is True
    done = _poll(client, started.id)
    foreground = _create(server, **kwargs)
    assert done.status == "incomplete" and done.output_text == foreground.output_text
    # (the foreground run's prompt is a prefix-cache hit: the same values up to rounding)
    assert [(e.token, round(e.logprob, 4)) for e in done.output[0].content[0].logprobs] == [
        (e.token, round(e.logprob, 4)) for e in foreground.output[0].content[0].logprobs]
    assert len(done.output[0].content[0].logprobs) == 12
    assert done.usage.output_tokens == 12
    with pytest.raises(BadRequestError) as e:  # a synchronous response is not cancelled
        client.responses.cancel(foreground.id)
    assert "synchronous" in e.value.body["message"]
    assert client.responses.cancel(done.id).status == "incomplete"  # done: as it is


def test_a_cancelled_background_response_frees_its_blocks(server):
    client = _client(server)
    started = _create(server, input=ASK, max_output_tokens=500, background=True,
                      extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"
    server.wait_idle()  # the engine request was aborted: no block held
    with pytest.raises(BadRequestError) as e:  # a cancelled response is not continued
        _create(server, input="more", previous_response_id=started.id)
    assert e.value.body["param"] == "previous_response_id"
    # a running background response deleted is cancelled first
    running = _create(server, input=ASK, max_output_tokens=500, background=True,
                      extra_body={"ignore_eos": True})
    client.responses.delete(running.id)
    server.wait_idle()
    server.assert_healthy()


@pytest.mark.parametrize("kwargs,param", [
    (dict(background=True, store=False), "background"),
    (dict(background=True, stream=True), "stream"),
    (dict(conversation="conv_1"), "conversation"),
])
def test_what_the_store_does_not_serve_is_a_400(server, kwargs, param):
    r = httpx.post(server.url + "/v1/responses", timeout=60,
                   json={"model": MODEL_NAME, "input": ASK, "max_output_tokens": 2, **kwargs})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    bad = httpx.get(server.url + "/v1/responses/resp_x/input_items", params={"order": "up"})
    assert bad.status_code == 404  # an unknown response before its bad order
    server.wait_idle()


def test_without_a_store_the_routes_say_so(tiny_llama):
    s = start_in_process(tiny_llama, max_model_len=256)
    try:
        client = _client(s)
        r = _create(s, input=ASK, max_output_tokens=2)
        assert r.store is False
        with pytest.raises(NotFoundError) as e:
            client.responses.retrieve(r.id)
        assert "--responses-store-size" in e.value.body["message"]
        with pytest.raises(BadRequestError) as e:
            _create(s, input=ASK, previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id"
        assert "--responses-store-size" in e.value.body["message"]
    finally:
        stop_server(s)


def test_a_background_response_over_the_request_timeout_fails_and_says_why(tiny_llama):
    s = start_in_process(tiny_llama, max_model_len=1024, step_delay=0.02,
                         settings=dict(responses_store_size=2, request_timeout=0.5))
    try:
        started = _create(s, input=ASK, max_output_tokens=500, background=True,
                          extra_body={"ignore_eos": True})
        failed = _poll(_client(s), started.id)
        assert failed.status == "failed" and failed.error.code == "timeout", failed
        assert "request timeout" in failed.error.message
        s.wait_idle()
    finally:
        stop_server(s)
