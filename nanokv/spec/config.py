"""`speculative_config`, vLLM's form: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m, "num_speculative_tokens_per_batch_size":
[[first, last, k], ...]}, or a draft model: {"model": path, "num_speculative_tokens": k}
("method": "draft_model", implied by "model" as vLLM does)."""

from __future__ import annotations

from dataclasses import dataclass

from nanokv.validation import check_int

METHODS = ("ngram", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "num_speculative_tokens_per_batch_size", "model", "draft_tensor_parallel_size")
NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")  # read by method "ngram" only
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """k draft tokens a step per decoding request: method "ngram", from the longest n-gram
    (prompt_lookup_min <= n <= prompt_lookup_max) that ends its tokens and occurred in them
    before (the tokens that followed its first occurrence); method "draft_model", the greedy
    continuation of `model` (a smaller checkpoint of the same vocabulary, `nanokv/spec/
    draft_model.py`)."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    # vLLM's dynamic speculative decoding: (first, last, k) inclusive ranges of batch sizes,
    # sorted, from 1, k >= 0 (capped at num_speculative_tokens); None: k at every batch size
    per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    model: str | None = None  # the draft model's checkpoint directory (method "draft_model")

    def tokens_for_batch(self, batch_size: int) -> int:
        """Draft tokens per request in a step of batch_size requests: the k of the range that
        holds it; between ranges and past the last, the k of the range before (vLLM's)."""
        k = self.num_speculative_tokens
        if self.per_batch_size is None:
            return k
        chosen = self.per_batch_size[0][2]
        for first, _, tokens in self.per_batch_size:
            if first > batch_size:
                break
            chosen = tokens
        return min(k, chosen)

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
        model = given.get("model")
        method = given.get("method", "draft_model" if model is not None else "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {list(METHODS)} (drafts "
                             f"from n-grams of the request's own tokens, or from a draft model "
                             f"given as \"model\"), got {method!r}")
        if method == "draft_model":
            if not isinstance(model, str) or not model.strip():
                raise ValueError(f"speculative_config method \"draft_model\" needs \"model\": "
                                 f"the draft checkpoint's directory, got {model!r}")
            given_ngram = [key for key in NGRAM_KEYS if key in given]
            if given_ngram:
                raise ValueError(f"speculative_config {given_ngram} apply to method \"ngram\" "
                                 f"only, not to a draft model")
            tp = given.get("draft_tensor_parallel_size", 1)
            if tp != 1 or isinstance(tp, bool):
                raise ValueError(f"speculative_config draft_tensor_parallel_size must be 1 (the "
                                 f"draft model runs in one process), got {tp!r}")
        elif model is not None or "draft_tensor_parallel_size" in given:
            raise ValueError(f"speculative_config \"model\" and \"draft_tensor_parallel_size\" "
                             f"apply to method \"draft_model\" only, got method {method!r}")
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
        schedule = given.get("num_speculative_tokens_per_batch_size")
        return cls(k, high, low, method, None if schedule is None else _batch_schedule(schedule),
                   model)


def _batch_schedule(given) -> tuple[tuple[int, int, int], ...]:
    """vLLM's rules for num_speculative_tokens_per_batch_size: a non-empty list of [first,
    last, k] (inclusive batch sizes, first >= 1, first <= last, k >= 0), ranges apart, the
    first from 1."""
    name = "speculative_config num_speculative_tokens_per_batch_size"
    shape = "a non-empty list of [first, last, k] entries (inclusive batch-size ranges)"
    if not isinstance(given, (list, tuple)) or not given:
        raise ValueError(f"{name} must be {shape}, got {given!r}")
    entries = []
    for entry in given:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise ValueError(f"{name} must be {shape}; got the entry {entry!r}")
        first, last, k = entry
        if first < 1 or first > last:
            raise ValueError(f"{name}: a range must have 1 <= first <= last, got {entry!r}")
        if k < 0:
            raise ValueError(f"{name}: k must be >= 0 (0: no drafts), got {entry!r}")
        entries.append((first, last, k))
    entries.sort()
    for (_, last, _), (first, _, _) in zip(entries, entries[1:]):
        if first <= last:
            raise ValueError(f"{name}: the ranges must not overlap, got {list(given)!r}")
    if entries[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at batch size 1 (every batch "
                         f"size needs a k), got {list(given)!r}")
    return tuple(entries)
