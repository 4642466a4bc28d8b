"""Passkey formats (nanokv.eval.passkey_formats): every haystack x wording builds a sound sample,
the classic format is the task as it always was, and the trained / held-out split is disjoint."""

from __future__ import annotations

import itertools
import re

import pytest

from nanokv.eval import corpus, tasks
from nanokv.eval import passkey_formats as formats
from nanokv.eval.harness import EvalSettings


def byte_tok(text: str) -> list[int]:
    return list(text.encode("utf-8"))


ALL_FORMATS = [f"{h}/{w}" for h, w in itertools.product(formats.HAYSTACKS, formats.WORDINGS)]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_every_format_hides_one_key_and_asks_for_it(fmt):
    ctx = 3000
    s = tasks.passkey_sample(byte_tok, ctx, seed=11, fmt=fmt)
    haystack, wording = fmt.split("/")
    words = formats.WORDINGS[wording]
    key = s.meta["passkey"]
    assert s.answer == f" {key}" and 1 <= key <= formats.KEY_MAX
    assert s.prompt.startswith(words.header) and s.prompt.endswith(words.query)
    assert s.prompt.count(words.needle.format(key=key)) == 1
    # the key is the only number in the prompt: nothing in the haystack competes with it
    assert set(re.findall(r"\d+", s.prompt)) == {str(key)}
    # filled to within one filler unit of the budget, never over it
    assert s.prompt_tokens == len(byte_tok(s.prompt)) <= ctx
    assert s.prompt_tokens > ctx - 200
    assert tasks.score(s, s.answer) == 1.0
    assert tasks.passkey_sample(byte_tok, ctx, seed=11, fmt=fmt).prompt == s.prompt


def test_classic_is_the_kvquant_longlora_task():
    words = formats.WORDINGS["pass_key"]
    assert words.header == tasks.PASSKEY_HEADER and words.query == tasks.PASSKEY_QUERY
    for seed in range(30):
        s = tasks.passkey_sample(byte_tok, 600, seed=seed)
        assert s.meta["format"] == "classic" and s.meta["haystack"] == "grass"
        assert s.meta["passkey"] <= formats.CLASSIC_KEY_MAX
        body = s.prompt[len(tasks.PASSKEY_HEADER):-len(tasks.PASSKEY_QUERY)]
        filler = body.replace(s.meta["needle"], " ").split()
        assert all(w.strip(".") in " ".join(tasks.FILLER_SENTENCES) for w in filler)


def test_trained_and_held_out_formats_are_disjoint_and_drawn_from_their_split():
    assert not set(formats.TRAINED_HAYSTACKS) & set(formats.HELD_OUT_HAYSTACKS)
    assert not set(formats.TRAINED_WORDINGS) & set(formats.HELD_OUT_WORDINGS)
    assert set(formats.TRAINED_HAYSTACKS) | set(formats.HELD_OUT_HAYSTACKS) == \
        set(formats.HAYSTACKS)
    assert set(formats.TRAINED_WORDINGS) | set(formats.HELD_OUT_WORDINGS) == set(formats.WORDINGS)
    seen = {"trained": set(), "held_out": set()}
    for mix in seen:
        for seed in range(40):
            s = tasks.passkey_sample(byte_tok, 800, seed=seed, fmt=mix)
            seen[mix].add((s.meta["haystack"], s.meta["wording"]))
    assert {h for h, _ in seen["trained"]} == set(formats.TRAINED_HAYSTACKS)
    assert {w for _, w in seen["trained"]} == set(formats.TRAINED_WORDINGS)
    assert {h for h, _ in seen["held_out"]} == set(formats.HELD_OUT_HAYSTACKS)
    assert {w for _, w in seen["held_out"]} == set(formats.HELD_OUT_WORDINGS)


@pytest.mark.parametrize("haystack,heldout", [("code", False), ("heldout_code", True)])
def test_code_haystacks_come_from_their_side_of_the_stdlib_split(haystack, heldout):
    s = tasks.passkey_sample(byte_tok, 1500, seed=5, fmt=f"{haystack}/pass_key")
    lines = [ln for ln in s.prompt.splitlines()[1:-1] if ln and "pass key" not in ln]
    files = corpus.heldout_files() if heldout else corpus.training_files()
    sources = [corpus.read_text(p) for p in files]
    # every haystack line is a line of one file of the right split
    owners = [i for i, text in enumerate(sources) if all(ln in text for ln in lines[:20])]
    assert owners, "the haystack's lines come from no single file of the split"
    other = corpus.training_files() if heldout else corpus.heldout_files()
    assert not any(all(ln in corpus.read_text(p) for ln in lines[:20]) for p in other)


@pytest.mark.parametrize("bad", ["", "grass", "grass/nope", "nope/pass_key", "held-out"])
def test_unknown_formats_are_rejected_with_the_choices(bad):
    with pytest.raises(ValueError, match="HAYSTACK/WORDING"):
        tasks.passkey_sample(byte_tok, 600, seed=0, fmt=bad)
    with pytest.raises(ValueError, match="HAYSTACK/WORDING"):
        EvalSettings("unused", passkey_format=bad)
