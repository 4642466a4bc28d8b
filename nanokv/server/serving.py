"""Request handling behind the HTTP routes: validation, tokenization (in a worker thread, so a
huge prompt never stalls the event loop) into engine requests, admission, reading the engine's
streams under the request timeout and the client's connection, and draining on shutdown."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

from fastapi import Request
from fastapi.responses import StreamingResponse

from nanokv.bad_words import tokenize_bad_words
from nanokv.engine.detokenizer import TokenTexts
from nanokv.engine.prompts import truncate_prompt
from nanokv.extras import MissingExtraError
from nanokv.lora.request import LoRARequest
from nanokv.metrics.prometheus import PrometheusExporter
from nanokv.metrics.stats import CacheConfigInfo
from nanokv.outputs import RequestOutput
from nanokv.sampling_params import MAX_LOGPROBS, SamplingParams
from nanokv.server.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                        RequestStream)
from nanokv.engine.chat import ChatRenderer
from nanokv.server.protocol import MAX_N, APIError, _SamplingRequest, template_tools
from nanokv.server.reasoning import END as REASONING_END
from nanokv.server.reasoning import get_parser
from nanokv.server.tool_calls import PARSERS as TOOL_CALL_PARSERS
from nanokv.server.tool_calls import answer_tool_calls, named_schema, required_schema
from nanokv.server.tool_stream import ToolCallStream
from nanokv.structured.params import StructuredOutputsParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens",
                   "min_tokens", "stop", "stop_token_ids", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs",
                   "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens")
REQUEST_CLASS_HEADER = "x-request-class"
PRIORITY_HEADER = "x-vllm-priority"  # vLLM's: an integer priority overriding the body's
DEFAULT_REQUEST_CLASS = "default"
CHARS_PER_TOKEN_LIMIT = 64  # default --max-prompt-chars: this many characters per context token
TOKENIZER_THREADS = 4  # a huge prompt occupies one; the others keep serving small ones


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
    max_body_bytes: int = 16 * 2**20  # larger request bodies: 413, before they are read
    max_prompt_chars: int | None = None  # None: CHARS_PER_TOKEN_LIMIT x max_model_len
    max_stop_strings: int = 64
    max_stop_length: int = 1000  # characters of one stop string
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    request_classes: tuple[str, ...] = ()  # allowed values of the X-Request-Class header
    trace_file: str | None = None  # append one JSON line per finished request (nanokv.sim)
    trace_steps_file: str | None = None  # and one per engine step (nanokv/sim/step_log.py)
    reasoning_parser: str | None = None  # splits chat answers' reasoning (nanokv.server.reasoning)
    # structured outputs constrain the reasoning too (vLLM's structured_outputs_config.
    # enable_in_reasoning); off: a chat answer's constraint starts after its </think>
    structured_outputs_enable_in_reasoning: bool = False
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (nanokv.server.tool_calls)
    tool_call_parser: str | None = None  # reads tool calls out of chat answers
    responses_store_size: int = 0  # Responses API responses kept (response_store); 0: none
    # LoRA adapters served by name (--lora-modules; the engine needs enable_lora)
    lora_modules: tuple[LoRARequest, ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the served model name must not be empty")
        if self.trace_steps_file and not self.trace_file:
            raise ValueError("--trace-steps needs --trace-file (the steps and the requests "
                             "share one clock)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        for name in ("max_waiting", "max_body_bytes", "max_stop_strings", "max_stop_length",
                     "responses_store_size"):
            value = getattr(self, name)
            low = 0 if name in ("max_waiting", "responses_store_size") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.max_prompt_chars is not None and (not isinstance(self.max_prompt_chars, int)
                                                  or self.max_prompt_chars < 1):
            raise ValueError(f"max_prompt_chars must be an integer >= 1, got "
                             f"{self.max_prompt_chars!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout!r}")
        if not self.metrics_window > 0:
            raise ValueError(f"metrics_window must be > 0 seconds, got {self.metrics_window!r}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got "
                             f"{self.shutdown_timeout!r}")
        if self.reasoning_parser is not None:
            get_parser(self.reasoning_parser)
        elif self.structured_outputs_enable_in_reasoning:
            raise ValueError("--structured-outputs-enable-in-reasoning needs --reasoning-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; known: "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        self.request_classes = tuple(self.request_classes)
        self.lora_modules = tuple(self.lora_modules)
        if self.model_name in {m.lora_name for m in self.lora_modules}:
            raise ValueError(f"a LoRA module may not be named as the served model "
                             f"({self.model_name!r})")
        for c in self.request_classes:
            if not (c and len(c) <= 64 and all(ch.isalnum() or ch in "-_." for ch in c)):
                raise ValueError(f"a request class must be 1-64 letters, digits, '-', '_' or "
                                 f"'.', got {c!r}")


class ShuttingDown(RuntimeError):
    """The server is draining: in-flight requests were aborted at --shutdown-timeout."""


@dataclass
class ChatPrompt:
    """A chat-shaped request's prompt and what its answer is read with (`chat_prompt`)."""

    text: str
    token_ids: list[int]
    labels: tuple[str, str]  # the prefix-cache counters' (endpoint, class)
    tool_choice: str | None  # "none", "auto", "required", "function" or None (no tools)
    tool_name: str | None  # the named function's
    thinking: bool  # the answer starts in its reasoning (a reasoning parser's)
    bad_words: tuple | None
    structured: StructuredOutputsParams | None


class OpenAIServer:
    """Request handling: validation, tokenization, streaming; the engine runs in its thread."""

    def __init__(self, engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.hf_config.vocab_size
        self.max_prompt_chars = settings.max_prompt_chars or \
            CHARS_PER_TOKEN_LIMIT * self.max_model_len
        # the engine thread detokenizes with engine.tokenizer; the event loop (token strings of
        # logprobs) and each tokenizer worker thread get their own copies (a Rust tokenizer
        # shared across threads can fail with "Already borrowed")
        tok = engine.tokenizer
        self.tokenizer = copy.deepcopy(tok) if tok is not None else None
        self.chat = ChatRenderer(self.tokenizer, settings.chat_template) if tok else None
        self.reasoning_parser = get_parser(settings.reasoning_parser) \
            if settings.reasoning_parser else None
        self._local = threading.local()
        self._worker = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="nanokv-tokenize")
        if settings.lora_modules and engine.lora is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for module in settings.lora_modules:  # read and checked before serving
            engine.lora.register(module)
        self.loras = {m.lora_name: m for m in settings.lora_modules}
        self._next_lora_id = len(settings.lora_modules) + 1  # ids are never reused
        self.exporter = PrometheusExporter(settings.model_name,
                                           CacheConfigInfo.from_engine(engine),
                                           window_s=settings.metrics_window)
        trace = None
        if settings.trace_file:
            from nanokv.sim.trace import TraceWriter

            trace = TraceWriter(settings.trace_file, steps_path=settings.trace_steps_file)
        self.async_engine = AsyncLLMEngine(engine, settings.max_waiting, self.exporter.record,
                                           settings.check_invariants, trace=trace)
        self.created = int(time.time())
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    # ---- validation ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """The body's `model`: the served model's name, a LoRA module's, or None."""
        if model is not None and model != self.settings.model_name and model not in self.loras:
            served = ", ".join(f"`{name}`" for name in (self.settings.model_name, *self.loras))
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"{served}.", param="model", code="model_not_found")

    async def load_lora(self, name: str, path: str) -> str:
        """POST /v1/load_lora_adapter: the adapter read and checked (in a worker thread), then
        served under `name` with a new id."""
        self._check_runtime_lora()
        if not name or name == self.settings.model_name or name in self.loras:
            why = "is the served model's" if name == self.settings.model_name else \
                "is already loaded" if name else "must not be empty"
            raise APIError(400, f"The lora adapter name '{name}' {why}.", param="lora_name",
                           code="invalid_value")
        try:
            lora = LoRARequest(name, self._next_lora_id, path)
            await asyncio.get_running_loop().run_in_executor(self._worker,
                                                             self.engine.lora.register, lora)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_value") from e
        self._next_lora_id += 1
        self.loras[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora(self, name: str, lora_int_id: int | None) -> str:
        """POST /v1/unload_lora_adapter: the name no longer served (requests already queued
        under it finish with it)."""
        self._check_runtime_lora()
        lora = self.loras.get(name)
        if lora is None or lora_int_id not in (None, lora.lora_int_id):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           "not_found_error", param="lora_name", code="model_not_found")
        del self.loras[name]
        self.engine.remove_lora(lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_runtime_lora(self) -> None:
        if not self.settings.allow_runtime_lora_updating or self.engine.lora is None:
            raise APIError(400, "loading and unloading LoRA adapters at runtime needs "
                                "--enable-lora and --allow-runtime-lora-updating (or "
                                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                           code="unsupported_operation")

    def served_name(self, model: str | None) -> str:
        """The `model` a response names: the LoRA module asked for, else the served model."""
        return model if model in self.loras else self.settings.model_name

    def check_request(self, body: _SamplingRequest) -> None:
        self.check_model(body.model)
        for field, why in body.unsupported():
            raise APIError(400, why, param=field, code="unsupported_parameter")
        s = self.settings
        if not 1 <= body.num_choices <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {body.n}", param="n",
                           code="invalid_value")
        stops = body.stop_list()
        if len(stops) > s.max_stop_strings:
            raise APIError(400, f"stop has {len(stops)} strings; this server allows at most "
                                f"{s.max_stop_strings} (--max-stop-strings)", param="stop",
                           code="invalid_value")
        longest = max((len(x) for x in stops), default=0)
        if longest > s.max_stop_length:
            raise APIError(400, f"a stop string has {longest} characters; this server allows "
                                f"at most {s.max_stop_length} (--max-stop-length)",
                           param="stop", code="invalid_value")
        try:
            bias = body.token_logit_bias()
        except ValueError as e:
            raise APIError(400, str(e), param="logit_bias", code="invalid_value") from e
        for param, ids in (("stop_token_ids", body.stop_token_ids or []),
                           ("logit_bias", bias or {}),
                           ("allowed_token_ids", body.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                subject = "logit_bias keys" if param == "logit_bias" else param
                raise APIError(400, f"{subject} must be token ids in [0, {self.vocab_size}); "
                                    f"got {bad[:5]}", param=param, code="invalid_value")
        k = body.num_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            param = "top_logprobs" if hasattr(body, "top_logprobs") else "logprobs"
            raise APIError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {k}", param=param,
                           code="invalid_value")
        k = body.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            whole = " (-1, the whole vocabulary, is not supported)" if k == -1 else ""
            raise APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}{whole}",
                           param="prompt_logprobs", code="invalid_value")
        if k and body.stream:  # vLLM's rule: a stream has no field for them
            raise APIError(400, "prompt_logprobs are not available when stream=true (echo=true "
                                "with logprobs streams the prompt's log-probabilities)",
                           param="prompt_logprobs", code="invalid_value")

    def request_class(self, raw: Request, endpoint: str) -> tuple[str, str]:
        """(endpoint, class): the prefix-cache counters' labels, from a bounded set."""
        given = raw.headers.get(REQUEST_CLASS_HEADER)
        if given is None:
            return endpoint, DEFAULT_REQUEST_CLASS
        if given not in self.settings.request_classes:
            allowed = ", ".join(self.settings.request_classes) or "none configured"
            raise APIError(400, f"unknown request class {given!r} in the X-Request-Class "
                                f"header; allowed: {allowed} (--request-classes)",
                           code="invalid_value")
        return endpoint, given

    @staticmethod
    def priority(body: _SamplingRequest, raw: Request) -> int:
        """The request's priority: vLLM's X-Vllm-Priority header where it holds an integer (it
        overrides the body's; another value is ignored), else the body's `priority`."""
        header = raw.headers.get(PRIORITY_HEADER)
        if header is not None:
            try:
                return int(header)
            except ValueError:
                pass
        return body.priority

    def check_chars(self, n: int, param: str) -> None:
        if n > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {n} characters; this server tokenizes at most "
                                f"{self.max_prompt_chars} (--max-prompt-chars)", param=param,
                           code="context_length_exceeded")

    # ---- tokenization (one worker thread, off the event loop) ----------------------------------
    async def _in_worker(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        except APIError:
            raise
        except Exception as e:  # whatever the input made the tokenizer raise: the input's fault
            raise APIError(400, f"the tokenizer rejected the input: {e}",
                           code="invalid_value") from e

    def _thread_tokenizer(self):
        """This worker thread's own tokenizer and chat renderer (made on first use)."""
        if not hasattr(self._local, "tokenizer"):
            self._local.tokenizer = copy.deepcopy(self.tokenizer)
            self._local.chat = ChatRenderer(self._local.tokenizer, self.settings.chat_template)
        return self._local.tokenizer, self._local.chat

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer (--skip-tokenizer-init): "
                                "send prompts as token ids", param=param)

    async def encode(self, text: str, add_special_tokens: bool = True,
                     param: str = "prompt") -> list[int]:
        self._need_tokenizer(param)
        self.check_chars(len(text), param)
        return await self._in_worker(lambda: list(self._thread_tokenizer()[0].encode(
            text, add_special_tokens=add_special_tokens)))

    async def chat_token_ids(self, messages, add_generation_prompt: bool,
                             add_special_tokens: bool = False,
                             template_kwargs: dict | None = None,
                             continue_final_message: bool = False,
                             tools: list | None = None) -> tuple[str, list[int]]:
        """`tools`: the request's, for the template (vLLM passes them whatever the
        tool_choice)."""
        if self.chat is None:
            raise APIError(400, "chat needs a tokenizer; this server runs without one "
                                "(--skip-tokenizer-init)", param="messages")
        plain = [m.for_template() for m in messages]
        self.check_chars(sum(len(m["content"]) for m in plain), "messages")
        tool_dicts = template_tools(tools)

        def work() -> tuple[str, list[int]]:
            tok, chat = self._thread_tokenizer()
            try:
                text = chat.render(plain, add_generation_prompt, template_kwargs,
                                   continue_final_message, tools=tool_dicts)
            except ValueError as e:
                param = ("chat_template_kwargs" if str(e).startswith("chat_template_kwargs")
                         else "messages")
                raise APIError(400, str(e), param=param) from e
            self.check_chars(len(text), "messages")
            return text, list(tok.encode(text, add_special_tokens=add_special_tokens))

        return await self._in_worker(work)

    async def bad_words_token_ids(self, body: _SamplingRequest
                                  ) -> tuple[tuple[int, ...], ...] | None:
        """The request's bad_words as token sequences (vLLM's rules, `tokenize_bad_words`),
        tokenized in a worker thread; None when it has none."""
        if not body.bad_words:
            return None
        if self.tokenizer is None:
            raise APIError(400, "bad_words are tokenized, which needs a tokenizer; this server "
                                "runs without one (--skip-tokenizer-init)", param="bad_words",
                           code="invalid_value")
        words = list(dict.fromkeys(body.bad_words))
        self.check_chars(sum(len(w) for w in words), "bad_words")

        def work():
            tok = self._thread_tokenizer()[0]
            try:
                return tokenize_bad_words(
                    words, lambda text: tok.encode(text, add_special_tokens=False),
                    self.vocab_size)
            except ValueError as e:
                raise APIError(400, str(e), param="bad_words", code="invalid_value") from e

        return await self._in_worker(work)

    def tool_choice(self, body) -> tuple[str | None, str | None]:
        """The chat request's (tool_choice, function name), refused (400) when this server
        cannot honour it (vLLM's rules: "auto" needs --enable-auto-tool-choice, "required"
        and named functions need the tool call parser too). Answers that may hold tool calls
        keep their special tokens (vLLM's hermes parser's rule: some models' <tool_call> is
        one)."""
        choice, name = body.checked_tool_choice()
        if choice in (None, "none"):
            return choice, name
        s = self.settings
        if not (s.enable_auto_tool_choice and s.tool_call_parser):
            what = {"auto": '"auto" tool choice', "required": 'tool_choice "required"'}.get(
                choice, f"tool_choice function {name!r}")
            raise APIError(400, f"{what} requires --enable-auto-tool-choice and "
                                f"--tool-call-parser to be set (tool_choice \"none\" needs "
                                f"neither)", param="tool_choice", code="unsupported_parameter")
        body.skip_special_tokens = False
        return choice, name

    def tool_constraint(self, body, choice: str | None, name: str | None
                        ) -> StructuredOutputsParams | None:
        """vLLM's constraint for a forced tool call: "required", an array of calls; a named
        function, its parameters (no structured outputs may come with it). It keeps the
        request's structured_outputs.disable_any_whitespace (vLLM drops it)."""
        compact = bool((body.structured_outputs or {}).get("disable_any_whitespace"))
        tools = [t.model_dump() for t in body.chat_tools()]
        if choice == "required":
            return StructuredOutputsParams(json=required_schema(tools, body.parallel_tool_calls),
                                           disable_any_whitespace=compact)
        if choice == "function":
            if any((body.structured_outputs or {}).get(k) is not None
                   for k in ("json", "regex", "choice")):
                raise APIError(400, "structured_outputs cannot come with a named tool_choice "
                                    "(its parameters are the constraint); use tool_choice "
                                    "\"auto\" or \"required\"", param="structured_outputs",
                               code="invalid_value")
            return StructuredOutputsParams(json=named_schema(tools, name),
                                           disable_any_whitespace=compact)
        return None

    async def structured_outputs(self, body: _SamplingRequest,
                                 forced: StructuredOutputsParams | None = None
                                 ) -> StructuredOutputsParams | None:
        """The request's response_format / structured_outputs (or `forced`, which overrides
        them: a tool choice's) as the engine's constraint, compiled (once per distinct
        constraint) in a worker thread: a schema, regex or grammar xgrammar cannot compile is
        a 400 naming its field, before any engine request exists."""
        spec, param = (forced, "tools") if forced else body.structured_outputs_params()
        if spec is None:
            return None
        if self.tokenizer is None:
            raise APIError(400, f"{param} needs a tokenizer; this server runs without one "
                                f"(--skip-tokenizer-init)", param=param, code="invalid_value")

        def work():
            self.engine.structured_backend(self._thread_tokenizer()[0]).compile(spec)

        try:
            await asyncio.get_running_loop().run_in_executor(self._worker, work)
        except MissingExtraError as e:
            raise APIError(400, str(e), param=param, code="unsupported_parameter") from e
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from e
        return spec

    async def chat_prompt(self, body, raw: Request, endpoint: str, messages: list,
                          add_generation_prompt: bool = True, add_special_tokens: bool = False,
                          continue_final_message: bool = False) -> ChatPrompt:
        """A chat-shaped request (chat completions, responses) checked and made into its
        prompt: the tool choice, the template's rendering of `messages` and the tools, the
        truncation, the bad words, the constraint (a forced call's, or structured outputs',
        after the reasoning under a reasoning parser)."""
        self.check_request(body)
        tool_choice, tool_name = self.tool_choice(body)
        labels = self.request_class(raw, endpoint)
        text, ids = await self.chat_token_ids(messages, add_generation_prompt, add_special_tokens,
                                              body.chat_template_kwargs, continue_final_message,
                                              body.chat_tools())
        ids = self.truncate(body, ids)
        bad_words = await self.bad_words_token_ids(body)
        parser = self.reasoning_parser
        thinking = parser is not None and parser.thinking(body.chat_template_kwargs)
        structured = self.after_reasoning(await self.structured_outputs(
            body, self.tool_constraint(body, tool_choice, tool_name)), thinking)
        return ChatPrompt(text, ids, labels, tool_choice, tool_name, thinking, bad_words,
                          structured)

    def answer_streams(self, prompt: ChatPrompt) -> tuple[Callable | None, Callable | None]:
        """A streamed chat answer's makers of its reasoning split (None without a reasoning
        parser) and its tool call extraction (None without a tool choice)."""
        parser = self.reasoning_parser
        return (partial(parser.stream, prompt.thinking) if parser else None,
                None if prompt.tool_choice in (None, "none") else partial(
                    ToolCallStream, prompt.tool_choice, prompt.tool_name,
                    self.settings.tool_call_parser))

    def split_answer(self, prompt: ChatPrompt, text: str
                     ) -> tuple[str | None, str | None, list[dict] | None]:
        """A whole chat answer's (reasoning, content, tool calls): reasoning None without a
        reasoning parser (or none given), calls None without a tool choice."""
        parser = self.reasoning_parser
        thought, content = parser.split(text, prompt.thinking) if parser else (None, text)
        if prompt.tool_choice in (None, "none"):
            return thought, content, None
        calls, content = answer_tool_calls(content or "", prompt.tool_choice, prompt.tool_name,
                                           self.settings.tool_call_parser)
        return thought, content, calls

    def after_reasoning(self, spec: StructuredOutputsParams | None, thinking: bool
                        ) -> StructuredOutputsParams | None:
        """A chat answer's constraint under a reasoning parser, as vLLM's: it starts after the
        answer's end-of-reasoning marker (</think>) when the answer starts in the reasoning and
        the server does not constrain the reasoning too."""
        if spec is None or not thinking or self.settings.structured_outputs_enable_in_reasoning:
            return spec
        return replace(spec, starts_after=REASONING_END)

    def truncate(self, body: _SamplingRequest, token_ids: list[int]) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (vLLM's), before its length is
        checked and its default max_tokens chosen."""
        try:
            return truncate_prompt(token_ids, body.truncate_prompt_tokens, self.max_model_len)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens",
                           code="invalid_value") from e

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._in_worker(lambda: self._thread_tokenizer()[0].decode(
            token_ids, skip_special_tokens=skip_special_tokens))

    def token_texts(self, prompt_token_ids: list[int],
                    skip_special_tokens: bool = True) -> TokenTexts:
        """A choice's token texts for its log-probabilities (each token's part of the text, its
        output decoded after its prompt, with the request's skip_special_tokens, as the text
        is)."""
        return TokenTexts(self.tokenizer, prompt_token_ids, skip_special_tokens)

    # ---- engine requests -----------------------------------------------------------------------
    def max_tokens_of(self, body: _SamplingRequest, n: int, requested_max: int | None,
                      default_max: int, prompt_param: str, max_param: str = "max_tokens") -> int:
        """The output budget of an `n`-token prompt: the request's, checked against the model
        length (APIError 400 naming the field), else `default_max`."""
        if n >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens; the prompt has {n} tokens (at most "
                                f"{self.max_model_len - 1} leave room for one output token).",
                           param=prompt_param, code="context_length_exceeded")
        echo_only = getattr(body, "echo_only", False)
        if requested_max is None:
            max_tokens = default_max
        elif echo_only:
            max_tokens = 1  # vLLM's: one token is computed, the answer holds the prompt alone
        else:
            if requested_max < 1:
                raise APIError(400, f"{max_param} must be at least 1 (0 only with echo=true), "
                                    f"got {requested_max}", param=max_param,
                               code="invalid_value")
            if n + requested_max > self.max_model_len:
                raise APIError(400, f"This model's maximum context length is "
                                    f"{self.max_model_len} tokens. However, you requested "
                                    f"{n + requested_max} tokens ({n} in the prompt, "
                                    f"{requested_max} for the completion). Please reduce the "
                                    f"prompt or {max_param}.", param=max_param,
                               code="context_length_exceeded")
            max_tokens = requested_max
        return max_tokens

    def make_requests(self, body: _SamplingRequest, token_ids: list[int], text: str | None,
                      request_id: str, requested_max: int | None, default_max: int,
                      prompt_param: str, max_param: str = "max_tokens",
                      bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None,
                      structured_outputs: StructuredOutputsParams | None = None,
                      priority: int = 0) -> list:
        """The n engine requests of one prompt (ids `request_id-j`; `token_ids` already
        truncated, `bad_words_token_ids` from `bad_words_token_ids`, `structured_outputs`
        from `structured_outputs`, `priority` from `priority()`); n > 1 share the prompt's
        blocks through the prefix cache, and seeded choices use seed + j. Echo with max_tokens
        0 runs max_tokens 1 (vLLM's)."""
        max_tokens = self.max_tokens_of(body, len(token_ids), requested_max, default_max,
                                        prompt_param, max_param)
        try:
            kwargs = body.sampling_kwargs()
            base = SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=body.num_logprobs,
                                  prompt_logprobs=body.num_prompt_logprobs,
                                  structured_outputs=structured_outputs)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=field if field in SAMPLING_FIELDS else None,
                           code="invalid_value") from e
        requests = []
        for j in range(body.num_choices):
            params = base.sample(j)  # sample 0 alone computes the prompt's log-probabilities,
            if body.stream:  # but each streamed choice echoes them in its first chunk
                params = replace(params, prompt_logprobs=base.prompt_logprobs)
            try:
                request = self.engine.make_request(token_ids, params,
                                                   request_id=f"{request_id}-{j}",
                                                   cache_salt=body.cache_salt,
                                                   bad_words_token_ids=bad_words_token_ids,
                                                   priority=priority,
                                                   lora_request=self.loras.get(body.model))
            except ValueError as e:
                first = str(e).split(" ", 1)[0]
                param = ("cache_salt" if "cache_salt" in str(e)
                         else "stop" if str(e).startswith("stop strings")
                         else first if first in ("bad_words", "truncate_prompt_tokens")
                         else prompt_param)
                raise APIError(400, str(e), param=param, code="invalid_value") from e
            request.prompt = text
            requests.append(request)
        return requests

    def open_streams(self, requests, request_class: tuple[str, str]) -> list[RequestStream]:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           "server_error", code="shutting_down",
                           headers={"Retry-After": str(self.settings.retry_after)})
        capacity = self.async_engine.max_in_flight
        if len(requests) > capacity:  # never admitted, however long the client waits
            raise APIError(400, f"the request asks for {len(requests)} sequences (n x prompts); "
                                f"this server holds at most {capacity} in flight "
                                f"(max_num_seqs + --max-waiting)", param="n",
                           code="invalid_value")
        try:  # all of the call's requests, or none: a refusal aborts nothing
            return self.async_engine.open_all(requests, request_class)
        except (QueueFullError, EngineDeadError) as e:
            full = isinstance(e, QueueFullError)
            if full:
                self.exporter.record_rejected()
            raise APIError(503, str(e), "server_error", code="overloaded" if full else
                           "engine_unavailable",
                           headers={"Retry-After": str(self.settings.retry_after)}) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e

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

    async def run_to_end(self, streams: list[RequestStream], raw: Request
                         ) -> tuple[list[RequestOutput], list[list]]:
        """Final outputs of all streams and each one's token logprobs; aborts them when the
        client disconnects."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        logprobs: list[list] = [[] for _ in streams]

        async def collect() -> None:
            events = self.events(streams)
            try:
                async for i, out in events:
                    logprobs[i] += out.new_logprobs or []
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
                return finals, logprobs
            raise ClientGone()
        finally:
            gone.cancel()
            work.cancel()
            for s in streams:
                s.close()

    # ---- shutdown ------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Refuse new requests (503), let in-flight ones finish for `timeout` s, then end the
        rest with an error (streams: an error event; others: a 503 body)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.async_engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.async_engine.num_in_flight:
            self.async_engine.abort_all(ShuttingDown(
                f"the server is shutting down: the request did not finish within "
                f"--shutdown-timeout {timeout:g} s and was aborted"))


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
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), "server_error", code="shutting_down")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", code="engine_unavailable",
                        headers={"Retry-After": "1"})
    return APIError(500, f"the engine failed: {e}", "server_error", code="engine_error")
