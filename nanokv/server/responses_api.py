"""OpenAI's Responses API (`POST /v1/responses`, vLLM's too), for text and function tools: the
request's `input` (a string, or items: messages, an earlier answer's reasoning, function calls
and their outputs) and `instructions` become a chat, run as a chat completion is (sampling
fields, structured outputs from `text.format`, the reasoning split under --reasoning-parser,
tool calls under the chat's tool choice and parser); the answer comes back as a response
object (`responses_output`).

With the server's response store (`--responses-store-size`, `response_store`), a request may
continue a stored response (`previous_response_id`: its conversation, then this input) and run
in the background (`background`: answered at once, queued; polled and cancelled by id).

`include: ["message.output_text.logprobs"]` gives the output text's token log-probabilities
(`top_logprobs` alternatives each).

Refused (400 naming the field): tools other than functions, `conversation`, other `include`
values, `prompt` templates, `truncation: "auto"`, input items of other kinds (files,
images, built-in tools' calls), and the chat fields the Responses API does not have (`n`,
`max_tokens`, `response_format`: use `text.format`). An earlier answer's reasoning items sent
back in `input` are accepted and not shown to the model (as chat history's reasoning)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from nanokv.sampling_params import MAX_LOGPROBS
from nanokv.server.protocol import (APIError, ChatMessage, FunctionDefinition, Tool, ToolCall,
                                    ToolCallFunction, _SamplingRequest, _Strict,
                                    checked_tool_choice, format_constraint)

INPUT_TEXT_TYPES = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value served


class InputTextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # an earlier answer's (output_text)
    logprobs: list[dict[str, Any]] | None = None


class _SentBack(_Strict):
    """An input item; one an earlier answer gave comes with its id and status."""

    id: str | None = None
    status: str | None = None


class InputMessage(_SentBack):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]

    def chat_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)
        return ChatMessage(role=self.role, content=text)


class InputReasoning(_SentBack):
    """An earlier answer's reasoning item, sent back with its output: not shown to the model
    (as chat history's reasoning)."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


class InputFunctionCall(_SentBack):
    """An earlier answer's function call, sent back: the history's assistant tool call."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class InputFunctionOutput(_SentBack):
    """A function call's result: the history's tool message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


InputItem = InputMessage | InputReasoning | InputFunctionCall | InputFunctionOutput


class ResponsesRequest(_SamplingRequest):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" |
    #                                      "json_schema", ...}, "verbosity": ...}
    reasoning: dict[str, Any] | None = None  # effort / summary: accepted, nothing reads them
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM extensions
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        if self.use_beam_search:  # the first reason given: nothing else of it applies
            return [("use_beam_search", "beam search is served on /v1/completions and "
                                        "/v1/chat/completions, not on /v1/responses")]
        bad = super().unsupported()
        for name, why in (("n", "one answer per response"), ("max_tokens", "use "
                          "max_output_tokens"), ("response_format", "use text.format"),
                          ("stream_options", "not a Responses field"),
                          ("prompt_logprobs", "logprobs are not returned")):
            value = getattr(self, name)
            if value is not None and not (name == "n" and value == 1):
                bad.append((name, f"{name} is not a Responses API field: {why}"))
        if self.conversation is not None:
            bad.append(("conversation", "conversation objects are not supported: continue a "
                                        "stored response with previous_response_id, or send "
                                        "the whole conversation as `input`"))
        k = self.top_logprobs
        if k is not None and not self.wants_logprobs and not 0 <= k <= MAX_LOGPROBS:
            bad.append(("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}"))
        unknown = [x for x in self.include or [] if x != LOGPROBS_INCLUDE]
        if unknown:
            bad.append(("include", f"include: only {LOGPROBS_INCLUDE!r} is served, got "
                                   f"{unknown}"))
        if self.prompt is not None:
            bad.append(("prompt", "prompt templates are not supported"))
        if self.truncation == "auto":
            bad.append(("truncation", "truncation \"auto\" is not supported: the input must fit"))
        return bad

    def input_list(self) -> list[InputItem]:
        """The input as items (a string: one user message)."""
        return [InputMessage(role="user", content=self.input)] if isinstance(
            self.input, str) else list(self.input)

    def messages(self, history: list[ChatMessage] = ()) -> list[ChatMessage]:
        """The chat: the instructions as a system message, the `history` (a stored response's
        conversation), then the input's messages; function calls as an assistant message's
        tool calls (consecutive ones together), their outputs as tool messages; reasoning items
        left out."""
        chat = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions is not None else []
        chat += history
        for item in self.input_list():
            if isinstance(item, InputMessage):
                chat.append(item.chat_message())
            elif isinstance(item, InputFunctionCall):
                call = ToolCall(id=item.call_id, function=ToolCallFunction(
                    name=item.name, arguments=item.arguments))
                if chat and chat[-1].role == "assistant" and chat[-1].tool_calls \
                        and not chat[-1].text():
                    chat[-1].tool_calls.append(call)
                else:
                    chat.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
            elif isinstance(item, InputFunctionOutput):
                chat.append(ChatMessage(role="tool", content=item.output,
                                        tool_call_id=item.call_id))
        if not chat:
            raise APIError(400, "input holds no message", param="input", code="invalid_value")
        return chat

    def chat_tools(self) -> list[Tool]:
        """The function tools in chat's form (for the template and the forced calls)."""
        return [Tool(function=FunctionDefinition(name=t.name, description=t.description,
                                                 parameters=t.parameters))
                for t in self.tools or []]

    def checked_tool_choice(self) -> tuple[str | None, str | None]:
        """(choice, function name) as chat's, a named function written {"type": "function",
        "name": ...}."""
        def named(choice) -> str | None:
            name = choice.get("name") if isinstance(choice, dict) else None
            ok = isinstance(name, str) and choice.get("type") == "function" \
                and set(choice) <= {"type", "name"}
            return name if ok else None

        return checked_tool_choice(self.tools, [t.name for t in self.tools or []],
                                   self.tool_choice, named,
                                   '{"type": "function", "name": "my_function"}')

    FORMAT_PARAM: ClassVar[str] = "text"

    def _format_given(self) -> bool:
        return (self.text or {}).get("format") is not None

    def _response_format_constraint(self) -> dict[str, Any]:
        """text.format as structured_outputs fields ({} for type text): set over
        structured_outputs' (its disable_any_whitespace applies), as chat's response_format."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return {}
        if not isinstance(fmt, dict):
            raise APIError(400, "text.format must be an object with a type", param="text",
                           code="invalid_value")
        return format_constraint(fmt.get("type"), fmt, "text", "text.format", "text.format",
                                 'a schema: {"type": "json_schema", "name": ..., "schema": {a '
                                 'JSON schema object}, "strict": ...}', ("type",))

    @property
    def wants_logprobs(self) -> bool:
        """include "message.output_text.logprobs": the output text's token log-probabilities
        (vLLM's rule: top_logprobs alone asks for none)."""
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def num_logprobs(self) -> int | None:
        """The engine's logprobs: top_logprobs alternatives where the logprobs are included
        (range-checked by `check_request` then, by `unsupported` otherwise)."""
        return (self.top_logprobs or 0) if self.wants_logprobs else None

    def echoed(self, store: bool = False) -> dict:
        """The request's fields a response object repeats (`store`: whether it is kept)."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "parallel_tool_calls": True if self.parallel_tool_calls is None
                else self.parallel_tool_calls,
                "tool_choice": self.tool_choice or "auto",
                "tools": [t.model_dump() for t in self.tools or []],
                "text": self.text or {"format": {"type": "text"}},
                "reasoning": self.reasoning, "metadata": self.metadata or {},
                "previous_response_id": self.previous_response_id, "store": store,
                "truncation": "disabled", "user": self.user,
                "background": bool(self.background), "service_tier": "auto"}
