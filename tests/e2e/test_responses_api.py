"""The Responses API (`POST /v1/responses`) through the `openai` SDK's `responses.create`: the
answer is the chat completion's of the same conversation (the oracle: /v1/chat/completions on
the same server), whole and streamed (the events put together); text.format constrains it;
max_output_tokens cuts it (status incomplete); a reasoning parser splits a reasoning item off;
function tools answer with function_call items (whole and streamed), and function calls with
their outputs sent back are the chat's tool history; what is not supported is a 400 naming the
field."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI

from servers import MODEL_NAME, start_in_process, stop_server

ASK = "Tell me about blocks"


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = start_in_process(tiny_llama, max_model_len=512)
    yield s
    stop_server(s)


def _client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat(server, messages, **kwargs):
    return _client(server).chat.completions.create(model=MODEL_NAME, messages=messages,
                                                   temperature=0, **kwargs)


def test_a_response_is_the_chat_answer(server):
    client = _client(server)
    r = client.responses.create(model=MODEL_NAME, input=ASK, temperature=0,
                                max_output_tokens=12, extra_body={"ignore_eos": True})
    chat = _chat(server, [{"role": "user", "content": ASK}], max_tokens=12,
                 extra_body={"ignore_eos": True})
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == 12 == r.usage.total_tokens - r.usage.input_tokens
    assert r.max_output_tokens == 12 and r.temperature == 0


def test_instructions_and_message_items_make_the_chat(server):
    items = [{"role": "user", "content": "hi"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "more"}]}]
    r = _client(server).responses.create(model=MODEL_NAME, input=items, instructions="Be brief",
                                         temperature=0, max_output_tokens=8)
    chat = _chat(server, [{"role": "system", "content": "Be brief"},
                          {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "more"}], max_tokens=8)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.instructions == "Be brief"


def test_a_streamed_response_puts_together_to_the_whole(server):
    kwargs = dict(model=MODEL_NAME, input=ASK, temperature=0, max_output_tokens=16)
    whole = _client(server).responses.create(**kwargs)
    events = list(_client(server).responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the SDK's own accumulator
    with _client(server).responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_text_format_constrains_the_answer(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = _client(server).responses.create(
        model=MODEL_NAME, input=ASK, temperature=0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert r.status == "completed"
    assert set(json.loads(r.output_text)) == {"n"}


def _entries(logprobs):
    """(token, logprob rounded, top tokens) of each logprobs entry (chat's or a response's)."""
    return [(e.token, round(e.logprob, 4), [t.token for t in e.top_logprobs]) for e in logprobs]


def test_included_logprobs_are_the_chat_answers_whole_and_streamed(server):
    kwargs = dict(model=MODEL_NAME, input=ASK, temperature=0, max_output_tokens=10,
                  top_logprobs=2, include=["message.output_text.logprobs"],
                  extra_body={"ignore_eos": True})
    r = _client(server).responses.create(**kwargs)
    chat = _chat(server, [{"role": "user", "content": ASK}], max_tokens=10, logprobs=True,
                 top_logprobs=2, extra_body={"ignore_eos": True})
    want = _entries(chat.choices[0].logprobs.content)
    [part] = r.output[0].content
    assert len(want) == 10 and _entries(part.logprobs) == want
    assert "".join(e.token for e in part.logprobs) == part.text
    events = list(_client(server).responses.create(stream=True, **kwargs))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert _entries(deltas) == _entries(done.logprobs) == want
    assert _entries(events[-1].response.output[0].content[0].logprobs) == want
    # not included: none (vLLM's rule), top_logprobs alone asks for nothing
    plain = _client(server).responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=3,
                                             top_logprobs=2)
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("kwargs,param", [
    (dict(top_logprobs=21, include=["message.output_text.logprobs"]), "top_logprobs"),
    (dict(top_logprobs=-1), "top_logprobs"),
    (dict(tools=[{"type": "function", "name": "f", "parameters": {}}]), "tool_choice"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(background=True), "background"),
    (dict(include=["reasoning.encrypted_content"]), "include"),
    (dict(input=[{"type": "file_search_call", "id": "c", "queries": []}]), "input"),
    (dict(extra_body={"max_tokens": 3}), "max_tokens"),
    (dict(extra_body={"n": 2}), "n"),
    (dict(text={"format": {"type": "yaml"}}), "text"),
    (dict(input=[]), "input"),
])
def test_what_is_not_supported_is_a_400_naming_the_field(server, kwargs, param):
    kwargs = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": 4, **kwargs}
    with pytest.raises(BadRequestError) as e:
        _client(server).responses.create(**kwargs)
    assert e.value.body["param"] == param, e.value.body
    # nothing stays allocated: the server goes on serving
    assert _client(server).responses.create(model=MODEL_NAME, input=ASK,
                                            max_output_tokens=2).usage.output_tokens <= 2


def test_store_metadata_and_reasoning_settings_are_accepted(server):
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL_NAME, "input": ASK, "max_output_tokens": 3, "store": True,
        "metadata": {"k": "v"}, "reasoning": {"effort": "low"}, "user": "u"})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"}


def test_a_reasoning_parser_splits_a_reasoning_item_off(tiny_llama):
    s = start_in_process(tiny_llama, settings=dict(
        reasoning_parser="qwen3", structured_outputs_enable_in_reasoning=True))
    try:
        regex = {"structured_outputs": {"regex": "[a-z]{3}</think>[a-z]{4}"}}
        kwargs = dict(model=MODEL_NAME, input=ASK, temperature=0, max_output_tokens=40,
                      extra_body=regex)
        r = _client(s).responses.create(**kwargs)
        thought, message = r.output
        assert thought.type == "reasoning" and len(thought.content[0].text) == 3
        assert message.type == "message" and len(r.output_text) == 4
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        events = list(_client(s).responses.create(stream=True, **kwargs))
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (reasoning, text) == (thought.content[0].text, r.output_text)
        assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
        # the answer's items sent back as history: the reasoning item is not shown
        again = dict(kwargs, input=[{"role": "user", "content": ASK},
                                    *[item.model_dump(exclude_none=True) for item in r.output],
                                    {"role": "user", "content": "more"}])
        chat = dict(kwargs, input=[{"role": "user", "content": ASK},
                                   {"role": "assistant", "content": r.output_text},
                                   {"role": "user", "content": "more"}])
        assert _client(s).responses.create(**again).usage.input_tokens == \
            _client(s).responses.create(**chat).usage.input_tokens
        hidden = _client(s).responses.create(**{**kwargs, "extra_body": {
            **regex, "include_reasoning": False}})
        assert [item.type for item in hidden.output] == ["message"]
        assert hidden.output_text == r.output_text
    finally:
        stop_server(s)


TOOLS = [{"type": "function", "name": "get_weather", "description": "weather now",
          "parameters": {"type": "object", "properties": {"city": {
              "type": "string", "enum": ["rome", "oslo"]}}, "required": ["city"],
              "additionalProperties": False}},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}]
CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{3}"\}\}\n'
        r'</tool_call>')


@pytest.fixture(scope="module")
def tool_server(tiny_llama):
    s = start_in_process(tiny_llama, settings=dict(enable_auto_tool_choice=True,
                                                   tool_call_parser="hermes"),
                         max_model_len=1024)
    yield s
    stop_server(s)


def _calls(response):
    return [(i.name, i.arguments) for i in response.output if i.type == "function_call"]


@pytest.mark.parametrize("kwargs,content,num_calls", [
    (dict(extra_body={"structured_outputs": {"regex": "[a-z]{4}" + CALL + CALL}}), 4, 2),
    (dict(tool_choice="required", extra_body={"structured_outputs": {
        "disable_any_whitespace": True}}), 0, None),
    (dict(tool_choice={"type": "function", "name": "get_weather"},
          extra_body={"structured_outputs": {"disable_any_whitespace": True}}), 0, 1),
])
def test_function_tools_answer_with_function_calls(tool_server, kwargs, content, num_calls):
    """Each call a function_call item (the chat answer's calls: the same server's chat endpoint
    with the same tools is the oracle); streamed, the events put together to the same items."""
    client = _client(tool_server)
    r = client.responses.create(model=MODEL_NAME, input=ASK, temperature=0, tools=TOOLS,
                                max_output_tokens=200, **kwargs)
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in TOOLS]
    chat_choice = kwargs.get("tool_choice")
    if isinstance(chat_choice, dict):
        chat_choice = {"type": "function", "function": {"name": chat_choice["name"]}}
    chat = _chat(tool_server, [{"role": "user", "content": ASK}], tools=chat_tools,
                 max_tokens=200, extra_body=kwargs.get("extra_body"),
                 **({"tool_choice": chat_choice} if chat_choice else {})).choices[0].message
    want = [(c.function.name, c.function.arguments) for c in chat.tool_calls]
    assert _calls(r) == want and want and (num_calls is None or len(want) == num_calls)
    assert len(r.output_text) == content == len(chat.content or "")
    assert all(i.call_id.startswith("chatcmpl-tool-") and i.status == "completed"
               for i in r.output if i.type == "function_call")
    events = list(client.responses.create(model=MODEL_NAME, input=ASK, temperature=0,
                                          tools=TOOLS, max_output_tokens=200, stream=True,
                                          **kwargs))
    final = events[-1].response
    assert events[-1].type == "response.completed" and _calls(final) == want
    args = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    assert [args[i] for i in sorted(args)] == [a for _, a in want]
    assert final.output_text == r.output_text


def test_function_calls_and_outputs_sent_back_are_the_tool_history(tool_server):
    history = [{"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "oslo"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "-3 C"}]
    r = _client(tool_server).responses.create(
        model=MODEL_NAME, input=[{"role": "user", "content": ASK}, *history], tools=TOOLS,
        tool_choice="none", max_output_tokens=4, temperature=0)
    chat = _chat(tool_server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
               for t in TOOLS], tool_choice="none", max_tokens=4)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
