"""Tool calling through the `openai` SDK (`nanokv serve --enable-auto-tool-choice
--tool-call-parser hermes`, llama3_json, pythonic and mistral), whole and streamed (the stream's
deltas put together against the whole answer): the tiny model writes no tool calls by itself,
so `auto` is driven by a structured-outputs regex, and "required" / named functions by the
engine's own constraint. The prompt's tools and history are checked against transformers'
apply_chat_template(tools=...)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI

from servers import MODEL_NAME, start_in_process, stop_server

TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["rome", "oslo"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # no runaway whitespace
ASK = [{"role": "user", "content": "weather?"}]
CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{3}"\}\}\n'
        r'</tool_call>')


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """(a tool-calling server, a server without the flags), both with TEMPLATE."""
    tools = start_in_process(tiny_llama, settings=dict(
        chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes"),
        max_model_len=1024)
    plain = start_in_process(tiny_llama, settings=dict(chat_template=TEMPLATE),
                             max_model_len=1024)
    yield tools, plain
    stop_server(tools)
    stop_server(plain)


def _client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat(server, **kwargs):
    return _client(server).chat.completions.create(
        model=MODEL_NAME, messages=kwargs.pop("messages", ASK), temperature=0, **kwargs)


def test_auto_reads_the_calls_and_the_content_before_them(servers):
    server = servers[0]
    r = _chat(server, tools=TOOLS, max_tokens=200,
              extra_body={"structured_outputs": {"regex": "[a-z]{4}" + CALL}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.content) == 4 and choice.message.content.isalpha()
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    city = json.loads(call.function.arguments)["city"]
    assert len(city) == 3 and city.isalpha()


def test_auto_without_a_call_is_plain_content(servers):
    r = _chat(servers[0], tools=TOOLS, max_tokens=10,
              extra_body={"structured_outputs": {"regex": "[a-z]{5}"}})
    choice = r.choices[0]
    assert choice.message.tool_calls is None and len(choice.message.content) == 5
    assert choice.finish_reason == "stop"


def test_required_is_constrained_to_a_valid_call(servers):
    r = _chat(servers[0], tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=300, extra_body=COMPACT)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, arguments) in [("get_weather", {"city": "rome"}),
                                               ("get_weather", {"city": "oslo"}),
                                               ("get_time", {})]


def test_a_named_function_is_constrained_to_its_parameters(servers):
    r = _chat(servers[0], tools=TOOLS, max_tokens=200, extra_body=COMPACT,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ""  # vLLM's
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("rome", "oslo")


def _stream(server, **kwargs):
    """A streamed chat answer through the SDK, its deltas put together: (content, calls as
    (id, name, arguments), finish_reason, the chunks' tool_calls entries)."""
    content, calls, entries, finish = "", {}, [], None
    for chunk in _client(server).chat.completions.create(
            model=MODEL_NAME, messages=ASK, temperature=0, stream=True, **kwargs):
        [choice] = chunk.choices
        content += choice.delta.content or ""
        for entry in choice.delta.tool_calls or []:
            entries.append(entry)
            call = calls.setdefault(entry.index, ["", "", ""])
            call[0] += entry.id or ""
            call[1] += entry.function.name or ""
            call[2] += entry.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, entries


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _whole_and_streamed(server, regex: str, num_calls: int):
    """The auto answer the regex drives, whole and streamed: the same calls (num_calls of
    them), content and finish_reason. Returns (whole choice, streamed content, streamed calls
    as (id, name, arguments))."""
    kwargs = dict(tools=TOOLS, max_tokens=200, extra_body={"structured_outputs": {
        "regex": regex}})
    whole = _chat(server, **kwargs).choices[0]
    content, calls, finish, _ = _stream(server, **kwargs)
    assert len(_calls(whole.message)) == num_calls
    assert [(name, args) for _, name, args in calls] == _calls(whole.message)
    assert (content or None) == whole.message.content
    assert finish == whole.finish_reason == ("tool_calls" if num_calls else "stop")
    return whole, content, calls


@pytest.mark.parametrize("regex,content_len,num_calls", [
    ("[a-z]{4}" + CALL, 4, 1),  # content, then a call
    (r"\n" + CALL + "[a-z]{2}" + CALL, 0, 2),  # blank content, two calls, text between
    ("[a-z]{5}", 5, 0),  # no call: content alone
])
def test_streamed_auto_calls_are_the_whole_answers(servers, regex, content_len, num_calls):
    kwargs = dict(tools=TOOLS, max_tokens=200, extra_body={"structured_outputs": {
        "regex": regex}})
    whole = _chat(servers[0], **kwargs).choices[0]
    content, calls, finish, entries = _stream(servers[0], **kwargs)
    assert len(content) == content_len and content == (whole.message.content or "")
    assert [(name, args) for _, name, args in calls] == _calls(whole.message)
    assert len(calls) == num_calls and [e.index for e in entries] == list(range(num_calls))
    assert all(e.type == "function" and e.id.startswith("chatcmpl-tool-") for e in entries)
    assert finish == whole.finish_reason == ("tool_calls" if num_calls else "stop")


def test_the_sdks_stream_helper_puts_the_calls_together(servers):
    """The SDK's own accumulator (`chat.completions.stream`, which also checks each delta's
    shape) makes the whole answer's message of the streamed calls."""
    kwargs = dict(tools=TOOLS, max_tokens=200, extra_body={"structured_outputs": {
        "regex": "[a-z]{3}" + CALL + CALL}})
    whole = _chat(servers[0], **kwargs).choices[0]
    with _client(servers[0]).chat.completions.stream(
            model=MODEL_NAME, messages=ASK, temperature=0, **kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert final.message.content == whole.message.content
    assert _calls(final.message) == _calls(whole.message) and len(_calls(whole.message)) == 2
    assert [c.id for c in final.message.tool_calls][0].startswith("chatcmpl-tool-")


def test_streamed_required_calls_are_the_whole_answers(servers):
    kwargs = dict(tools=TOOLS, tool_choice="required", max_tokens=300, extra_body=COMPACT)
    whole = _chat(servers[0], **kwargs).choices[0]
    content, calls, finish, _ = _stream(servers[0], **kwargs)
    assert content == "" and finish == whole.finish_reason == "tool_calls"
    assert [(name, args) for _, name, args in calls] == _calls(whole.message) != []


def test_a_streamed_named_function_sends_its_arguments_as_they_come(servers):
    kwargs = dict(tools=TOOLS, max_tokens=200, extra_body=COMPACT,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = _chat(servers[0], **kwargs).choices[0]
    content, calls, finish, entries = _stream(servers[0], **kwargs)
    assert content == "" and finish == whole.finish_reason == "stop"
    assert [(name, args) for _, name, args in calls] == _calls(whole.message)
    assert len(entries) > 1 and entries[0].function.name == "get_weather"  # pieces
    assert all(e.id is None and e.function.name is None for e in entries[1:])


def test_streamed_calls_after_reasoning(tiny_llama):
    """With a reasoning parser, the calls are read from the content after </think>, streamed
    or not."""
    server = start_in_process(tiny_llama, settings=dict(
        chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes",
        reasoning_parser="qwen3", structured_outputs_enable_in_reasoning=True),
        max_model_len=1024)  # the regex drives the reasoning too
    try:
        kwargs = dict(tools=TOOLS, max_tokens=200, extra_body={"structured_outputs": {
            "regex": "[a-z]{3}</think>[a-z]{2}" + CALL}})
        whole = _chat(server, **kwargs).choices[0]
        assert len(whole.message.reasoning) == 3 and len(whole.message.content) == 2
        thought = ""
        for chunk in _client(server).chat.completions.create(
                model=MODEL_NAME, messages=ASK, temperature=0, stream=True, **kwargs):
            thought += getattr(chunk.choices[0].delta, "reasoning", None) or ""
        content, calls, finish, _ = _stream(server, **kwargs)
        assert (thought, content) == (whole.message.reasoning, whole.message.content)
        assert [(name, args) for _, name, args in calls] == _calls(whole.message) != []
        assert finish == whole.finish_reason == "tool_calls"
    finally:
        stop_server(server)


def test_llama3_json_calls_whole_and_streamed(tiny_llama):
    """`--tool-call-parser llama3_json`: JSON objects with `parameters` are the calls (content
    null), streamed when the answer starts with one; other answers are content."""
    server = start_in_process(tiny_llama, settings=dict(
        chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="llama3_json"),
        max_model_len=1024)
    one = r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{3}"\}\}'
    try:
        for regex, num_calls in ((one + "; " + one, 2), ("[a-z]{6}", 0)):
            whole, _, calls = _whole_and_streamed(server, regex, num_calls)
            if num_calls:
                assert whole.message.content is None
                assert all(json.loads(args)["city"].isalpha() for _, _, args in calls)
    finally:
        stop_server(server)


def test_pythonic_calls_whole_and_streamed(tiny_llama):
    """`--tool-call-parser pythonic`: an answer that is a list of calls is the calls (content
    null; streamed, at its end); other answers are content."""
    server = start_in_process(tiny_llama, settings=dict(
        chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="pythonic"),
        max_model_len=1024)
    try:
        for regex, num_calls in ((r'\[get_weather\(city="[a-z]{3}"\), get_time\(\)\]', 2),
                                 ("[a-z]{6}", 0)):
            _whole_and_streamed(server, regex, num_calls)
    finally:
        stop_server(server)


def test_mistral_calls_whole_and_streamed_and_their_ids_go_back(tiny_llama):
    """`--tool-call-parser mistral`: v11+ `[TOOL_CALLS]name[ARGS]{...}` calls and a pre-v11
    `[TOOL_CALLS] [{...}]` list are the calls, the text before them the content, whole and
    streamed; each id 9 letters and digits (Mistral's templates refuse others), and an answer's
    call sent back in the history reaches the template with its id."""
    # Mistral's templates' check of the ids in the history (their message, as they raise it)
    checked = ("{% for m in messages %}{% for i in [m.tool_call_id] + (m.tool_calls or [])"
               "| map(attribute='id', default=m.tool_call_id) | list if i %}"
               "{% if i | length != 9 %}{{ raise_exception('Tool call IDs should be "
               "alphanumeric strings with length 9!') }}{% endif %}{% endfor %}{% endfor %}")
    server = start_in_process(tiny_llama, settings=dict(
        chat_template=checked + TEMPLATE, enable_auto_tool_choice=True,
        tool_call_parser="mistral"), max_model_len=1024)
    v11 = r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "[a-z]{3}"\}'
    listed = r'\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "[a-z]{3}"\}\}\]'
    try:
        for regex, num_calls, content_len in (("[a-z]{4}" + v11 + v11, 2, 4), (listed, 1, 0),
                                              ("[a-z]{6}", 0, 6)):
            whole, content, calls = _whole_and_streamed(server, regex, num_calls)
            assert len(content) == content_len
            ids = [c.id for c in whole.message.tool_calls or []] + [i for i, _, _ in calls]
            assert all(len(i) == 9 and i.isalnum() for i in ids)
            assert all(json.loads(args)["city"].isalpha() for _, _, args in calls)
        whole = _chat(server, tools=TOOLS, max_tokens=200, extra_body={"structured_outputs": {
            "regex": v11}}).choices[0]
        [call] = whole.message.tool_calls
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            call.model_dump()]}, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        r = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS},
                       timeout=30)
        assert r.status_code == 200, r.text
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(tiny_llama).decode(r.json()["tokens"])
        assert f"sunny [{call.id}]" in prompt and '"name": "get_weather"' in prompt
        history[-1]["tool_call_id"] = history[1]["tool_calls"][0]["id"] = "call_1"
        with pytest.raises(BadRequestError, match="length 9"):  # what other ids would meet
            _chat(server, messages=history, tools=TOOLS, max_tokens=2)
    finally:
        stop_server(server)


def test_the_template_gets_the_tools_and_the_tool_history(servers, tiny_llama):
    from transformers import AutoTokenizer

    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    oracle = json.loads(json.dumps(history))
    oracle[1]["tool_calls"][0]["function"]["arguments"] = {"city": "oslo"}
    text = tok.apply_chat_template(oracle, tools=TOOLS, chat_template=TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)
    assert '"get_time"' in text and '{"city": "oslo"}' in text and "-3 C [call_1]" in text
    expected = tok.encode(text, add_special_tokens=False)
    for server in servers:
        r = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == expected
        # the chat request renders the same prompt (tool_choice none: no flags needed)
        answer = _chat(server, messages=history, tools=TOOLS, tool_choice="none", max_tokens=2)
        assert answer.usage.prompt_tokens == len(expected)
        assert answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize("kwargs,param,says", [
    (dict(tools=TOOLS), "tool_choice", "--enable-auto-tool-choice"),  # default: auto
    (dict(tools=TOOLS, tool_choice="required"), "tool_choice", "--tool-call-parser"),
])
def test_tool_calls_without_the_flags_are_refused(servers, kwargs, param, says):
    with pytest.raises(BadRequestError) as e:
        _chat(servers[1], max_tokens=2, **kwargs)
    assert e.value.body["param"] == param and says in e.value.body["message"]


@pytest.mark.parametrize("kwargs,param,says", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", "get_weather"),
    (dict(tools=TOOLS, tool_choice="any"), "tool_choice", '"required"'),
    (dict(tool_choice="auto"), "tool_choice", "needs `tools`"),
    (dict(tools=[]), "tools", "empty"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
          extra_body={"structured_outputs": {"regex": "a"}}), "structured_outputs", "named"),
])
def test_bad_tool_requests_say_what_is_allowed(servers, kwargs, param, says):
    with pytest.raises(BadRequestError) as e:
        _chat(servers[0], max_tokens=2, **kwargs)
    assert e.value.body["param"] == param and says in e.value.body["message"]
