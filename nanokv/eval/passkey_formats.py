"""Passkey formats: what the haystack is made of and how the needle is worded.

A model that retrieves a pass key only in the format it was trained on has learnt a template,
not retrieval, and a KV policy ranked on it says little about real models. So the passkey task
can be drawn in other formats, split once and for all into formats a model may train on
(`TRAINED_*`) and formats kept out of training for evaluation (`HELD_OUT_*`):

haystacks (the filler the needle hides in)
- grass: the KVQuant / LongLoRA filler "The grass is green. ..." repeated (trained)
- prose: generated sentences over one vocabulary (trained)
- code: consecutive lines of a stdlib file from the training split (trained)
- story: generated sentences over another vocabulary and other sentence shapes (held out)
- heldout_code: lines of a stdlib file from the held-out split (held out; the same files
  perplexity is measured on, never seen in training)

wordings (needle, question, header)
- pass_key: "The pass key is N. Remember it. N is the pass key." (trained; the classic)
- passcode, magic_number, access_code (trained)
- secret_code, vault_combination (held out)

A format is "HAYSTACK/WORDING"; "classic" is grass/pass_key with keys in [1, 50000] (the task as
it always was, so earlier results stay comparable); "trained" and "held_out" draw a haystack and
a wording per sample from their split. Keys of every format but classic are uniform over
[1, 99999] (the full five-digit range).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

CLASSIC_KEY_MAX = 50000
KEY_MAX = 99999


@dataclass(frozen=True)
class Wording:
    needle: str  # with {key}
    query: str  # the prompt's last line; the answer " N" follows it
    header: str


WORDINGS: dict[str, Wording] = {
    "pass_key": Wording(
        "The pass key is {key}. Remember it. {key} is the pass key.",
        "What is the pass key? The pass key is",
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize them. I will quiz you about the important information there."),
    "passcode": Wording(
        "Note: the passcode is {key}. Keep the passcode {key} in mind.",
        "Which passcode was given? The passcode is",
        "A passcode is written somewhere in the text below. Read carefully."),
    "magic_number": Wording(
        "The magic number is {key}. Do not forget the magic number {key}.",
        "What was the magic number? The magic number is",
        "Somewhere below there is a magic number. You will be asked for it at the end."),
    "access_code": Wording(
        "Your access code is {key}. Repeat: the access code is {key}.",
        "Tell me the access code. The access code is",
        "The following document contains an access code. Remember it."),
    "secret_code": Wording(
        "The secret code is {key}. Keep it safe: {key} is the secret code.",
        "What is the secret code? The secret code is",
        "Hidden in the text that follows is a secret code. Memorize it; it will be asked for."),
    "vault_combination": Wording(
        "Combination of the vault: {key}. Write down {key} for the vault.",
        "Which number opens the vault? The vault combination is",
        "Read the notes below. One of them tells you how to open the vault."),
}

HAYSTACKS = ("grass", "prose", "code", "story", "heldout_code")
TRAINED_HAYSTACKS = ("grass", "prose", "code")
HELD_OUT_HAYSTACKS = ("story", "heldout_code")
TRAINED_WORDINGS = ("pass_key", "passcode", "magic_number", "access_code")
HELD_OUT_WORDINGS = ("secret_code", "vault_combination")
MIXES = ("classic", "trained", "held_out")

_GRASS = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
_PROSE = (  # subjects, verbs, objects, places
    ("The farmer", "A child", "The old teacher", "My neighbour", "The baker", "A traveller"),
    ("carried", "painted", "found", "sold", "repaired", "watched"),
    ("a red bicycle", "the wooden fence", "three baskets", "an old map", "the kitchen door"),
    ("near the river", "in the morning", "at the market", "behind the barn", "after lunch"),
)
_STORY = (  # another vocabulary, other sentence shapes
    ("Captain Ortega", "the lighthouse keeper", "a quiet engineer", "the twins", "our pilot"),
    ("studied", "argued about", "forgot", "photographed", "measured"),
    ("the comet", "a broken compass", "seven lanterns", "the northern glacier", "a silver key"),
    ("during the storm", "before dawn", "on the third island", "while the engine hummed"),
)


def parse_format(fmt: str) -> str:
    """The format, checked: a mix name or HAYSTACK/WORDING."""
    if fmt in MIXES:
        return fmt
    haystack, _, wording = fmt.partition("/")
    if haystack not in HAYSTACKS or wording not in WORDINGS:
        raise ValueError(
            f"passkey format {fmt!r} is not known: use one of {list(MIXES)} or HAYSTACK/WORDING "
            f"with a haystack of {list(HAYSTACKS)} and a wording of {sorted(WORDINGS)}")
    return fmt


def choose(fmt: str, rng: random.Random) -> tuple[str, str, int]:
    """(haystack, wording, largest key) of one sample of format `fmt`."""
    fmt = parse_format(fmt)
    if fmt == "classic":
        return "grass", "pass_key", CLASSIC_KEY_MAX
    if fmt == "trained":
        return rng.choice(TRAINED_HAYSTACKS), rng.choice(TRAINED_WORDINGS), KEY_MAX
    if fmt == "held_out":
        return rng.choice(HELD_OUT_HAYSTACKS), rng.choice(HELD_OUT_WORDINGS), KEY_MAX
    haystack, wording = fmt.split("/")
    return haystack, wording, KEY_MAX


def haystack_units(name: str, rng: random.Random, count: int = 600) -> tuple[tuple[str, ...], str]:
    """The filler units (sentences or code lines) of one sample, cycled as needed, and the
    string that joins them."""
    if name == "grass":
        return _GRASS, " "
    if name in ("prose", "story"):
        words = _PROSE if name == "prose" else _STORY
        units = []
        for _ in range(count):
            s, v, o, p = (rng.choice(w) for w in words)
            units.append(f"{s} {v} {o} {p}." if name == "prose" else f"{p.capitalize()}, {s} "
                         f"{v} {o}.")
        return tuple(u[0].upper() + u[1:] for u in units), " "
    lines = _code_lines(heldout=name == "heldout_code")
    file_lines = lines[rng.randrange(len(lines))]
    start = rng.randrange(max(1, len(file_lines) - count))
    return tuple(file_lines[start:start + count]), "\n"


@lru_cache(maxsize=2)
def _code_lines(heldout: bool) -> tuple[tuple[str, ...], ...]:
    """Per stdlib file of the split (with at least 200 non-blank lines): its non-blank lines,
    without any digit (a number in the haystack would compete with the key)."""
    from nanokv.eval import corpus

    files = corpus.heldout_files() if heldout else corpus.training_files()
    out = []
    for path in files:
        lines = tuple(line.rstrip() for line in corpus.read_text(path).splitlines()
                      if line.strip() and not any(c.isdigit() for c in line))
        if len(lines) >= 200:
            out.append(lines)
    if not out:
        raise ValueError("no stdlib file has enough lines for a code haystack")
    return tuple(out)
