"""Bad input: each answer is a 4xx with OpenAI's error body, and the server keeps serving.
Dropped clients: their requests are aborted and their blocks come back."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from servers import MODEL_NAME

LONG = "def add(a, b):\n    return a + b\n" * 40  # far more than 256 tokens


def completion(**kw):
    return {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 4, **kw}


def chat(**kw):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, **kw}


CASES = [
    # (id, path, body (dict, or str sent raw), status, param, code)
    ("malformed-json", "/v1/completions", '{"model": "tiny-llama", "prompt": ', 400, None,
     "invalid_json"),
    ("not-an-object", "/v1/completions", "[1, 2]", 400, None, None),
    ("empty-body", "/v1/completions", "", 400, None, None),
    ("missing-prompt", "/v1/completions", {"model": MODEL_NAME}, 400, "prompt",
     "missing_required_parameter"),
    ("seed-over-int64", "/v1/completions", completion(seed=2**63), 400, "seed", None),
    ("seed-under-int64", "/v1/chat/completions", chat(seed=-2**63 - 1), 400, "seed", None),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages",
     "missing_required_parameter"),
    ("empty-messages", "/v1/chat/completions", chat(messages=[]), 400, "messages", None),
    ("bad-role", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]),
     400, "messages", None),
    ("prompt-too-long", "/v1/completions", completion(prompt=LONG), 400, "prompt",
     "context_length_exceeded"),
    ("chat-too-long", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": LONG}]), 400, "messages",
     "context_length_exceeded"),
    ("max-tokens-0", "/v1/completions", completion(max_tokens=0), 400, "max_tokens", None),
    ("max-tokens-negative", "/v1/chat/completions", chat(max_tokens=-3), 400, "max_tokens", None),
    ("max-completion-tokens-0", "/v1/chat/completions", chat(max_completion_tokens=0), 400,
     "max_completion_tokens", None),
    ("max-tokens-huge", "/v1/completions", completion(max_tokens=10**9), 400, "max_tokens",
     "context_length_exceeded"),
    ("max-tokens-not-int", "/v1/completions", completion(max_tokens="many"), 400, "max_tokens",
     None),
    ("temperature-negative", "/v1/completions", completion(temperature=-0.5), 400,
     "temperature", None),
    ("top-p-zero", "/v1/chat/completions", chat(top_p=0), 400, "top_p", None),
    ("empty-prompt", "/v1/completions", completion(prompt=""), 400, "prompt", None),
    ("token-out-of-vocab", "/v1/completions", completion(prompt=[1, 2, 10**6]), 400, "prompt",
     None),
    ("unknown-field", "/v1/completions", completion(bogus=1), 400, "bogus",
     "unknown_parameter"),
    ("n-0", "/v1/completions", completion(n=0), 400, "n", "invalid_value"),
    ("logit-bias-key-not-an-id", "/v1/completions", completion(logit_bias={"five": 10.0}), 400,
     "logit_bias", "invalid_value"),
    ("logit-bias-key-negative", "/v1/chat/completions", chat(logit_bias={"-1": 10.0}), 400,
     "logit_bias", "invalid_value"),
    ("logit-bias-key-out-of-vocab", "/v1/completions", completion(logit_bias={"1000000": 1}),
     400, "logit_bias", "invalid_value"),
    ("logit-bias-value-string", "/v1/chat/completions", chat(logit_bias={"5": "high"}), 400,
     "logit_bias", "invalid_type"),
    ("logit-bias-value-nan", "/v1/completions",
     '{"model": "tiny-llama", "prompt": "hi", "logit_bias": {"5": NaN}}', 400, "logit_bias",
     None),
    ("allowed-token-ids-empty", "/v1/completions", completion(allowed_token_ids=[]), 400,
     "allowed_token_ids", "invalid_value"),
    ("allowed-token-ids-out-of-vocab", "/v1/chat/completions",
     chat(allowed_token_ids=[5, 10**6]), 400, "allowed_token_ids", "invalid_value"),
    ("allowed-token-ids-not-a-list", "/v1/completions", completion(allowed_token_ids=5), 400,
     "allowed_token_ids", "invalid_type"),
    ("tools-without-auto-tool-choice", "/v1/chat/completions", chat(tools=[{
        "type": "function", "function": {"name": "f"}}]), 400, "tool_choice",
     "unsupported_parameter"),
    ("skip-special-tokens-not-bool", "/v1/completions", completion(skip_special_tokens="no"),
     400, "skip_special_tokens", None),
    ("chat-documents", "/v1/chat/completions", chat(documents=[{"text": "x"}]), 400,
     "documents", "unsupported_parameter"),
    ("max-tokens-0", "/v1/completions", completion(max_tokens=0), 400, "max_tokens",
     "invalid_value"),
    ("prompt-logprobs-21", "/v1/completions", completion(prompt_logprobs=21), 400,
     "prompt_logprobs", "invalid_value"),
    ("prompt-logprobs-all", "/v1/chat/completions", chat(prompt_logprobs=-1), 400,
     "prompt_logprobs", "invalid_value"),
    ("prompt-logprobs-stream", "/v1/completions", completion(prompt_logprobs=1, stream=True),
     400, "prompt_logprobs", "invalid_value"),
    ("best-of-3", "/v1/completions", completion(best_of=3), 400, "best_of",
     "unsupported_parameter"),
    ("modalities-audio", "/v1/chat/completions", chat(modalities=["text", "audio"]), 400,
     "modalities", "unsupported_parameter"),
    ("image-part", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages", None),
    ("refusal-text", "/v1/chat/completions", chat(messages=[
        {"role": "assistant", "content": None, "refusal": "no"},
        {"role": "user", "content": "hi"}]), 400, "messages", None),
    # strict types (OpenAI answers 400 to each)
    ("max-tokens-string", "/v1/completions", completion(max_tokens="12"), 400, "max_tokens",
     "invalid_type"),
    ("max-tokens-float", "/v1/completions", completion(max_tokens=12.0), 400, "max_tokens",
     "invalid_type"),
    ("stream-string", "/v1/completions", completion(stream="yes"), 400, "stream",
     "invalid_type"),
    ("stream-int", "/v1/chat/completions", chat(stream=1), 400, "stream", "invalid_type"),
    ("prompt-bool-tokens", "/v1/completions", completion(prompt=[True]), 400, "prompt", None),
    ("temperature-infinity", "/v1/completions",
     '{"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "temperature": Infinity}', 400,
     "temperature", None),
    ("temperature-nan", "/v1/chat/completions",
     '{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], '
     '"temperature": NaN}', 400, "temperature", None),
    ("temperature-1e308", "/v1/completions", completion(temperature=1e308), 400, "temperature",
     "invalid_value"),
    ("repetition-penalty-0", "/v1/completions", completion(repetition_penalty=0.0), 400,
     "repetition_penalty", "invalid_value"),
    ("presence-penalty-3", "/v1/chat/completions", chat(presence_penalty=3.0), 400,
     "presence_penalty", "invalid_value"),
    ("min-p-2", "/v1/completions", completion(min_p=2.0), 400, "min_p", "invalid_value"),
    ("logprobs-21", "/v1/completions", completion(logprobs=21), 400, "logprobs",
     "invalid_value"),
    ("top-logprobs-21", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400,
     "top_logprobs", "invalid_value"),
    ("stop-token-out-of-vocab", "/v1/completions", completion(stop_token_ids=[10**6]), 400,
     "stop_token_ids", "invalid_value"),
    ("stop-1000-strings", "/v1/completions", completion(stop=[f"s{i}" for i in range(1000)]),
     400, "stop", "invalid_value"),
    ("stop-100k-chars", "/v1/chat/completions", chat(stop="x" * 100_000), 400, "stop",
     "invalid_value"),
    # lone surrogates: JSON allows them, no tokenizer can encode them
    ("surrogate-prompt", "/v1/completions",
     '{"model": "tiny-llama", "prompt": "a\\ud800b", "max_tokens": 4}', 400, "prompt",
     "invalid_value"),
    ("surrogate-chat", "/v1/chat/completions",
     '{"model": "tiny-llama", "messages": [{"role": "user", "content": "a\\udfffb"}]}', 400,
     "messages", "invalid_value"),
    ("surrogate-tokenize", "/tokenize", '{"prompt": "\\ud83d"}', 400, "prompt",
     "invalid_value"),
    ("surrogate-stop", "/v1/completions",
     '{"model": "tiny-llama", "prompt": "hi", "stop": ["\\ud800"]}', 400, "stop",
     "invalid_value"),
    ("unknown-request-class", "/v1/completions", completion(), 400, None, "invalid_value"),
    ("empty-stop-string", "/v1/completions", completion(stop=""), 400, "stop", "invalid_value"),
    ("empty-stop-string-stream", "/v1/chat/completions", chat(stop="", stream=True), 400,
     "stop", "invalid_value"),
    ("template-kwargs-messages", "/v1/chat/completions",
     chat(chat_template_kwargs={"messages": False}), 400, "chat_template_kwargs", None),
    ("template-kwargs-generation-prompt", "/v1/chat/completions",
     chat(chat_template_kwargs={"add_generation_prompt": False}), 400, "chat_template_kwargs",
     None),
    ("empty-cache-salt", "/v1/completions", completion(cache_salt=""), 400, "cache_salt", None),
    ("unknown-model", "/v1/completions", completion(model="gpt-9"), 404, "model",
     "model_not_found"),
    ("unknown-model-chat", "/v1/chat/completions", chat(model="gpt-9"), 404, "model",
     "model_not_found"),
    ("detokenize-bad-ids", "/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    # vLLM's truncate_prompt_tokens: -1 or [1, max_model_len]; bad_words: words that tokenize
    ("truncate-0", "/v1/completions", completion(truncate_prompt_tokens=0), 400,
     "truncate_prompt_tokens", "invalid_value"),
    ("truncate-minus-2", "/v1/chat/completions", chat(truncate_prompt_tokens=-2), 400,
     "truncate_prompt_tokens", "invalid_value"),
    ("truncate-over-context", "/v1/completions", completion(truncate_prompt_tokens=257), 400,
     "truncate_prompt_tokens", "invalid_value"),
    ("truncate-whole-context", "/v1/completions",
     completion(prompt=LONG, truncate_prompt_tokens=256), 400, "prompt",
     "context_length_exceeded"),
    ("bad-words-empty", "/v1/completions", completion(bad_words=[""]), 400, "bad_words",
     "invalid_value"),
    ("bad-words-spaces", "/v1/chat/completions", chat(bad_words=["   "]), 400, "bad_words",
     "invalid_value"),
    ("bad-words-too-many", "/v1/completions",
     completion(bad_words=[f"w{i}" for i in range(200)]), 400, "bad_words", "invalid_value"),
    ("bad-words-not-a-list", "/v1/completions", completion(bad_words="def"), 400, "bad_words",
     "invalid_type"),
    ("tokenize-nothing", "/tokenize", {}, 400, None, None),
    # structured outputs: what xgrammar cannot compile is the request's fault, never the engine's
    ("json-schema-bad-type", "/v1/chat/completions",
     chat(response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": {"type": "nope"}}}), 400,
     "response_format", "invalid_value"),
    ("json-schema-missing", "/v1/completions",
     completion(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format", "invalid_value"),
    ("structured-bad-regex", "/v1/completions", completion(structured_outputs={"regex": "("}),
     400, "structured_outputs", "invalid_value"),
    ("structured-bad-grammar", "/v1/chat/completions",
     chat(structured_outputs={"grammar": "root ::= "}), 400, "structured_outputs",
     "invalid_value"),
    ("structured-empty", "/v1/chat/completions", chat(structured_outputs={}), 400,
     "structured_outputs", "invalid_value"),
]


def assert_error_body(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_still_serving(server) -> None:
    r = httpx.post(server.url + "/v1/completions", headers=server.headers,
                   json=completion(temperature=0), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_4xx_with_openai_body(server, case):
    name, path, body, status, param, code = case
    headers = {**server.headers, "Content-Type": "application/json"}
    if name == "unknown-request-class":
        headers["X-Request-Class"] = "no-such-class"
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, headers=headers, content=content, timeout=30)
    assert_error_body(r, status, param, code)


def test_server_serves_after_bad_input(server):
    for _, path, body, *_ in CASES:
        httpx.post(server.url + path, headers={**server.headers,
                                               "Content-Type": "application/json"},
                   content=body if isinstance(body, str) else json.dumps(body), timeout=30)
    m = server.wait_idle()  # nothing running, nothing waiting, no KV block held
    assert m[("nanokv:num_requests_running", ())] == 0
    assert m[("nanokv:num_requests_waiting", ())] == 0
    assert m[("nanokv:kv_cache_usage_perc", ())] == 0
    assert_still_serving(server)
    server.assert_healthy()


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_sent_as_json_is_415_saying_so(server, content_type):
    """curl -d sends a form type: the answer names the media type (vLLM's check), not the
    fields it could not read; so does a body without a Content-Type."""
    body = json.dumps(completion(temperature=0))
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, headers={**server.headers,
                                                   "Content-Type": content_type},
                       content=body, timeout=30)
        err = assert_error_body(r, 415, code="unsupported_media_type")
        assert "application/json" in err["message"] and content_type in err["message"]
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, content=body,
                   timeout=30)  # httpx sets no Content-Type for raw content
    assert "content-type" not in {k.lower() for k in r.request.headers}
    err = assert_error_body(r, 415, code="unsupported_media_type")
    assert "no Content-Type" in err["message"]
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30, headers={
        **server.headers, "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_model_may_be_left_out(server):
    """As in vLLM: a request without `model` is served by the served model."""
    for path, body in (("/v1/completions", completion(temperature=0)),
                       ("/v1/chat/completions", chat(temperature=0))):
        del body["model"]
        r = httpx.post(server.url + path, headers=server.headers, json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL_NAME and r.json()["usage"]["completion_tokens"] == 4


def test_wrong_or_missing_api_key(server):
    for headers in ({"Authorization": "Bearer sk-wrong"}, {}, {"Authorization": "sk-nanokv-test"}):
        for path in ("/v1/completions", "/metrics", "/tokenize"):
            r = httpx.post(server.url + path, headers=headers, json=completion())
            assert_error_body(r, 401, code="invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong",
                      max_retries=0).models.list()
    assert_still_serving(server)


def test_unknown_route_and_method(server):
    assert_error_body(httpx.get(server.url + "/v1/nope", headers=server.headers), 404)
    assert_error_body(httpx.get(server.url + "/v1/completions", headers=server.headers), 405)


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def _aborted(server) -> float:
    return server.metrics()[("nanokv:request_success_total", (("finished_reason", "abort"),))]


def test_dropped_stream_frees_its_blocks(slow_server):
    server = slow_server
    idle = server.wait_idle()
    aborted = idle[("nanokv:request_success_total", (("finished_reason", "abort"),))]
    body = completion(prompt="def add(a, b):", max_tokens=240, ignore_eos=True, stream=True,
                      temperature=0)
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", headers=server.headers,
                      json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert got
            m = server.metrics()
            assert m[("nanokv:kv_cache_usage_perc", ())] > 0  # it holds blocks mid-stream
            assert m[("nanokv:num_requests_running", ())] == 1
        # leaving the block closes the connection mid-stream
    after = server.wait_idle(timeout=10)  # usage back to its idle value 0, nothing running
    assert after[("nanokv:kv_cache_usage_perc", ())] == idle[("nanokv:kv_cache_usage_perc", ())]
    assert _aborted(server) == aborted + 1
    server.assert_healthy()  # --check-invariants found the block accounting consistent
    assert_still_serving(server)


def test_client_timeout_aborts_non_streaming_request(slow_server):
    server = slow_server
    aborted = _aborted(server)
    body = completion(prompt="def add(a, b):", max_tokens=240, ignore_eos=True, temperature=0)
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=server.headers, json=body,
                   timeout=httpx.Timeout(30, read=0.3))  # the answer needs > 2.4 s
    server.wait_idle(timeout=10)
    assert _aborted(server) == aborted + 1, "the request ran on after its client left"
    assert time.monotonic() - t0 < 10
    server.assert_healthy()
