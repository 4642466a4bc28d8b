"""`nanokv serve --enable-lora --lora-modules ...` through the openai SDK: the adapters are
listed as models, a request's `model` picks its adapter (the answer equals the offline engine's
under that LoRARequest: `LLM.generate`, whose tokens tests/model/test_lora.py holds to PEFT's),
streams too, an unknown model is a 404 naming what is served, /metrics carries vLLM's
lora_requests_info, and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter change what is
served."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from nanokv import LLM, SamplingParams
from nanokv.lora import LoRARequest
from servers import (API_KEY, MODEL_NAME, OFFLINE_OPTIONS, launch_server, start_in_process,
                     stop_server, wait_ready)
from tiny_models import build_lora_adapter

PROMPTS = ["block cache block cache", "def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {"sql": build_lora_adapter(tiny_llama, str(root / "sql"), seed=4),
            "chat": build_lora_adapter(tiny_llama, str(root / "chat"), rank=4, alpha=4,
                                       targets=("q_proj", "v_proj"), seed=5, std=0.2)}


@pytest.fixture(scope="module")
def server(tiny_llama, adapters, tmp_path_factory):
    s = wait_ready(launch_server(
        tiny_llama, str(tmp_path_factory.mktemp("lora-server")), "--enable-lora",
        "--max-loras", "2", "--allow-runtime-lora-updating",
        "--lora-modules", f"sql={adapters['sql']}",
        json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": MODEL_NAME})))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def offline(tiny_llama, adapters) -> dict[str | None, list[str]]:
    """model name -> the offline engine's greedy text of each prompt under it."""
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, **OFFLINE_OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = {}
    for name, lora in ((MODEL_NAME, None), ("sql", LoRARequest("sql", 1, adapters["sql"])),
                       ("chat", LoRARequest("chat", 2, adapters["chat"]))):
        out[name] = [o.outputs[0].text
                     for o in llm.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)]
    assert len({tuple(texts) for texts in out.values()}) == 3  # the adapters matter
    return out


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_adapters_are_listed_as_models(server, adapters):
    client = _client(server)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "sql", "chat"}
    assert cards["sql"].model_extra["parent"] == MODEL_NAME
    assert cards["chat"].model_extra["root"] == adapters["chat"]
    assert client.models.retrieve("sql").id == "sql"


def test_model_field_picks_the_adapter(server, offline):
    client = _client(server)
    for name in (MODEL_NAME, "sql", "chat"):
        for i, prompt in enumerate(PROMPTS):
            args = dict(model=name, prompt=prompt, max_tokens=16, temperature=0,
                        extra_body={"ignore_eos": True})
            answer = client.completions.create(**args)
            assert answer.model == name
            assert answer.choices[0].text == offline[name][i]
            streamed = "".join(c.choices[0].text
                               for c in client.completions.create(**args, stream=True))
            assert streamed == offline[name][i]
    # both adapters and the base model in flight at once
    batch = client.completions.create(model="sql", prompt=PROMPTS, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == offline["sql"]
    chat = client.chat.completions.create(model="chat", max_tokens=8,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "chat"
    metrics = server.wait_idle()
    info = [labels for (name, labels), _ in metrics.items()
            if name == "nanokv:lora_requests_info"]
    assert info == [(("max_lora", "2"), ("running_lora_adapters", ""),
                     ("waiting_lora_adapters", ""))]
    server.assert_healthy()


def test_unknown_model_is_a_404_naming_the_served_ones(server):
    with pytest.raises(openai.NotFoundError) as e:
        _client(server).completions.create(model="nope", prompt="x", max_tokens=2)
    assert "`nope` does not exist" in str(e.value)
    assert "`sql`" in str(e.value) and "`chat`" in str(e.value)
    server.assert_healthy()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)


def test_adapters_loaded_and_unloaded_at_runtime(server, adapters, offline):
    client = _client(server)
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "math", "lora_path": adapters["sql"]})
    assert r.status_code == 200 and "'math' added" in r.text
    assert "math" in {m.id for m in client.models.list().data}
    args = dict(prompt=PROMPTS[0], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(model="math", **args).choices[0].text == offline["sql"][0]
    for body, status, message in (
            ({"lora_name": "math", "lora_path": adapters["chat"]}, 400, "already loaded"),
            ({"lora_name": MODEL_NAME, "lora_path": adapters["chat"]}, 400,
             "the served model's"),
            ({"lora_name": "bad", "lora_path": "/nonexistent"}, 400, "is not a directory"),
            ({"lora_name": "bad"}, 400, "lora_path")):
        r = _post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "math"})
    assert r.status_code == 200 and "'math' removed" in r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="math", **args)
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "math"}).status_code == 404
    assert _post(server, "/v1/unload_lora_adapter",
                 {"lora_name": "sql", "lora_int_id": 99}).status_code == 404
    # the name again, now another adapter (a new id: no block of the old one is a hit)
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "math",
                                                "lora_path": adapters["chat"]})
    assert r.status_code == 200
    assert client.completions.create(model="math", **args).choices[0].text == offline["chat"][0]
    server.wait_idle()
    server.assert_healthy()


def test_runtime_updating_is_off_by_default(tiny_llama, adapters):
    plain = start_in_process(tiny_llama, enable_lora=True)
    try:
        r = _post(plain, "/v1/load_lora_adapter", {"lora_name": "x",
                                                   "lora_path": adapters["sql"]})
        assert r.status_code == 400
        assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    finally:
        stop_server(plain)
