"""Seeded synthetic long-context retrieval tasks: pure functions, no torch.

Every builder takes a tokenizer (anything with ``encode(text)``: a ``transformers`` tokenizer, a
``tokenizers.Tokenizer``, or a plain callable ``text -> list[int]``), a target prompt length in
tokens, and a seed, and returns a :class:`TaskSample`. The same arguments always give the same
sample. The prompt holds at most ``context_tokens`` tokens (encoded without special tokens) and
is filled to within one filler sentence of it. The answer is the exact continuation that a
greedy decode should produce (it starts with a space, e.g. ``" 31415"``); score generations with
:func:`score`.

Tasks
The retrieval samples (passkey, multikey_needle) end with their question, ``meta["question"]``
(the prompt's last line), so an evaluation can compress the context before it.

- passkey (KVQuant / LongLoRA format): header, the filler "The grass is green. ..." repeated, the
  needle "The pass key is N. Remember it. N is the pass key." on its own line at the given depth
  (fraction of filler sentences before it), and the query "What is the pass key? The pass key is".
  N is uniform in [1, 50000] as in LongLoRA's passkey_retrieval.py.
- multikey_needle (RULER niah_multikey style): several "The special magic number for KEY is N."
  needles at independent depths in the same filler; the query asks for one of them.
- kv_lookup (Lost in the Middle style): a JSON object of random hex keys and values; the query
  names one key.
- variable_tracking (RULER vt style): a chain "VAR A = 12345." -> "VAR B = VAR A." ... scattered
  through the filler; the answer lists every variable in the chain, in order.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable

from nanokv.eval import passkey_formats as formats

PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
PASSKEY_HEADER = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
PASSKEY_QUERY = "What is the pass key? The pass key is"
PASSKEY_MAX = 50000

FILLER_SENTENCES = tuple(s.strip() + "." for s in PASSKEY_FILLER.split(".") if s.strip())

MULTIKEY_HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards."
)
KV_HEADER = "Extract the value corresponding to the specified key in the JSON object below."
VT_HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text."

_ADJECTIVES = (
    "brave", "calm", "eager", "fancy", "gentle", "happy", "jolly", "kind", "lively", "merry",
    "nice", "proud", "silly", "witty", "zealous", "ancient", "bitter", "crimson", "dusty",
    "frozen", "golden", "hollow", "icy", "lucky", "misty", "noisy", "quiet", "rapid", "shiny",
    "tiny", "vast", "wild",
)
_NOUNS = (
    "apple", "badger", "canyon", "dolphin", "engine", "falcon", "garden", "harbor", "island",
    "jungle", "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quartz", "river",
    "saddle", "tiger", "umbrella", "violin", "walrus", "yacht", "zebra", "anchor", "bottle",
    "castle", "desert", "forest", "glacier", "hammer",
)

Tokenizer = Any  # has .encode(text) (HF / tokenizers) or is a callable text -> ids


@dataclass(frozen=True)
class TaskSample:
    """One prompt and its expected greedy continuation."""

    task: str
    prompt: str
    answer: str
    seed: int
    context_tokens: int  # the requested prompt budget in tokens
    prompt_tokens: int  # the prompt's actual length in tokens
    depth: float | None = None  # fraction of filler before the (queried) needle
    meta: dict = field(default_factory=dict)


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Number of tokens in ``text`` without special tokens."""
    if hasattr(tokenizer, "encode"):
        try:
            ids = tokenizer.encode(text, add_special_tokens=False)
        except TypeError:
            ids = tokenizer.encode(text)
    elif callable(tokenizer):
        ids = tokenizer(text)
    else:
        raise ValueError(f"tokenizer must have .encode or be callable, got {type(tokenizer)!r}")
    ids = getattr(ids, "ids", ids)
    return len(ids)


def _check(context_tokens: int, seed: int, depth: float | None) -> None:
    if context_tokens < 16:
        raise ValueError(f"context_tokens must be >= 16, got {context_tokens}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {type(seed).__name__}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")


def _render(head: list[str], sentences: list[str], needles: list[tuple[float, str]],
            tail: list[str], joiner: str = " ") -> tuple[str, list[int]]:
    """Lines: head, filler segments with each needle on its own line, tail.

    A needle at depth d goes after round(d * n) of the n filler sentences. Returns the text and
    the sentence index chosen for every needle (in the order given).
    """
    n = len(sentences)
    slots = [min(n, max(0, round(d * n))) for d, _ in needles]
    order = sorted(range(len(needles)), key=lambda i: (slots[i], i))
    lines = list(head)
    start = 0
    for i in order:
        if slots[i] > start:
            lines.append(joiner.join(sentences[start:slots[i]]))
            start = slots[i]
        lines.append(needles[i][1])
    if start < n:
        lines.append(joiner.join(sentences[start:]))
    lines.extend(tail)
    return "\n".join(lines), slots


def _fit(tokenizer: Tokenizer, context_tokens: int, head: list[str],
         needles: list[tuple[float, str]], tail: list[str],
         filler: tuple[str, ...] = FILLER_SENTENCES,
         joiner: str = " ") -> tuple[str, int, list[int], int]:
    """Choose the number of filler sentences so the prompt fills ``context_tokens``.

    Returns (prompt, prompt_tokens, needle slots, filler sentence count). Raises ValueError when
    even an empty haystack does not fit.
    """
    def sentences(n: int) -> list[str]:
        return [filler[i % len(filler)] for i in range(n)]

    def length(n: int) -> tuple[str, int, list[int]]:
        text, slots = _render(head, sentences(n), needles, tail, joiner)
        return text, count_tokens(tokenizer, text), slots

    text, base, slots = length(0)
    if base > context_tokens:
        raise ValueError(
            f"context_tokens={context_tokens} is too small: the prompt without filler already "
            f"takes {base} tokens")
    per_cycle = max(1, count_tokens(tokenizer, joiner.join(filler)))
    per_sentence = per_cycle / len(filler)
    n = max(0, int((context_tokens - base) / per_sentence))
    text, used, slots = length(n)
    # correct the estimate: shrink until it fits, then grow while the next sentence still fits
    while used > context_tokens and n > 0:
        n = max(0, n - max(1, int((used - context_tokens) / per_sentence)))
        text, used, slots = length(n)
    while True:
        t2, u2, s2 = length(n + 1)
        if u2 > context_tokens:
            break
        n, text, used, slots = n + 1, t2, u2, s2
    return text, used, slots, n


def passkey_sample(tokenizer: Tokenizer, context_tokens: int, depth: float | None = None,
                   seed: int = 0, fmt: str = "classic") -> TaskSample:
    """Passkey retrieval; ``depth`` None draws it uniformly from the seed. ``fmt``: the haystack
    and wording (`nanokv.eval.passkey_formats`; "classic" is the KVQuant / LongLoRA task)."""
    _check(context_tokens, seed, depth)
    rng = random.Random(seed)
    if fmt == "classic":  # the draws of the task as it always was: same samples per seed
        haystack, wording, key_max = "grass", "pass_key", formats.CLASSIC_KEY_MAX
    else:
        haystack, wording, key_max = formats.choose(fmt, random.Random(f"format:{seed}"))
    key = rng.randint(1, key_max)
    d = rng.random() if depth is None else depth
    words = formats.WORDINGS[wording]
    needle = words.needle.format(key=key)
    if haystack == "grass":
        filler, joiner = FILLER_SENTENCES, " "
    else:
        filler, joiner = formats.haystack_units(haystack, random.Random(f"haystack:{seed}"))
    prompt, used, slots, n = _fit(tokenizer, context_tokens, [words.header], [(d, needle)],
                                  [words.query], filler, joiner)
    return TaskSample("passkey", prompt, f" {key}", seed, context_tokens, used,
                      depth=slots[0] / n if n else 0.0,
                      meta={"needle": needle, "passkey": key, "question": words.query,
                            "format": fmt, "haystack": haystack, "wording": wording})


def _key_name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if name not in used:
            used.add(name)
            return name


def multikey_needle_sample(tokenizer: Tokenizer, context_tokens: int, num_needles: int = 4,
                           depth: float | None = None, seed: int = 0,
                           value_digits: int = 7) -> TaskSample:
    """Multi-key needle in a haystack; ``depth`` places the queried needle (others random)."""
    _check(context_tokens, seed, depth)
    if not 1 <= num_needles <= 64:
        raise ValueError(f"num_needles must be in [1, 64], got {num_needles}")
    if not 1 <= value_digits <= 12:
        raise ValueError(f"value_digits must be in [1, 12], got {value_digits}")
    rng = random.Random(seed)
    used: set[str] = set()
    keys = [_key_name(rng, used) for _ in range(num_needles)]
    lo = 10 ** (value_digits - 1) if value_digits > 1 else 0
    values = [rng.randint(lo, 10 ** value_digits - 1) for _ in range(num_needles)]
    depths = [rng.random() for _ in range(num_needles)]
    target = rng.randrange(num_needles)
    if depth is not None:
        depths[target] = depth
    needles = [(depths[i], f"The special magic number for {keys[i]} is {values[i]}.")
               for i in range(num_needles)]
    query = (f"What is the special magic number for {keys[target]}? "
             f"The special magic number for {keys[target]} is")
    prompt, used_tokens, slots, n = _fit(tokenizer, context_tokens, [MULTIKEY_HEADER], needles,
                                         [query])
    return TaskSample("multikey_needle", prompt, f" {values[target]}", seed, context_tokens,
                      used_tokens, depth=slots[target] / n if n else 0.0,
                      meta={"keys": keys, "values": values, "target": target,
                            "needle": needles[target][1], "question": query})


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def kv_lookup_sample(tokenizer: Tokenizer, context_tokens: int, depth: float | None = None,
                     seed: int = 0, key_chars: int = 8, value_chars: int = 8) -> TaskSample:
    """Key-value retrieval from a JSON object filled to the budget with random hex pairs."""
    _check(context_tokens, seed, depth)
    if not 2 <= key_chars <= 64 or not 2 <= value_chars <= 64:
        raise ValueError("key_chars and value_chars must be in [2, 64]")
    rng = random.Random(seed)
    d = rng.random() if depth is None else depth

    def render(pairs: list[tuple[str, str]], qk: str) -> str:
        body = ",\n ".join(f'"{k}": "{v}"' for k, v in pairs)
        return (f"{KV_HEADER}\n\nJSON data:\n{{{body}}}\n\nKey: \"{qk}\"\n"
                f"The value associated with the specified key is")

    def pairs_for(n: int) -> list[tuple[str, str]]:
        r = random.Random(f"kv:{seed}")  # same pairs for every n: a prefix of one stream
        seen: set[str] = set()
        out = []
        while len(out) < n:
            k = _hex(r, key_chars)
            if k in seen:
                continue
            seen.add(k)
            out.append((k, _hex(r, value_chars)))
        return out

    def build(n: int) -> tuple[str, int, int, list[tuple[str, str]]]:
        pairs = pairs_for(n)
        idx = min(n - 1, max(0, round(d * (n - 1))))
        text = render(pairs, pairs[idx][0])
        return text, count_tokens(tokenizer, text), idx, pairs

    text, used, idx, pairs = build(1)
    if used > context_tokens:
        raise ValueError(f"context_tokens={context_tokens} is too small for one key-value pair")
    per_pair = max(1, count_tokens(tokenizer, f'"{"a" * key_chars}": "{"b" * value_chars}",\n '))
    n = max(1, 1 + (context_tokens - used) // per_pair)
    text, used, idx, pairs = build(n)
    while used > context_tokens and n > 1:
        n = max(1, n - max(1, (used - context_tokens) // per_pair))
        text, used, idx, pairs = build(n)
    while True:
        t2, u2, i2, p2 = build(n + 1)
        if u2 > context_tokens:
            break
        n, text, used, idx, pairs = n + 1, t2, u2, i2, p2
    return TaskSample("kv_lookup", text, f' "{pairs[idx][1]}"', seed, context_tokens, used,
                      depth=idx / (n - 1) if n > 1 else 0.0,
                      meta={"key": pairs[idx][0], "num_pairs": n})


def _var_name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in used:
            used.add(name)
            return name


def variable_tracking_sample(tokenizer: Tokenizer, context_tokens: int, num_hops: int = 4,
                             num_chains: int = 1, seed: int = 0) -> TaskSample:
    """Variable tracking: follow ``VAR X = VAR Y`` chains back to a value; list the chain."""
    _check(context_tokens, seed, None)
    if not 1 <= num_hops <= 16 or not 1 <= num_chains <= 8:
        raise ValueError("num_hops must be in [1, 16] and num_chains in [1, 8]")
    rng = random.Random(seed)
    used: set[str] = set()
    values = rng.sample(range(10000, 100000), num_chains)
    chains = [[_var_name(rng, used) for _ in range(num_hops + 1)] for _ in range(num_chains)]
    needles: list[tuple[float, str]] = []
    for chain, value in zip(chains, values):
        depths = sorted(rng.random() for _ in chain)  # assignments appear in chain order
        needles.append((depths[0], f"VAR {chain[0]} = {value}."))
        for j in range(1, len(chain)):
            needles.append((depths[j], f"VAR {chain[j]} = VAR {chain[j - 1]}."))
    target = rng.randrange(num_chains)
    value = values[target]
    tail = [f"Question: Find all variables that are assigned the value {value} in the text "
            f"above. Answer: According to the chain(s) of variables assigned the value {value}, "
            f"the variables are:"]
    prompt, used_tokens, _, _ = _fit(tokenizer, context_tokens, [VT_HEADER], needles, tail)
    return TaskSample("variable_tracking", prompt, " " + " ".join(chains[target]), seed,
                      context_tokens, used_tokens, depth=None,
                      meta={"chain": chains[target], "value": value})


TASKS: dict[str, Callable[..., TaskSample]] = {
    "passkey": passkey_sample,
    "multikey_needle": multikey_needle_sample,
    "kv_lookup": kv_lookup_sample,
    "variable_tracking": variable_tracking_sample,
}


def context_length(tokenizer: Tokenizer, sample: TaskSample,
                   prompt_ids: list[int] | None = None) -> int:
    """Tokens of a retrieval prompt before its question (what the "question" protocol
    compresses): the prompt's leading tokens that the context alone encodes to, at least 1 and
    at most all but the last. prompt_ids: the prompt's tokens, when the caller has them."""
    question = sample.meta["question"]
    if not sample.prompt.endswith(question):
        raise ValueError("the sample's prompt does not end with its question")
    full = tokenizer.encode(sample.prompt) if prompt_ids is None else prompt_ids
    context = tokenizer.encode(sample.prompt[:-len(question)])
    common = 0
    for a, b in zip(full, context):
        if a != b:
            break
        common += 1
    return max(1, min(common, len(full) - 1))


def score(sample: TaskSample, generated: str) -> float:
    """Exact-match score in [0, 1] of a generated continuation.

    passkey / multikey_needle: the first run of digits equals the number. kv_lookup: the first
    hex run equals the value. variable_tracking: the fraction of chain variables that appear
    (RULER's string_match_all).
    """
    if sample.task in ("passkey", "multikey_needle"):
        m = re.search(r"\d+", generated)
        return float(m is not None and m.group(0) == sample.answer.strip())
    if sample.task == "kv_lookup":
        m = re.search(r"[0-9a-f]+", generated)
        return float(m is not None and m.group(0) == sample.answer.strip().strip('"'))
    if sample.task == "variable_tracking":
        chain = sample.meta["chain"]
        words = set(re.findall(r"[A-Z]+", generated))
        return sum(v in words for v in chain) / len(chain)
    raise ValueError(f"unknown task {sample.task!r}; known: {sorted(TASKS)}")
