"""/v1/completions echo and vLLM's prompt_logprobs against Hugging Face transformers' forward
pass on the shipped model: lm-evaluation-harness's `local-completions` scoring call through the
`openai` SDK, streamed echo, token-id prompts, n > 1 and chat's prompt_logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from servers import MODEL_NAME, start_in_process, stop_server
from tiny_models import load_hf

SHIPPED = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")
CONTEXT = "import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
CONTINUATION = "        return [line.rstrip() for line in f]\n"


@pytest.fixture(scope="module")
def shipped_server():
    # a small prefill chunk: the prompt's log-probabilities are computed over several steps
    s = start_in_process(SHIPPED, max_num_batched_tokens=8)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def tokenizer(shipped_server):
    return shipped_server.app.state.server.tokenizer


@pytest.fixture(scope="module")
def hf_logprobs():
    hf = load_hf(SHIPPED)

    def run(ids: list[int]) -> torch.Tensor:  # [n - 1, vocab]: row i scores token i + 1
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return run


def expected_token_logprobs(hf_logprobs, ids: list[int]) -> list[float]:
    rows = hf_logprobs(ids)
    return [float(rows[i, t]) for i, t in enumerate(ids[1:])]


def test_lm_eval_loglikelihood_call(shipped_server, tokenizer, hf_logprobs):
    """What lm-eval's local-completions sends to score a continuation: the context and the
    continuation as one prompt, echo=True, logprobs=1, max_tokens=0; it reads
    choices[0].logprobs.token_logprobs (and top_logprobs for greedy-ness)."""
    from openai import OpenAI

    client = OpenAI(base_url=shipped_server.url + "/v1", api_key="none", max_retries=0,
                    timeout=60)
    ids = tokenizer.encode(CONTEXT + CONTINUATION)
    assert len(ids) > 2 * 8
    for prompt in (CONTEXT + CONTINUATION, ids):  # lm-eval sends token ids; text works too
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True, logprobs=1,
                                      max_tokens=0, temperature=0)
        choice = r.choices[0]
        lp = choice.logprobs
        assert choice.text == tokenizer.decode(ids)  # the prompt alone
        assert len(lp.token_logprobs) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]),
                                   torch.tensor(expected_token_logprobs(hf_logprobs, ids)),
                                   atol=1e-4, rtol=0)
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i])
                                  for i in range(len(ids))]
        rows = hf_logprobs(ids)
        for i, top in enumerate(lp.top_logprobs[1:]):  # the prompt token and the best one
            best = float(rows[i].max())
            assert abs(max(top.values()) - best) < 1e-4
            assert len(top) <= 2
        assert r.usage.prompt_tokens == len(ids)


def test_lm_eval_0_4_13_payload_and_parse(shipped_server, tokenizer, hf_logprobs):
    """lm-eval 0.4.13's exact loglikelihood payload (a batch of token-id prompts, echo,
    logprobs 1, max_tokens 1, seed) and its `parse_logprobs`: the continuation's entries are
    token_logprobs[ctxlen:-1] (the last is the generated token's)."""
    from openai import OpenAI

    client = OpenAI(base_url=shipped_server.url + "/v1", api_key="none", max_retries=0,
                    timeout=60)
    context = tokenizer.encode(CONTEXT)
    continuations = [tokenizer.encode(CONTINUATION), tokenizer.encode("        pass\n")]
    prompts = [context + c for c in continuations]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, temperature=0,
                                  max_tokens=1, logprobs=1, seed=1234, echo=True)
    choices = sorted(r.choices, key=lambda c: c.index)
    assert len(choices) == 2
    for choice, prompt in zip(choices, prompts):
        ctxlen = len(context)
        values = choice.logprobs.token_logprobs[ctxlen:-1]
        tops = choice.logprobs.top_logprobs[ctxlen:-1]
        rows = hf_logprobs(prompt)  # row i scores token i + 1
        expected = [float(rows[i - 1, prompt[i]]) for i in range(ctxlen, len(prompt))]
        assert abs(sum(values) - sum(expected)) < 1e-3
        greedy = all(v == max(top.values()) for v, top in zip(values, tops))
        assert greedy == all(int(rows[i - 1].argmax()) == prompt[i]
                             for i in range(ctxlen, len(prompt)))


def test_echo_with_output_and_prompt_logprobs_field(shipped_server, tokenizer, hf_logprobs):
    """echo with max_tokens > 0: the prompt's entries then the output's; vLLM's
    prompt_logprobs field in the choice; n = 2 choices share the prompt's values."""
    ids = tokenizer.encode(CONTEXT)
    body = {"model": MODEL_NAME, "prompt": CONTEXT, "echo": True, "logprobs": 2,
            "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2,
            "prompt_logprobs": 3}
    r = httpx.post(shipped_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    expected = expected_token_logprobs(hf_logprobs, ids)
    rows = hf_logprobs(ids)
    for choice in r.json()["choices"]:
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 3
        assert choice["text"].startswith(CONTEXT) and len(choice["text"]) > len(CONTEXT)
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:len(ids)]),
                                   torch.tensor(expected), atol=1e-4, rtol=0)
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for i, entry in enumerate(plp[1:]):
            token = ids[i + 1]
            mine = entry[str(token)]  # the prompt token first, then the top 3
            assert list(entry)[0] == str(token)
            assert abs(mine["logprob"] - expected[i]) < 1e-4
            assert mine["rank"] == int((rows[i] > rows[i, token]).sum()) + 1
            assert mine["decoded_token"] == tokenizer.decode([token])
            assert len(entry) in (3, 4)
            best = max(entry.values(), key=lambda e: e["logprob"])
            assert abs(best["logprob"] - float(rows[i].max())) < 1e-4


def test_streamed_echo(shipped_server, tokenizer, hf_logprobs):
    """A streamed echo: each choice's first chunk holds the prompt's text and entries; with
    max_tokens 0 nothing of the output follows."""
    ids = tokenizer.encode(CONTEXT)
    for max_tokens in (0, 4):
        body = {"model": MODEL_NAME, "prompt": ids, "echo": True, "logprobs": 1,
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", shipped_server.url + "/v1/completions", json=body,
                          timeout=60) as r:
            assert r.status_code == 200, r.read()
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(c["text"] for c in choices)
        values = [v for c in choices if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert text.startswith(tokenizer.decode(ids))
        assert len(values) == len(ids) + max_tokens
        assert values[0] is None
        torch.testing.assert_close(torch.tensor(values[1:len(ids)]),
                                   torch.tensor(expected_token_logprobs(hf_logprobs, ids)),
                                   atol=1e-4, rtol=0)
        if max_tokens == 0:
            assert text == tokenizer.decode(ids)


def test_chat_prompt_logprobs(shipped_server, hf_logprobs):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": CONTEXT}],
            "max_tokens": 2, "prompt_logprobs": 0, "return_token_ids": True}
    r = httpx.post(shipped_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    ids = data["choices"][0]["prompt_token_ids"]
    plp = data["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    got = [entry[str(t)]["logprob"] for entry, t in zip(plp[1:], ids[1:])]
    torch.testing.assert_close(torch.tensor(got),
                               torch.tensor(expected_token_logprobs(hf_logprobs, ids)),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
])
def test_refused(shipped_server, body, param):
    r = httpx.post(shipped_server.url + "/v1/completions",
                   json={"model": MODEL_NAME, "prompt": CONTEXT, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
