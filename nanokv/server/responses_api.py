"""OpenAI's Responses API (`POST /v1/responses`, vLLM's too), for text: the request's `input`
(a string, or message items) and `instructions` become a chat, run as a chat completion is
(sampling fields, structured outputs from `text.format`, the reasoning split under
--reasoning-parser), and the answer comes back as a response object: a `reasoning` item (with a
reasoning parser) and a `message` item of `output_text`; streamed as the Responses events
(`response.created` ... `response.output_text.delta` ... `response.completed`).

Refused (400 naming the field): tools and tool choices other than none / auto without tools,
`previous_response_id` and `conversation` (nothing is stored: `store` is accepted and
ignored), `background`, `include`, `prompt` templates, `top_logprobs`, `truncation: "auto"`,
input items other than messages and reasoning (function calls and their outputs, files,
images), and the chat fields the Responses API does not have (`n`, `max_tokens`,
`response_format`: use `text.format`). An earlier answer's reasoning items sent back in `input`
are accepted and not shown to the model (as chat history's reasoning)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, Literal

from nanokv.outputs import RequestOutput
from nanokv.server.protocol import (JSON_SCHEMA_FORMAT_KEYS, APIError, ChatMessage,
                                    _SamplingRequest, _Strict)
from nanokv.server.reasoning import ReasoningStream
from nanokv.server.responses import TextDelta

INPUT_TEXT_TYPES = ("input_text", "output_text", "text")


class InputTextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # an earlier answer's (output_text)
    logprobs: list[dict[str, Any]] | None = None


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]
    id: str | None = None  # an earlier answer's item, sent back
    status: str | None = None

    def chat_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)
        return ChatMessage(role=self.role, content=text)


class InputReasoning(_Strict):
    """An earlier answer's reasoning item, sent back with its output: not shown to the model
    (as chat history's reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class ResponsesRequest(_SamplingRequest):
    input: str | list[InputMessage | InputReasoning]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" |
    #                                      "json_schema", ...}, "verbosity": ...}
    reasoning: dict[str, Any] | None = None  # effort / summary: accepted, nothing reads them
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM extensions
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        for name, why in (("n", "one answer per response"), ("max_tokens", "use "
                          "max_output_tokens"), ("response_format", "use text.format"),
                          ("stream_options", "not a Responses field"),
                          ("prompt_logprobs", "logprobs are not returned")):
            value = getattr(self, name)
            if value is not None and not (name == "n" and value == 1):
                bad.append((name, f"{name} is not a Responses API field: {why}"))
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            bad.append(("tools", "tool calling is not supported on /v1/responses (it is on "
                                 "/v1/chat/completions)"))
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                bad.append((name, f"{name}: no response is stored; send the whole "
                                  f"conversation as `input`"))
        if self.background:
            bad.append(("background", "background responses are not supported"))
        if self.include:
            bad.append(("include", "include is not supported"))
        if self.prompt is not None:
            bad.append(("prompt", "prompt templates are not supported"))
        if self.top_logprobs:
            bad.append(("top_logprobs", "logprobs are not supported on /v1/responses"))
        if self.truncation == "auto":
            bad.append(("truncation", "truncation \"auto\" is not supported: the input must fit"))
        return bad

    def messages(self) -> list[ChatMessage]:
        """The chat: the instructions as a system message, then the input's messages."""
        items = [InputMessage(role="user", content=self.input)] if isinstance(
            self.input, str) else self.input
        chat = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions is not None else []
        chat += [item.chat_message() for item in items if isinstance(item, InputMessage)]
        if not chat:
            raise APIError(400, "input holds no message", param="input", code="invalid_value")
        return chat

    FORMAT_PARAM: ClassVar[str] = "text"

    def _format_given(self) -> bool:
        return (self.text or {}).get("format") is not None

    def _response_format_constraint(self) -> dict[str, Any]:
        """text.format as structured_outputs fields ({} for type text): set over
        structured_outputs' (its disable_any_whitespace applies), as chat's response_format."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return {}
        if not isinstance(fmt, dict):
            raise APIError(400, "text.format must be an object with a type", param="text",
                           code="invalid_value")
        kind = fmt.get("type")
        if kind == "text":
            return {}
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise APIError(400, "text.format type 'json_schema' needs a schema: {\"type\": "
                                    "\"json_schema\", \"name\": ..., \"schema\": {a JSON schema "
                                    "object}, \"strict\": ...}", param="text",
                               code="invalid_value")
            unknown = [k for k in fmt if k not in ("type", *JSON_SCHEMA_FORMAT_KEYS)]
            if unknown:
                raise APIError(400, f"text.format has unknown fields {unknown}; allowed: type, "
                                    f"{', '.join(JSON_SCHEMA_FORMAT_KEYS)}", param="text",
                               code="invalid_value")
            return {"json": fmt["schema"]}
        raise APIError(400, f"text.format type must be 'text', 'json_object' or 'json_schema', "
                            f"got {kind!r}", param="text", code="invalid_value")

    @property
    def num_logprobs(self) -> None:
        return None

    def echoed(self) -> dict:
        """The request's fields a response object repeats."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "parallel_tool_calls": True if self.parallel_tool_calls is None
                else self.parallel_tool_calls,
                "tool_choice": self.tool_choice or "auto", "tools": [],
                "text": self.text or {"format": {"type": "text"}},
                "reasoning": self.reasoning, "metadata": self.metadata or {},
                "previous_response_id": None, "store": False, "truncation": "disabled",
                "user": self.user, "background": False, "service_tier": "auto"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if text is not None else []}


def reasoning_item(item_id: str, text: str | None) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text is not None else [],
            "status": "completed"}


def response_usage(out: RequestOutput | None, reasoning_tokens: int | None) -> dict | None:
    if out is None:
        return None
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens or 0},
            "total_tokens": prompt + completion}


class ResponseShape:
    """One response's fixed fields and its object at a status."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id, self.created_at = new_id("resp"), int(time.time())
        self.body, self.model = body, model

    def object(self, status: str, output: list[dict], out: RequestOutput | None = None,
               reasoning_tokens: int | None = None) -> dict:
        """The response object at `status` ("in_progress", or `status_of` its answer)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "model": self.model, "status": status, "error": None,
                "incomplete_details": incomplete, "output": output,
                "usage": response_usage(out, reasoning_tokens), **self.body.echoed()}


def status_of(out: RequestOutput) -> str:
    """vLLM's: "incomplete" when max_output_tokens cut the answer, "cancelled" when it was
    aborted, else "completed"."""
    return {"length": "incomplete", "abort": "cancelled"}.get(out.finish_reason, "completed")


def whole_output(shape: ResponseShape, out: RequestOutput, reasoning: tuple | None,
                 reasoning_tokens: int | None) -> dict:
    """A non-streamed response: `reasoning` (the split's (reasoning, content), None without a
    reasoning parser; reasoning None when hidden or empty)."""
    thought, content = reasoning if reasoning is not None else (None, out.text)
    status = status_of(out)
    output = [reasoning_item(new_id("rs"), thought)] if thought is not None else []
    output.append(message_item(new_id("msg"), content or "", status))
    return shape.object(status, output, out, reasoning_tokens)


def event(kind: str, sequence: int, **fields) -> str:
    """One server-sent Responses event (vLLM's and OpenAI's form: the type as the event name
    and in the data)."""
    data = json.dumps({"type": kind, "sequence_number": sequence, **fields},
                      separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


async def stream_response(events: AsyncIterator[tuple[int, RequestOutput]], shape: ResponseShape,
                          body: ResponsesRequest,
                          reasoning: Callable[[], ReasoningStream] | None,
                          count_reasoning: Callable[[RequestOutput], int] | None
                          ) -> AsyncIterator[str]:
    """The Responses events of one answer: created, in_progress; a reasoning item with its
    `response.reasoning_text.delta`s (with a reasoning parser, unless include_reasoning is
    false) then a message item with its `response.output_text.delta`s, each opened at its
    first text and closed (`.done` events) before the next; completed, the response with its
    status and usage. An error ends the stream with an `error` event."""
    seq = iter(range(1 << 62))
    split = reasoning() if reasoning else None
    delta = TextDelta(body.stop_list(), body.include_stop_str_in_output)
    items: list[dict] = []  # the output items so far
    texts: list[str] = []  # each item's text
    kinds: list[str] = []  # each item's kind: "reasoning" or "message"

    def open_item(kind: str) -> list[str]:
        item_id = new_id("rs" if kind == "reasoning" else "msg")
        item = {"type": "reasoning", "id": item_id, "summary": [], "content": [],
                "status": "in_progress"} if kind == "reasoning" \
            else message_item(item_id, None, "in_progress")
        items.append(item)
        texts.append("")
        kinds.append(kind)
        i = len(items) - 1
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
        return [event("response.output_item.added", next(seq), output_index=i, item=item),
                event("response.content_part.added", next(seq), item_id=item_id,
                      output_index=i, content_index=0, part=part)]

    def close_item(status: str) -> list[str]:
        i, item = len(items) - 1, items[-1]
        text = texts[i]
        if kinds[i] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            done = [event("response.reasoning_text.done", next(seq), item_id=item["id"],
                          output_index=i, content_index=0, text=text)]
            items[i] = {**reasoning_item(item["id"], text)}
        else:
            part = text_part(text)
            done = [event("response.output_text.done", next(seq), item_id=item["id"],
                          output_index=i, content_index=0, text=text, logprobs=[])]
            items[i] = message_item(item["id"], text, status)
        return done + [event("response.content_part.done", next(seq), item_id=item["id"],
                             output_index=i, content_index=0, part=part),
                       event("response.output_item.done", next(seq), output_index=i,
                             item=items[i])]

    def add_text(kind: str, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if not kinds or kinds[-1] != kind:
            if kinds:
                out += close_item("completed")
            out += open_item(kind)
        i = len(items) - 1
        texts[i] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(event(name, next(seq), item_id=items[i]["id"], output_index=i,
                         content_index=0, delta=text, **extra))
        return out

    try:
        yield event("response.created", next(seq), response=shape.object("in_progress", []))
        yield event("response.in_progress", next(seq), response=shape.object("in_progress", []))
        final = None
        async for _, out in events:
            piece = delta.next(out.text, out.finished)
            thought, content = ("", piece) if split is None else split.feed(piece)
            if out.finished and split is not None:
                more_thought, more_content = split.finish()
                thought, content = thought + more_thought, content + more_content
            for chunk in (add_text("reasoning", thought) if body.include_reasoning else []) \
                    + add_text("message", content):
                yield chunk
            if out.finished:
                final = out
        if final is None:  # the events ended without an answer (the engine went away)
            return
        status = status_of(final)
        if not kinds or kinds[-1] != "message":  # an answer with no content: an empty message
            if kinds:
                for chunk in close_item("completed"):
                    yield chunk
            for chunk in open_item("message"):
                yield chunk
        for chunk in close_item(status):
            yield chunk
        # vLLM's: response.completed whatever the status (the SDK's stream helper waits for it)
        yield event("response.completed", next(seq), response=shape.object(
            status, items, final, count_reasoning(final) if count_reasoning else None))
    except APIError as e:
        err = e.body()["error"]
        yield event("error", next(seq), code=err.get("code"), message=err.get("message"),
                    param=err.get("param"))
    finally:
        await events.aclose()
