"""`nanokv serve --reasoning-parser` through the `openai` SDK: the tiny model is made to answer
with <think> markers by a structured-outputs regex (the servers constrain the reasoning too:
--structured-outputs-enable-in-reasoning), and each answer's `reasoning` / `content` (whole and
streamed) is checked against the plain server's text of the same request. Without that flag, a
chat answer's constraint starts after its </think>."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from servers import API_KEY, MODEL_NAME, start_in_process, stop_server

THINK = "<think>[a-z]{3}</think>[a-z]{4}"
ASK = [{"role": "user", "content": "think first"}]


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def thinking(request, tiny_llama):
    """(parser name, a client of an in-process server running that parser)."""
    s = start_in_process(tiny_llama, settings=dict(reasoning_parser=request.param,
                                                   structured_outputs_enable_in_reasoning=True))
    yield request.param, OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0,
                                timeout=60)
    stop_server(s)


def _ask(client, regex: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, temperature=0, max_tokens=40,
        extra_body={"structured_outputs": {"regex": regex}, **kwargs.pop("extra_body", {})},
        **kwargs)


def _streamed(client, regex: str, **kwargs) -> tuple[list[str], list[str], list[str]]:
    """The stream's reasoning and content deltas (in the order they came, as 'r'/'c')."""
    reasoning, content, order = [], [], []
    for chunk in _ask(client, regex, stream=True, **kwargs):
        for choice in chunk.choices:
            r, c = getattr(choice.delta, "reasoning", None), choice.delta.content
            if r:
                reasoning.append(r)
                order.append("r")
            if c:
                content.append(c)
                order.append("c")
    return reasoning, content, order


@pytest.mark.parametrize("regex,split", [
    (THINK, lambda t: (t[7:10], t[18:])),
    ("[a-z]{3}</think>[a-z]{4}", lambda t: (t[:3], t[11:])),  # <think> was in the prompt
    ("<think>[a-z]{5}", lambda t: (t[7:], None)),  # never ended: all reasoning
    ("[a-z]{2}<think>[a-z]{3}</think>[a-z]{4}", lambda t: (t[:2] + t[9:12], t[20:])),
])
def test_answers_split_into_reasoning_and_content(thinking, client, regex, split):
    _, reasoner = thinking
    plain = _ask(client, regex).choices[0].message
    assert "think>" in plain.content
    expected = split(plain.content)
    message = _ask(reasoner, regex).choices[0].message
    assert (message.reasoning, message.content) == expected
    reasoning, content, order = _streamed(reasoner, regex)
    assert ("".join(reasoning), "".join(content) or None) == expected
    assert order == sorted(order, reverse=True)  # reasoning deltas, then content ones
    assert not any("<" in d or ">" in d for d in reasoning + content)  # no marker pieces


def test_enable_thinking_false_keeps_qwen3_answers_as_content(thinking, client):
    name, reasoner = thinking
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = _ask(client, THINK, extra_body=off).choices[0].message.content
    message = _ask(reasoner, THINK, extra_body=off).choices[0].message
    if name == "qwen3":
        assert (message.reasoning, message.content) == (None, plain)
        reasoning, content, _ = _streamed(reasoner, THINK, extra_body=off)
        assert (reasoning, "".join(content)) == ([], plain)
    else:  # deepseek_r1 has no such switch
        assert (message.reasoning, message.content) == (plain[7:10], plain[18:])


def test_logprobs_and_completions_are_unchanged(thinking, client):
    _, reasoner = thinking
    plain = _ask(client, THINK, logprobs=True).choices[0]
    choice = _ask(reasoner, THINK, logprobs=True).choices[0]
    assert "".join(t.token for t in choice.logprobs.content) == plain.message.content
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [t.logprob for t in plain.logprobs.content], abs=1e-4)  # all the answer's tokens
    streamed = "".join(t.token for chunk in _ask(reasoner, THINK, logprobs=True, stream=True)
                       for c in chunk.choices if c.logprobs for t in c.logprobs.content)
    assert streamed == plain.message.content
    kw = dict(model=MODEL_NAME, prompt="think", max_tokens=30, temperature=0,
              extra_body={"structured_outputs": {"regex": THINK}})
    assert reasoner.completions.create(**kw).choices[0].text == \
        client.completions.create(**kw).choices[0].text


def test_history_may_carry_reasoning_which_the_model_does_not_see(server, client):
    history = [*ASK, {"role": "assistant", "content": "abcd", "reasoning": "secret"},
               {"role": "user", "content": "again"}]
    bare = [*ASK, {"role": "assistant", "content": "abcd"}, {"role": "user", "content": "again"}]

    def prompt(messages):
        r = httpx.post(server.url + "/tokenize", timeout=30, json={"messages": messages},
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert prompt(history) == prompt(bare)
    # greedy without EOS: the history runs to max_tokens (sampled, an early EOS made it flaky)
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


def test_structured_outputs_start_after_the_reasoning(tiny_llama, client):
    """vLLM's default: the constraint waits for </think>. The tiny model never writes one, so a
    constrained answer is the unconstrained answer, all reasoning; with qwen3's
    enable_thinking false the answer starts after the reasoning: constrained from its start."""
    s = start_in_process(tiny_llama, settings=dict(reasoning_parser="qwen3"))
    try:
        reasoner = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        free = client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0,
                                              max_tokens=40).choices[0].message.content
        assert "think>" not in free
        answer = _ask(reasoner, "[a-z]{4}")  # 40 tokens
        message = answer.choices[0].message
        assert (message.reasoning, message.content) == (free, None)
        assert answer.usage.completion_tokens_details.reasoning_tokens == \
            answer.usage.completion_tokens == 40  # all reasoning
        off = _ask(reasoner, "[a-z]{4}",
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.choices[0].message.content.isalpha()
        assert len(off.choices[0].message.content) == 4
    finally:
        stop_server(s)


def _reasoning_tokens(token_ids, tokenizer_dir):
    """An oracle of the usage's reasoning tokens: the output's tokens whose text starts before
    its first </think>, but those wholly inside a <think> (prefixes decoded)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = tok.decode(token_ids)
    end = text.find("</think>") if "</think>" in text else len(text)
    starts = [i for i in range(end) if text.startswith("<think>", i)]
    count = 0
    for t in range(len(token_ids)):
        a, b = len(tok.decode(token_ids[:t])), len(tok.decode(token_ids[:t + 1]))
        if a < end and not any(s <= a and b <= s + 7 for s in starts):
            count += 1
    return count


def test_usage_counts_reasoning_tokens(thinking, client, tiny_llama):
    _, reasoner = thinking
    answer = _ask(reasoner, THINK, extra_body={"return_token_ids": True})
    ids = answer.choices[0].token_ids
    expected = _reasoning_tokens(ids, tiny_llama)
    assert 0 < expected < len(ids)
    assert answer.usage.completion_tokens_details.reasoning_tokens == expected
    last = [c for c in _ask(reasoner, THINK, stream=True,
                            stream_options={"include_usage": True})][-1]
    assert last.usage.completion_tokens_details.reasoning_tokens == expected
    # without a parser: no details
    assert _ask(client, THINK).usage.completion_tokens_details is None


def test_include_reasoning_false_sends_no_reasoning(thinking):
    _, reasoner = thinking
    full = _ask(reasoner, THINK).choices[0].message
    hidden = _ask(reasoner, THINK, logprobs=True,
                  extra_body={"include_reasoning": False, "return_token_ids": True})
    choice = hidden.choices[0]
    assert (choice.message.reasoning, choice.message.content) == (None, full.content)
    assert choice.logprobs is None and getattr(choice, "token_ids", None) is None
    reasoning, content, _ = _streamed(reasoner, THINK, logprobs=True,
                                      extra_body={"include_reasoning": False})
    assert (reasoning, "".join(content)) == ([], full.content)
    assert hidden.usage.completion_tokens_details.reasoning_tokens > 0
