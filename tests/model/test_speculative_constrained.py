"""Speculative decoding (n-gram drafts) for requests whose next tokens the sampler constrains:
structured outputs (a grammar's mask at every draft row, drafts the grammar refuses cut, a
grammar that starts after a text), bad_words and min_tokens (each row's banned tokens as if the
drafts before it were outputs). Oracle: the same engine without speculative_config, token for
token; every case asserts that drafts were accepted, else it would test nothing."""

from __future__ import annotations

import json
import re

import pytest

from nanokv import LLM, SamplingParams, StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
PROMPTS = ["The grass is", "def add(a, b):", "import os\n", "class Block:",
           "The sky is blue. The sky is", "print('hello world')\nprint("]
OPTIONS = dict(block_size=16, max_model_len=256)
CONSTRAINTS = {
    "regex": (dict(regex=r"(ab|cd|ef|[0-9])+"), lambda text: re.fullmatch(r"(ab|cd|ef|[0-9])+",
                                                                           text)),
    "json": (dict(json={"type": "array", "items": {"type": "integer"}},
                  disable_any_whitespace=True), lambda text: isinstance(json.loads(text), list)),
    "grammar": (dict(grammar='root ::= ("ab" | "ba" | "is ")+'),
                lambda text: re.fullmatch("(ab|ba|is )+", text)),
}


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return LLM(tiny_llama, **OPTIONS), LLM(tiny_llama, speculative_config=SPEC, **OPTIONS)


def accepted(llm: LLM) -> int:
    return llm.engine.scheduler.spec_stats.num_accepted_tokens


def both(engines, prompts, params):
    """Each engine's outputs and the drafts the speculative one accepted for them."""
    plain, spec = engines
    before = accepted(spec)
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    for llm in engines:
        llm.engine.check_invariants()
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    return want, got, accepted(spec) - before


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_structured_outputs_with_drafts_are_decoding_alone(engines, name, temperature):
    constraint, valid = CONSTRAINTS[name]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(**constraint))
    want, got, n = both(engines, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.text, o.finish_reason) for o in got] == [(o.text, o.finish_reason) for o in want]
    assert n > 0
    for o in got:
        if o.finish_reason == "stop":  # complete: valid (at max_tokens it may be cut short)
            assert valid(o.text), o.text


def test_a_grammar_starting_after_a_text_with_drafts_is_decoding_alone(engines):
    """Drafts while the grammar waits stop before the token that completes its text; the
    grammar's masks after it."""
    plain, _ = engines
    free = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)
    decode = plain.engine.tokenizer.decode
    started = 0
    for prompt, out in zip(PROMPTS, free):
        tokens = out.outputs[0].token_ids
        marker = decode(tokens[:9])[-3:]  # ends a few tokens in, in a loop the drafts follow
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=(
            StructuredOutputsParams(regex=r"(ab|cd|[0-9])+", starts_after=marker)))
        want, got, n = both(engines, [prompt], params)
        assert got[0].token_ids == want[0].token_ids and got[0].text == want[0].text
        started += want[0].token_ids[:9] == tokens[:9] and n > 0
    assert started >= 3


def test_bad_words_with_drafts_are_decoding_alone(engines):
    """The bad words are pairs of tokens the loops would repeat: a draft row bans what would
    complete one after the drafts before it."""
    plain, _ = engines
    free = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)
    tokenizer = plain.engine.tokenizer
    total = changed = 0
    for prompt, out in zip(PROMPTS, free):
        tokens = out.outputs[0].token_ids
        words = [tokenizer.decode(tokens[i:i + 2]) for i in (6, 12)]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, bad_words=words)
        want, got, n = both(engines, [prompt], params)
        assert got[0].token_ids == want[0].token_ids
        total += n
        changed += got[0].token_ids != tokens
    assert total > 0 and changed >= 3


def test_min_tokens_with_drafts_is_decoding_alone(engines):
    """The stop token is banned at the draft rows before min_tokens outputs and allowed after:
    the output ends at its first occurrence from min_tokens on."""
    plain, _ = engines
    free = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)
    total = 0
    for prompt, out in zip(PROMPTS, free):
        tokens = out.outputs[0].token_ids
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=12,
                                stop_token_ids=[tokens[3]])
        want, got, n = both(engines, [prompt], params)
        assert (got[0].token_ids, got[0].finish_reason) == (want[0].token_ids,
                                                            want[0].finish_reason)
        total += n
    assert total > 0
