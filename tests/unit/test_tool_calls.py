"""The tool call parsers (vLLM's `--tool-call-parser hermes`, `llama3_json`, `pythonic` and
`mistral`) and the constraints of forced tool choices."""

from __future__ import annotations

import json

from nanokv.server.tool_calls import (answer_tool_calls, parse_hermes, parse_llama3_json,
                                      parse_mistral, parse_pythonic, required_schema,
                                      template_tool_calls)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def _functions(calls):
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_call_and_the_text_before_it():
    calls, content = parse_hermes("Let me look.\n" + WEATHER)
    assert _functions(calls) == [("get_weather", {"city": "Zürich"})]
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'  # not ASCII-escaped
    assert content == "Let me look.\n"


def test_several_calls_have_their_own_ids_and_no_content():
    calls, content = parse_hermes(WEATHER + "\n" + TIME)
    assert _functions(calls) == [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    assert calls[0]["id"] != calls[1]["id"]
    assert content is None


def test_an_unclosed_last_call_is_read():
    calls, _ = parse_hermes(WEATHER + '<tool_call>{"name": "get_time", "arguments": {"z": 1}}')
    assert _functions(calls) == [("get_weather", {"city": "Zürich"}), ("get_time", {"z": 1})]


def test_malformed_calls_leave_the_whole_answer_as_content():
    for text in ['<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
                 WEATHER + '<tool_call>{"name": "get_time"}</tool_call>',  # no arguments
                 '<tool_call>["get_weather"]</tool_call>',
                 "Sure.<tool_call>{\"name\": \"get_wea"]:
        assert parse_hermes(text) == ([], text)


def test_an_answer_without_calls_is_content():
    assert parse_hermes("It is sunny.") == ([], "It is sunny.")
    assert parse_hermes("") == ([], "")


def test_forced_answers():
    calls, content = answer_tool_calls(
        '[{"name": "get_weather", "parameters": {"city": "Rome"}}]', "required", None)
    assert _functions(calls) == [("get_weather", {"city": "Rome"})] and content == ""
    assert answer_tool_calls('[{"name": "get_w', "required", None) == ([], "")
    calls, content = answer_tool_calls('{"city": "Rome"}', "function", "get_weather")
    assert _functions(calls) == [("get_weather", {"city": "Rome"})] and content == ""
    assert answer_tool_calls(" ", "function", "get_weather") == ([], "")


def test_required_schema_is_vllms():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    schema = required_schema(tools, parallel_tool_calls=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["f"], ["g"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object", "properties": {}}
    assert "maxItems" not in required_schema(tools, None)


def test_history_arguments_reach_templates_as_dicts():
    calls = template_tool_calls([
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"type": "function", "function": {"name": "g", "arguments": ""}},
        {"type": "function", "function": {"name": "h", "arguments": "{bad"}}])
    assert [c["function"]["arguments"] for c in calls] == [{"a": 1}, {}, {}]
    assert calls[0]["id"] == "1"


# llama3_json: each case's (calls as (name, arguments), content) as vLLM 0.32's
# Llama3JsonToolParser.extract_tool_calls gives them (checked against it)
LLAMA3 = [
    ('{"name": "f", "parameters": {"a": 1}}', [("f", '{"a": 1}')], None),
    ('<|python_tag|>{"name": "f", "arguments": {"a": "x"}}; {"name": "g", "parameters": {}}',
     [("f", '{"a": "x"}'), ("g", "{}")], None),
    ('Sure: {"name": "f", "parameters": {"a": [1, {"b": 2}]}} done',
     [("f", '{"a": [1, {"b": 2}]}')], None),
    ('{"name": "f", "parameters": {"s": "ü}{"}}', [("f", '{"s": "ü}{"}')], None),
    ('{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}', [("f", '{"a": 1}')], None),
    ('{"name": "f", "parameters": "str"}', [("f", '"str"')], None),
    ("no json here", [], "no json here"),
    ("use {x} please", [], "use {x} please"),  # a { that starts no JSON
    ('{"name": "f"}', [], '{"name": "f"}'),  # neither parameters nor arguments
    ('{"name": "f", "parameters": {"a": 1}} {"foo": 1}', [],
     '{"name": "f", "parameters": {"a": 1}} {"foo": 1}'),  # one object not a call
    ('{"name": "f", "parameters": {"a": 1}', [], '{"name": "f", "parameters": {"a": 1}'),
]


def test_llama3_json_reads_answers_as_vllm():
    for text, calls, content in LLAMA3:
        got_calls, got_content = parse_llama3_json(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] \
            == calls, text
        assert got_content == content, text
        assert all(c["id"].startswith("chatcmpl-tool-") for c in got_calls)
        assert answer_tool_calls(text, "auto", None, "llama3_json")[1] == content


# pythonic: each case's (calls, content) as vLLM 0.32's PythonicToolParser.extract_tool_calls
# gives them (checked against it)
PYTHONIC = [
    ('[get_weather(city="Rome"), get_time()]', [("get_weather", '{"city": "Rome"}'),
                                                ("get_time", "{}")], None),
    ('[f(a=1, b=[1, 2, {"x": null}], c=true, d=None, e=-2.5)]',
     [("f", '{"a": 1, "b": [1, 2, {"x": null}], "c": true, "d": null, "e": -2.5}')], None),
    ('[f(a=1),\n g(b="x")]', [("f", '{"a": 1}'), ("g", '{"b": "x"}')], None),
    ('[f(a={"k": 1, 2: "v"})]', [("f", '{"a": {"k": 1, "2": "v"}}')], None),
    ('[f(s="ü")]', [("f", '{"s": "ü"}')], None),
    ("Sure: [f(a=1)]", [], "Sure: [f(a=1)]"),  # text first
    ("[f(a=1)] trailing", [], "[f(a=1)] trailing"),
    ("  [f(a=1)]", [], "  [f(a=1)]"),
    ("[f(1)]", [], "[f(1)]"),  # a positional argument
    ("[f(a=b)]", [], "[f(a=b)]"),  # not a literal
    ('[f(a=b"x")]', [], '[f(a=b"x")]'),  # not a JSON value
    ('[a.b(x="y")]', [], '[a.b(x="y")]'),
    ("no calls", [], "no calls"),
]


def test_pythonic_reads_answers_as_vllm():
    for text, calls, content in PYTHONIC:
        got_calls, got_content = parse_pythonic(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] \
            == calls, text
        assert got_content == content, text
        assert answer_tool_calls(text, "auto", None, "pythonic")[1] == content


# mistral: each well-formed case's (calls, content) as vLLM 0.32's MistralToolParser gives them
# with a tokenizer of the case's format (v11+: `[ARGS]` in the vocabulary; pre-v11: not),
# checked against it; nanokv reads both formats whatever the tokenizer
MISTRAL = [
    ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "rome"}[TOOL_CALLS]get_time{}',  # v11
     [("get_weather", '{"city": "rome"}'), ("get_time", "{}")], "Sure."),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "ü", "n": [1, {"x": null}]}',
     [("get_weather", '{"city": "ü", "n": [1, {"x": null}]}')], None),
    ("[TOOL_CALLS]get_time[ARGS]{}", [("get_time", "{}")], None),
    ('  [TOOL_CALLS]get_weather{"city": [1, "]"]} trailing',
     [("get_weather", '{"city": [1, "]"]}')], None),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "ü"}}]',  # pre-v11
     [("get_weather", '{"city": "ü"}')], None),
    ('I will call.[TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 1}"}, '
     '{"name": "a", "arguments": {}}]', [("f", '{"a": 1}'), ("a", "{}")], "I will call."),
    ('text [TOOL_CALLS] {"name": "x", "arguments": {}}', [("x", "{}")], "text "),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] after', [("f", '{"a": 1}')], None),
    ("no calls at all", [], "no calls at all"),
]
# malformed: all content (vLLM differs: a v11 tokenizer makes a call of an unclosed object or
# of a bare name, a pre-v11 one returns the text after the marker alone)
MISTRAL_MALFORMED = ["[TOOL_CALLS] nothing", '[TOOL_CALLS]get_weather[ARGS]{"city": "rome"',
                     '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS][1]',
                     '[TOOL_CALLS] [{"name": "f"}]', '[TOOL_CALLS] [{"name": 1, "arguments": {}}]']


def test_mistral_reads_answers_as_vllm():
    for text, calls, content in MISTRAL:
        got_calls, got_content = parse_mistral(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] \
            == calls, text
        assert got_content == content, text
        # Mistral's templates take back only ids of 9 letters and digits
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)
        assert answer_tool_calls(text, "auto", None, "mistral")[1] == content
    for text in MISTRAL_MALFORMED:
        assert parse_mistral(text) == ([], text)
    ids = {c["id"] for c in answer_tool_calls('[{"name": "f", "parameters": {}}]', "required",
                                              None, "mistral")[0]}
    ids |= {c["id"] for c in answer_tool_calls('{"a": 1}', "function", "f", "mistral")[0]}
    assert len(ids) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)
