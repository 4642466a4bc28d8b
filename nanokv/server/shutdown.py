"""Graceful shutdown: on SIGTERM or SIGINT the server drains instead of cutting connections.

    signal -> /health and new requests answer 503 -> in-flight requests finish, for at most
    --shutdown-timeout s -> the rest end with an OpenAI error (streams: an error event and
    [DONE]; others: a 503 body) -> uvicorn closes the connections -> the engine stops -> exit 0

A second signal stops at once. uvicorn's own handler would re-raise the signal after shutting
down (exit status -15); a drained server exits 0.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

logger = logging.getLogger("nanokv.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, api, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.api = api  # the OpenAIServer
        self.shutdown_timeout = shutdown_timeout
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:  # runs in the main thread, between bytecodes
        loop = self.api.loop
        if self._draining or self.should_exit or loop is None:  # again, or before start-up
            self.force_exit = self._draining or self.should_exit
            self.should_exit = True
            return
        self._draining = True
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        logger.warning("shutting down: draining %d in-flight requests (at most %g s)",
                       self.api.async_engine.num_in_flight, self.shutdown_timeout)
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.api.drain(self.shutdown_timeout)
            await asyncio.sleep(0.2)  # let the handlers write their error bodies
        finally:
            self.should_exit = True
