"""Streamed tool calls (`nanokv/server/tool_stream.py`) against the whole answer's parse
(`tool_calls.parse_hermes`, `parse_llama3_json`, `parse_pythonic`, `parse_mistral`,
`parse_required`, the named function's arguments): the same text fed in pieces of random sizes
puts together to the same content and calls."""

import json
import random

import pytest

from nanokv.server.tool_calls import (parse_hermes, parse_llama3_json, parse_mistral,
                                      parse_pythonic, parse_required)
from nanokv.server.tool_stream import ToolCallStream


def streamed(choice, text, rng, name=None, parser="hermes"):
    """(content, [(name, arguments)], the entries, the stream) of `text` fed in random pieces."""
    stream = ToolCallStream(choice, name, parser)
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        pieces.append(stream.feed(text[at:at + step]))
        at += step
    pieces.append(stream.finish())
    content, calls, entries = "", {}, []
    for piece_content, piece_calls in pieces:
        content += piece_content
        for entry in piece_calls:
            entries.append(entry)
            call = calls.setdefault(entry["index"], ["", ""])
            call[0] += entry["function"].get("name", "")
            call[1] += entry["function"].get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)], entries, stream


def block(name, arguments, close=True):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n' + \
        ("</tool_call>" if close else "")


HERMES = [
    "just text, no call",
    "   ",
    "text ending in half a marker <tool_ca",
    "checking the weather " + block("get_weather", {"city": "rome"}),
    "\n\n" + block("f", {"a": "x</tool", "b": [1, 2]}) + " between " + block("g", {}),
    block("f", {"a": 1}) + block("g", {"b": "ü"}, close=False),  # the last block unclosed
    "<tool_call" + "> not quite" + block("f", {}),
]


@pytest.mark.parametrize("text", HERMES)
def test_auto_streams_the_whole_answers_calls(text):
    rng = random.Random(text)
    want_calls, want_content = parse_hermes(text)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    for _ in range(30):
        content, calls, entries, stream = streamed("auto", text, rng)
        assert calls == want
        assert (content if content.strip() or not want else None) == want_content
        assert [e["index"] for e in entries] == list(range(len(want)))
        assert all(e["id"].startswith("chatcmpl-tool-") and e["type"] == "function"
                   for e in entries)
        assert stream.finish_reason("stop") == ("tool_calls" if want else "stop")
        assert stream.finish_reason("length") == ("tool_calls" if want else "length")


def test_auto_blank_text_before_a_call_waits_and_is_dropped():
    stream = ToolCallStream("auto")
    assert stream.feed("\n ") == ("", [])  # may be the blank before a call
    assert stream.feed("<tool_") == ("", [])  # may begin one
    content, calls = stream.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "" and [c["function"]["name"] for c in calls] == ["f"]
    stream = ToolCallStream("auto")
    assert stream.feed("\n ") == ("", [])
    assert stream.feed("hi") == ("\n hi", [])  # not blank after all: content


def test_auto_a_block_that_is_not_a_call_and_what_follows_are_content():
    text = "a " + block("f", {"x": 1}).replace('"name"', '"nom"') + " b " + block("g", {})
    rng = random.Random(0)
    for _ in range(20):
        content, calls, _, stream = streamed("auto", text, rng)
        assert (content, calls) == (text, []) == (parse_hermes(text)[1], parse_hermes(text)[0])
        assert stream.finish_reason("stop") == "stop"
    # after calls went out: they stay, and the rest is content
    content, calls, _, _ = streamed("auto", block("g", {}) + " <tool_call>{oops}</tool_call>.",
                                    rng)
    assert calls == [("g", "{}")] and content == "<tool_call>{oops}</tool_call>."


@pytest.mark.parametrize("items", [
    [{"name": "get_weather", "parameters": {"city": 'ro"}me'}}],
    [{"name": "a", "parameters": {"x": [{"y": "]"}], "z": "\\"}}, {"name": "b", "parameters": {}}],
])
def test_required_streams_each_item_once_it_closes(items):
    text = json.dumps(items, ensure_ascii=False)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in parse_required(text)]
    rng = random.Random(text)
    for _ in range(30):
        content, calls, entries, stream = streamed("required", text, rng)
        assert content == "" and calls == want and len(want) == len(items)
        assert stream.finish_reason("stop") == "tool_calls"
        assert stream.finish_reason("length") == "length"
    cut = ToolCallStream("required")  # cut short: the items that closed
    _, first = cut.feed(text[:len(json.dumps(items[0])) + 2])
    assert [c["function"]["name"] for c in first] == [items[0]["name"]]


def test_a_named_function_streams_its_arguments():
    stream = ToolCallStream("function", "get_weather")
    assert stream.feed("  ") == ("", [])  # no call before its arguments begin
    _, [first] = stream.feed('{"ci')
    assert first["index"] == 0 and first["function"] == {"name": "get_weather",
                                                         "arguments": '  {"ci'}
    assert stream.feed('ty": 1}') == ("", [{"index": 0, "function": {"arguments": 'ty": 1}'}}])
    assert stream.finish() == ("", []) and stream.finish_reason("stop") == "stop"
    assert ToolCallStream("function", "f").finish() == ("", [])  # blank answer: no call


LLAMA3_CALLS = [
    '{"name": "f", "parameters": {"a": 1}}',
    '<|python_tag|>{"name": "f", "arguments": {"a": "x}"}}; {"name": "g", "parameters": {}}',
    '{"name": "f", "parameters": {"s": "\\"{[", "l": [{"b": 2}]}}',
]


@pytest.mark.parametrize("text", LLAMA3_CALLS)
def test_llama3_json_streams_the_whole_answers_calls(text):
    want_calls, want_content = parse_llama3_json(text)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    rng = random.Random(text)
    for _ in range(30):
        content, calls, entries, stream = streamed("auto", text, rng, parser="llama3_json")
        assert want and calls == want and content == "" and want_content is None
        assert [e["index"] for e in entries] == list(range(len(want)))
        assert stream.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("text", [
    "plain text, then {\"name\": \"f\", \"parameters\": {}}",  # the whole answer finds a call
    "<|python", "", "{oops} and more", '{"name": "f", "parameters": {"a": 1}',  # cut short
])
def test_llama3_json_streams_other_answers_as_content(text):
    rng = random.Random(text)
    for _ in range(10):
        content, calls, _, stream = streamed("auto", text, rng, parser="llama3_json")
        assert (content, calls) == (text, [])
        assert stream.finish_reason("stop") == "stop"
    # after calls went out: an object that is not a call and all after it are content
    text = '{"name": "f", "parameters": {}}; {"nom": 1} tail'
    content, calls, _, _ = streamed("auto", text, rng, parser="llama3_json")
    assert calls == [("f", "{}")] and content == '{"nom": 1} tail'


def test_random_hermes_answers_stream_as_the_whole_answer():
    """Answers made of content, blank text, calls with strings that hold markers and braces,
    text between calls and an unclosed last call, fed in random pieces: the same content and
    calls as the whole answer's parse (every block a call)."""
    rng = random.Random(7)
    words = ["hi", " ", "\n", "<tool", "call>", "{", "}", '"', "\\", "ü", "</tool_call", "<"]
    for _ in range(300):
        parts = []
        if rng.random() < 0.7:
            parts.append("".join(rng.choice(words) for _ in range(rng.randint(0, 5)))
                         .replace("<tool_call>", ""))
        for k in range(rng.randint(0, 3)):
            args = {"s": "".join(rng.choice(words) for _ in range(rng.randint(0, 4))),
                    "n": [k, {"x": None}]}
            parts.append(block(f"f{k}", args))
            parts.append(rng.choice(["", " ", "\n", "junk"]))
        if rng.random() < 0.3:
            parts.append(block("last", {"a": 1}, close=False))
        text = "".join(parts)
        want_calls, want_content = parse_hermes(text)
        if "<tool_call>" in text and not want_calls:
            continue  # a block that is not a call (the text the content made one)
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
        content, calls, _, stream = streamed("auto", text, rng)
        assert calls == want, text
        assert (content if content.strip() or not want else None) == want_content, text
        assert stream.finish_reason("stop") == ("tool_calls" if want else "stop")


@pytest.mark.parametrize("text", ['[get_weather(city="Rome"), get_time()]', "[f(1)]",
                                  "plain [f(a=1)]", ""])
def test_pythonic_streams_the_whole_answers_calls_at_its_end(text):
    want_calls, want_content = parse_pythonic(text)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    rng = random.Random(text)
    for _ in range(10):
        content, calls, entries, stream = streamed("auto", text, rng, parser="pythonic")
        assert calls == want and (content or None) == (want_content or None)
        assert [e["index"] for e in entries] == list(range(len(want)))
        assert stream.finish_reason("stop") == ("tool_calls" if want else "stop")
    stream = ToolCallStream("auto", parser="pythonic")
    assert stream.feed("[f(a=") == ("", [])  # a list: read whole at the end
    assert stream.feed("1)]") == ("", [])
    assert [c["function"]["name"] for c in stream.finish()[1]] == ["f"]
    stream = ToolCallStream("auto", parser="pythonic")
    assert stream.feed("hi [") == ("hi [", [])  # not a list: content as it comes


def test_random_mistral_answers_stream_as_the_whole_answer():
    """Answers of content, blank text, v11+ calls (`name[ARGS]{...}`, `name{...}`) or a pre-v11
    list or object, with strings holding markers and brackets, text after calls, fed in random
    pieces: the same content and calls as the whole answer's parse; and what is no call streams
    as content."""
    from test_tool_calls import MISTRAL, MISTRAL_MALFORMED

    rng = random.Random(11)
    words = ["hi", " ", "\n", "[TOOL", "_CALLS]", "[ARGS]", "{", "}", "[", "]", '"', "ü"]

    def args():
        return {"s": "".join(rng.choice(words) for _ in range(rng.randint(0, 4))), "n": [1]}

    texts = [text for text, _, _ in MISTRAL]
    for _ in range(300):
        parts = ["".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
                 .replace("[TOOL_CALLS]", "")] if rng.random() < 0.7 else []
        if rng.random() < 0.5:  # v11+
            for k in range(rng.randint(1, 3)):
                parts.append(rng.choice(["[TOOL_CALLS]", "[TOOL_CALLS] ", "[TOOL_CALLS]\n"]))
                parts.append(f"f{k}" + rng.choice(["[ARGS]", "", " [ARGS] "])
                             + json.dumps(args()) + rng.choice(["", " ", "junk"]))
        else:  # pre-v11
            calls = [{"name": f"f{k}", "arguments": args()} for k in range(rng.randint(1, 3))]
            parts.append("[TOOL_CALLS]" + rng.choice(["", " "]) + json.dumps(
                calls if len(calls) > 1 or rng.random() < 0.5 else calls[0]))
        texts.append("".join(parts))
    for text in texts:
        want_calls, want_content = parse_mistral(text)
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
        content, calls, entries, stream = streamed("auto", text, rng, parser="mistral")
        assert calls == want, text
        assert (content if content.strip() or not want else None) == want_content, text
        assert all(len(e["id"]) == 9 and e["id"].isalnum() for e in entries)
        assert stream.finish_reason("stop") == ("tool_calls" if want else "stop")
    for text in MISTRAL_MALFORMED[:2]:  # no call before the bad one: all content
        assert streamed("auto", text, rng, parser="mistral")[:2] == (text, [])
