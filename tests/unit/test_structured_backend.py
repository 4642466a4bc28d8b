"""Structured outputs without a model: StructuredOutputsParams' validation, the xgrammar
backend (compile cache, errors naming the field, the extra named when xgrammar is missing) and
the sampler's bitmask path against the host reference."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from nanokv import SamplingParams, StructuredOutputsParams
from nanokv.extras import MissingExtraError
from nanokv.layers.batch_sampling import apply_token_bitmasks
from nanokv.layers.sampler import Sampler
from nanokv.structured.xgrammar_backend import GrammarBackend, choice_grammar
from tiny_models import VOCAB, build_tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("kwargs", [
    dict(json=SCHEMA), dict(json='{"type": "string"}'), dict(json_object=True),
    dict(regex="[a-z]+"), dict(choice=["yes", "no"]), dict(grammar='root ::= "a" | "b"'),
    dict(json=SCHEMA, disable_any_whitespace=True),
])
def test_one_constraint_of_the_right_type_is_accepted(kwargs):
    spec = StructuredOutputsParams(**kwargs)
    assert spec.kind == next(k for k in kwargs if k != "disable_any_whitespace")
    assert SamplingParams(structured_outputs=spec).structured_outputs is spec


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(), "exactly one of .* none is set"),
    (dict(regex="a", choice=["a"]), r"exactly one of .* 2 are set \(regex, choice\)"),
    (dict(json="{not json"), "structured_outputs.json must be a JSON schema.*not JSON"),
    (dict(json="[1, 2]"), "structured_outputs.json must be a JSON schema"),
    (dict(json=5), "structured_outputs.json must be a JSON schema"),
    (dict(json={"x": object()}), "plain JSON values"),
    (dict(json_object=False), "json_object must be true"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(regex="a\x00"), "without NUL"),
    (dict(regex=3), "regex must be a non-empty string"),
    (dict(choice=[]), "choice must be a non-empty list of non-empty strings"),
    (dict(choice="yes"), "choice must be a non-empty list"),
    (dict(choice=["a", 1]), "choice must be a non-empty list of non-empty strings"),
    (dict(grammar="  "), "grammar must be a non-empty EBNF grammar"),
    (dict(choice=["a"], disable_any_whitespace=1), "disable_any_whitespace must be true or"),
])
def test_bad_constraints_are_value_errors_saying_what_is_allowed(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_checks_the_field_again():
    with pytest.raises(ValueError, match="structured_outputs must be None or a "
                                         "StructuredOutputsParams, got dict"):
        SamplingParams(structured_outputs={"choice": ["a"]})
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    p.structured_outputs.regex = "b"  # changed after construction: two constraints
    with pytest.raises(ValueError, match="exactly one"):
        p.validate()


def test_equal_constraints_share_a_cache_key():
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "string"}})
    b = StructuredOutputsParams(json='{"a": {"type": "string"}, "b": 1}')
    assert a.key == b.key
    assert a.key != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key
    # whitespace means nothing to a regex: the same grammar
    assert (StructuredOutputsParams(regex="x").key
            == StructuredOutputsParams(regex="x", disable_any_whitespace=True).key)


def test_choice_grammar_escapes_like_vllm():
    assert choice_grammar(["a", 'say "hi"\n', "back\\slash", "\x01"]) == \
        'root ::= "a" | "say \\"hi\\"\\n" | "back\\\\slash" | "\\u0001"'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, VOCAB)


def _allowed(bitmask: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits[:VOCAB])}


def test_each_constraint_compiles_once_and_each_request_has_its_own_matcher(backend,
                                                                            tokenizer):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    before = backend.num_compiled
    a = backend.request_grammar(spec, stop_token_ids=(tokenizer.eos_token_id,))
    b = backend.request_grammar(StructuredOutputsParams(choice=["yes", "no"]),
                                stop_token_ids=(tokenizer.eos_token_id,))
    assert backend.num_compiled == before + 1
    yes = tokenizer.encode("yes", add_special_tokens=False)
    for t in yes:
        assert t in _allowed(a.allowed_bitmask())
        assert a.accept(t)
    assert _allowed(a.allowed_bitmask()) == {tokenizer.eos_token_id}  # complete: only EOS
    assert not a.is_terminated
    assert a.accept(tokenizer.eos_token_id) and a.is_terminated
    assert not b.is_terminated and yes[0] in _allowed(b.allowed_bitmask())  # its own state
    assert not b.accept(tokenizer.eos_token_id)  # nothing chosen yet: EOS is not allowed


@pytest.mark.parametrize("kwargs,field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "json"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="root ::= undefined_rule"), "grammar"),
    (dict(grammar="this is not ebnf"), "grammar"),
])
def test_what_xgrammar_cannot_compile_is_a_value_error_naming_the_field(backend, kwargs,
                                                                        field):
    with pytest.raises(ValueError, match=f"^structured_outputs.{field} must be"):
        backend.compile(StructuredOutputsParams(**kwargs))


def test_without_xgrammar_the_error_names_the_extra(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    import nanokv.extras as extras

    real = extras.importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgrammar" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r"pip install 'nanokv\[structured\]'"):
        GrammarBackend(tokenizer, VOCAB)


def _bitmask(allowed: list[int], vocab: int) -> np.ndarray:
    bits = np.zeros((vocab + 31) // 32 * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("seed", range(4))
def test_bitmask_rows_sample_only_allowed_tokens_as_the_reference(seed):
    """Mixed batches (greedy and sampled, penalties, logit_bias, banned tokens): the batched
    path equals the row-by-row reference given the allowed ids, every constrained row picks an
    allowed token, and the unconstrained rows pick what they pick without the constrained
    ones' masks."""
    rng = random.Random(seed)
    vocab, n = 100, 8  # 100: the last bitmask word is partly past the vocabulary
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = [SamplingParams(temperature=rng.choice([0, 0.8]), top_k=rng.choice([-1, 5]),
                             seed=rng.choice([None, 7]), repetition_penalty=1.2,
                             logit_bias={3: 5.0} if i % 3 == 0 else None)
              for i in range(n)]
    histories = [([1, 2], [3]) for _ in range(n)]
    indices = list(range(n))
    allowed = [sorted(rng.sample(range(vocab), rng.randint(1, 6))) if i % 2 else None
               for i in range(n)]
    allowed[1] = [vocab - 1]  # the vocabulary's last token
    masks = [None if a is None else _bitmask(a, vocab) for a in allowed]
    banned = [(int(logits[i].argmax()),) if i % 4 == 0 else () for i in range(n)]
    got = Sampler(seed).sample(logits, params, indices, histories, banned, masks).token_ids
    assert got == Sampler(seed).sample_reference(logits, params, indices, histories, banned,
                                                 allowed)
    assert all(a is None or t in a for t, a in zip(got, allowed))
    free = Sampler(seed).sample(logits, params, indices, histories, banned).token_ids
    assert all(got[i] == free[i] for i in range(n) if allowed[i] is None and params[i].greedy)


def test_apply_token_bitmasks_masks_only_the_constrained_rows():
    logits = torch.zeros(3, 40)
    out = apply_token_bitmasks(logits, [None, _bitmask([0, 33, 39], 40), None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().view(-1).tolist() == [0, 33, 39]
    assert torch.equal(logits, torch.zeros(3, 40))  # the input is left as it was
    # bit 31 of a word is its sign bit: token 31 allowed alone
    assert torch.isfinite(apply_token_bitmasks(logits[:1], [_bitmask([31], 40)])[0]) \
        .nonzero().view(-1).tolist() == [31]


def test_unconstrained_steps_cost_nothing(monkeypatch):
    import nanokv.layers.sampler as sampler_module

    def boom(*a, **k):
        raise AssertionError("no row is constrained")

    monkeypatch.setattr(sampler_module, "apply_token_bitmasks", boom)
    logits = torch.randn(2, 50)
    p = [SamplingParams(temperature=0)] * 2
    assert Sampler(0).sample(logits, p, [0, 0], None, None, [None, None]).token_ids == \
        logits.argmax(-1).tolist()


def _matcher_rows(backend, spec, eos, tokens):
    """An independent xgrammar matcher's bitmask after each prefix of tokens (the rows a
    request and its drafts sample at)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(backend.compile(spec), override_stop_tokens=[eos])
    rows = []
    for t in [*tokens, None]:
        mask = np.empty((1, (VOCAB + 31) // 32), dtype=np.int32)
        matcher.fill_next_token_bitmask(mask)
        rows.append(_allowed(mask[0]))
        if t is not None:
            assert matcher.accept_token(t)
    return rows


def test_draft_rows_cut_the_drafts_the_grammar_refuses_or_ends_on(backend, tokenizer):
    """Speculative decoding: row j's mask is the grammar's after drafts[:j] (an independent
    matcher's); drafts stop before the first the grammar refuses or that would end it; the
    request's matcher is left where it was."""
    eos = tokenizer.eos_token_id
    spec = StructuredOutputsParams(choice=["yes sir", "no"])
    grammar = backend.request_grammar(spec, stop_token_ids=(eos,))
    yes = tokenizer.encode("yes sir", add_special_tokens=False)
    no = tokenizer.encode("no", add_special_tokens=False)
    assert len(yes) >= 2
    before = _allowed(grammar.allowed_bitmask())
    for drafts, kept in [(yes, yes), (yes + [eos, yes[0]], yes),  # EOS would end the grammar
                         (yes[:1] + no, yes[:1]), (no + yes, no), (yes[1:], []), ([eos], [])]:
        got, masks = grammar.draft_rows(list(drafts))
        assert got == kept and masks.shape == (len(kept) + 1, (VOCAB + 31) // 32)
        assert [_allowed(m) for m in masks] == _matcher_rows(backend, spec, eos, kept)
        assert _allowed(grammar.allowed_bitmask()) == before  # the matcher did not move
    for t in yes:  # then the accepted drafts are fed one by one, as sampled tokens are
        assert grammar.accept(t)
    assert _allowed(grammar.allowed_bitmask()) == {eos}


def test_draft_rows_while_a_grammar_waits_are_free_up_to_its_start(backend, tokenizer):
    """starts_after: the drafts stop before the one that completes the text (the rows after
    it would be the grammar's); every row before is free."""
    spec = StructuredOutputsParams(regex="[0-9]+", starts_after="grass")
    grammar = backend.request_grammar(spec, stop_token_ids=(tokenizer.eos_token_id,),
                                      decode=tokenizer.decode)
    tokens = tokenizer.encode("The grass is green", add_special_tokens=False)
    start = next(k for k in range(1, len(tokens) + 1)
                 if "grass" in tokenizer.decode(tokens[:k]))
    assert grammar.draft_rows(tokens) == (tokens[:start - 1], None)
    assert grammar.draft_rows(tokens[:start - 1]) == (tokens[:start - 1], None)
    assert grammar.accept(tokens[0]) and grammar.waiting  # fed one by one: the same start
    assert grammar.draft_rows(tokens[1:]) == (tokens[1:start - 1], None)
    for t in tokens[1:start]:
        assert grammar.accept(t)
    assert not grammar.waiting
