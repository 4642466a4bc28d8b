"""Stored responses of the Responses API (`--responses-store-size N`; vLLM's
VLLM_ENABLE_RESPONSES_API_STORE, bounded): each kept response's object, the conversation a
later request continues with `previous_response_id`, and its input items. In the server's
memory only: the last N responses, the oldest dropped first (a background response still
running is never dropped)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from nanokv.server.protocol import APIError, ChatMessage, ToolCall, ToolCallFunction
from nanokv.server.responses_api import InputItem, InputMessage
from nanokv.server.responses_output import new_id


@dataclass
class StoredResponse:
    response: dict  # the response object, as GET /v1/responses/{id} returns it
    # the chat a later request continues: the earlier turns (the instructions left out, as
    # OpenAI's previous_response_id does), this response's input, then its answer once done
    conversation: list[ChatMessage]
    input_items: list[dict]  # this response's input, as GET .../input_items lists it
    task: asyncio.Task | None = field(default=None, repr=False)  # a background run's

    @property
    def id(self) -> str:
        return self.response["id"]

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def finish(self, response: dict) -> None:
        """The final object; a completed or incomplete answer joins the conversation."""
        self.response = response
        if response["status"] in ("completed", "incomplete"):
            self.conversation = self.conversation + answer_messages(response["output"])


class ResponseStore:
    """At most `capacity` responses (0: none is stored), by id; the oldest dropped first."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"the response store's size must be an integer >= 0, got "
                             f"{capacity!r}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.id] = stored
        self._items.move_to_end(stored.id)
        over = len(self._items) - self.capacity
        for rid in [rid for rid, s in self._items.items() if not s.running][:max(over, 0)]:
            del self._items[rid]

    def get(self, rid: str, param: str | None = None) -> StoredResponse:
        """The stored response `rid`, else a 404 (vLLM's message)."""
        stored = self._items.get(rid)
        if stored is None:
            why = "" if self.enabled else (" (this server stores no responses: start it "
                                           "with --responses-store-size N)")
            raise APIError(404, f"Response with id '{rid}' not found.{why}", param=param,
                           code="not_found")
        return stored

    def pop(self, rid: str) -> StoredResponse:
        stored = self.get(rid)
        del self._items[rid]
        return stored

    def running(self) -> list[StoredResponse]:
        return [s for s in self._items.values() if s.running]


def answer_messages(output: list[dict]) -> list[ChatMessage]:
    """A response's output as the chat's assistant turn: its messages' text as the content,
    its function calls as tool calls (reasoning left out, as chat history's)."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [ToolCall(id=item["call_id"], function=ToolCallFunction(
        name=item["name"], arguments=item["arguments"]))
        for item in output if item["type"] == "function_call"]
    return [ChatMessage(role="assistant", content=text, tool_calls=calls or None)]


def listed_input_items(items: list[InputItem]) -> list[dict]:
    """A request's input items as input_items lists them: each with an id and a status, a
    message's content as parts (an assistant's output_text, else input_text)."""
    listed = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        if isinstance(item, InputMessage):
            d["type"] = "message"
            if isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                d["content"] = [{"type": kind, "text": item.content}]
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}.get(d["type"],
                                                                                 "fco")
        listed.append({**d, "id": d.get("id") or new_id(prefix),
                       "status": d.get("status") or "completed"})
    return listed


def input_items_page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """OpenAI's list of a response's input items: `order` "asc" or "desc" (the default),
    `limit` of them after the item `after`."""
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order",
                       code="invalid_value")
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be in [1, 100], got {limit}", param="limit",
                       code="invalid_value")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response",
                           param="after", code="invalid_value")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(ordered)}
