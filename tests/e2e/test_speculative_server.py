"""`nanokv serve` with speculative decoding (n-gram drafts, and a draft model: the model
itself): streamed and whole completions equal a server's without it (the oracle), and /metrics
counts the drafts (vLLM's spec_decode counters)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from servers import MODEL_NAME, start_in_process, stop_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
PROMPTS = ["block cache block cache block cache block", "def add(a, b):\n    return a + b\n"
           "def add(a, b):\n    return"]


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def servers(tiny_llama, request):
    config = SPEC if request.param == "ngram" else {"model": tiny_llama,
                                                    "num_speculative_tokens": 4}
    plain = start_in_process(tiny_llama, max_model_len=256)
    spec = start_in_process(tiny_llama, max_model_len=256, speculative_config=config)
    yield plain, spec
    stop_server(plain)
    stop_server(spec)


def _complete(server, prompt, extra_body=None, **kwargs):
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40,
                                     temperature=0, extra_body={"ignore_eos": True,
                                                                **(extra_body or {})}, **kwargs)


def test_completions_equal_decoding_alone_and_drafts_are_counted(servers):
    plain, spec = servers
    for prompt in PROMPTS:
        want = _complete(plain, prompt).choices[0].text
        assert _complete(spec, prompt).choices[0].text == want
        streamed = "".join(c.choices[0].text for c in _complete(spec, prompt, stream=True))
        assert streamed == want
    metrics = spec.wait_idle()
    drafts = metrics[("nanokv:spec_decode_num_draft_tokens_total", ())]
    accepted = metrics[("nanokv:spec_decode_num_accepted_tokens_total", ())]
    assert 0 < accepted <= drafts
    assert accepted == sum(v for (name, _), v in metrics.items()
                           if name == "nanokv:spec_decode_num_accepted_tokens_per_pos_total")
    assert not any("spec_decode" in name for name, _ in plain.metrics())
    r = httpx.get(spec.url + "/health", timeout=10)
    assert r.status_code == 200


def test_structured_completions_with_drafts_equal_decoding_alone(servers):
    """The openai SDK's structured requests (vLLM's structured_outputs field and a JSON
    schema response_format) through the speculative server: the plain server's answers, with
    drafts accepted."""
    plain, spec = servers
    before = spec.wait_idle().get(("nanokv:spec_decode_num_accepted_tokens_total", ()), 0)
    regex = {"structured_outputs": {"regex": "(ab|cd|[0-9])+"}}
    for prompt in PROMPTS:
        want = _complete(plain, prompt, extra_body=regex).choices[0].text
        assert _complete(spec, prompt, extra_body=regex).choices[0].text == want
    schema = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
        "type": "array", "items": {"type": "integer"}}}}
    answers = []
    for server in servers:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        answers.append([client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=40,
            temperature=0, response_format=schema).choices[0].message.content
            for prompt in PROMPTS])
    assert answers[0] == answers[1]
    after = spec.wait_idle()[("nanokv:spec_decode_num_accepted_tokens_total", ())]
    assert after > before
