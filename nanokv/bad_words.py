"""vLLM's bad_words: the token sequences a request's output may not contain, and the tokens that
would complete one next. No torch: the scheduler adds those tokens to the row's banned tokens,
which the sampler masks on the device (`nanokv/layers/batch_sampling.py` `ban_tokens`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_BAD_WORDS = 128  # token sequences per request (vLLM's VLLM_MAX_NUM_BAD_WORDS default)


def tokenize_bad_words(bad_words: Sequence[str], encode: Callable[[str], list[int]],
                       vocab: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's `SamplingParams.update_from_tokenizer`: each word (leading spaces stripped) as it
    stands, and after a space when that gives a different first token and as many tokens (the
    word inside a text rather than at its start). `encode`: text -> ids without special tokens.
    Raises ValueError naming bad_words."""
    sequences: list[list[int]] = []
    for word in bad_words:
        bare = encode(word.lstrip())
        if not bare:
            raise ValueError(f"bad_words entries must tokenize to at least one token; "
                             f"{word!r} gives none")
        sequences.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words give {len(sequences)} token sequences or more; at "
                             f"most {MAX_BAD_WORDS} are allowed (each word counts once, or "
                             f"twice with its leading-space form)")
    outside = [t for ids in sequences for t in ids if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"bad_words tokenize to ids outside the model's vocabulary "
                         f"[0, {vocab}): {outside[:5]}")
    return tuple(tuple(ids) for ids in sequences)


def completing_tokens(bad_words_token_ids: Sequence[Sequence[int]],
                      output_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The tokens the next output token may not be: each sequence's last token where the
    output ends with the tokens before it (vLLM's `apply_bad_words`, over the output only)."""
    banned = []
    n = len(output_token_ids)
    for ids in bad_words_token_ids:
        before = len(ids) - 1
        if before > n:
            continue
        if all(output_token_ids[n - before + i] == ids[i] for i in range(before)):
            banned.append(ids[-1])
    return tuple(banned)
