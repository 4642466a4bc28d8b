"""Call an ASGI app in-process: a replica runs nanokv's OpenAI app unchanged and hands each
proxied request to it as ASGI messages, the response coming back as a stream of parts.

A proxied request is plain data (method, path, query, headers, body), so it crosses Ray's object
store; the response is `ResponseStart` then `bytes` chunks. Cancelling the consumer (the client
left, or the ingress gave up) tells the app `http.disconnect`, which aborts the engine requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class ProxiedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    # the router's key: the prompt's chained block hashes (prefix_hashes.py); empty = by load
    block_hashes: list[int] = field(default_factory=list)


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


class LifespanError(RuntimeError):
    """The app's start-up failed."""


async def start_lifespan(app) -> asyncio.Task:
    """Run the app's lifespan start-up; returns the task to hand to `stop_lifespan`."""
    inbox: asyncio.Queue = asyncio.Queue()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    inbox.put_nowait({"type": "lifespan.startup"})

    async def send(message) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete" and not started.done():
            started.set_result(None)
        elif kind == "lifespan.startup.failed" and not started.done():
            started.set_exception(LifespanError(message.get("message", "start-up failed")))

    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                   inbox.get, send))
    task.inbox = inbox  # type: ignore[attr-defined]
    await started
    return task


async def stop_lifespan(task: asyncio.Task, timeout: float = 10.0) -> None:
    task.inbox.put_nowait({"type": "lifespan.shutdown"})  # type: ignore[attr-defined]
    try:
        await asyncio.wait_for(task, timeout)
    except (TimeoutError, asyncio.CancelledError):
        task.cancel()


async def call_app(app, request: ProxiedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """The app's response to `request`: a ResponseStart, then the body's chunks."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "query_string": request.query_string,
        "root_path": "", "headers": list(request.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message) -> None:
        out.put_nowait(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            out.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                task.result()  # re-raise what the app raised
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    yield bytes(chunk)
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()  # the consumer stopped early: the app sees the client leave
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                task.cancel()
