"""Fast checks of nanokv.eval: seeded tasks and the deterministic stdlib split."""

from __future__ import annotations

import pytest

from nanokv.eval import corpus, tasks
from nanokv.eval.tasks import (
    PASSKEY_QUERY,
    count_tokens,
    kv_lookup_sample,
    multikey_needle_sample,
    passkey_sample,
    score,
    variable_tracking_sample,
)


def byte_tok(text: str) -> list[int]:
    """A stand-in tokenizer: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


class WordTok:
    """A stand-in with an HF-like .encode(text, add_special_tokens=...) API."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]


BUILDERS = [
    lambda tok, ctx, seed: passkey_sample(tok, ctx, seed=seed),
    lambda tok, ctx, seed: multikey_needle_sample(tok, ctx, num_needles=4, seed=seed),
    lambda tok, ctx, seed: kv_lookup_sample(tok, ctx, seed=seed),
    lambda tok, ctx, seed: variable_tracking_sample(tok, ctx, seed=seed),
]


@pytest.mark.parametrize("build", BUILDERS)
def test_same_seed_same_sample_other_seed_differs(build):
    a, b, c = build(byte_tok, 1500, 7), build(byte_tok, 1500, 7), build(byte_tok, 1500, 8)
    assert a == b
    assert (a.prompt, a.answer) != (c.prompt, c.answer)


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("ctx", [512, 2048, 4096])
def test_context_length_within_tolerance(build, ctx):
    for seed in range(3):
        s = build(byte_tok, ctx, seed)
        n = count_tokens(byte_tok, s.prompt)
        assert n == s.prompt_tokens
        assert n <= ctx
        assert n >= ctx - 64  # within one filler sentence / one key-value pair


def test_passkey_format():
    s = passkey_sample(byte_tok, 2048, depth=0.5, seed=3)
    key = s.meta["passkey"]
    assert 1 <= key <= tasks.PASSKEY_MAX
    assert s.answer == f" {key}"
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.prompt
    assert s.prompt.endswith(PASSKEY_QUERY)
    assert "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back " \
           "again." in s.prompt


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_needle_depth_placement(depth):
    s = passkey_sample(byte_tok, 4096, depth=depth, seed=11)
    assert abs(s.depth - depth) < 0.01
    start = s.prompt.index(tasks.PASSKEY_HEADER) + len(tasks.PASSKEY_HEADER)
    end = s.prompt.index(PASSKEY_QUERY)
    where = (s.prompt.index(s.meta["needle"]) - start) / (end - start - len(s.meta["needle"]))
    assert abs(where - depth) < 0.02


def test_random_depths_cover_the_range():
    depths = [passkey_sample(byte_tok, 1024, seed=i).depth for i in range(50)]
    assert min(depths) < 0.2 and max(depths) > 0.8


def test_multikey_query_targets_one_needle():
    s = multikey_needle_sample(byte_tok, 2048, num_needles=5, depth=0.3, seed=5)
    assert abs(s.depth - 0.3) < 0.02
    target = s.meta["target"]
    key, value = s.meta["keys"][target], s.meta["values"][target]
    assert s.answer == f" {value}"
    assert sum(f"The special magic number for {k} is" in s.prompt for k in s.meta["keys"]) == 5
    assert s.prompt.rstrip().endswith(f"The special magic number for {key} is")


def test_kv_lookup_answer_is_in_the_json():
    s = kv_lookup_sample(byte_tok, 1024, depth=0.5, seed=2)
    assert f'"{s.meta["key"]}": {s.answer.strip()}' in s.prompt


def test_variable_tracking_chain_order():
    s = variable_tracking_sample(byte_tok, 2048, num_hops=3, num_chains=2, seed=4)
    chain = s.meta["chain"]
    assert len(chain) == 4
    positions = [s.prompt.index(f"VAR {v} =") for v in chain]
    assert positions == sorted(positions)
    assert s.answer.split() == chain


def test_hf_style_tokenizer_api():
    s = passkey_sample(WordTok(), 300, seed=1)
    assert s.prompt_tokens <= 300
    assert s.prompt_tokens == count_tokens(WordTok(), s.prompt)


def test_score():
    s = passkey_sample(byte_tok, 512, seed=9)
    assert score(s, s.answer + ". Remember") == 1.0
    assert score(s, " 0") == 0.0
    kv = kv_lookup_sample(byte_tok, 512, seed=9)
    assert score(kv, kv.answer) == 1.0
    vt = variable_tracking_sample(byte_tok, 1024, num_hops=3, seed=9)
    assert score(vt, " " + " ".join(vt.meta["chain"][:2])) == 0.5


def test_invalid_arguments_raise():
    with pytest.raises(ValueError):
        passkey_sample(byte_tok, 2048, depth=1.5, seed=0)
    with pytest.raises(ValueError):
        passkey_sample(byte_tok, 100, seed=0)  # the header and query alone do not fit
    with pytest.raises(ValueError):
        multikey_needle_sample(byte_tok, 2048, num_needles=0)


def test_heldout_and_training_disjoint_and_deterministic():
    held, train = corpus.heldout_files(), corpus.training_files()
    assert held and train
    assert not set(held) & set(train)
    assert set(held) | set(train) == set(corpus.all_files())
    assert held == corpus.heldout_files()
    assert 0.02 < len(held) / (len(held) + len(train)) < 0.10
    root = corpus.stdlib_root()
    for p in held:
        assert corpus.is_heldout(p.relative_to(root).as_posix())
    for p in train[:50]:
        parts = p.relative_to(root).parts
        assert not set(parts[:-1]) & corpus.EXCLUDED_DIRS


def test_is_heldout_depends_only_on_relpath():
    assert corpus.is_heldout("json/decoder.py") == corpus.is_heldout("json/decoder.py")
    with pytest.raises(ValueError):
        corpus.is_heldout("x.py", modulus=1)
