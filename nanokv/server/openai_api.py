"""The OpenAI-compatible HTTP server (FastAPI).

    POST /v1/completions, /v1/chat/completions, /v1/responses (JSON or server-sent events)
    GET, DELETE /v1/responses/{id}; POST /v1/responses/{id}/cancel; GET .../input_items
    GET  /v1/models, /v1/models/{model}, /health, /ping (also POST), /version, /metrics
    POST /tokenize, /detokenize
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter (--allow-runtime-lora-updating)

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 bad input, 401 bad
API key, 404 unknown model or route, 413 body over --max-body-bytes, 415 a body not sent as
JSON (no Content-Type, or another than application/json), 503 + Retry-After when the
queue is full or the server drains, 504 on the server-side request timeout, 500 when the engine
fails. The request handling itself is in
serving.py; this module is the routes, the error mapping and the API-key check.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanokv.server.beam_serving import beam_search_events, run_beam_search
from nanokv.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, LoadLoRAAdapterRequest, TokenizeRequest,
                                    UnloadLoRAAdapterRequest, error_body)
from nanokv.server.responses_api import ResponsesRequest
from nanokv.server.responses_serving import ResponsesServing
from nanokv.server.responses import (ChatParts, ReasoningTokenCount, chat_logprobs,
                                     completion_logprobs, count_reasoning, echo_logprobs,
                                     prompt_logprobs_json, stream_events, usage)
from nanokv.server.tool_calls import finish_reason
from nanokv.server.serving import (COMPLETION_DEFAULT_MAX_TOKENS, ClientGone,
                                   EngineStreamingResponse, OpenAIServer, ServerSettings)

__all__ = ["build_app", "ServerSettings", "OpenAIServer"]

logger = logging.getLogger("nanokv.server")

OPEN_PATHS = ("/health", "/ping", "/version")  # never behind --api-key


class APIKeyMiddleware:
    """Pure ASGI: `Authorization: Bearer <key>` compared in constant time; OPEN_PATHS stay
    open."""

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


class BodyLimitMiddleware:
    """Pure ASGI: a request body over `max_bytes` is a 413, by its Content-Length before it is
    read, else as soon as the bytes read pass the limit; an accepted body is replayed to the
    app, and later receives (disconnects) pass through."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> JSONResponse:
        return JSONResponse(error_body(
            f"the request body is {size} bytes; this server accepts at most {self.max_bytes} "
            f"(--max-body-bytes)", code="request_too_large"), status_code=413,
            headers={"Connection": "close"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(length.decode())(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(f"over {self.max_bytes}")(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_app(engine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app over an LLMEngine; the engine loop starts with the app's lifespan."""
    server = OpenAIServer(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start()
        server.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            await app.state.responses.close()
            server.async_engine.shutdown()
            server.close()

    app = FastAPI(title="nanokv", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:  # outermost: a wrong key is refused before the body is read
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


def require_json(raw: Request) -> None:
    """A POST body must be sent as JSON (vLLM's check): a form or text body, or one without a
    Content-Type, is a 415 that says so, rather than a 400 about fields it could not read."""
    given = raw.headers.get("content-type")
    media = (given or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        got = f"got '{given}'" if given is not None else "the request has no Content-Type"
        raise APIError(415, f"Unsupported Media Type: the request body must be JSON with "
                            f"'Content-Type: application/json' ({got})",
                       code="unsupported_media_type")


def nanokv_version() -> str:
    """The installed nanokv's version ("unknown" when run from a source tree)."""
    try:
        return dist_version("nanokv")
    except PackageNotFoundError:
        return "unknown"


def _add_routes(app: FastAPI, server: OpenAIServer) -> None:
    settings = server.settings
    json_body = [Depends(require_json)]

    @app.get("/health")
    async def health():
        if server.draining:
            return JSONResponse(error_body("the server is shutting down", "server_error",
                                           code="shutting_down"), status_code=503)
        if server.async_engine.is_running:
            return {"status": "ok"}
        return JSONResponse(error_body(server.async_engine.dead_reason(), "server_error",
                                       code="engine_unavailable"), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.exporter.render(), media_type=server.exporter.content_type)

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": server.created,
                "owned_by": "nanokv", "max_model_len": server.max_model_len}

    def lora_card(module) -> dict:  # vLLM's: the adapter's path as root, the model as parent
        return {**model_card(), "id": module.lora_name, "root": module.lora_path,
                "parent": settings.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list",
                "data": [model_card(), *(lora_card(m) for m in server.loras.values())]}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (`client.models.retrieve`)
    async def model(model: str):
        server.check_model(model)
        return lora_card(server.loras[model]) if model in server.loras else model_card()

    @app.post("/v1/load_lora_adapter", dependencies=json_body)  # vLLM's
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return Response(await server.load_lora(body.lora_name, body.lora_path),
                        media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", dependencies=json_body)  # vLLM's
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return Response(server.unload_lora(body.lora_name, body.lora_int_id),
                        media_type="text/plain")

    @app.get("/version")  # vLLM's
    async def version():
        return {"version": nanokv_version()}

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's): as /health
    async def ping():
        return await health()

    @app.post("/tokenize", dependencies=json_body)
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            _, ids = await server.chat_token_ids(body.messages, body.add_generation_prompt,
                                                 tools=body.tools)
        else:
            ids = await server.encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=json_body)
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        if server.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer", param="tokens")
        vocab = server.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}",
                           param="tokens", code="invalid_value")
        return {"prompt": await server.decode(body.tokens)}

    async def final_response(streams, raw: Request, head: dict, body, content,
                             prompt_logprobs_field: bool = False, reasoning_tokens=None,
                             token_ids: bool = True):
        """A non-streamed answer: every choice run to its end; `content(output, logprobs,
        prompt_logprobs)` gives a choice's endpoint-specific fields (text or message, and
        logprobs); the prompt's log-probabilities come from its first choice, which alone
        computed them. `prompt_logprobs_field`: they go in the response (vLLM's chat), once.
        `reasoning_tokens(outputs)`: the usage's completion_tokens_details (chat); `token_ids`
        false: no return_token_ids (a hidden reasoning's)."""
        try:
            finals, logprobs = await server.run_to_end(streams, raw)
        except ClientGone:
            return Response(status_code=499)
        return respond(finals, logprobs, head, body, content, prompt_logprobs_field,
                       reasoning_tokens, token_ids)

    async def beam_response(prompts, rid: str, labels, raw: Request, head: dict, body, content,
                            reasoning_tokens=None, token_ids: bool = True):
        """A beam search's answer (use_beam_search): each prompt's n best sequences are its
        choices, made as `final_response` makes a run's."""
        try:
            answers = await run_beam_search(server, body, prompts, rid, labels, raw,
                                            server.priority(body, raw))
        except ClientGone:
            return Response(status_code=499)
        finals = [o for outs in answers for o in outs]
        return respond(finals, [[] for _ in finals], head, body, content, False,
                       reasoning_tokens, token_ids, [outs[0] for outs in answers])

    def respond(finals, logprobs, head: dict, body, content, prompt_logprobs_field: bool,
                reasoning_tokens, token_ids: bool, per_prompt=None) -> dict:
        """The answer's body from the choices' final outputs (`final_response`'s arguments);
        `per_prompt`: one output of each prompt for the usage, where not every n-th one."""
        choices, n = [], body.num_choices
        for i, (o, lps) in enumerate(zip(finals, logprobs)):
            prompt_lps = finals[i - i % n].prompt_logprobs
            fields = content(o, lps, prompt_lps)
            choice = {"index": i, **fields,
                      "finish_reason": fields.pop("finish_reason", o.finish_reason),
                      "stop_reason": o.outputs[0].stop_reason}
            if body.return_token_ids and token_ids:
                choice.update(token_ids=o.token_ids, prompt_token_ids=o.prompt_token_ids)
            choices.append(choice)
        completion_tokens = None if per_prompt is None else sum(len(o.token_ids) for o in finals)
        response = {**head, "choices": choices, "usage": usage(
            finals if per_prompt is None else per_prompt, n if per_prompt is None else 1,
            completion_tokens, reasoning_tokens(finals) if reasoning_tokens else None)}
        if prompt_logprobs_field and finals[0].prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs,
                                                               server.tokenizer)
        return response

    @app.post("/v1/completions", dependencies=json_body)
    async def completions(body: CompletionRequest, raw: Request):
        server.check_request(body)
        labels = server.request_class(raw, "completions")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        server.check_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        bad_words = await server.bad_words_token_ids(body)
        structured = await server.structured_outputs(body)
        requests, beam_prompts = [], []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                text, ids = p, await server.encode(p, body.add_special_tokens)
            elif body.echo and server.tokenizer is not None:  # vLLM echoes ids as their text
                text, ids = await server.decode(list(p)), list(p)
            else:
                text, ids = None, list(p)
            ids = server.truncate(body, ids)  # the echoed text stays the prompt's (vLLM's)
            default = max(min(COMPLETION_DEFAULT_MAX_TOKENS, server.max_model_len - len(ids)), 1)
            if body.use_beam_search:
                beam_prompts.append((ids, text, server.max_tokens_of(
                    body, len(ids), body.max_tokens, default, "prompt")))
                continue
            requests += server.make_requests(body, ids, text, f"{rid}-{i}", body.max_tokens,
                                             default, "prompt",
                                             bad_words_token_ids=bad_words,
                                             structured_outputs=structured,
                                             priority=server.priority(body, raw))
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": server.served_name(body.model)}
        token_texts = partial(server.token_texts, skip_special_tokens=body.skip_special_tokens)
        streams = [] if body.use_beam_search else server.open_streams(requests, labels)
        if body.stream:
            return EngineStreamingResponse(
                stream_events(server.events(streams), len(streams), head, body, False,
                              token_texts), streams)

        def completion_choice(o, lps, prompt_lps) -> dict:
            text, logprobs = o.text, None
            if body.echo:
                text = (o.prompt or "") + ("" if body.echo_only else o.text)
            if body.num_logprobs is not None and body.echo:
                logprobs = echo_logprobs(prompt_lps or [None], [] if body.echo_only else lps,
                                         body.num_logprobs, token_texts([]),
                                         o.prompt_token_ids)
            elif body.num_logprobs is not None:
                logprobs = completion_logprobs(lps, token_texts(o.prompt_token_ids))
            choice = {"text": text, "logprobs": logprobs}
            if prompt_lps is not None:  # vLLM's extension
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt_lps, server.tokenizer)
            return choice

        if body.use_beam_search:
            return await beam_response(beam_prompts, rid, labels, raw, head, body,
                                       completion_choice)
        return await final_response(streams, raw, head, body, completion_choice)

    responses_serving = ResponsesServing(server)
    app.state.responses = responses_serving

    @app.post("/v1/responses", dependencies=json_body)
    async def responses(body: ResponsesRequest, raw: Request):
        return await responses_serving.create(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False):
        return responses_serving.retrieve(response_id, stream)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return await responses_serving.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await responses_serving.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, after: str | None = None, limit: int = 20,
                                   order: str = "desc"):
        return responses_serving.input_items(response_id, after, limit, order)

    @app.post("/v1/chat/completions", dependencies=json_body)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        prompt = await server.chat_prompt(body, raw, "chat_completions", body.messages,
                                          body.add_generation_prompt, body.add_special_tokens,
                                          body.continue_final_message)
        parser = server.reasoning_parser
        ids = prompt.token_ids
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        max_param = "max_tokens" if body.max_completion_tokens is None \
            else "max_completion_tokens"
        default = max(server.max_model_len - len(ids), 1)
        if body.use_beam_search:
            if prompt.structured is not None:  # a forced tool call's grammar
                raise APIError(400, "tool_choice required or a named function constrains the "
                                    "answer, which beam search (use_beam_search=true) does not "
                                    "apply; use tool_choice auto or none", param="tool_choice",
                               code="unsupported_parameter")
            beam_prompts = [(ids, prompt.text, server.max_tokens_of(
                body, len(ids), body.requested_max_tokens, default, "messages", max_param))]
            streams = []
        else:
            requests = server.make_requests(body, ids, prompt.text, rid,
                                            body.requested_max_tokens, default, "messages",
                                            max_param, prompt.bad_words, prompt.structured,
                                            server.priority(body, raw))
            streams = server.open_streams(requests, prompt.labels)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": server.served_name(body.model)}
        token_texts = partial(server.token_texts, skip_special_tokens=body.skip_special_tokens)
        hidden = parser is not None and not body.include_reasoning  # vLLM's rule
        if body.stream:
            head["object"] = "chat.completion.chunk"
            reasoning, tool_calls = server.answer_streams(prompt)
            parts = ChatParts(
                reasoning=reasoning, tool_calls=tool_calls,
                reasoning_tokens=(lambda prompt_ids: ReasoningTokenCount(
                    token_texts(prompt_ids), prompt.thinking)) if parser else None,
                include_reasoning=body.include_reasoning, echo=body.echo_text(),
                role=body.answer_role)
            events, num = (server.events(streams), len(streams)) if not body.use_beam_search \
                else (beam_search_events(server, body, beam_prompts, rid, prompt.labels, raw,
                                         server.priority(body, raw)), body.num_choices)
            return EngineStreamingResponse(
                stream_events(events, num, head, body, True, token_texts, ids, parts), streams)

        echo = body.echo_text()

        def message(o) -> dict:
            thought, content, calls = server.split_answer(prompt, o.text)
            message = {"role": body.answer_role}
            if parser is not None:
                message["reasoning"] = None if hidden else thought
            if echo:
                content = echo + (content or "")
            if calls is None:
                return {"message": {**message, "content": content}}
            if calls or prompt.tool_choice != "auto":
                message["tool_calls"] = calls
            return {"message": {**message, "content": content}, "finish_reason": finish_reason(
                prompt.tool_choice, bool(calls), o.finish_reason)}

        def choice(o, lps, _) -> dict:
            return {**message(o), "logprobs": chat_logprobs(lps, token_texts(o.prompt_token_ids))
                    if body.num_logprobs is not None and not hidden else None}

        count = partial(count_reasoning, token_texts=token_texts, thinking=prompt.thinking) \
            if parser else None
        if body.use_beam_search:
            return await beam_response(beam_prompts, rid, prompt.labels, raw, head, body, choice,
                                       count, not hidden)
        return await final_response(streams, raw, head, body, choice, prompt_logprobs_field=True,
                                    reasoning_tokens=count, token_ids=not hidden)
