"""Structured outputs through the real server and the official `openai` client: OpenAI's
response_format (chat and completions) and vLLM's structured_outputs object."""

from __future__ import annotations

import json
import re

import httpx

from servers import MODEL_NAME

SCHEMA = {"type": "object",
          "properties": {"color": {"type": "string", "enum": ["red", "green"]},
                         "count": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["color", "count"], "additionalProperties": False}
NO_SPACES = {"structured_outputs": {"disable_any_whitespace": True}}


def test_chat_json_schema_through_the_sdk(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "a color?"}], temperature=0,
        max_tokens=60, extra_body=NO_SPACES,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    assert value["color"] in ("red", "green") and 1 <= value["count"] <= 5
    assert set(value) == {"color", "count"} and r.choices[0].finish_reason == "stop"


def test_chat_choice_and_completion_regex_through_extra_body(client):
    choices = ["alpha", "beta", "gamma"]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "pick"}], temperature=0.9,
        seed=5, n=3, max_tokens=10, extra_body={"structured_outputs": {"choice": choices}})
    assert [c.message.content in choices for c in r.choices] == [True] * 3
    assert all(c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=12,
                                  temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-[a-c]{2}"}})
    assert re.fullmatch(r"\d{3}-[a-c]{2}", r.choices[0].text)


def test_completions_accept_response_format_and_streams_are_constrained(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt="The sky is", max_tokens=60, temperature=0,
        extra_body={**NO_SPACES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert json.loads(r.choices[0].text)["color"] in ("red", "green")
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], temperature=0,
        max_tokens=10, stream=True, extra_body={"structured_outputs": {"choice": ["on", "off"]}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text in ("on", "off")


def _post(server, path, **body):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
            else {"prompt": "hi"})
    return httpx.post(server.url + path, headers=server.headers, timeout=30,
                      json={"model": MODEL_NAME, "max_tokens": 4, **base, **body})


def test_bad_constraints_are_400s_naming_the_field(server):
    cases = [
        ("/v1/chat/completions", dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}),
         "response_format", "invalid_value", "structured_outputs.json must be"),
        ("/v1/chat/completions", dict(response_format={"type": "json_schema"}),
         "response_format", "invalid_value", "json_schema"),
        ("/v1/completions", dict(response_format={"type": "xml"}), "response_format",
         "invalid_value", "'text', 'json_object' or 'json_schema'"),
        ("/v1/chat/completions", dict(structured_outputs={"grammar": "root ::= nothing"}),
         "structured_outputs", "invalid_value", "structured_outputs.grammar must be"),
        ("/v1/completions", dict(structured_outputs={"regex": "(open"}), "structured_outputs",
         "invalid_value", "structured_outputs.regex must be"),
        ("/v1/completions", dict(structured_outputs={"regex": "a", "choice": ["a"]}),
         "structured_outputs", "invalid_value", "exactly one"),
        ("/v1/completions", dict(structured_outputs={"choices": ["a"]}), "structured_outputs",
         "invalid_value", "unknown field 'choices'"),
        ("/v1/chat/completions", dict(structured_outputs={"structural_tag": "{}"}),
         "structured_outputs", "unsupported_parameter", "structural tags"),
        ("/v1/chat/completions", dict(structured_outputs={"choice": ["a"]},
                                      response_format={"type": "json_object"}),
         "response_format", "invalid_value", "exactly one"),
        ("/v1/completions", dict(guided_json=SCHEMA), "guided_json", "unsupported_parameter",
         "structured_outputs"),
    ]
    for path, body, param, code, fragment in cases:
        r = _post(server, path, **body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (param, code), (body, err)
        assert fragment in err["message"], (body, err)
    r = _post(server, "/v1/chat/completions", temperature=0,
              response_format={"type": "json_object"}, structured_outputs={
                  "disable_any_whitespace": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")
    r = _post(server, "/v1/chat/completions", response_format={"type": "text"})
    assert r.status_code == 200, r.text
