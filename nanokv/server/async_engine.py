"""The engine behind the server: ONE background thread owns the LLMEngine and steps it while
requests are in flight; asyncio code submits requests and reads each one's outputs from its own
queue.

    event loop (any number of requests)           engine thread (the only user of LLMEngine)
    stream = engine.open(request) -- commands -->  add_prepared / abort, between two steps
    async for out in stream  <-- call_soon_threadsafe --  step() outputs

All add/abort go through the command list, so LLMEngine stays single-threaded. The idle thread
blocks on a condition variable. Leaving a stream before its request finished (client gone,
timeout, error) aborts the request: its blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from nanokv.metrics.stats import FinishedRequestStats, IterationStats, SchedulerDeltas
from nanokv.outputs import RequestOutput
from nanokv.request import Request

logger = logging.getLogger("nanokv.server")


class QueueFullError(RuntimeError):
    """Admission refused: the engine already holds max_num_seqs + max_waiting requests."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed)."""


class RequestStream:
    """Outputs of one request, in order; an async iterator and an async context manager.

    When the reader lags, pending outputs are merged into one (the latest cumulative text, the
    new token ids joined). Leaving the `async with` block before the request finished aborts it.
    """

    def __init__(self, engine: AsyncLLMEngine, request: Request,
                 loop: asyncio.AbstractEventLoop,
                 request_class: tuple[str, str] = ("", "")) -> None:
        self.engine = engine
        self.request = request
        self.request_class = request_class  # (endpoint, class) labels of its cache counters
        self.request_id = request.request_id
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False  # the reader saw the final output (or an error)
        # engine-thread bookkeeping
        self.added = False
        self.num_tokens_seen = 0
        self.last_token_time: float | None = None

    # engine thread -> event loop
    def _put(self, item: RequestOutput | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        outputs = []
        for item in items:
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            outputs.append(item)
        out = outputs[-1]
        if len(outputs) > 1:
            new = [t for o in outputs for t in (o.new_token_ids or [])]
            lps = [lp for o in outputs for lp in (o.new_logprobs or [])]
            out = dataclasses.replace(out, new_token_ids=new, new_logprobs=lps or None)
        if out.finished:
            self.finished = True
        return out

    async def final(self) -> RequestOutput:
        """Read to the end; return the final output."""
        out = None
        async for out in self:  # noqa: B007 - keep the last item
            pass
        if out is None:
            raise EngineDeadError("the request ended without an output")
        return out

    def close(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncLLMEngine:
    def __init__(self, engine, max_waiting: int = 256,
                 on_stats: Callable[[IterationStats], None] | None = None,
                 check_invariants: bool = False, trace=None) -> None:
        """trace: a `nanokv.sim.trace.TraceWriter` recording every finished request (and,
        with a step log, every step: the loop reports each turn's start and end to it)."""
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_in_flight = engine.config.max_num_seqs + max_waiting
        self.on_stats = on_stats
        self.check_invariants = check_invariants
        self.trace = trace
        if trace is not None:
            trace.attach(engine)
        # what one block really costs (a quantized KV cache: codes, scales, outliers, positions)
        self.bytes_per_block = engine.kv_bytes_per_block
        self._cond = threading.Condition()
        self._commands: list[tuple[str, object]] = []
        self._streams: dict[str, RequestStream] = {}  # every request not yet finished
        # engine thread: streams whose prefix-cache lookup is not yet counted by class
        self._uncounted: dict[str, RequestStream] = {}
        self._stopping = False
        self._deltas = SchedulerDeltas()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the loop died, if it did
        self.num_steps = 0

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="nanokv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.error is None)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- event-loop side -----------------------------------------------------------------------
    def open(self, request: Request,
             request_class: tuple[str, str] = ("", "")) -> RequestStream:
        """Queue a validated request (from LLMEngine.make_request) and return its stream.

        request_class: the (endpoint, class) labels its prefix-cache lookup is counted under.
        Raises QueueFullError when max_num_seqs + max_waiting requests are already in flight,
        EngineDeadError when the loop is not running. Must be called on the event loop.
        """
        return self.open_all([request], request_class)[0]

    def open_all(self, requests: list[Request],
                 request_class: tuple[str, str] = ("", "")) -> list[RequestStream]:
        """`open` for the requests of one API call (n choices, several prompts): all queued, or
        none (the same errors, raised before any is queued: a refused call leaves nothing to
        abort and counts once)."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, r, loop, request_class) for r in requests]
        with self._cond:
            if not self.is_running:
                raise EngineDeadError(self.dead_reason())
            if len(self._streams) + len(streams) > self.max_in_flight:
                raise QueueFullError(
                    f"the server is at capacity: {len(self._streams)} requests in flight "
                    f"(max_num_seqs {self.engine.config.max_num_seqs} + max_waiting "
                    f"{self.max_waiting}), this one needs {len(streams)} more; retry later")
            ids = [r.request_id for r in requests]
            taken = [i for i in ids if i in self._streams]
            if taken or len(set(ids)) < len(ids):
                raise ValueError(f"request id {(taken or ids)[0]!r} is already in use")
            for stream in streams:
                self._streams[stream.request_id] = stream
                self._commands.append(("add", stream))
            self._cond.notify()
        return streams

    def abort(self, request_id: str) -> None:
        with self._cond:
            if request_id in self._streams and not self._stopping:
                self._commands.append(("abort", request_id))
                self._cond.notify()

    def abort_all(self, error: BaseException) -> None:
        """End every request in flight: its reader gets `error`, the engine aborts it."""
        with self._cond:
            streams = list(self._streams.values())
            self._commands += [("abort", s.request_id) for s in streams]
            self._cond.notify()
        for stream in streams:
            stream._put(error)

    def dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine loop died: {self.error!r}"
        return "the engine is not running (shutting down or not started)"

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # a bug: fail every request, report unhealthy
            logger.exception("engine loop crashed")
            self.error = e
        finally:
            with self._cond:
                streams = list(self._streams.values())
                self._streams.clear()
                self._commands.clear()
            reason = EngineDeadError(self.dead_reason())
            for stream in streams:
                stream._put(reason)
                if stream.added:
                    try:
                        self.engine.abort(stream.request_id)
                    except Exception:  # the engine is broken already; the request has failed
                        logger.exception("abort after the loop stopped failed")

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._commands and not self._stopping and \
                        not engine.has_unfinished_requests():
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            if self.trace is not None:
                self.trace.begin_turn()
            it = IterationStats(time=0.0)
            for kind, arg in commands:
                if kind == "add":
                    self._add(arg, it)
                else:
                    out = engine.abort(arg)
                    if out is not None:
                        self._deliver(out, it)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:  # the engine freed the step's requests: fail them
                    logger.exception("engine step failed")
                    self._fail_dropped(e, it)
                    outputs = []
                self.num_steps += 1
                for out in outputs:
                    self._deliver(out, it)
            self._record(it)
            if self.trace is not None:
                self.trace.end_turn(engine.has_unfinished_requests())
            if self.check_invariants and not engine.has_unfinished_requests():
                engine.check_invariants()

    def _add(self, stream: RequestStream, it: IterationStats) -> None:
        with self._cond:
            if stream.request_id not in self._streams:  # aborted before it was added
                return
        try:
            self.engine.add_prepared(stream.request)
        except Exception as e:
            with self._cond:
                self._streams.pop(stream.request_id, None)
            stream._put(e if isinstance(e, ValueError) else RuntimeError(str(e)))
            return
        stream.added = True
        if self.engine.block_manager.enable_prefix_caching:  # else nothing is looked up
            self._uncounted[stream.request_id] = stream
        if self.trace is not None:
            self.trace.admitted(stream.request)

    def _deliver(self, out: RequestOutput, it: IterationStats) -> None:
        with self._cond:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                del self._streams[out.request_id]
        if stream is None:
            return
        new = out.new_token_ids or []
        if new:
            m = out.metrics
            now = m.last_token_time or time.monotonic()
            if stream.num_tokens_seen == 0:
                it.prompt_tokens += len(out.prompt_token_ids)
                if m.ttft is not None:
                    it.ttfts_s.append(m.ttft)
                gaps = len(new) - 1
            else:
                gaps = len(new)
            if gaps and stream.last_token_time is not None:
                it.itls_s.extend([(now - stream.last_token_time) / gaps] * gaps)
            stream.last_token_time = now
            stream.num_tokens_seen += len(new)
            it.generation_tokens += len(new)
        if out.finished:
            request = stream.request
            end = out.metrics.finished_time or time.monotonic()
            it.finished.append(FinishedRequestStats.of(
                out.finish_reason or "abort", len(out.prompt_token_ids), len(out.token_ids),
                out.metrics, end, request.peak_blocks * self.bytes_per_block,
                out.num_cached_tokens, request.params.max_tokens, request.num_preemptions))
            if self.trace is not None:
                self.trace.record(request, "/".join(stream.request_class))
        if out.error is not None:  # the engine aborted it (a KV policy failed on it)
            stream._put(RuntimeError(f"the engine failed while running this request: "
                                     f"{out.error}"))
            return
        stream._put(out)

    def _fail_dropped(self, error: Exception, it: IterationStats) -> None:
        live = self.engine.scheduler.requests
        with self._cond:
            dropped = [s for rid, s in self._streams.items() if s.added and rid not in live]
            for s in dropped:
                del self._streams[s.request_id]
        for s in dropped:
            it.finished.append(FinishedRequestStats(
                "abort", len(s.request.prompt_token_ids), s.num_tokens_seen, 0.0,
                s.request.peak_blocks * self.bytes_per_block,
                max_tokens=s.request.params.max_tokens,
                num_preemptions=s.request.num_preemptions))
            s._put(RuntimeError(f"the engine failed while running this request: {error}"))

    def _count_lookups(self, it: IterationStats) -> None:
        """Prefix-cache lookups by request class, in the turn the scheduler counts them (a
        request's first admission), so the labelled counters add up to the scheduler's."""
        for rid, stream in list(self._uncounted.items()):
            request = stream.request
            if request.num_cached_tokens >= 0:
                queries, hits = it.prefix_cache_by_class.get(stream.request_class, (0, 0))
                it.prefix_cache_by_class[stream.request_class] = (
                    queries + request.num_prompt_tokens, hits + request.num_cached_tokens)
                del self._uncounted[rid]
            elif request.is_finished:  # aborted while waiting: never looked up
                del self._uncounted[rid]

    def _record(self, it: IterationStats) -> None:
        bm = self.engine.block_manager
        self._deltas.fill(self.engine.stats(), it)
        self._count_lookups(it)
        lifetimes = bm.stats.evicted_block_lifetimes
        if lifetimes:
            it.block_lifetimes_s = list(lifetimes)
            lifetimes.clear()
        it.time = time.monotonic()
        if self.on_stats is not None:
            try:
                self.on_stats(it)
            except Exception:
                logger.exception("recording metrics failed")
