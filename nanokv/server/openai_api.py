"""The OpenAI-compatible HTTP server (FastAPI).

    POST /v1/completions, /v1/chat/completions (JSON or server-sent events)
    GET  /v1/models, /health, /metrics
    POST /tokenize, /detokenize

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 bad input, 401 bad
API key, 404 unknown model or route, 503 + Retry-After when the queue is full, 504 on the
server-side request timeout, 500 when the engine fails. The request handling itself is in
serving.py; this module is the routes, the error mapping and the API-key check.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanokv.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, TokenizeRequest, error_body)
from nanokv.server.serving import (COMPLETION_DEFAULT_MAX_TOKENS, ClientGone,
                                   EngineStreamingResponse, OpenAIServer, ServerSettings,
                                   chat_events, completion_events, usage)

__all__ = ["build_app", "ServerSettings", "OpenAIServer"]

logger = logging.getLogger("nanokv.server")

OPEN_PATHS = ("/health",)  # never behind --api-key


class APIKeyMiddleware:
    """Pure ASGI: `Authorization: Bearer <key>` compared in constant time; /health stays open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS \
                and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(error_body(
                    "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'",
                    "invalid_request_error", None, "invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app over an LLMEngine; the engine loop starts with the app's lifespan."""
    server = OpenAIServer(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start()
        try:
            yield
        finally:
            server.async_engine.shutdown()

    app = FastAPI(title="nanokv", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    _add_error_handlers(app)
    _add_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return JSONResponse(validation_error_body(e.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal server error: {e}", "server_error"),
                            status_code=500)


def validation_error_body(errors) -> dict:
    e = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    path = ".".join(loc)
    kind = e.get("type", "")
    if kind == "json_invalid":
        reason = (e.get("ctx") or {}).get("error", "")
        return error_body(f"Malformed JSON in the request body: {reason}".rstrip(": "),
                          code="invalid_json")
    if kind == "missing":
        what = f"required field '{path}'" if path else "request body"
        return error_body(f"Missing {what}", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return error_body(f"Unrecognized request argument supplied: {path}", param=param,
                          code="unknown_parameter")
    where = f"for '{path}'" if path else "of the request body"
    return error_body(f"Invalid value {where}: {e.get('msg', '')}", param=param,
                      code="invalid_type" if kind.endswith("_type") else "invalid_value")


def _add_routes(app: FastAPI, server: OpenAIServer) -> None:
    settings = server.settings

    @app.get("/health")
    async def health():
        if server.async_engine.is_running:
            return {"status": "ok"}
        return JSONResponse(error_body(server.async_engine.dead_reason(), "server_error",
                                       code="engine_unavailable"), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.exporter.render(), media_type=server.exporter.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": server.created,
            "owned_by": "nanokv", "max_model_len": server.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            _, ids = server.chat_token_ids(body.messages, body.add_generation_prompt)
        else:
            ids = server.encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        if server.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer", param="tokens")
        vocab = server.engine.hf_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}",
                           param="tokens")
        return {"prompt": server.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        server.check_request(body)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        requests = []
        for i, p in enumerate(prompts):
            text, ids = (p, server.encode(p)) if isinstance(p, str) else (None, list(p))
            default = min(COMPLETION_DEFAULT_MAX_TOKENS, server.max_model_len - len(ids))
            requests.append(server.make_request(body, ids, text, f"{rid}-{i}", body.max_tokens,
                                                max(default, 1), "prompt"))
        streams = server.open_streams(requests)
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": settings.model_name}
        if body.stream:
            return EngineStreamingResponse(completion_events(server, streams, head, body),
                                           streams)
        try:
            finals = await server.run_to_end(streams, raw)
        except ClientGone:
            return Response(status_code=499)
        choices = [{"index": i, "text": o.text, "logprobs": None,
                    "finish_reason": o.finish_reason, "stop_reason": o.outputs[0].stop_reason}
                   for i, o in enumerate(finals)]
        if body.return_token_ids:
            for choice, o in zip(choices, finals):
                choice.update(token_ids=o.token_ids, prompt_token_ids=o.prompt_token_ids)
        return {**head, "choices": choices, "usage": usage(finals)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        server.check_request(body)
        text, ids = server.chat_token_ids(body.messages, body.add_generation_prompt)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        max_param = "max_tokens" if body.max_completion_tokens is None \
            else "max_completion_tokens"
        request = server.make_request(body, ids, text, rid, body.requested_max_tokens,
                                      max(server.max_model_len - len(ids), 1), "messages",
                                      max_param)
        streams = server.open_streams([request])
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": settings.model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return EngineStreamingResponse(chat_events(server, streams, head, body),
                                           streams)
        try:
            (final,) = await server.run_to_end(streams, raw)
        except ClientGone:
            return Response(status_code=499)
        choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                  "logprobs": None, "finish_reason": final.finish_reason,
                  "stop_reason": final.outputs[0].stop_reason}
        if body.return_token_ids:
            choice.update(token_ids=final.token_ids, prompt_token_ids=final.prompt_token_ids)
        return {**head, "choices": [choice], "usage": usage([final])}
