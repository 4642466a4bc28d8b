"""Structured outputs through the engine on random tiny models: whatever the model would say,
the grammar makes the output valid; greedy tokens are the argmax over the tokens an independent
xgrammar matcher allows (HF transformers' logits); unconstrained rows are untouched."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import xgrammar as xgr

from nanokv import LLM, SamplingParams, StructuredOutputsParams
from tiny_models import load_hf

PROMPTS = ["The grass is", "def add(a, b):", "import os\n", "class Block:"]
SCHEMA = {"type": "object",
          "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "count"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-c]{2}"


def constrained(temperature=0.0, max_tokens=40, **spec) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, block_size=16, max_model_len=256)


def assert_idle(llm):
    llm.engine.check_invariants()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def check_schema(value) -> None:
    assert set(value) == {"color", "count"}, value
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["count"], int) and 0 <= value["count"] <= 9


def test_choice_regex_and_json_schema_are_obeyed_and_stop(llm):
    choices = ["yes", "no", "maybe so"]
    outs = llm.generate(PROMPTS, constrained(choice=choices))
    assert all(o.outputs[0].text in choices for o in outs), [o.outputs[0].text for o in outs]
    outs = llm.generate(PROMPTS, constrained(regex=REGEX))
    for o in outs:
        assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text
    # without whitespace: a random model cannot spend its tokens on runs of spaces
    outs = llm.generate(PROMPTS, constrained(json=SCHEMA, max_tokens=60,
                                             disable_any_whitespace=True))
    for o in outs:
        check_schema(json.loads(o.outputs[0].text))
        assert " " not in o.outputs[0].text
    # each ended where its grammar did: on EOS, a "stop" with no stop reason
    eos = llm.engine.eos_token_ids
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason is None and c.token_ids[-1] in eos
    # any object: its keys are free strings a random model may never close
    outs = llm.generate(PROMPTS, constrained(json_object=True, max_tokens=60,
                                             disable_any_whitespace=True))
    assert all(o.outputs[0].text.startswith("{") for o in outs)
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert done and all(isinstance(json.loads(text), dict) for text in done)
    assert_idle(llm)


def test_grammar_ends_on_a_stop_token_or_at_max_tokens(llm):
    out = llm.generate(["The grass is"], constrained(grammar='root ::= "ab" | "ba"',
                                                     max_tokens=10))[0].outputs[0]
    assert out.text in ("ab", "ba") and out.finish_reason == "stop"
    # a stop token of the request's own also ends the grammar (vLLM's: all stop tokens)
    eos = llm.engine.eos_token_ids[0]
    stop = 7
    p = constrained(choice=["x"], max_tokens=10)
    p.stop_token_ids = [stop]
    tokens = llm.generate(["The grass is"], p)[0].outputs[0]
    assert tokens.finish_reason == "stop" and tokens.token_ids[-1] in (eos, stop)
    cut = llm.generate(["The grass is"], constrained(regex="[a-c]{20}", max_tokens=5))[0]
    assert cut.outputs[0].finish_reason == "length"
    assert re.fullmatch("[a-c]*", cut.outputs[0].text)
    assert_idle(llm)


def test_unconstrained_rows_are_untouched_by_constrained_ones(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], plain)]
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:],
                         [plain, plain, constrained(regex=REGEX), constrained(choice=["a"])])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert re.fullmatch(REGEX, mixed[2].outputs[0].text) and mixed[3].outputs[0].text == "a"


def test_a_grammar_that_starts_after_a_marker(llm):
    """starts_after (a reasoning parser's end marker, a text): the output is the unconstrained
    one up to the token that completes the text's first occurrence, the grammar's after it; a
    text that never comes leaves the whole output free."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    decode = llm.engine.tokenizer.decode
    for prompt, tokens in zip(PROMPTS, free):
        marker = decode(tokens[:5])[-4:]  # may span tokens
        start = next(k for k in range(1, len(tokens) + 1) if marker in decode(tokens[:k]))
        out = llm.generate([prompt], constrained(regex=REGEX, starts_after=marker,
                                                 max_tokens=30))[0].outputs[0]
        assert out.token_ids[:start] == tokens[:start]
        assert re.fullmatch(REGEX, decode(out.token_ids[start:-1]))
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    never = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                           structured_outputs=StructuredOutputsParams(
                               regex=REGEX, starts_after="\x00never"))
    assert llm.generate(PROMPTS[:1], never)[0].outputs[0].token_ids == free[0]
    for bad in ("", [1, 2]):
        with pytest.raises(ValueError, match="starts_after"):
            StructuredOutputsParams(regex=REGEX, starts_after=bad)
    assert_idle(llm)


def test_n_samples_each_follow_their_own_matcher(llm):
    p = SamplingParams(temperature=1.0, max_tokens=10, seed=3, n=2,
                       structured_outputs=StructuredOutputsParams(regex="[a-c]{2}[0-9]"))
    out = llm.generate(["The grass is"], p)[0]
    assert len(out.outputs) == 2
    assert all(re.fullmatch("[a-c]{2}[0-9]", c.text) for c in out.outputs)
    again = llm.generate(["The grass is"], p)[0]
    assert [c.text for c in again.outputs] == [c.text for c in out.outputs]  # seeded


def test_logprobs_are_those_of_the_tokens_the_grammar_allows(llm):
    """vLLM masks the logits before its sampler: the top alternatives are allowed tokens (the
    rest are -inf) and the sampled token's probability is renormalised over them."""
    tok = llm.engine.tokenizer
    p = constrained(choice=["yes", "no"])
    p.logprobs = 3
    out = llm.generate(["The grass is"], p)[0].outputs[0]
    first = out.logprobs[0]
    firsts = {tok.encode("yes", add_special_tokens=False)[0],
              tok.encode("no", add_special_tokens=False)[0]}
    finite = [t for t, lp in first.top if lp > float("-inf")]
    assert set(finite) <= firsts and first.token_id in firsts
    assert sum(np.exp(lp) for t, lp in first.top if lp > float("-inf")) == pytest.approx(1.0)


def test_greedy_tokens_are_the_argmax_over_what_an_independent_matcher_allows(tiny_llama,
                                                                                llm):
    """The oracle: HF transformers' logits of each prefix, restricted to the tokens a fresh
    xgrammar matcher (compiled here, not by nanokv) allows after the same tokens."""
    hf = load_hf(tiny_llama)
    tok = llm.engine.tokenizer
    vocab = llm.engine.hf_config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False,
                                                             separators=(",", ":"))
    prompt = tok.encode("The sky is")
    out = llm.generate([prompt], constrained(json=SCHEMA, max_tokens=60,
                                             disable_any_whitespace=True))[0].outputs[0]
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(llm.engine.eos_token_ids))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    assert len(out.token_ids) >= 5
    for i, token in enumerate(out.token_ids):
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
        allowed = torch.from_numpy(bits.astype(bool))
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids[:i]])).logits[0, -1]
        assert token == int(logits.masked_fill(~allowed, float("-inf")).argmax()), i
        assert matcher.accept_token(token)
    assert matcher.is_terminated()


def test_preemption_keeps_each_matcher_in_step(tiny_llama, llm):
    """A pool too small for all: requests are preempted and recomputed; their outputs (and
    the grammar's state, which follows the kept output tokens) are those of a roomy run."""
    params = constrained(regex="[a-c]{30}x", max_tokens=40)
    prompts = [p * 3 for p in PROMPTS]
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = LLM(tiny_llama, block_size=16, max_model_len=128, num_kv_blocks=8)
    outs = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == roomy
    assert all(re.fullmatch("[a-c]{30}x", o.outputs[0].text) for o in outs)
    assert_idle(tight)


def test_abort_frees_the_matcher(llm):
    engine = llm.engine
    rid = engine.add_request("The grass is", constrained(regex="[a-c]{30}", max_tokens=40))
    engine.step()
    request = engine.scheduler.requests[rid]
    assert request.grammar is not None
    engine.abort(rid)
    assert request.grammar is None and request.status.value == "abort"
    assert_idle(llm)


def test_structured_outputs_need_a_tokenizer(tiny_llama):
    bare = LLM(tiny_llama, block_size=16, max_model_len=128, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="structured_outputs need a tokenizer.*"
                                         "skip_tokenizer_init=True"):
        bare.generate([[3, 4, 5]], constrained(choice=["a"]))
    assert not bare.engine.has_unfinished_requests()


def test_a_schema_xgrammar_cannot_compile_is_refused_before_queueing(llm):
    bad = constrained(json={"type": "object", "properties": {"a": {"type": "nope"}}})
    with pytest.raises(ValueError, match="structured_outputs.json must be"):
        llm.generate(["The grass is"], bad)
    assert_idle(llm)


def test_tensor_parallel_rank_0_masks_and_samples(tiny_llama, llm):
    """Two ranks (gloo): the matchers stay with rank 0, the bitmasks travel with the step (the
    other rank ignores them); the same tokens as one process."""
    params = [constrained(regex=REGEX), SamplingParams(temperature=0, max_tokens=8),
              constrained(json=SCHEMA, max_tokens=60, disable_any_whitespace=True)]
    prompts = PROMPTS[:3]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    two = LLM(tiny_llama, block_size=16, max_model_len=256, tensor_parallel_size=2)
    try:
        outs = two.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert re.fullmatch(REGEX, outs[0].outputs[0].text)
        check_schema(json.loads(outs[2].outputs[0].text))
    finally:
        two.engine.close()
