"""`nanokv serve MODEL`: the OpenAI-compatible server (hooked into nanokv/cli.py)."""

from __future__ import annotations

import argparse
import os
import sys

from nanokv.server.reasoning import PARSERS
from nanokv.server.tool_calls import PARSERS as TOOL_CALL_PARSERS


def add_serve_parser(subparsers, add_engine_args, engine_options) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with Prometheus metrics",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics, /tokenize, /detokenize.")
    p.add_argument("model_dir", nargs="?", metavar="MODEL", default=None,
                   help="local Hugging Face model directory (same as --model)")
    add_engine_args(p)
    s = p.add_argument_group("server options")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: loopback only; 0.0.0.0 exposes "
                        "the server to the network)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients must send (default: MODEL as given)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: the NANOKV_API_KEY environment variable, else no key)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests allowed beyond the --max-num-seqs running ones; past "
                        "that the server answers 503 with Retry-After (default 256)")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds after which an unfinished request is aborted (504; default "
                        "600)")
    s.add_argument("--retry-after", type=int, default=1,
                   help="seconds sent in the Retry-After header of a 503 (default 1)")
    s.add_argument("--metrics-window", type=float, default=60.0,
                   help="seconds of the sliding window of the hit-rate and KV-volatility "
                        "gauges (default 60)")
    s.add_argument("--max-body-bytes", type=int, default=16 * 2**20,
                   help="largest request body in bytes; larger ones get 413 before they are "
                        "read (default 16 MiB)")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest prompt in characters that is tokenized; longer ones get 400 "
                        "(default 64 x max_model_len)")
    s.add_argument("--max-stop-strings", type=int, default=64,
                   help="most stop strings per request (default 64)")
    s.add_argument("--max-stop-length", type=int, default=1000,
                   help="longest stop string in characters (default 1000)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish while new "
                        "ones get 503; the rest then end with an error (default 30)")
    s.add_argument("--request-classes", default="", metavar="A,B,...",
                   help="allowed values of the X-Request-Class header, which labels the "
                        "prefix-cache counters (default: none; requests without the header "
                        "are class 'default')")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (default: the tokenizer's, else nanokv's "
                        "simple fallback '<|role|>\\ncontent\\n ... <|assistant|>\\n')")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(PARSERS), metavar="NAME",
                   help="split chat answers into the message's `reasoning` (the text up to "
                        "</think>) and `content` (the rest), streamed too, as vLLM's: "
                        f"{', '.join(sorted(PARSERS))}; qwen3 honours chat_template_kwargs "
                        "enable_thinking=false (all content) (default: off)")
    s.add_argument("--structured-outputs-enable-in-reasoning", action="store_true",
                   help="with --reasoning-parser: a chat answer's structured outputs (and "
                        "forced tool calls) constrain its reasoning too (vLLM's "
                        "structured_outputs_config.enable_in_reasoning); off: the constraint "
                        "starts after the answer's </think> (default: off)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="chat tool_choice \"auto\" (the default with `tools`): the answer's "
                        "tool calls, read by --tool-call-parser, become the message's "
                        "`tool_calls` (finish_reason \"tool_calls\"); \"required\" and named "
                        "functions are constrained to a valid call; streamed too (vLLM's flag; "
                        "without it only tool_choice \"none\" is served)")
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   metavar="NAME",
                   help="how tool calls are written in answers, for --enable-auto-tool-choice: "
                        "hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, "
                        "Qwen2.5 / Qwen3 / Hermes templates), llama3_json ({\"name\": ..., "
                        "\"parameters\": {...}} objects, Llama 3.1 / 3.2 / 3.3 JSON templates) "
                        "pythonic ([f(a=1), g()], Llama 3.2 / 4 pythonic templates) or "
                        "mistral ([TOOL_CALLS]name[ARGS]{...} or [TOOL_CALLS] [{\"name\": ..., "
                        "\"arguments\": {...}}], Mistral's templates; 9-character call ids) "
                        "(default: none)")
    s.add_argument("--responses-store-size", type=int, default=0, metavar="N",
                   help="keep the last N responses of /v1/responses in memory (the oldest "
                        "dropped first): GET / DELETE /v1/responses/{id}, its input_items, "
                        "previous_response_id to continue one, background responses and their "
                        "cancel (vLLM's VLLM_ENABLE_RESPONSES_API_STORE, bounded). Default 0: "
                        "none is kept, `store` is ignored; not with --replicas")
    s.add_argument("--trace-file", default=None, metavar="FILE",
                   help="append one JSON line per finished request to FILE: arrival time, "
                        "lengths, keyed block hashes (no text, no token ids), finish reason, "
                        "request class; replayed by nanokv simulate / advise --trace")
    s.add_argument("--trace-steps", default=None, metavar="FILE",
                   help="with --trace-file: also append one JSON line per engine step to FILE "
                        "(start, duration, tokens, sequences, context read; every 4th step "
                        "also times a fixed ~0.2 ms machine-speed probe); nanokv simulate "
                        "--step-log fits a step model to it")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served under their own names, "
                        "vLLM's forms: name=path or JSON {\"name\": ..., \"path\": ...}; a "
                        "request's `model` picks one (listed in /v1/models); needs "
                        "--enable-lora")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve vLLM's POST /v1/load_lora_adapter {lora_name, lora_path} and "
                        "/v1/unload_lora_adapter {lora_name} (needs --enable-lora; also on with "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as in vLLM); not with "
                        "--replicas")
    s.add_argument("--check-invariants", action="store_true",
                   help="debug: verify the block accounting whenever the engine goes idle; a "
                        "violation stops the engine and /health turns 503")
    s.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default info)")
    s.add_argument("--no-access-log", action="store_true", help="do not log every request")
    from nanokv.replicas.cli import add_replica_args

    add_replica_args(p)
    p.set_defaults(func=lambda args: cmd_serve(args, engine_options),
                   model_default=p.get_default("model"))


def runtime_lora_updating(args: argparse.Namespace) -> bool:
    """--allow-runtime-lora-updating, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (true / 1)."""
    env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower()
    return args.allow_runtime_lora_updating or env in ("1", "true")


def cmd_serve(args: argparse.Namespace, engine_options) -> int:
    import uvicorn

    from nanokv.config import EngineConfig
    from nanokv.engine.llm_engine import LLMEngine
    from nanokv.lora.request import parse_lora_modules
    from nanokv.server.openai_api import ServerSettings, build_app
    from nanokv.server.shutdown import DrainingServer

    model = args.model_dir or args.model
    if args.model_dir and args.model not in (args.model_default, args.model_dir):
        raise ValueError(f"the model is given twice ({args.model_dir!r} and --model "
                         f"{args.model!r}); give it once")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must be a non-empty name (default: the model "
                         "path)")
    if args.retry_after < 0:
        raise ValueError(f"--retry-after must be >= 0, got {args.retry_after}")
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ValueError(f"cannot read --chat-template {args.chat_template!r}: {e}") from e
    api_key = args.api_key if args.api_key is not None else os.environ.get("NANOKV_API_KEY")
    settings = ServerSettings(
        model_name=args.served_model_name or model, api_key=api_key,
        max_waiting=args.max_waiting, request_timeout=args.request_timeout,
        retry_after=args.retry_after, metrics_window=args.metrics_window,
        chat_template=template, check_invariants=args.check_invariants,
        max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
        max_stop_strings=args.max_stop_strings, max_stop_length=args.max_stop_length,
        shutdown_timeout=args.shutdown_timeout,
        request_classes=tuple(c.strip() for c in args.request_classes.split(",") if c.strip()),
        trace_file=args.trace_file, trace_steps_file=args.trace_steps,
        reasoning_parser=args.reasoning_parser,
        structured_outputs_enable_in_reasoning=args.structured_outputs_enable_in_reasoning,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, responses_store_size=args.responses_store_size,
        lora_modules=parse_lora_modules(args.lora_modules),
        allow_runtime_lora_updating=runtime_lora_updating(args))

    if settings.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if settings.allow_runtime_lora_updating and not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING) "
                         "needs --enable-lora")
    if settings.allow_runtime_lora_updating and args.replicas is not None:
        raise ValueError("--allow-runtime-lora-updating would load an adapter on one replica "
                         "only: not with --replicas (give the adapters as --lora-modules)")
    from nanokv.replicas.cli import check_replica_args

    check_replica_args(args)
    if args.replicas is not None:  # N engines on Ray Serve (nanokv/replicas)
        from nanokv.extras import require
        from nanokv.replicas.cli import serve_replicas

        require("ray", "nanokv serve --replicas")
        return serve_replicas(args, model, settings, engine_options(args))
    engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options(args)))
    for line in engine.startup_lines:
        print(f"[nanokv] {line}", file=sys.stderr)
    app = build_app(engine, settings)
    print(f"[nanokv] serving {settings.model_name!r} on http://{args.host}:{args.port} "
          f"(chat template: {app.state.server.chat.source if app.state.server.chat else '-'}; "
          f"API key: {'on' if api_key else 'off'})", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.no_access_log, timeout_graceful_shutdown=5)
    DrainingServer(config, app.state.server, settings.shutdown_timeout).run()
    return 0
