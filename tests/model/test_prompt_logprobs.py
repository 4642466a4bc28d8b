"""SamplingParams.prompt_logprobs (vLLM's) against Hugging Face transformers' own forward pass
over the prompt on the shipped model: chunks spanning steps, a prompt the prefix cache holds,
n > 1, preemption."""

from pathlib import Path

import pytest
import torch

from nanokv import LLM, SamplingParams
from tiny_models import load_hf

SHIPPED = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")
TEXT = ("import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
        "        return [line.rstrip() for line in f]\n\n\nclass Block:\n"
        "    def __init__(self, block_id):\n        self.block_id = block_id\n")


@pytest.fixture(scope="module")
def hf():
    return load_hf(SHIPPED)


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[n - 1, vocab]: row i is the distribution of prompt token i + 1 given tokens <= i."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return logits[:-1].log_softmax(-1)


def check_against_hf(entries: list, prompt: list[int], expected: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for i, lp in enumerate(entries[1:]):
        row, token = expected[i], prompt[i + 1]
        assert lp.token_id == token
        assert abs(lp.logprob - float(row[token])) < 1e-4, f"position {i + 1}"
        ties = (row - row[token]).abs() < 1e-5  # a rank is ambiguous only among near-ties
        assert int((row > row[token]).sum()) + 1 <= lp.rank \
            <= int((row > row[token]).sum() + ties.sum())
        values, ids = torch.topk(row, k)
        assert len(lp.top) == k
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values,
                                   atol=1e-4, rtol=0)
        for (t, v) in lp.top:  # each alternative's value is its own (ties may reorder ids)
            assert abs(v - float(row[t])) < 1e-4


def test_prompt_logprobs_match_hf_across_chunks_cache_and_samples(hf):
    llm = LLM(SHIPPED, block_size=16, max_model_len=512, max_num_batched_tokens=16)
    prompt = llm.tokenizer.encode(TEXT)
    assert len(prompt) > 3 * 16  # the prompt spans several prefill steps
    expected = hf_prompt_logprobs(hf, prompt)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)

    first = llm.generate(prompt, params)[0]
    check_against_hf(first.prompt_logprobs, prompt, expected, 3)

    # the same prompt again: its blocks are cached, but every position must still be scored
    again = llm.generate(prompt, params)[0]
    assert again.num_cached_tokens == 0
    check_against_hf(again.prompt_logprobs, prompt, expected, 3)
    assert llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0] \
        .num_cached_tokens > 0  # a request without prompt_logprobs reads the cache

    # n = 2: one output of the prompt, its prompt log-probabilities computed by one sample
    both = llm.generate(prompt, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=3,
                                               prompt_logprobs=0))[0]
    assert len(both.outputs) == 2
    check_against_hf(both.prompt_logprobs, prompt, expected, 0)

    # the last prompt position's distribution is the first output token's, not an entry
    logprobs = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=2,
                                                   prompt_logprobs=2))[0]
    with torch.no_grad():
        last = hf(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    assert abs(logprobs.outputs[0].logprobs[0].logprob - float(last.max())) < 1e-4
    check_against_hf(logprobs.prompt_logprobs, prompt, expected, 2)


def test_prompt_logprobs_after_preemption(hf):
    """A pool too small for both requests preempts one mid-prompt or after outputs: its
    prompt log-probabilities are still complete and right."""
    llm = LLM(SHIPPED, block_size=16, max_model_len=160, max_num_batched_tokens=24,
              num_kv_blocks=10)
    tok = llm.tokenizer
    prompts = [tok.encode(TEXT[:200]), tok.encode(TEXT[40:240])]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check_against_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 1)


def test_requests_without_prompt_logprobs_get_none():
    llm = LLM(SHIPPED, block_size=16, max_model_len=128)
    out = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("value,fragment", [
    (-1, "whole vocabulary"),
    (-2, r"\[0, 20\]"),
    (21, r"\[0, 20\]"),
    (True, r"\[0, 20\]"),
    (1.0, r"\[0, 20\]"),
])
def test_prompt_logprobs_range(value, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_under_tensor_parallelism():
    """2 ranks (gloo): rank 0 gathers the logits; every rank computes each chunk's slice."""
    llm = LLM(SHIPPED, block_size=16, max_model_len=256, max_num_batched_tokens=16,
              tensor_parallel_size=2)
    try:
        prompts = [llm.tokenizer.encode(TEXT), llm.tokenizer.encode(TEXT[:90])]
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    hf = load_hf(SHIPPED)
    for prompt, out in zip(prompts, outs):
        check_against_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 2)
