"""The Responses API's requests (`POST /v1/responses`) and its stored responses' routes
(`GET` / `DELETE /v1/responses/{id}`, `POST .../cancel`, `GET .../input_items`): a request
runs as a chat completion (`OpenAIServer.chat_prompt`), its answer made a response object
(`responses_output`); with the response store (`--responses-store-size`, `response_store`)
it is kept, continued by `previous_response_id`, and may run in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from nanokv.outputs import RequestOutput
from nanokv.server.async_engine import RequestStream
from nanokv.server.protocol import APIError, ChatMessage
from nanokv.server.response_store import (ResponseStore, StoredResponse, input_items_page,
                                          listed_input_items)
from nanokv.engine.detokenizer import TokenTexts
from nanokv.server.responses import chat_logprobs, count_reasoning
from nanokv.server.responses_api import ResponsesRequest
from nanokv.server.responses_output import ResponseShape, stream_response, whole_output
from nanokv.server.serving import ChatPrompt, ClientGone, EngineStreamingResponse, OpenAIServer


class ResponsesServing:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self.store = ResponseStore(server.settings.responses_store_size)

    # ---- POST /v1/responses --------------------------------------------------------------------
    def keeps(self, body: ResponsesRequest) -> bool:
        """Is the response stored: the server has a store and `store` is not false (OpenAI's
        default is true; without a store the request is served and not kept, as vLLM's). A
        background response must be stored (it is polled by id) and is not streamed."""
        keep = self.store.enabled and body.store is not False
        if body.background:
            if not keep:
                raise APIError(400, "background responses are polled by id: they need store "
                                    "(not false) on a server started with "
                                    "--responses-store-size N", param="background",
                               code="invalid_value")
            if body.stream:
                raise APIError(400, "a background response is not streamed: poll GET "
                                    "/v1/responses/{id}", param="stream", code="invalid_value")
        return keep

    def history(self, body: ResponsesRequest) -> list[ChatMessage]:
        """The stored conversation `previous_response_id` continues ([] without one)."""
        rid = body.previous_response_id
        if rid is None:
            return []
        if not self.store.enabled:
            raise APIError(400, "previous_response_id: this server stores no responses (start "
                                "it with --responses-store-size N); send the whole "
                                "conversation as input", param="previous_response_id",
                           code="invalid_value")
        previous = self.store.get(rid, "previous_response_id")
        if previous.status not in ("completed", "incomplete"):
            raise APIError(400, f"previous_response_id: response '{rid}' is "
                                f"{previous.status}; only a completed or incomplete response "
                                f"can be continued", param="previous_response_id",
                           code="invalid_value")
        return previous.conversation

    async def create(self, body: ResponsesRequest, raw: Request):
        server = self.server
        keep = self.keeps(body)
        chat = body.messages(self.history(body))
        prompt = await server.chat_prompt(body, raw, "responses", chat)
        shape = ResponseShape(body, server.served_name(body.model), keep)
        ids = prompt.token_ids
        requests = server.make_requests(body, ids, prompt.text, shape.id, body.max_output_tokens,
                                        max(server.max_model_len - len(ids), 1), "input",
                                        "max_output_tokens", prompt.bad_words, prompt.structured,
                                        server.priority(body, raw))
        token_texts = partial(server.token_texts, skip_special_tokens=body.skip_special_tokens)
        count = partial(count_reasoning, token_texts=token_texts, thinking=prompt.thinking) \
            if server.reasoning_parser else None
        logprobs = self._logprobs(body, ids, token_texts)
        stored = StoredResponse(
            shape.object("queued", []), chat[1:] if body.instructions is not None else chat,
            listed_input_items(body.input_list())) if keep else None
        streams = server.open_streams(requests, prompt.labels)  # last: nothing fails after

        def done(response: dict) -> None:
            if stored is not None:
                stored.finish(response)
                self.store.put(stored)

        if body.background:
            stored.task = asyncio.create_task(self._background(stored, shape, streams, prompt,
                                                               body, count, logprobs))
            self.store.put(stored)
            return stored.response
        if body.stream:
            return EngineStreamingResponse(stream_response(
                server.events(streams), shape, body, *server.answer_streams(prompt),
                (lambda out: count([out])) if count else None, done, logprobs), streams)
        try:
            finals, lps = await server.run_to_end(streams, raw)
        except ClientGone:
            return Response(status_code=499)
        response = self._whole(shape, prompt, body, finals[0], count,
                               logprobs(lps[0], True) if logprobs else [])
        done(response)
        return response

    def _logprobs(self, body: ResponsesRequest, prompt_token_ids: list[int],
                  token_texts: Callable[[list[int]], TokenTexts]
                  ) -> Callable[[list, bool], list[dict]] | None:
        """The maker of the output text's logprobs entries (chat's per-token form) from the
        answer's token logprobs, in order; None unless included, or when the reasoning is
        hidden (chat's rule: they would show it)."""
        if not body.wants_logprobs or (self.server.reasoning_parser is not None
                                       and not body.include_reasoning):
            return None
        texts = token_texts(prompt_token_ids)
        return lambda lps, final: chat_logprobs(lps, texts, final)["content"]

    def _whole(self, shape: ResponseShape, prompt: ChatPrompt, body: ResponsesRequest,
               out: RequestOutput, count, logprobs: list[dict]) -> dict:
        thought, content, calls = self.server.split_answer(prompt, out.text)
        return whole_output(shape, out, thought if body.include_reasoning else None, content,
                            calls or [], count([out]) if count else None, logprobs)

    async def _background(self, stored: StoredResponse, shape: ResponseShape,
                          streams: list[RequestStream], prompt: ChatPrompt,
                          body: ResponsesRequest, count, logprobs) -> None:
        """A background response's run: queued, in progress from its first output, then its
        answer; cancelled (`cancel`) or failed (the request timeout, the engine) on the
        way."""
        events = self.server.events(streams)
        try:
            final, lps = None, []
            async for _, out in events:
                if stored.status == "queued":
                    stored.response = shape.object("in_progress", [])
                lps += out.new_logprobs or []
                if out.finished:
                    final = out
            if final is None:
                raise APIError(503, "the engine stopped before the response was done",
                               "server_error", code="engine_unavailable")
            stored.finish(self._whole(shape, prompt, body, final, count,
                                      logprobs(lps, True) if logprobs else []))
        except asyncio.CancelledError:
            stored.finish({**stored.response, "status": "cancelled"})
        except Exception as e:  # noqa: BLE001 - the response is polled: it says so
            error = e if isinstance(e, APIError) else APIError(
                500, f"the server failed: {e!r}", "server_error", code="server_error")
            stored.finish({**stored.response, "status": "failed", "error": {
                "code": error.code or error.type, "message": error.message}})
        finally:
            await events.aclose()
            for s in streams:
                s.close()

    # ---- stored responses ----------------------------------------------------------------------
    def retrieve(self, rid: str, stream: bool = False) -> dict:
        if stream:
            raise APIError(400, "a stored response is not streamed again: GET it without "
                                "stream", param="stream", code="invalid_value")
        return self.store.get(rid).response

    async def cancel(self, rid: str) -> dict:
        """Cancel a background response (its engine request aborted; status "cancelled"); one
        already done is answered as it is."""
        stored = self.store.get(rid)
        if not stored.response.get("background"):
            raise APIError(400, f"Cannot cancel a synchronous response: '{rid}' did not run in "
                                f"the background", code="invalid_value")
        if stored.running:
            stored.task.cancel()
            await asyncio.wait([stored.task])
        return stored.response

    async def delete(self, rid: str) -> dict:
        if self.store.get(rid).running:
            await self.cancel(rid)
        self.store.pop(rid)
        return {"id": rid, "object": "response", "deleted": True}

    def input_items(self, rid: str, after: str | None, limit: int, order: str) -> dict:
        return input_items_page(self.store.get(rid).input_items, after, limit, order)

    async def close(self) -> None:
        """Cancel the background runs (the server stops)."""
        tasks = [s.task for s in self.store.running()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
