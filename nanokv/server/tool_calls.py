"""Tool calling on chat completions (vLLM's `--enable-auto-tool-choice --tool-call-parser
hermes | llama3_json`): the request's `tools` go to the chat template, and the answer's tool calls
come back as the message's `tool_calls`.

- `tool_choice: "auto"` (the default when `tools` are given): the model decides; the parser
  reads the calls out of the answer:
  - hermes (the Qwen2.5 / Qwen3 / Hermes templates): `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>` blocks; the text before the first block is the `content`.
  - llama3_json (the Llama 3.1 / 3.2 / 3.3 JSON templates): JSON objects `{"name": ...,
    "parameters" or "arguments": {...}}` anywhere in the answer (after `<|python_tag|>`, or
    separated by `; `), as vLLM reads them; with calls the `content` is null.
  - pythonic (Llama 3.2 / 4 pythonic templates): the answer is a Python list of calls with
    keyword arguments of literal values, `[get_weather(city="Rome"), get_time()]`, as vLLM
    reads it; content null.
  - mistral (Mistral's templates): the text before the first `[TOOL_CALLS]` is the `content`;
    after a marker, v11+ tokenizers' `name[ARGS]{...}` (or `name{...}`), one call per marker,
    or pre-v11's JSON array of `{"name": ..., "arguments": {...}}` (or one such object). Call
    ids are 9 letters and digits, what Mistral's templates accept back in the history.
- `"required"`: the answer is constrained (structured outputs) to a JSON array of
  `{"name", "parameters"}`, one of the tools each, every item a call.
- a named function (`{"type": "function", "function": {"name": ...}}`): the answer is
  constrained to that function's parameters schema, and is its arguments.
- `"none"`: the tools reach the template, the answer is plain content.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from typing import Any

PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")
PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker of a tool call answer
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
MISTRAL_CALLS = "[TOOL_CALLS]"  # Mistral's marker before each call (v11+) or the call list
MISTRAL_FUNCTION = re.compile(r"[A-Za-z_][\w.\-]*")  # a v11+ call's function name
# a v11+ call's name, then [ARGS] (or nothing) before its JSON arguments
MISTRAL_NAME = re.compile(rf"\s*({MISTRAL_FUNCTION.pattern})\s*(?:\[ARGS\])?\s*(?=\{{)")
ALPHANUMERIC = string.ascii_letters + string.digits


def tool_call(name: str, arguments: str, parser: str | None = None) -> dict:
    """A response message's tool call (vLLM's id format; under the mistral parser 9 letters
    and digits, as Mistral's templates require of the ids sent back)."""
    call_id = ("".join(secrets.choice(ALPHANUMERIC) for _ in range(9)) if parser == "mistral"
               else f"chatcmpl-tool-{uuid.uuid4().hex}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


NOT_A_CALL = (ValueError, KeyError, TypeError)  # what reading a text that is no call raises


def hermes_call(block: str) -> dict:
    """The call of one hermes block's text: JSON with `name` and `arguments` (NOT_A_CALL when
    it is not one)."""
    call = json.loads(block)
    return tool_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))


def required_call(item, parser: str | None = None) -> dict:
    """The call of one item of a "required" answer's array: {"name", "parameters"}."""
    return tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False), parser)


def parse_hermes(text: str) -> tuple[list[dict], str | None]:
    """(tool calls, content) of an answer, as vLLM's hermes parser reads it: every
    `<tool_call>` block (the last one may be unclosed) holds a JSON object with `name` and
    `arguments`; the content is the text before the first block (None when empty). If any
    block is not such JSON, there are no calls and the whole text is the content."""
    if "<tool_call>" not in text:
        return [], text
    try:
        calls = [hermes_call(closed or unclosed)
                 for closed, unclosed in HERMES_CALL.findall(text)]
    except NOT_A_CALL:
        return [], text
    content = text[:text.find("<tool_call>")]
    return calls, content if content.strip() else None


def llama3_call(obj) -> dict:
    """A call of one llama3_json object: its `name` and its `arguments`, else `parameters`
    (raises KeyError / TypeError when it is no call)."""
    arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
    return tool_call(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_llama3_json(text: str) -> tuple[list[dict], str | None]:
    """(tool calls, content) of an answer, as vLLM's llama3_json parser reads it: each `{` not
    inside an object already read starts a JSON object, which must be a call; with calls the
    content is None. If any such object is not a call (or not JSON), there are no calls and
    the whole text is the content."""
    decoder, calls, end = json.JSONDecoder(), [], -1
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        if start <= end:
            continue
        try:
            obj, length = decoder.raw_decode(text[start:])
            calls.append(llama3_call(obj))
        except NOT_A_CALL:
            return [], text
        end = start + length - 1
    return (calls, None) if calls else ([], text)


PYTHONIC_LIST = re.compile(  # vLLM's pre-check: a list of name(keyword=...) calls
    r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*"
    r"([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]", re.DOTALL)
JSON_NAMES = {"null": None, "true": True, "false": False}  # some models write JSON's


def _literal(node: ast.expr):
    """A call argument's value: a Python literal (or JSON's null / true / false), as JSON."""
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in node.keys):
            raise ValueError("dict keys must be literals")
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    value = ast.literal_eval(node)
    if value is not None and not isinstance(value, (str, int, float)):
        raise ValueError("arguments must be JSON values")
    return value


def parse_pythonic(text: str) -> tuple[list[dict], str | None]:
    """(tool calls, content) of an answer, as vLLM's pythonic parser reads it: an answer that
    is a Python list of calls from its first character (`[f(a=1), g()]`, keyword arguments of
    literal values; JSON's null / true / false too), each a call; content None. Anything else,
    or a list that does not parse so, is all content, no calls."""
    if not PYTHONIC_LIST.match(text):
        return [], text
    try:
        node = ast.parse(text).body[0].value
        if not isinstance(node, ast.List) or not all(isinstance(e, ast.Call)
                                                     for e in node.elts):
            return [], text
        return [tool_call(e.func.id, json.dumps(  # a name: the pre-check's
            {k.arg: _literal(k.value) for k in e.keywords}, ensure_ascii=False))
            for e in node.elts], None
    except (SyntaxError, ValueError, TypeError, AttributeError, IndexError):
        return [], text


def mistral_listed_call(obj) -> dict:
    """A call of a pre-v11 Mistral list: {"name": a string, "arguments": an object or a JSON
    string (kept as given)} (NOT_A_CALL when it is not one)."""
    name, arguments = obj["name"], obj["arguments"]
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        raise ValueError("not a call")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return tool_call(name, arguments, "mistral")


def mistral_named_call(name: str, arguments) -> dict:
    """A v11+ Mistral call: its name and its JSON arguments, which must be an object
    (NOT_A_CALL otherwise)."""
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    return tool_call(name, json.dumps(arguments, ensure_ascii=False), "mistral")


def mistral_segment_calls(text: str) -> tuple[list[dict], int]:
    """The calls at the start of `text` (after a `[TOOL_CALLS]`, blank text skipped) and where
    they end: pre-v11's JSON array of calls (or one call object), or v11+'s `name[ARGS]{...}`
    (NOT_A_CALL when it is neither)."""
    start = len(text) - len(text.lstrip())
    decoder = json.JSONDecoder()
    if text[start:start + 1] in ("[", "{"):
        value, end = decoder.raw_decode(text, start)
        items = value if isinstance(value, list) else [value]
        return [mistral_listed_call(v) for v in items], end
    match = MISTRAL_NAME.match(text, start)
    if match is None:
        raise ValueError("not a call")
    arguments, end = decoder.raw_decode(text, match.end())
    return [mistral_named_call(match.group(1), arguments)], end


def parse_mistral(text: str) -> tuple[list[dict], str | None]:
    """(tool calls, content) of an answer, as vLLM's mistral parser reads it: the content is
    the text before the first `[TOOL_CALLS]` (None when blank); after each marker (markers with
    nothing between count once) the calls that follow it, and text after them up to the next
    marker is dropped. If a marker is followed by no call, there are no calls and the whole
    text is the content."""
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return [], text
    calls = []
    try:
        while at >= 0:
            while text.startswith(MISTRAL_CALLS, at):  # repeated markers: one
                at = len(text) - len(text[at + len(MISTRAL_CALLS):].lstrip())
            if at == len(text):
                break
            found, end = mistral_segment_calls(text[at:])
            calls += found
            at = text.find(MISTRAL_CALLS, at + end)
    except (*NOT_A_CALL, json.JSONDecodeError):
        return [], text
    if not calls:
        return [], text
    content = text[:text.find(MISTRAL_CALLS)]
    return calls, content if content.strip() else None


def parse_required(text: str, parser: str | None = None) -> list[dict]:
    """The calls of a `tool_choice: "required"` answer (a JSON array of {"name",
    "parameters"}); none when it is not one (an answer cut short by max_tokens)."""
    try:
        return [required_call(item, parser) for item in json.loads(text)]
    except NOT_A_CALL:
        return []


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict], parallel_tool_calls: bool | None) -> dict:
    """vLLM's constraint for `tool_choice: "required"`: at least one call of the tools (at
    most one with parallel_tool_calls false)."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {
        "type": "object",
        "anyOf": [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                  "parameters": _parameters(t)},
                   "required": ["name", "parameters"]} for t in tools]}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[dict], name: str) -> dict:
    """The constraint of a named tool_choice: the function's parameters."""
    return next(_parameters(t) for t in tools if t["function"]["name"] == name)


def template_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """A history message's tool calls as chat templates take them (vLLM's): each call's
    `arguments` a dict (a JSON string parsed; empty or malformed: {})."""
    out = []
    for call in tool_calls:
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except ValueError:
                arguments = {}
        function["arguments"] = arguments if isinstance(arguments, dict) else {}
        out.append({**call, "function": function})
    return out


def finish_reason(choice: str, called: bool, engine_reason: str | None) -> str | None:
    """A tool-choice answer's finish_reason (vLLM's): "tool_calls" for auto calls and for
    "required" ended by a stop, the engine's otherwise (a named function's too)."""
    if (choice == "auto" and called) or (choice == "required" and engine_reason == "stop"):
        return "tool_calls"
    return engine_reason


def answer_tool_calls(text: str, choice: str, name: str | None, parser: str = "hermes"
                      ) -> tuple[list[dict], str | None]:
    """(tool calls, content) of a chat answer under the tool choice ("auto", read by `parser`;
    "required"; or "function" with the function's name): vLLM's message fields (content ""
    when a call was forced)."""
    if choice == "auto":
        return {"llama3_json": parse_llama3_json, "pythonic": parse_pythonic,
                "mistral": parse_mistral}.get(parser, parse_hermes)(text)
    if choice == "required":
        return parse_required(text, parser), ""
    return ([tool_call(name, text, parser)] if text.strip() else []), ""
