"""The router's prefix prediction (nanokv/replicas/prefix_hashes.py) equals the prefix cache's
hit, block for block: same chained hashes, extra keys (KV dtype, cache salt) and look-up cap.
No Ray needed; the `nanokv serve --replicas` flags and the missing-extra message too."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import nanokv.cli as cli
from nanokv import LLM, SamplingParams
from nanokv import extras
from nanokv.replicas.prefix_hashes import (HashSpec, PromptTokenizer, matched_blocks,
                                           prompt_block_hashes)
from nanokv.engine.chat import ChatRenderer

ROOT = Path(__file__).resolve().parents[2]
BS = 16


def served_hit(llm: LLM, ids: list[int], salt: str | None = None, lora=None) -> int:
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), cache_salt=salt,
                       use_tqdm=False, lora_request=lora)[0]
    return out.num_cached_tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_predicted_hit_is_the_served_hit(tiny_llama, kv_cache_dtype):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=BS, max_model_len=512,
              kv_cache_dtype=kv_cache_dtype)
    spec = HashSpec.from_engine(llm.engine)
    cached = llm.engine.block_manager.cached
    base = [(7 * i) % 250 + 3 for i in range(5 * BS + 3)]
    assert served_hit(llm, base) == 0
    cases = [(base[:3 * BS + 5] + [1, 2, 3], None),  # shares 3 full blocks
             (base, None),  # the whole prompt cached: the last token is still computed
             (base[:4 * BS], None),  # ends on a block boundary: 3 blocks looked up
             (base[:2 * BS] + [9] * BS, None),
             (base, "tenant-a"),  # another namespace: nothing
             (base + [5], "tenant-a")]  # same namespace, once it is cached
    for ids, salt in cases:
        predicted = matched_blocks(prompt_block_hashes(ids, spec, salt), set(cached)) * BS
        assert predicted == served_hit(llm, ids, salt), (len(ids), salt)
    assert spec.extra_keys == llm.engine.block_manager.extra_keys
    assert (("kv_dtype", "torch.float32") in spec.extra_keys)



def test_predicted_hit_under_lora_adapters_is_the_served_hit(tiny_llama, tmp_path):
    """A request's LoRA adapter is part of its blocks' hashes (the body's `model` naming a
    --lora-modules entry): the router predicts no hit across adapters, a hit within one."""
    from nanokv.lora import LoRARequest
    from nanokv.replicas.prefix_hashes import body_lora_id
    from tiny_models import write_lora_adapter

    adapters = [LoRARequest(f"a{i}", i + 1, write_lora_adapter(tiny_llama, str(tmp_path / f"a{i}"),
                                                               seed=i)) for i in range(2)]
    lora_ids = {a.lora_name: a.lora_int_id for a in adapters}
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=BS, max_model_len=512, enable_lora=True,
              max_loras=2)
    spec = HashSpec.from_engine(llm.engine)
    cached = llm.engine.block_manager.cached
    base = [(5 * i) % 250 + 3 for i in range(4 * BS + 3)]
    for ids, model in ((base, None), (base, "a0"), (base + [1], "a0"), (base + [2], "a1"),
                       (base + [3], "m"), (base[:2 * BS + 1], "a1")):
        body = json.dumps({"model": model, "prompt": ids}).encode()
        lora_int_id = body_lora_id(body, lora_ids)
        predicted = matched_blocks(prompt_block_hashes(ids, spec, None, lora_int_id),
                                   set(cached)) * BS
        lora = adapters[lora_int_id - 1] if lora_int_id else None
        assert predicted == served_hit(llm, ids, lora=lora), (len(ids), model)
    assert [served_hit(llm, base + [4], lora=a) for a in (None, *adapters)] == [4 * BS] * 3
    assert body_lora_id(b"[1, 2]", lora_ids) == body_lora_id(b"{", lora_ids) == 0
    assert body_lora_id(b'{"model": 3}', lora_ids) == 0

def test_prompt_tokenizer_matches_the_server_tokenization(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BS, max_model_len=256)
    tok = llm.engine.tokenizer
    prompts = PromptTokenizer(tok)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "def add(a, b):"}]
    ids, salt = prompts.token_ids("/v1/chat/completions", json.dumps(
        {"model": "m", "messages": messages, "cache_salt": "s1"}).encode())
    text = ChatRenderer(tok).render(messages, True)
    assert ids == list(tok.encode(text, add_special_tokens=False)) and salt == "s1"
    ids, salt = prompts.token_ids("/v1/completions", json.dumps(
        {"model": "m", "prompt": "def add(a, b):"}).encode())
    assert ids == list(tok.encode("def add(a, b):", add_special_tokens=True)) and salt is None
    several = b'{"model": "m", "prompt": [[4, 5], [6]]}'  # several prompts: the first routes
    assert prompts.token_ids("/v1/completions", several) == ([4, 5], None)
    # what the server rejects, or has no prompt, is routed by load (None)
    for path, body in [("/v1/completions", b"{not json"), ("/v1/completions", b'{"x": 1}'),
                       ("/v1/models", b""), ("/v1/chat/completions", b'{"messages": []}')]:
        assert prompts.token_ids(path, body) is None
    assert PromptTokenizer(tok, max_prompt_chars=3).token_ids(
        "/v1/completions", b'{"model": "m", "prompt": "four"}') is None


def test_no_prefix_caching_predicts_nothing():
    spec = HashSpec(BS, (), enabled=False)
    assert prompt_block_hashes(list(range(100)), spec) == []
    assert prompt_block_hashes([], HashSpec(BS, (), True)) == []
    assert matched_blocks([1, 2, 3], {1, 3}) == 1


def test_serve_replicas_flags_and_missing_extra(monkeypatch, capsys):
    model = str(ROOT / "models" / "nanokv-tiny")
    assert cli.main(["serve", model, "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
    assert cli.main(["serve", model, "--replicas", "2", "--replica-cpus", "0"]) == 2
    assert "--replica-cpus must be > 0" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    assert cli.main(["serve", model, "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "nanokv serve --replicas needs the [ray] extra (missing: ray)" in err
    assert "pip install 'nanokv[ray]'" in err


def test_replica_prometheus_config_and_dashboard_row():
    import shutil
    import subprocess

    dash = json.loads((ROOT / "deploy" / "grafana" / "nanokv-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert any("by (replica)" in e for e in exprs)
    assert "replica" in {v["name"] for v in dash["templating"]["list"]}
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not installed")
    prom = ROOT / "deploy" / "prometheus"
    r = subprocess.run([tool, "check", "config", "prometheus-replicas.yml"], cwd=prom,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_router_renders_tools_and_tool_history_as_the_server(tiny_llama):
    """The replicas' router predicts a tool-calling chat's prompt as the server renders it:
    the tools and the history's tool calls / results reach the template (oracle: transformers'
    apply_chat_template with the same template)."""
    from transformers import AutoTokenizer

    template = (
        "{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call>{{ c.function | tojson }}</call>{% endfor %}"
        "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}]
    history = [{"role": "user", "content": "time?"},
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    oracle = json.loads(json.dumps(history))
    oracle[1]["tool_calls"][0]["function"]["arguments"] = {}
    text = tok.apply_chat_template(oracle, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=True)
    assert '"get_time"' in text and "noon [call_1]" in text
    ids, _ = PromptTokenizer(tok, chat_template=template).token_ids(
        "/v1/chat/completions",
        json.dumps({"model": "m", "messages": history, "tools": tools}).encode())
    assert ids == list(tok.encode(text, add_special_tokens=False))



def test_the_router_renders_a_responses_input_as_the_server(tiny_llama):
    """/v1/responses: the instructions and input items make the chat the server renders (the
    oracle: the same conversation as a chat body)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = PromptTokenizer(tok)
    items = [{"role": "user", "content": "time?"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "noon", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "again"}]}]
    ids, salt = prompts.token_ids("/v1/responses", json.dumps({
        "model": "m", "input": items, "instructions": "brief", "cache_salt": "s"}).encode())
    chat, _ = prompts.token_ids("/v1/chat/completions", json.dumps({
        "model": "m", "messages": [{"role": "system", "content": "brief"},
                                   {"role": "user", "content": "time?"},
                                   {"role": "assistant", "content": "noon"},
                                   {"role": "user", "content": "again"}]}).encode())
    assert ids == chat and salt == "s"
    assert prompts.token_ids("/v1/responses", b'{"input": []}') is None  # the server's 400
