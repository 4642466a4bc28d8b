"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Unknown fields are rejected (400 naming the field) rather than silently ignored; fields OpenAI has
but nanokv does not implement are accepted only at their neutral value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanokv.sampling_params import SamplingParams

GREEDY_EPS = 1e-5  # temperatures in [0, GREEDY_EPS) decode greedily


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int = -1
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, description="a tenant's prefix-cache namespace")
    return_token_ids: bool = False  # choices carry "token_ids" (streaming: each chunk's new ids)

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for fields set to something nanokv does not implement."""
        bad = []
        if self.n != 1:
            bad.append(("n", "only n=1 is supported"))
        if self.presence_penalty != 0:
            bad.append(("presence_penalty", "presence_penalty is not supported (use 0)"))
        if self.frequency_penalty != 0:
            bad.append(("frequency_penalty", "frequency_penalty is not supported (use 0)"))
        if self.logit_bias:
            bad.append(("logit_bias", "logit_bias is not supported"))
        if self.stream_options is not None and not self.stream:
            bad.append(("stream_options", "stream_options needs stream=true"))
        return bad

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        # like vLLM, a temperature too small to divide the logits by safely means greedy
        temperature = 0.0 if 0 <= self.temperature < GREEDY_EPS else self.temperature
        return SamplingParams(
            temperature=temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        if self.echo:
            bad.append(("echo", "echo is not supported"))
        if self.logprobs is not None:
            bad.append(("logprobs", "logprobs are not supported"))
        if self.suffix:
            bad.append(("suffix", "suffix is not supported"))
        if self.best_of not in (None, 1):
            bad.append(("best_of", "only best_of=1 is supported"))
        return bad


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        if self.logprobs or self.top_logprobs:
            bad.append(("logprobs", "logprobs are not supported"))
        if self.response_format and self.response_format.get("type") != "text":
            bad.append(("response_format", "only response_format type 'text' is supported"))
        if self.tools:
            bad.append(("tools", "tool calling is not supported"))
        if self.tool_choice not in (None, "none"):
            bad.append(("tool_choice", "tool calling is not supported"))
        return bad

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
