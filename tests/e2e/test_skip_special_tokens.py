"""skip_special_tokens=False (vLLM's field) end to end: the tiny model with a chat-style special
token added to its tokenizer ("<|im_end|>", id 300, which the model's 320-token head generates),
so a greedy output holds it. Oracle: the Hugging Face tokenizer's own decode of the output ids,
with the same flag (byte-level BPE: the output decodes alone as after its prompt)."""

from __future__ import annotations

import os
import shutil

import pytest

from servers import OFFLINE_OPTIONS, start_in_process, stop_server
from nanokv import LLM, SamplingParams

END = "<|im_end|>"
PROMPT = "class Block:\n    def __init__(self"  # its greedy output holds END (4th token)
MESSAGES = [{"role": "user", "content": "hi"}]  # so does this chat's
KEEP = {"skip_special_tokens": False, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def special_model(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama's weights with its tokenizer plus the special token END."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny-llama-im-end"))
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if os.path.exists(os.path.join(tiny_llama, name)):
            shutil.copy(os.path.join(tiny_llama, name), path)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.add_special_tokens({"additional_special_tokens": [END]})
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(special_model):
    return LLM(special_model, **OFFLINE_OPTIONS)


@pytest.fixture(scope="module")
def client(special_model):
    from openai import OpenAI

    server = start_in_process(special_model)
    yield OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stop_server(server)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw)


def test_generate_keeps_special_tokens_when_asked(llm):
    tok, end = llm.tokenizer, llm.tokenizer.convert_tokens_to_ids(END)
    kept = llm.generate([PROMPT], greedy(skip_special_tokens=False))[0].outputs[0]
    skipped = llm.generate([PROMPT], greedy())[0].outputs[0]
    assert kept.token_ids == skipped.token_ids and end in kept.token_ids
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False)
    assert skipped.text == tok.decode(kept.token_ids, skip_special_tokens=True)
    assert END in kept.text and END not in skipped.text


def test_a_special_token_ends_a_request_as_a_stop_string_or_a_stop_token(llm):
    """stop=[END] matches the kept token's text (the text cut before it); a stop token id is
    left out of the text unless include_stop_str_in_output, as vLLM (its text then kept)."""
    tok, end = llm.tokenizer, llm.tokenizer.convert_tokens_to_ids(END)
    ids = llm.generate([PROMPT], greedy())[0].outputs[0].token_ids
    upto = tok.decode(ids[:ids.index(end) + 1], skip_special_tokens=False)
    assert upto.endswith(END)
    out = llm.generate([PROMPT], greedy(skip_special_tokens=False, stop=[END]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (upto[:-len(END)], "stop", END)
    assert llm.generate([PROMPT], greedy(stop=[END]))[0].outputs[0].finish_reason == "length"
    for include in (False, True):
        out = llm.generate([PROMPT], greedy(skip_special_tokens=False, stop_token_ids=[end],
                                            include_stop_str_in_output=include))[0].outputs[0]
        assert out.token_ids == ids[:ids.index(end) + 1] and out.finish_reason == "stop"
        assert out.text == (upto if include else upto[:-len(END)])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_keeps_special_tokens(client, llm, stream):
    """Text and log-probabilities' token strings (which add up to it) keep END."""
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24,
                                  temperature=0, logprobs=0, stream=stream, extra_body=KEEP)
    choices = [c.choices[0] for c in r if c.choices] if stream else r.choices
    text = "".join(c.text for c in choices)
    ids = [t for c in choices for t in c.token_ids or []]
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    assert text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert END in text and "".join(tokens) == text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_keeps_special_tokens(client, llm, stream):
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=24,
                                       temperature=0, logprobs=True, stream=stream,
                                       extra_body=KEEP)
    choices = [c.choices[0] for c in r if c.choices] if stream else r.choices
    text = "".join((c.delta if stream else c.message).content or "" for c in choices)
    ids = [t for c in choices for t in getattr(c, "token_ids", None) or []]
    tokens = [t.token for c in choices if c.logprobs for t in c.logprobs.content]
    assert text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert END in text and "".join(tokens) == text


def test_server_skips_special_tokens_by_default_and_stops_on_one_kept(client, llm):
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
    choice = r.choices[0]
    assert choice.text == llm.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert END not in choice.text
    chunks = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24,
                                       temperature=0, stream=True,
                                       extra_body={**KEEP, "stop": [END]})
    chunks = [c.choices[0] for c in chunks if c.choices]
    ids = choice.token_ids
    end = ids.index(llm.tokenizer.convert_tokens_to_ids(END))
    assert "".join(c.text for c in chunks) == \
        llm.tokenizer.decode(ids[:end + 1], skip_special_tokens=False)[:-len(END)]
    assert chunks[-1].finish_reason == "stop"
