"""The real server through the official `openai` client: outputs equal the offline greedy ones."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from servers import API_KEY, MODEL_NAME
from nanokv import SamplingParams
from nanokv.bad_words import tokenize_bad_words
from nanokv.engine.chat import ChatRenderer

PROMPTS = ["def add(a, b):", "The grass is green. The sky", "import os\nimport sys\n",
           "class Block:\n    def __init__(self", "print('hello", "The sun is yellow.",
           "def fib(n):\n    return", "Here we go. The"]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def offline_outputs(offline, prompts, max_tokens):
    return offline.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True))


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert httpx.get(server.url + "/v1/models").status_code == 401
    # the SDK's models.retrieve; vLLM's /ping (as /health) and /version, open without a key
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.owned_by == "nanokv"
    missing = httpx.get(server.url + "/v1/models/other", headers=server.headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/v1/models/" + MODEL_NAME).status_code == 401
    for method in ("GET", "POST"):
        ping = httpx.request(method, server.url + "/ping")
        assert ping.status_code == 200 and ping.json() == {"status": "ok"}
    version = httpx.get(server.url + "/version")
    assert version.status_code == 200 and set(version.json()) == {"version"}


def test_completion_equals_offline(client, offline):
    (ref,) = offline_outputs(offline, [PROMPTS[0]], 12)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, **GREEDY)
    choice = r.choices[0]
    assert choice.token_ids == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_tiny_temperature_is_greedy(client, offline):
    (ref,) = offline_outputs(offline, [PROMPTS[2]], 6)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6,
                                  temperature=1e-30, extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text  # 1e-30 would overflow the logits: decoded greedily


def test_token_id_prompt_and_batch(client, offline):
    refs = offline_outputs(offline, [[5, 6, 7, 8], [9, 10]], 6)
    r = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7, 8], [9, 10]],
                                  max_tokens=6, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.token_ids for c in r.choices] == [o.token_ids for o in refs]


def test_chat_equals_offline(server, client, offline):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "def add(a, b):"}]
    ids = httpx.post(server.url + "/tokenize", headers=server.headers,
                     json={"messages": messages}).json()["tokens"]
    assert ids == ChatRenderer(offline.tokenizer).token_ids(messages)  # the fallback template
    (ref,) = offline_outputs(offline, [ids], 10)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                       **GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].token_ids == ref.token_ids
    assert r.usage.prompt_tokens == len(ids)


def test_truncate_prompt_tokens_keeps_the_last_k_as_offline(server, client, offline):
    """vLLM's truncate_prompt_tokens (extra_body): the prompt's last k tokens, counted so in
    usage; -1 serves a prompt longer than the context with its last max_model_len - 1."""
    text = PROMPTS[1] * 4
    full = offline.tokenizer.encode(text)
    (ref,) = offline_outputs(offline, [full[-7:]], 6)
    r = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=6, temperature=0,
                                  extra_body={**GREEDY["extra_body"],
                                              "truncate_prompt_tokens": 7})
    assert r.usage.prompt_tokens == 7
    assert r.choices[0].prompt_token_ids == full[-7:]
    assert r.choices[0].token_ids == ref.token_ids
    messages = [{"role": "user", "content": text}]
    ids = httpx.post(server.url + "/tokenize", headers=server.headers,
                     json={"messages": messages}).json()["tokens"]
    (ref,) = offline_outputs(offline, [ids[-5:]], 6)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                       temperature=0, extra_body={**GREEDY["extra_body"],
                                                                  "truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5 and r.choices[0].token_ids == ref.token_ids
    r = client.completions.create(model=MODEL_NAME, prompt=text * 40, temperature=0,
                                  extra_body={"truncate_prompt_tokens": -1})
    max_model_len = httpx.get(server.url + "/v1/models",
                              headers=server.headers).json()["data"][0]["max_model_len"]
    assert r.usage.prompt_tokens == max_model_len - 1 and r.usage.completion_tokens == 1


def test_bad_words_as_offline(server, client, offline):
    """vLLM's bad_words (extra_body): the same tokens as LLM.generate with them, never the
    banned word's tokens, on completions and chat."""
    (free,) = offline_outputs(offline, [PROMPTS[0]], 12)
    tok = offline.tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    vocab = offline.engine.hf_config.vocab_size
    word = next(w for t in free.token_ids[1:] if (w := tok.decode([t]).strip())
                and (t,) in tokenize_bad_words([w], encode, vocab))
    banned = {s[0] for s in tokenize_bad_words([word], encode, vocab) if len(s) == 1}
    (ref,) = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True, bad_words=[word]))
    assert ref.token_ids != free.token_ids and not banned & set(ref.token_ids)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12,
                                  temperature=0, extra_body={**GREEDY["extra_body"],
                                                             "bad_words": [word]})
    assert r.choices[0].token_ids == ref.token_ids
    messages = [{"role": "user", "content": PROMPTS[0]}]
    ids = httpx.post(server.url + "/tokenize", headers=server.headers,
                     json={"messages": messages}).json()["tokens"]
    (ref,) = offline.generate([ids], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, bad_words=[word]))
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                       temperature=0, extra_body={**GREEDY["extra_body"],
                                                                  "bad_words": [word]})
    assert r.choices[0].token_ids == ref.token_ids and not banned & set(ref.token_ids)


def test_chat_continues_the_final_message_as_offline_chat(server, client, offline):
    """continue_final_message (vLLM's extension): the last message rendered open, the same
    prompt and tokens as `LLM.chat`; with add_generation_prompt also true it is a 400 (as
    vLLM's)."""
    messages = [{"role": "user", "content": "def add(a, b):"},
                {"role": "assistant", "content": "    return"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (ref,) = offline.chat(messages, params, add_generation_prompt=False,
                          continue_final_message=True, use_tqdm=False)
    assert ref.prompt.endswith("<|assistant|>\n    return")
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].prompt_token_ids == ref.prompt_token_ids
    assert r.choices[0].token_ids == ref.token_ids
    bad = httpx.post(server.url + "/v1/chat/completions", headers=server.headers,
                     json={"model": MODEL_NAME, "messages": messages,
                           "continue_final_message": True})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "continue_final_message"
    assert "add_generation_prompt" in bad.json()["error"]["message"]


def test_chat_echo_starts_the_content_with_the_last_message(client, offline):
    """vLLM's chat `echo`: the content starts with the last message's, where that message has
    the answer's role (the continued assistant message; any last message without a generation
    prompt, whose role the answer then takes), streamed as its own chunk after the role's;
    otherwise nothing is echoed."""
    messages = [{"role": "user", "content": "def add(a, b):"},
                {"role": "assistant", "content": "    return"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (ref,) = offline.chat(messages, params, add_generation_prompt=False,
                          continue_final_message=True, use_tqdm=False)
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, n=2,
              extra_body={"ignore_eos": True, "echo": True, "add_generation_prompt": False,
                          "continue_final_message": True})
    r = client.chat.completions.create(**kw)
    assert [c.message.content for c in r.choices] == ["    return" + ref.outputs[0].text] * 2
    assert r.usage.completion_tokens == 16  # the echo is not counted
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for i in range(2):
        deltas = [c.choices[0].delta.content for c in chunks
                  if c.choices and c.choices[0].index == i]
        assert deltas[:2] == ["", "    return"]  # the role's chunk, then the echo's
        assert "".join(d or "" for d in deltas) == r.choices[i].message.content
    assert [c.message.role for c in r.choices] == ["assistant"] * 2
    # without a generation prompt the answer continues the last message: its role (vLLM's),
    # a user's content echoed too
    user = {**kw, "messages": messages[:1]}
    r = client.chat.completions.create(**user)
    assert r.choices[0].message.role == "user"
    assert r.choices[0].message.content.startswith("def add(a, b):")
    first = next(iter(client.chat.completions.create(stream=True, **user)))
    assert first.choices[0].delta.role == "user"
    # the last message is the user's, the answer the assistant's: nothing echoed
    plain = dict(model=MODEL_NAME, messages=messages[:1], max_tokens=4, temperature=0)
    assert client.chat.completions.create(**plain, extra_body={"echo": True}).choices[
        0].message.content == client.chat.completions.create(**plain).choices[0].message.content


def test_streaming_completion_with_usage(client, offline):
    (ref,) = offline_outputs(offline, [PROMPTS[1]], 16)
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert text == ref.text and ids == ref.token_ids
    # the prompt's ids once, in the choice's first chunk (vLLM's)
    prompt_ids = [getattr(c.choices[0], "prompt_token_ids", None) for c in chunks if c.choices]
    assert prompt_ids[0] == ref.prompt_token_ids and not any(prompt_ids[1:])
    # a chunk per step, unless the reader lagged and outputs merged (RequestStream): how many
    # depends on the machine's load; one chunk per step is tests/unit/test_stream_events.py's
    assert len([c for c in chunks if c.choices]) >= 1
    assert chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 16
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streaming_chat(client, offline):
    messages = [{"role": "user", "content": "The sky is"}]
    ids = ChatRenderer(offline.tokenizer).token_ids(messages)
    (ref,) = offline_outputs(offline, [ids], 12)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    # the prompt's ids once, in the stream's first chunk (vLLM's)
    assert chunks[0].prompt_token_ids == ids
    assert not any(getattr(c, "prompt_token_ids", None) for c in chunks[1:])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == len(ids) + 12


def test_concurrent_requests_equal_offline(server, offline):
    from openai import AsyncOpenAI

    max_tokens = [8 + 3 * i for i in range(len(PROMPTS))]
    refs = [offline_outputs(offline, [p], m)[0] for p, m in zip(PROMPTS, max_tokens)]
    generated_before = server.metrics()[("nanokv:generation_tokens_total", ())]

    async def run():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        async with client:
            async def one(p, m, stream):
                if not stream:
                    r = await client.completions.create(model=MODEL_NAME, prompt=p,
                                                        max_tokens=m, **GREEDY)
                    return r.choices[0].token_ids
                ids = []
                async for c in await client.completions.create(
                        model=MODEL_NAME, prompt=p, max_tokens=m, stream=True, **GREEDY):
                    ids += c.choices[0].token_ids
                return ids
            return await asyncio.gather(*(one(p, m, i % 2 == 1) for i, (p, m) in
                                          enumerate(zip(PROMPTS, max_tokens))))

    got = asyncio.run(run())
    assert got == [r.token_ids for r in refs]
    m = server.wait_idle()
    assert m[("nanokv:generation_tokens_total", ())] - generated_before == sum(max_tokens)


def test_tokenize_detokenize(server, offline):
    r = httpx.post(server.url + "/tokenize", headers=server.headers,
                   json={"model": MODEL_NAME, "prompt": "def add(a, b):"}).json()
    assert r["tokens"] == offline.tokenizer.encode("def add(a, b):")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    d = httpx.post(server.url + "/detokenize", headers=server.headers,
                   json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "def add(a, b):"


@pytest.mark.parametrize("salt", ["tenant-a"])
def test_cache_salt_isolates_tenants(client, salt):
    prompt = "import os\nimport sys\nprint('hello world')\n" * 4  # several full blocks

    def cached(salt):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                      temperature=0, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    cached(salt)
    assert cached(salt + "-other") == 0  # another tenant sees nothing of tenant a's prefix
    assert cached(salt) >= 32  # tenant a hits its own


def test_logit_bias_and_allowed_token_ids_through_the_sdk(client, offline):
    """OpenAI's logit_bias (string token ids -> bias, clamped to [-100, 100] as vLLM's server
    does) and vLLM's allowed_token_ids, on completions and chat, as offline with the same
    SamplingParams."""
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6,
                                  logit_bias={"123": 100}, **GREEDY)
    assert r.choices[0].token_ids == [123] * 6
    messages = [{"role": "user", "content": "The sky is"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                       logit_bias={"57": 100.0}, **GREEDY)
    assert r.choices[0].token_ids == [57] * 5
    # clamped: +1000 and +100 on the two allowed tokens are both +100, so the raw logits decide
    free = offline_outputs(offline, [PROMPTS[2]], 1)[0].token_ids[0]
    other = 200 if free != 200 else 201
    allowed = [free, other]
    (ref,) = offline.generate([PROMPTS[2]], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed,
        logit_bias={free: 100.0, other: 100.0}))
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6,
        logit_bias={str(free): 100, str(other): 1000}, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed})
    assert r.choices[0].token_ids == ref.token_ids
    assert r.choices[0].token_ids[0] == free and set(ref.token_ids) <= set(allowed)
    # sampled, n > 1: never outside the allowed set
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, n=3,
                                  temperature=1.0, seed=7,
                                  extra_body={"allowed_token_ids": [10, 20, 30],
                                              "ignore_eos": True, "return_token_ids": True})
    assert all(set(c.token_ids) <= {10, 20, 30} for c in r.choices)
