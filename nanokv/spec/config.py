"""`speculative_config`, vLLM's form: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}."""

from __future__ import annotations

from dataclasses import dataclass

from nanokv.validation import check_int

METHODS = ("ngram",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """k draft tokens a step per decoding request, from the longest n-gram (prompt_lookup_min
    <= n <= prompt_lookup_max) that ends its tokens and occurred in them before: the tokens that
    followed its first occurrence."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"

    @classmethod
    def from_dict(cls, given: dict) -> SpeculativeConfig:
        """Validated; prompt_lookup_min and _max default to each other (vLLM's), both 5 when
        neither is given."""
        if not isinstance(given, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object) such as "
                             f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {given!r}')
        unknown = sorted(set(given) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {list(KEYS)}")
        method = given.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {list(METHODS)} (drafts "
                             f"from n-grams of the request's own tokens), got {method!r}")
        if "num_speculative_tokens" not in given:
            raise ValueError("speculative_config needs num_speculative_tokens (draft tokens a "
                             "step, 1-16)")
        k = given["num_speculative_tokens"]
        check_int("speculative_config num_speculative_tokens", k, 1)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be <= "
                             f"{MAX_SPECULATIVE_TOKENS}, got {k}")
        high, low = given.get("prompt_lookup_max"), given.get("prompt_lookup_min")
        high = high if high is not None else (low if low is not None else 5)
        low = low if low is not None else high
        check_int("speculative_config prompt_lookup_max", high, 1)
        check_int("speculative_config prompt_lookup_min", low, 1)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min ({low}) must be <= "
                             f"prompt_lookup_max ({high})")
        return cls(k, high, low, method)
