"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Types are strict, as OpenAI's are: `max_tokens: "12"` or `12.0`, `stream: 1` and `prompt:
[true]` are 400s, and no float may be infinite or NaN. What real clients send is accepted the
way vLLM does:

- implemented: the sampling fields, penalties, `min_p`, `logit_bias`, `logprobs` /
  `top_logprobs`, `n`, vLLM's `prompt_logprobs`, `allowed_token_ids`, `bad_words` and
  `truncate_prompt_tokens`, structured outputs (`response_format` json_object / json_schema
  and vLLM's `structured_outputs`, chat and completions), `tools` / `tool_choice` and
  history `tool_calls` (nanokv/server/tool_calls.py), the completions' `echo` (with
  `max_tokens: 0`: the prompt alone, as vLLM's) and chat's (the last message's content first);
- bookkeeping that changes nothing (`user`, `store`, `metadata`, `service_tier`,
  `prompt_cache_key`, `safety_identifier`, `reasoning_effort`, `request_id` ...): accepted and
  ignored; `priority` (an integer) orders the request under `--scheduling-policy priority`
  and is ignored under fcfs, as in vLLM;
- fields nanokv does not implement: accepted only at the value that changes nothing
  (`best_of` = n, `modalities: ["text"]` ...), otherwise a
  400 naming the field (`unsupported()`);
- anything else is an unknown field: a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nanokv.server.tool_calls import template_tool_calls
from nanokv.structured.params import StructuredOutputsParams

MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_N = 64  # choices per prompt
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]: vLLM's server clamps a bias into it
# vLLM's structured_outputs keys: those nanokv implements, and vLLM's others (refused)
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
STRUCTURED_UNSUPPORTED = {
    "structural_tag": "structural tags are not supported",
    "whitespace_pattern": "whitespace_pattern is not supported (xgrammar ignores it in vLLM "
                          "too); disable_any_whitespace is",
    "disable_additional_properties": "disable_additional_properties is not supported (xgrammar "
                                     "ignores it in vLLM too): set additionalProperties: false "
                                     "in the schema",
}
JSON_SCHEMA_FORMAT_KEYS = ("name", "schema", "strict", "description")


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


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON allows "\\ud800";
    no tokenizer can encode it), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = find_lone_surrogate(k, path) or find_lone_surrogate(
                v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, dict, list)):
                found = find_lone_surrogate(v, f"{path}[{i}]")
                if found:
                    return found
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Body(_Strict):
    """A top-level request body: strings must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = find_lone_surrogate(data)
        if where is not None:
            raise APIError(400, f"'{where}' holds a lone UTF-16 surrogate (such as \\ud800), "
                                f"which is not valid Unicode text", param=where.split(".")[0]
                           .split("[")[0], code="invalid_value")
        return data


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class _SamplingRequest(_Body):
    model: str | None = None  # optional, as in vLLM: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # bookkeeping: accepted, ignored
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    request_id: str | None = None
    # vLLM extensions
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0  # lower is served first (--scheduling-policy priority)
    truncate_prompt_tokens: int | None = None  # -1: max_model_len - 1; checked by the server
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    # OpenAI's (chat; vLLM accepts it on completions too) and vLLM's structured_outputs object
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = Field(default=None, description="a tenant's prefix-cache namespace")
    return_token_ids: bool = False  # choices carry "token_ids" (streaming: each chunk's new ids)
    # vLLM's beam search (nanokv/server/beam_serving.py): n is the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for fields set to something nanokv does not implement."""
        bad = self._beam_search_conflicts() if self.use_beam_search else []
        if self.stream_options is not None and not self.stream:
            bad.append(("stream_options", "stream_options needs stream=true"))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                bad.append((name, f"{name} is not supported (vLLM removed it): use "
                                  f"structured_outputs {{\"{name[len('guided_'):]}\": ...}}"))
        return bad

    def _beam_search_conflicts(self) -> list[tuple[str, str]]:
        """With use_beam_search: the fields set to what a beam search does not apply (vLLM
        ignores them; nanokv says so). It applies n (the beam width), max_tokens,
        length_penalty, ignore_eos, include_stop_str_in_output, skip_special_tokens, the
        prompt's fields and the bookkeeping; temperature and seed change nothing in it."""
        given = {
            "top_p": self.top_p not in (None, 1.0), "top_k": self.top_k not in (None, 0, -1),
            "min_p": bool(self.min_p), "repetition_penalty": self.repetition_penalty
            not in (None, 1.0), "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty), "logit_bias": bool(
                self.logit_bias), "min_tokens": self.min_tokens != 0,
            "stop": bool(self.stop_list()), "stop_token_ids": bool(self.stop_token_ids),
            "bad_words": bool(self.bad_words), "allowed_token_ids": self.allowed_token_ids
            is not None, "prompt_logprobs": self.prompt_logprobs is not None,
            "logprobs": self.num_logprobs is not None,
            "structured_outputs": self.structured_outputs is not None,
            "response_format": self._response_format_constraint() != {}}
        takes = ("takes n (the beam width), max_tokens, length_penalty, ignore_eos, "
                 "include_stop_str_in_output and skip_special_tokens")
        return [(name, f"{name} is not applied by beam search (use_beam_search=true), which "
                       f"{takes}") for name, set_ in given.items() if set_]

    FORMAT_PARAM: ClassVar[str] = "response_format"  # the output format's field (Responses: text)

    def _format_given(self) -> bool:
        return self.response_format is not None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str]:
        """The request's constraint and the field it came from (response_format or
        structured_outputs): vLLM's rule, response_format's json_object / json_schema set over
        structured_outputs' fields. APIError 400 naming the field when either is malformed."""
        if not self._format_given() and self.structured_outputs is None:
            return None, ""
        fields: dict[str, Any] = {}
        if self.structured_outputs is not None:
            for key, value in self.structured_outputs.items():
                if key in STRUCTURED_UNSUPPORTED:
                    raise APIError(400, f"structured_outputs.{key}: "
                                        f"{STRUCTURED_UNSUPPORTED[key]}",
                                   param="structured_outputs", code="unsupported_parameter")
                if key not in STRUCTURED_KEYS:
                    raise APIError(400, f"structured_outputs has an unknown field {key!r}; "
                                        f"allowed: {', '.join(STRUCTURED_KEYS)}",
                                   param="structured_outputs", code="invalid_value")
                if value is not None:
                    fields[key] = value
        param = "structured_outputs"
        override = self._response_format_constraint()
        if override:
            fields.update(override)
            param = self.FORMAT_PARAM
        if not fields and self.structured_outputs is None:
            return None, ""
        try:
            return StructuredOutputsParams(**fields), param
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from e

    def _response_format_constraint(self) -> dict[str, Any]:
        """response_format as structured_outputs fields ({} for type text)."""
        rf = self.response_format
        if rf is None:
            return {}
        return format_constraint(
            rf.get("type"), rf.get("json_schema"), "response_format", "response_format",
            "response_format.json_schema", 'json_schema: {"name": ..., "schema": {a JSON schema '
            'object}, "strict": ...}')

    def sampling_kwargs(self) -> dict:
        """SamplingParams keyword arguments of the request (max_tokens, n and logprobs apart)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                             f"{temperature!r}")
        top_k = -1 if self.top_k in (None, 0) else self.top_k
        return dict(
            temperature=temperature, top_k=top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0, seed=self.seed, min_tokens=self.min_tokens,
            stop=self.stop_list(), stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self.token_logit_bias(), allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens)

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias keyed by token id, each bias clamped to [-100, 100] (vLLM's server's
        rule); ValueError naming the keys that are not integers."""
        if not self.logit_bias:
            return None
        bias, bad = {}, []
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                bad.append(key)
                continue
            bias[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
        if bad:
            raise ValueError(f"logit_bias keys must be token ids (integers written as strings, "
                             f"such as \"123\"), got {bad[:5]}")
        return bias

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The engine's prompt_logprobs: the request's (vLLM's extension)."""
        return self.prompt_logprobs

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM: a BOS token before text prompts

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        if self.use_beam_search and self.stream:  # vLLM's completions refuse it too
            bad.insert(0, ("stream", "stream=true is not supported with beam search "
                                     "(use_beam_search=true) on completions: its answer comes "
                                     "whole (chat completions stream it when it is done)"))
        if self.suffix:
            bad.append(("suffix", "suffix is not supported"))
        if self.best_of not in (None, self.num_choices):
            bad.append(("best_of", "best_of must equal n (no candidates are ranked)"))
        return bad

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's: prompt_logprobs, else with echo the logprobs (the echoed prompt's)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone (one token is still computed: vLLM's)."""
        return bool(self.echo) and self.max_tokens == 0


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolCallFunction(_Strict):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Strict):
    """An earlier answer's tool call (a history message's `tool_calls`)."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # what `message.model_dump()` of an OpenAI response carries: accepted when empty
    refusal: None = None
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[ToolCall] | None = None
    # an earlier answer's reasoning (vLLM's field, and its older name): not shown to the model
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates take it (vLLM's): role and content text, the name,
        an assistant's tool calls (arguments as dicts) and a tool result's tool_call_id (the
        server and the replicas' router render the same prompt from it)."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(
                [c.model_dump(exclude_none=True) for c in self.tool_calls])
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def format_constraint(kind, spec, param: str, name: str, spec_name: str, needs: str,
                      also_allowed: tuple[str, ...] = ()) -> dict[str, Any]:
    """An output format (chat's response_format, the Responses API's text.format) as
    structured_outputs fields: `kind` its type ("text": none, "json_object", "json_schema"),
    `spec` its schema object ({"name", "schema", "strict", "description"}). APIError 400 naming
    `param`, the format written `name`, its schema object `spec_name` (which may also hold
    `also_allowed` keys), what a json_schema format `needs`."""
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, f"{name} type 'json_schema' needs {needs}", param=param,
                           code="invalid_value")
        unknown = [k for k in spec if k not in JSON_SCHEMA_FORMAT_KEYS + also_allowed]
        if unknown:
            raise APIError(400, f"{spec_name} has unknown fields {unknown}; allowed: "
                                f"{', '.join(also_allowed + JSON_SCHEMA_FORMAT_KEYS)}",
                           param=param, code="invalid_value")
        return {"json": spec["schema"]}
    if kind in ("structural_tag", "structural_tags"):
        raise APIError(400, f"{name} type 'structural_tag' is not supported", param=param,
                       code="unsupported_parameter")
    raise APIError(400, f"{name} type must be 'text', 'json_object' or 'json_schema', got "
                        f"{kind!r}", param=param, code="invalid_value")


def checked_tool_choice(tools: list | None, names: list[str], choice,
                        named: Callable[[Any], str | None], named_form: str
                        ) -> tuple[str | None, str | None]:
    """(choice, function name) of a request, checked as vLLM checks it: choice "none", "auto",
    "required" or "function" (a named function: `named(choice)` reads its name, None when the
    choice is not one, written as `named_form`), None without tools (tools without a
    tool_choice: "auto"). APIError 400 saying what is allowed."""
    if tools == []:
        raise APIError(400, "`tools` must not be an empty array: give at least one tool or omit "
                            "the field", param="tools", code="invalid_value")
    if choice is None:
        return ("auto" if tools else None), None
    if choice == "none":
        return choice, None
    if not tools:
        raise APIError(400, "tool_choice needs `tools`", param="tool_choice",
                       code="invalid_value")
    if choice in ("auto", "required"):
        return choice, None
    name = named(choice)
    if name is None:
        raise APIError(400, f'tool_choice must be "none", "auto", "required" or {named_form}, '
                            f'got {choice!r}', param="tool_choice", code="invalid_value")
    if name not in names:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not one of "
                            f"`tools`: {names}", param="tool_choice", code="invalid_value")
    return "function", name


def template_tools(tools: list | None) -> list[dict] | None:
    """A request's tools as chat templates take them (null fields left out)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # default: "auto" with tools, else none
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None  # passed to nothing: the served models do not reason
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False  # the template already holds the special tokens it wants
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    include_reasoning: bool = True  # false: no reasoning (nor the logprobs, token ids) sent

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        if self.top_logprobs and not self.logprobs:
            bad.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        if self.functions:
            bad.append(("functions", "function calling is not supported"))
        if self.function_call not in (None, "none", "auto"):
            bad.append(("function_call", "function calling is not supported"))
        if self.modalities not in (None, ["text"]):
            bad.append(("modalities", "only the 'text' modality is supported"))
        if self.audio is not None:
            bad.append(("audio", "audio output is not supported"))
        if self.prediction is not None:
            bad.append(("prediction", "predicted outputs are not supported"))
        if self.continue_final_message and self.add_generation_prompt:
            bad.append(("continue_final_message", "continue_final_message and "
                        "add_generation_prompt cannot both be true: set add_generation_prompt "
                        "to false to continue the last message"))
        if self.chat_template is not None:
            bad.append(("chat_template", "per-request chat templates are not supported "
                                         "(the server's --chat-template applies)"))
        if self.documents:
            bad.append(("documents", "documents are not supported"))
        return bad

    @property
    def answer_role(self) -> str:
        """The answer message's role (vLLM's): assistant, or the last message's own where
        add_generation_prompt is false (the answer continues it)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str:
        """vLLM's chat `echo`: the last message's content, which the answer's content starts
        with, when that message has the answer's role; else ""."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.answer_role else ""

    def chat_tools(self) -> list[Tool]:
        """The request's function tools (for the template and the forced calls' schemas)."""
        return list(self.tools or [])

    def checked_tool_choice(self) -> tuple[str | None, str | None]:
        """(choice, function name) of the request (`checked_tool_choice`), a named function
        written {"type": "function", "function": {"name": ...}}."""
        def named(choice) -> str | None:
            function = choice.get("function") if isinstance(choice, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            ok = isinstance(name, str) and name and choice.get("type", "function") == "function" \
                and not set(choice) - {"type", "function"}
            return name if ok else None

        return checked_tool_choice(self.tools, [t.function.name for t in self.tools or []],
                                   self.tool_choice, named,
                                   '{"type": "function", "function": {"name": "my_function"}}')

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: for the chat template (vLLM's)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id, when given, must be the adapter's)."""

    lora_name: str
    lora_int_id: int | None = None
