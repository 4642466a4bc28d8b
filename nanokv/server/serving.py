"""Request handling behind the HTTP routes: validation and tokenization into engine requests,
admission, reading the engine's streams under the request timeout and the client's connection,
and the server-sent-event bodies of streamed completions."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from nanokv.metrics.prometheus import PrometheusExporter
from nanokv.metrics.stats import CacheConfigInfo
from nanokv.outputs import RequestOutput
from nanokv.server.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                        RequestStream)
from nanokv.server.chat import ChatRenderer
from nanokv.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                    _SamplingRequest)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "min_tokens", "stop",
                   "stop_token_ids")


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 256
    request_timeout: float = 600.0  # seconds; the request is aborted after it
    retry_after: int = 1  # seconds, the Retry-After of a 503
    metrics_window: float = 60.0  # seconds of the sliding-window gauges
    chat_template: str | None = None  # Jinja text; None: the tokenizer's, else the fallback
    check_invariants: bool = False  # verify block accounting whenever the engine goes idle

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the served model name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout!r}")
        if not self.metrics_window > 0:
            raise ValueError(f"metrics_window must be > 0 seconds, got {self.metrics_window!r}")


class OpenAIServer:
    """Request handling: validation, tokenization, streaming; the engine runs in its thread."""

    def __init__(self, engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.max_model_len = engine.config.max_model_len
        # the engine thread detokenizes with engine.tokenizer; the event loop gets its own copy
        # (a Rust tokenizer shared across threads can fail with "Already borrowed")
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        self.chat = ChatRenderer(self.tokenizer, settings.chat_template) if self.tokenizer \
            else None
        self.exporter = PrometheusExporter(settings.model_name,
                                           CacheConfigInfo.from_engine(engine),
                                           window_s=settings.metrics_window)
        self.async_engine = AsyncLLMEngine(engine, settings.max_waiting, self.exporter.record,
                                           settings.check_invariants)
        self.created = int(time.time())

    # ---- validation ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"`{self.settings.model_name}`.", param="model",
                           code="model_not_found")

    def check_request(self, body: _SamplingRequest) -> None:
        self.check_model(body.model)
        for field, why in body.unsupported():
            raise APIError(400, why, param=field, code="unsupported_parameter")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer (--skip-tokenizer-init): "
                                "send prompts as token ids", param="prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_token_ids(self, messages, add_generation_prompt: bool) -> tuple[str, list[int]]:
        if self.chat is None:
            raise APIError(400, "chat needs a tokenizer; this server runs without one "
                                "(--skip-tokenizer-init)", param="messages")
        plain = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.chat.render(plain, add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        return text, self.encode(text, add_special_tokens=False)

    def make_request(self, body: _SamplingRequest, token_ids: list[int], text: str | None,
                     request_id: str, requested_max: int | None, default_max: int,
                     prompt_param: str, max_param: str = "max_tokens"):
        n = len(token_ids)
        if n >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens; the prompt has {n} tokens (at most "
                                f"{self.max_model_len - 1} leave room for one output token).",
                           param=prompt_param, code="context_length_exceeded")
        if requested_max is None:
            max_tokens = default_max
        else:
            if requested_max < 1:
                raise APIError(400, f"{max_param} must be at least 1, got {requested_max}",
                               param=max_param, code="invalid_value")
            if n + requested_max > self.max_model_len:
                raise APIError(400, f"This model's maximum context length is "
                                    f"{self.max_model_len} tokens. However, you requested "
                                    f"{n + requested_max} tokens ({n} in the prompt, "
                                    f"{requested_max} for the completion). Please reduce the "
                                    f"prompt or {max_param}.", param=max_param,
                               code="context_length_exceeded")
            max_tokens = requested_max
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=field if field in SAMPLING_FIELDS else None,
                           code="invalid_value") from e
        try:
            request = self.engine.make_request(token_ids, params, request_id=request_id,
                                               cache_salt=body.cache_salt)
        except ValueError as e:
            param = "cache_salt" if "cache_salt" in str(e) else prompt_param
            raise APIError(400, str(e), param=param) from e
        request.prompt = text
        return request

    def open_streams(self, requests) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(self.async_engine.open(request))
        except (QueueFullError, EngineDeadError) as e:
            for s in streams:
                s.close()
            full = isinstance(e, QueueFullError)
            if full:
                self.exporter.record_rejected()
            raise APIError(503, str(e), "server_error", code="overloaded" if full else
                           "engine_unavailable",
                           headers={"Retry-After": str(self.settings.retry_after)}) from e
        except ValueError as e:
            for s in streams:
                s.close()
            raise APIError(400, str(e)) from e
        return streams

    # ---- running -------------------------------------------------------------------------------
    async def events(self, streams: list[RequestStream]
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) of all streams as they come, under the request timeout."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the reader
                queue.put_nowait((i, e))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        deadline = time.monotonic() + self.settings.request_timeout
        open_count = len(streams)
        try:
            while open_count:
                remaining = deadline - time.monotonic()
                try:
                    i, item = await asyncio.wait_for(queue.get(), max(remaining, 0))
                except TimeoutError:
                    raise APIError(504, f"the request did not finish within the server's "
                                        f"request timeout of {self.settings.request_timeout:g} "
                                        f"s; it was aborted", "server_error",
                                   code="timeout") from None
                if item is None:
                    open_count -= 1
                elif isinstance(item, BaseException):
                    raise engine_error(item)
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()

    async def run_to_end(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
        """Final outputs of all streams; aborts them when the client disconnects."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def collect() -> None:
            events = self.events(streams)
            try:
                async for i, out in events:
                    if out.finished:
                        finals[i] = out
            finally:
                await events.aclose()

        work = asyncio.create_task(collect())
        gone = asyncio.create_task(wait_for_disconnect(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()
                return finals
            raise ClientGone()
        finally:
            gone.cancel()
            work.cancel()
            for s in streams:
                s.close()


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def engine_error(e: BaseException) -> BaseException:
    if isinstance(e, (APIError, asyncio.CancelledError)):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", code="engine_unavailable",
                        headers={"Retry-After": "1"})
    return APIError(500, f"the engine failed: {e}", "server_error", code="engine_error")


def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(o.token_ids) for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class TextDelta:
    """The part of a request's cumulative text not yet sent, holding back what may still
    change: the tail a stop string could start in, and an incomplete UTF-8 character."""

    def __init__(self, stop: list[str]) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def next(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self.holdback
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece


class EngineStreamingResponse(StreamingResponse):
    """Closes (aborts) the streams however the response ends, even if the body never starts."""

    def __init__(self, content, streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()


def _stop_list(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


async def completion_events(server: OpenAIServer, streams, head: dict,
                             body: CompletionRequest) -> AsyncIterator[str]:
    deltas = [TextDelta(_stop_list(body.stop)) for _ in streams]
    finals: list[RequestOutput] = []
    events = server.events(streams)
    try:
        async for i, out in events:
            piece = deltas[i].next(out.text, out.finished)
            new = out.new_token_ids or []
            if not piece and not out.finished and not (body.return_token_ids and new):
                continue
            if out.finished:
                finals.append(out)
            choice = {"index": i, "text": piece, "logprobs": None,
                      "finish_reason": out.finish_reason if out.finished else None,
                      "stop_reason": out.outputs[0].stop_reason if out.finished else None}
            if body.return_token_ids:
                choice["token_ids"] = list(new)
            yield sse({**head, "choices": [choice], "usage": None})
        if body.include_usage:
            yield sse({**head, "choices": [], "usage": usage(finals)})
        yield sse("[DONE]")
    except APIError as e:
        yield sse(e.body())
    finally:
        await events.aclose()


async def chat_events(server: OpenAIServer, streams, head: dict,
                       body: ChatCompletionRequest) -> AsyncIterator[str]:
    delta = TextDelta(_stop_list(body.stop))
    events = server.events(streams)
    final = None
    try:
        yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
        async for _, out in events:
            piece = delta.next(out.text, out.finished)
            new = out.new_token_ids or []
            if not piece and not out.finished and not (body.return_token_ids and new):
                continue
            if out.finished:
                final = out
            choice = {"index": 0, "delta": {"content": piece} if piece else {},
                      "logprobs": None,
                      "finish_reason": out.finish_reason if out.finished else None}
            if body.return_token_ids:
                choice["token_ids"] = list(new)
            yield sse({**head, "choices": [choice]})
        if body.include_usage and final is not None:
            yield sse({**head, "choices": [], "usage": usage([final])})
        yield sse("[DONE]")
    except APIError as e:
        yield sse(e.body())
    finally:
        await events.aclose()
