"""The Responses API's answers (`responses_api`): the response object and its output items
(`reasoning`, `message` of `output_text`, `function_call`), whole or as the stream of Responses
events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from nanokv.outputs import RequestOutput
from nanokv.server.protocol import APIError
from nanokv.server.reasoning import ReasoningStream
from nanokv.server.responses import AnswerSplit, TextDelta
from nanokv.server.responses_api import ResponsesRequest
from nanokv.server.tool_stream import ToolCallStream


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: list[dict] = ()) -> dict:
    """An output_text part; `logprobs`: its tokens' entries (include
    "message.output_text.logprobs"), else none."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def message_item(item_id: str, text: str | None, status: str,
                 logprobs: list[dict] = ()) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)] if text is not None else []}


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

    def __init__(self, body: ResponsesRequest, model: str, store: bool = False) -> None:
        self.id, self.created_at = new_id("resp"), int(time.time())
        self.body, self.model, self.store = body, model, store

    def object(self, status: str, output: list[dict], out: RequestOutput | None = None,
               reasoning_tokens: int | None = None) -> dict:
        """The response object at `status` ("in_progress", or `status_of` its answer)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "model": self.model, "status": status, "error": None,
                "incomplete_details": incomplete, "output": output,
                "usage": response_usage(out, reasoning_tokens), **self.body.echoed(self.store)}


def status_of(out: RequestOutput) -> str:
    """vLLM's: "incomplete" when max_output_tokens cut the answer, "cancelled" when it was
    aborted, else "completed"."""
    return {"length": "incomplete", "abort": "cancelled"}.get(out.finish_reason, "completed")


def function_call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    """A function call (a chat tool call's `id`, `function.name` and `arguments`)."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def whole_output(shape: ResponseShape, out: RequestOutput, thought: str | None,
                 content: str | None, calls: list[dict], reasoning_tokens: int | None,
                 logprobs: list[dict] = ()) -> dict:
    """A non-streamed response: a reasoning item (`thought` None: none), a message item (its
    content, with the output's token `logprobs`; none where calls came without content), the
    function calls."""
    status = status_of(out)
    output = [reasoning_item(new_id("rs"), thought)] if thought is not None else []
    if content or not calls:
        output.append(message_item(new_id("msg"), content or "", status, logprobs))
    output += [function_call_item(new_id("fc"), call) for call in calls]
    return shape.object(status, output, out, reasoning_tokens)


def event(kind: str, sequence: int, **fields) -> str:
    """One server-sent Responses event (vLLM's and OpenAI's form: the type as the event name
    and in the data)."""
    data = json.dumps({"type": kind, "sequence_number": sequence, **fields},
                      separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


class OutputEvents:
    """The events of a streamed response's output items, one item open at a time: text goes
    to the open item of its kind (another kind closes it and opens one), a function call opens
    its own item (a named function's later arguments go to it)."""

    def __init__(self) -> None:
        self.seq = iter(range(1 << 62))
        self.items: list[dict] = []
        self.kinds: list[str] = []  # "reasoning", "message" or "function_call"
        self.texts: list[str] = []  # each item's text (a function call's arguments)
        self.logprobs: list[dict] = []  # the message's token entries sent so far
        self.is_open = False

    def next_seq(self) -> int:
        return next(self.seq)

    def open_item(self, kind: str, call: dict | None = None) -> list[str]:
        i = len(self.items)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            item, part = message_item(new_id("msg"), None, "in_progress"), text_part("")
        else:
            item = function_call_item(new_id("fc"), {**call, "function": {
                **call["function"], "arguments": ""}}, "in_progress")
            part = None
        self.items.append(item)
        self.kinds.append(kind)
        self.texts.append("")
        self.is_open = True
        out = [event("response.output_item.added", self.next_seq(), output_index=i, item=item)]
        if part is not None:
            out.append(event("response.content_part.added", self.next_seq(),
                             item_id=item["id"], output_index=i, content_index=0, part=part))
        return out

    def close(self, status: str = "completed") -> list[str]:
        if not self.is_open:
            return []
        self.is_open = False
        i, item, text = len(self.items) - 1, self.items[-1], self.texts[-1]
        kind, at = self.kinds[-1], dict(item_id=item["id"], output_index=i)
        if kind == "function_call":
            self.items[i] = {**item, "arguments": text, "status": "completed"}
            return [event("response.function_call_arguments.done", self.next_seq(), **at,
                          name=item["name"], arguments=text),
                    event("response.output_item.done", self.next_seq(), output_index=i,
                          item=self.items[i])]
        if kind == "reasoning":
            self.items[i] = reasoning_item(item["id"], text)
            part = {"type": "reasoning_text", "text": text}
            done = [event("response.reasoning_text.done", self.next_seq(), **at,
                          content_index=0, text=text)]
        else:
            self.items[i] = message_item(item["id"], text, status, self.logprobs)
            part = text_part(text, self.logprobs)
            done = [event("response.output_text.done", self.next_seq(), **at, content_index=0,
                          text=text, logprobs=self.logprobs)]
        return done + [event("response.content_part.done", self.next_seq(), **at,
                             content_index=0, part=part),
                       event("response.output_item.done", self.next_seq(), output_index=i,
                             item=self.items[i])]

    def text(self, kind: str, text: str, logprobs: list[dict] = ()) -> list[str]:
        """Text of an item of `kind`; a message's delta carries `logprobs` (its tokens')."""
        if not text:
            return []
        out = []
        if not (self.is_open and self.kinds[-1] == kind):
            out += self.close() + self.open_item(kind)
        i = len(self.items) - 1
        self.texts[i] += text
        name, extra = ("response.reasoning_text.delta", {}) if kind == "reasoning" else (
            "response.output_text.delta", {"logprobs": list(logprobs)})
        if kind == "message":
            self.logprobs += logprobs
        out.append(event(name, self.next_seq(), item_id=self.items[i]["id"], output_index=i,
                         content_index=0, delta=text, **extra))
        return out

    def call(self, entry: dict) -> list[str]:
        """A `ToolCallStream` entry: a call (with its id) opens its item, a named function's
        later arguments go to the open one."""
        out = []
        if "id" in entry:
            out += self.close() + self.open_item("function_call", entry)
        arguments = entry["function"].get("arguments", "")
        if arguments:
            i = len(self.items) - 1
            self.texts[i] += arguments
            out.append(event("response.function_call_arguments.delta", self.next_seq(),
                             item_id=self.items[i]["id"], output_index=i, delta=arguments))
        return out


async def stream_response(events: AsyncIterator[tuple[int, RequestOutput]], shape: ResponseShape,
                          body: ResponsesRequest,
                          reasoning: Callable[[], ReasoningStream] | None,
                          tool_calls: Callable[[], ToolCallStream] | None,
                          count_reasoning: Callable[[RequestOutput], int] | None,
                          on_done: Callable[[dict], None] | None = None,
                          logprobs: Callable[[list, bool], list[dict]] | None = None
                          ) -> AsyncIterator[str]:
    """The Responses events of one answer: created, in_progress; the output items as their
    text comes (`OutputEvents`): a reasoning item's `response.reasoning_text.delta`s (with a
    reasoning parser, unless include_reasoning is false), a message item's
    `response.output_text.delta`s, each function call's item (`tool_calls`: the chat stream's
    extraction) with its `response.function_call_arguments.delta`s; then completed, the
    response with its status and usage, handed to `on_done` first (the store keeps it).
    `logprobs(token logprobs, final)`: the entries of the output's tokens, each message delta
    carrying those of the tokens since the last one (every output token's, reasoning included,
    goes to the message's text, as vLLM's). An error ends the stream with an `error` event."""
    split = AnswerSplit(reasoning() if reasoning else None, tool_calls() if tool_calls else None)
    delta = TextDelta(body.stop_list(), body.include_stop_str_in_output)
    items = OutputEvents()
    try:
        in_progress = shape.object("in_progress", [])
        yield event("response.created", items.next_seq(), response=in_progress)
        yield event("response.in_progress", items.next_seq(), response=in_progress)
        final, pending = None, []
        async for _, out in events:
            if logprobs is not None:
                pending += logprobs(out.new_logprobs or [], out.finished)
            thought, content, entries = split.feed(delta.next(out.text, out.finished),
                                                   out.finished)
            chunks = items.text("reasoning", thought) if body.include_reasoning else []
            chunks += items.text("message", content, pending)
            if content:
                pending = []
            for entry in entries:
                chunks += items.call(entry)
            for chunk in chunks:
                yield chunk
            if out.finished:
                final = out
        if final is None:  # the events ended without an answer (the engine went away)
            return
        status = status_of(final)
        if "message" not in items.kinds and "function_call" not in items.kinds:
            for chunk in items.close() + items.open_item("message"):  # an empty answer's message
                yield chunk
        items.logprobs += pending  # tokens that added no text (a stop token's) to an open message
        for chunk in items.close(status):
            yield chunk
        response = shape.object(status, items.items, final,
                                count_reasoning(final) if count_reasoning else None)
        if on_done is not None:
            on_done(response)
        # vLLM's: response.completed whatever the status (the SDK's stream helper waits for it)
        yield event("response.completed", items.next_seq(), response=response)
    except APIError as e:
        err = e.body()["error"]
        yield event("error", items.next_seq(), code=err.get("code"), message=err.get("message"),
                    param=err.get("param"))
    finally:
        await events.aclose()
