"""The training script's data rows (scripts/train_tiny.py): needle placement and determinism."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "nanokv-tiny"


@pytest.fixture(scope="module")
def train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


def needle_depths(train_tiny, tok, n: int, **kw) -> list[float]:
    """Where the needle sits in each passkey row, as a fraction of the prompt's characters."""
    rng = random.Random(7)
    depths = []
    for _ in range(n):
        name, prompt, answer = train_tiny.synthetic_row(tok, rng, 512, {"passkey": 1.0}, **kw)
        assert name == "passkey"
        text = tok.decode(prompt)
        key = tok.decode(answer).strip()
        depths.append(text.index(f"The pass key is {key}.") / len(text))
    return depths


def test_early_needle_rows_put_the_needle_in_the_first_part(train_tiny, tok):
    early = needle_depths(train_tiny, tok, 40, early_frac=1.0, early_depth=0.2)
    # the header comes first, so a depth-0.2 slot lands a little past 0.2 of the characters
    assert max(early) < 0.3, early
    uniform = needle_depths(train_tiny, tok, 40)
    assert max(uniform) > 0.6 and sum(d > 0.3 for d in uniform) >= 15, uniform


def test_early_needle_share(train_tiny, tok):
    depths = needle_depths(train_tiny, tok, 200, early_frac=0.5, early_depth=0.2)
    late = sum(d > 0.3 for d in depths) / len(depths)
    # half the rows are early; the uniform half lands past 0.3 about 70% of the time: 0.35
    assert 0.22 < late < 0.48, late


def test_make_batch_is_deterministic_and_labels_the_answer(train_tiny, tok):
    args = train_tiny.parse_args(["--lengths", "256", "--tokens-per-step", "512",
                                  "--induction-warmup", "0", "--copy-frac", "0",
                                  "--stdlib-frac", "0", "--early-needle-frac", "1",
                                  "--task-weights", "passkey=1"])
    train_ids = torch.arange(1, 5000) % 4000 + 1
    a_ids, a_cat = train_tiny.make_batch(tok, train_ids, 3, 0, 0.5, args, 0)
    b_ids, b_cat = train_tiny.make_batch(tok, train_ids, 3, 0, 0.5, args, 0)
    assert a_ids.shape == (2, 256) and (a_ids == b_ids).all() and (a_cat == b_cat).all()
    for row, cat in zip(a_ids, a_cat):
        answer = tok.decode(row[cat == 2].tolist())  # the pass key's digits, then eos
        assert answer.strip().isdigit(), answer


def test_bad_fractions_are_rejected(train_tiny):
    with pytest.raises(SystemExit):
        train_tiny.parse_args(["--early-needle-frac", "1.5"])


def test_trained_format_rows_use_only_trained_haystacks_and_wordings(train_tiny, tok):
    from nanokv.eval import passkey_formats as formats

    rng = random.Random(3)
    wordings = set()
    for _ in range(60):
        name, prompt, answer = train_tiny.synthetic_row(tok, rng, 768, {"passkey": 1.0},
                                                        passkey_format="trained")
        text, key = tok.decode(prompt), tok.decode(answer).strip()
        found = [w for w, words in formats.WORDINGS.items()
                 if words.needle.format(key=key) in text]
        assert len(found) == 1, text[:300]
        wordings.add(found[0])
    assert wordings == set(formats.TRAINED_WORDINGS)


@pytest.mark.parametrize("fmt", ["held_out", "story/pass_key", "grass/secret_code"])
def test_held_out_formats_cannot_be_trained_on(train_tiny, fmt):
    with pytest.raises(SystemExit):
        train_tiny.parse_args(["--passkey-format", fmt])
    assert train_tiny.parse_args(["--passkey-format", "code/passcode"]).passkey_format == \
        "code/passcode"
