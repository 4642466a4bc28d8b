"""The Ray Serve application: N engine replicas behind one ingress.

    client --HTTP--> Serve proxy --> Ingress --handle, PrefixAffinityRouter--> EngineReplica x N

EngineReplica runs one LLMEngine and nanokv's OpenAI app (nanokv/server, unchanged): each
proxied request goes to the app in-process (asgi.py), so every route, error, limit and metric
of `nanokv serve` applies per replica. It reports the block hashes its prefix cache holds
(`record_routing_stats`) and serves its own Prometheus `/metrics` on `metrics_port + rank`.

Ingress tokenizes each completions / chat prompt the way the server does, computes its block
hashes with the replicas' HashSpec, and forwards the request with them. A replica that dies
before a response has started is retried on another (`max_attempts` in all); a stream that
breaks mid-way ends with an OpenAI error event and `[DONE]`.
"""

# no `from __future__ import annotations`: serve.ingress needs real annotations (Request)

import asyncio
import json
import logging
import os
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from nanokv.replicas.asgi import ProxiedRequest, ResponseStart, call_app, start_lifespan
from nanokv.replicas.drain import HEALTH_PERIOD_S
from nanokv.replicas.prefix_hashes import (HashSpec, PromptTokenizer, body_lora_id,
                                           prompt_block_hashes)
from nanokv.replicas.router import CACHED_HASHES_KEY
from nanokv.server.protocol import error_body
from nanokv.server.serving import ServerSettings

logger = logging.getLogger("nanokv.replicas")

ROUTERS = ("affinity", "pow2")  # pow2: Ray Serve's default power-of-two-choices router
MAX_REPORTED_HASHES = 1 << 17  # cached block hashes one routing-stats report carries at most
HASHED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
REPLICA_DIED = (RayActorError, ActorUnavailableError)


class EngineReplica:
    """One engine and its OpenAI app (a Serve deployment class; see build_replica_app)."""

    def __init__(self, model: str, engine_kwargs: dict, settings: ServerSettings,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 drain_signal: str | None = None) -> None:
        from nanokv.config import EngineConfig
        from nanokv.engine.llm_engine import LLMEngine
        from nanokv.server.openai_api import build_app

        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_kwargs))
        self.app = build_app(self.engine, settings)
        self.server = self.app.state.server
        self.hash_spec_value = HashSpec.from_engine(self.engine)
        self._lifespan: asyncio.Task | None = None
        self._start_lock = asyncio.Lock()
        self.drain_signal = drain_signal  # the DrainSignal actor's name (drain.py)
        self._signal = None  # its handle, looked up at the first health check
        self._drain: asyncio.Task | None = None
        ctx = serve.get_replica_context()
        rank = getattr(ctx.rank, "rank", ctx.rank)
        self.rank = int(rank) if rank is not None else 0
        self.replica_id = ctx.replica_id.to_full_id_str()
        self.metrics_url = None
        if metrics_port is not None:
            port = metrics_port + self.rank
            _serve_metrics(self.server, settings, metrics_host, port)
            self.metrics_url = f"http://{metrics_host}:{port}/metrics"

    async def _started(self) -> None:
        async with self._start_lock:
            if self._lifespan is None:
                self._lifespan = await start_lifespan(self.app)

    async def __call__(self, request: ProxiedRequest):
        await self._started()
        async for part in call_app(self.app, request):
            yield part

    async def hash_spec(self) -> HashSpec:
        return self.hash_spec_value

    async def info(self) -> dict:
        return {"pid": os.getpid(), "rank": self.rank, "replica_id": self.replica_id,
                "metrics_url": self.metrics_url}

    async def record_routing_stats(self) -> dict:
        """What the router reads as `replica.routing_stats` (polled by Serve's controller)."""
        bm = self.engine.block_manager
        cached = list(bm.cached)  # one C-level copy of the keys: safe against the engine thread
        return {CACHED_HASHES_KEY: cached[-MAX_REPORTED_HASHES:], "kv_usage": bm.usage}

    async def check_health(self) -> None:
        """Serve's periodic check; also where a replica learns that the CLI shuts down."""
        if self._lifespan is not None and not self.server.async_engine.is_running:
            raise RuntimeError(self.server.async_engine.dead_reason())
        if self.drain_signal is not None and self._drain is None:
            if self._signal is None:
                import ray

                from nanokv.replicas.drain import SIGNAL_NAMESPACE

                self._signal = ray.get_actor(self.drain_signal, namespace=SIGNAL_NAMESPACE)
            timeout = await self._signal.get.remote()
            if timeout is not None:
                self._drain = asyncio.ensure_future(self.drain(timeout))

    async def drain(self, timeout: float) -> None:
        """As `nanokv serve` on SIGTERM: new requests 503, in-flight ones finish for at most
        `timeout` s, the rest end with an error; then tell the signal."""
        try:
            self.server.draining = True  # also a replica that has served nothing yet: 503
            if self._lifespan is not None:
                await self.server.drain(timeout)
                await asyncio.sleep(0.2)  # the handlers write their error bodies
        finally:
            await self._signal.done.remote(self.replica_id)


def _serve_metrics(server, settings: ServerSettings, host: str, port: int) -> None:
    """This replica's own /metrics (behind the API key, as in `nanokv serve`), for Prometheus."""
    import uvicorn

    from nanokv.server.openai_api import APIKeyMiddleware

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics():
        return Response(server.exporter.render(), media_type=server.exporter.content_type)

    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    userver = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                            lifespan="off", access_log=False))
    threading.Thread(target=userver.run, name=f"nanokv-metrics-{port}", daemon=True).start()


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, "server_error", code=code), status_code=status)


def _stream_error_event(message: str) -> bytes:
    body = json.dumps(error_body(message, "server_error", code="replica_failed"))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class Ingress:
    """HTTP in, the prompt's block hashes computed, the request forwarded to a replica."""

    def __init__(self, replicas, model: str, tokenizer: str | None, skip_tokenizer_init: bool,
                 settings: ServerSettings, max_attempts: int = 3) -> None:
        from nanokv.worker.loader import load_tokenizer

        self.replicas = replicas
        tok = None if skip_tokenizer_init else load_tokenizer(tokenizer or model)
        self.prompts = PromptTokenizer(tok, settings.chat_template, settings.max_prompt_chars)
        self.max_body_bytes = settings.max_body_bytes
        self.max_attempts = max_attempts
        self._spec: HashSpec | None = None
        self.lora_ids = {m.lora_name: m.lora_int_id for m in settings.lora_modules}

    async def _block_hashes(self, path: str, body: bytes) -> list[int]:
        if path not in HASHED_PATHS or len(body) > self.max_body_bytes:
            return []
        if self._spec is None:
            self._spec = await self.replicas.hash_spec.remote()
        found = await asyncio.to_thread(self.prompts.token_ids, path, body)
        if found is None:
            return []
        token_ids, salt = found
        return prompt_block_hashes(token_ids, self._spec, salt,
                                   body_lora_id(body, self.lora_ids))

    async def forward(self, request: Request) -> Response:
        if request.url.path == "/metrics":  # one replica's counters would pass for the total
            return _error(404, "with --replicas each replica serves its own /metrics on "
                               "--metrics-port + its rank (deploy/prometheus/"
                               "prometheus-replicas.yml scrapes them); this port forwards "
                               "requests to one replica at a time", "metrics_per_replica")
        body = await request.body()
        proxied = ProxiedRequest(
            method=request.method, path=request.url.path,
            query_string=request.url.query.encode(),
            headers=[(k.lower(), v) for k, v in request.headers.raw if k.lower() != b"host"],
            body=body, block_hashes=await self._block_hashes(request.url.path, body))
        last_error: BaseException | None = None
        for attempt in range(self.max_attempts):
            gen = self.replicas.options(stream=True).remote(proxied)
            try:
                start = await gen.__anext__()
                if not isinstance(start, ResponseStart):
                    raise RuntimeError("a replica answered without a response start")
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
                           if k.lower() != b"content-length"}
                if headers.get("content-type", "").startswith("text/event-stream"):
                    return StreamingResponse(_relay(gen), status_code=start.status,
                                             headers=headers)
                chunks = [chunk async for chunk in gen]  # all of it: a death here is retried
                return Response(b"".join(chunks), status_code=start.status, headers=headers)
            except REPLICA_DIED as e:
                last_error = e
                logger.warning("replica failed before answering (attempt %d of %d): %s",
                               attempt + 1, self.max_attempts, e)
                await asyncio.sleep(0.1 * (attempt + 1))
            except asyncio.CancelledError:
                gen.cancel()  # the client left: the replica aborts the engine requests
                raise
        return _error(503, f"no replica could serve the request after {self.max_attempts} "
                           f"attempts: {last_error}", "replica_failed")


async def _relay(gen):
    """The rest of a streamed response; a replica lost mid-stream ends it with an error event."""
    done = False
    try:
        async for chunk in gen:
            yield chunk
        done = True
    except REPLICA_DIED as e:
        done = True
        logger.warning("replica failed mid-stream: %s", e)
        yield _stream_error_event(f"the replica serving this stream failed: {e}")
    finally:
        if not done:  # the client left: the replica aborts the engine requests
            gen.cancel()


def build_replica_app(model: str, engine_kwargs: dict, settings: ServerSettings,
                      num_replicas: int, router: str = "affinity", replica_cpus: float = 1,
                      metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                      routing_stats_period_s: float = 2.0, imbalance_threshold: int = 4,
                      min_match_ratio: float = 0.1, max_attempts: int = 3,
                      drain_signal: str | None = None):
    """The Serve application (pass it to serve.run). `drain_signal`: the name of a DrainSignal
    actor (drain.py) that tells the replicas to drain before the application goes."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"the number of replicas must be an integer >= 1, got {num_replicas!r}")
    if not replica_cpus > 0:
        raise ValueError(f"replica CPUs must be > 0, got {replica_cpus!r}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    if settings.responses_store_size:
        raise ValueError("--responses-store-size keeps responses in one engine process; with "
                         "--replicas a stored response's later requests could reach another "
                         "replica: leave it 0 (send the whole conversation as input)")
    engine_kwargs = dict(engine_kwargs)
    if engine_kwargs.get("num_threads") is None:  # replicas must not fight over the cores
        engine_kwargs["num_threads"] = max(1, int(replica_cpus))
    options = dict(
        name="EngineReplica", num_replicas=num_replicas,
        ray_actor_options={"num_cpus": replica_cpus},
        # the engine's own admission (running + waiting) decides; Serve must not refuse first
        max_ongoing_requests=engine_kwargs.get("max_num_seqs", 64) + settings.max_waiting,
        health_check_period_s=HEALTH_PERIOD_S)
    if router == "affinity":
        from nanokv.replicas.router import PrefixAffinityRouter, check_min_match_ratio

        check_min_match_ratio(min_match_ratio)  # here, not first in a replica's router

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"imbalance_threshold": imbalance_threshold,
                                   "min_match_ratio": min_match_ratio},
            request_routing_stats_period_s=routing_stats_period_s)
    replica = serve.deployment(EngineReplica).options(**options).bind(
        model, engine_kwargs, settings, metrics_port, metrics_host, drain_signal)
    ingress = serve.deployment(_ingress_class(), name="Ingress",
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return ingress.bind(replica, model, engine_kwargs.get("tokenizer"),
                        bool(engine_kwargs.get("skip_tokenizer_init")), settings, max_attempts)


def _ingress_class():
    """Ingress with its catch-all route (serve.ingress needs the route on the class)."""
    app = FastAPI(title="nanokv replicas", docs_url=None, redoc_url=None, openapi_url=None)

    @serve.ingress(app)
    class NanokvIngress(Ingress):
        @app.api_route("/{path:path}", methods=["GET", "POST"], include_in_schema=False)
        async def route(self, request: Request):
            return await self.forward(request)

    return NanokvIngress
