"""Per-request sampling parameters, validated at construction and again when a request is made."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

from nanokv.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's chat limit)
GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily (argmax)
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # a seed is a signed 64-bit integer (as vLLM's)
INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
              "truncate_prompt_tokens")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")
# vLLM's SamplingParams fields nanokv accepts only at their defaults: (default, why not)
UNSUPPORTED = {
    "logits_processors": (None, "logits processors are not implemented"),
}


@dataclass
class SamplingParams:
    """How one request samples its output.

    temperature 0 (or any below GREEDY_BELOW, 1e-5: dividing float32 logits by such a
    temperature overflows; vLLM 0.32 raises temperatures below 1e-2 to 1e-2 instead) means
    greedy decoding (argmax); top_k, top_p, min_p and seed are then ignored, the penalties are
    not (as in vLLM they change the logits greedy decoding reads).
    min_tokens: EOS (unless ignore_eos) and stop_token_ids cannot be sampled before the request
    has that many output tokens (vLLM's), and a stop string must end in a later token.
    """

    n: int = 1  # samples of the prompt (LLM.generate fans them out; seeded ones use seed + j)
    temperature: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the most likely one's
    seed: int | None = None  # per-request generator: same seed, same output
    max_tokens: int | None = 16  # None: as many as max_model_len leaves after the prompt
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: False leaves the output text empty (token ids only; no detokenizer work), so no
    # stop strings either
    detokenize: bool = True
    # vLLM's penalties: repetition divides positive / multiplies negative logits of every token
    # seen in the prompt or the output; presence and frequency subtract from the logits of
    # output tokens (once, or once per occurrence)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # log-probabilities of each sampled token and of its `logprobs` most likely alternatives
    # (from the model's raw distribution, before penalties and temperature; within what the
    # grammar allows for structured_outputs); None = off
    logprobs: int | None = None
    # vLLM's prompt_logprobs: for each prompt token after the first, its log-probability given
    # the tokens before it, its rank and the `prompt_logprobs` most likely tokens there
    # (RequestOutput.prompt_logprobs); such a request computes its whole prompt (no prefix hits)
    prompt_logprobs: int | None = None
    # evaluation: return the logits of every prompt position (RequestOutput.prompt_logits,
    # [num_prompt_tokens, vocab]); such a request computes its whole prompt (no prefix hits)
    return_prompt_logits: bool = False
    # the output text (and log-probabilities' token strings) leaves special tokens out; False
    # keeps their text (a chat template's end token, say). The token that stopped a request is
    # left out either way unless include_stop_str_in_output (vLLM's)
    skip_special_tokens: bool = True
    # no effect, either value: the tokenizer's decode (transformers 5) puts no spaces around
    # special tokens, as vLLM's detokenizer for fast tokenizers
    spaces_between_special_tokens: bool = True
    # vLLM's logits processors, applied (as vLLM V1 does) before the penalties, the temperature
    # and the filters, so greedy decoding sees them; log-probabilities do not (raw):
    # logit_bias: token id -> a finite number added to its logit (not clamped: vLLM's server
    # clamps to [-100, 100], its SamplingParams does not); allowed_token_ids: only these ids
    # may be sampled (None: any). Both are checked against the vocabulary per request.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: words the output may not contain. Each is tokenized as it stands and
    # after a space (`nanokv/bad_words.py`); a word's last token cannot be sampled where the
    # output's last tokens are the ones before it (the output only: the prompt is not read)
    bad_words: list[str] | None = None
    # vLLM's field nanokv does not implement: accepted at its default only (UNSUPPORTED)
    logits_processors: list | None = None
    # vLLM's: keep the prompt's last k tokens (left truncation, after tokenization, special
    # tokens included); -1 keeps max_model_len - 1. RequestOutput.prompt_token_ids are the
    # tokens kept, RequestOutput.prompt the text as given
    truncate_prompt_tokens: int | None = None
    # vLLM's structured outputs (guided decoding): the output must match a JSON schema, a
    # regex, a choice or a grammar (`nanokv/structured`; needs the [structured] extra and a
    # tokenizer). Tokens the grammar does not allow next are masked before anything else, so
    # log-probabilities are those of the masked distribution, as vLLM's
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field out of its range (run at construction, and
        again by the engine for each request: a field may have been changed since)."""
        for name, (default, why) in UNSUPPORTED.items():
            value = getattr(self, name)
            at_default = (value is None or (isinstance(value, (list, tuple)) and not value)
                          if default is None else value is default)
            _check(at_default,
                   f"{name}={value!r} is not supported: {why} (leave it at {default!r})")
        for name in INT_FIELDS:  # numpy integers and floats count as Python's
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                setattr(self, name, int(value))
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (int, float, bool)):
                setattr(self, name, float(value))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, "a string or a list of non-empty strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids,
                                       "a list of non-negative integers")
        if self.bad_words is not None:
            self.bad_words = _as_list("bad_words", self.bad_words,
                                      "None or a list of non-empty strings")
        self.stop_token_ids = [int(t) if isinstance(t, numbers.Integral)
                               and not isinstance(t, bool) else t for t in self.stop_token_ids]
        self._validate_logit_bias()
        self._validate_allowed_token_ids()
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               f"structured_outputs must be None or a StructuredOutputsParams, got "
               f"{type(self.structured_outputs).__name__}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        _check(_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0 (0 = greedy), got "
               f"{self.temperature!r}")
        _check(_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
               f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
               f"seed must be None or an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        _check(self.max_tokens is None or (_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be an integer >= 1 or None (up to max_model_len), got "
               f"{self.max_tokens!r}")
        _check(_int(self.min_tokens) and 0 <= self.min_tokens
               and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
               f"got {self.min_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a list of non-empty strings, got {self.stop!r}")
        _check(self.bad_words is None
               or all(isinstance(w, str) and w for w in self.bad_words),
               f"bad_words must be None or a list of non-empty strings, got {self.bad_words!r}")
        if self.bad_words is not None:  # vLLM's: a repeated word counts once
            self.bad_words = list(dict.fromkeys(self.bad_words))
        _check(self.truncate_prompt_tokens is None
               or (_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens == -1
                                                          or self.truncate_prompt_tokens >= 1)),
               f"truncate_prompt_tokens must be None, -1 (keep max_model_len - 1 tokens) or "
               f"an integer >= 1 (keep the prompt's last k tokens), got "
               f"{self.truncate_prompt_tokens!r}")
        _check(all(_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be a finite number > 0 (1 = off), got "
               f"{self.repetition_penalty!r}")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "return_prompt_logits",
                     "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            _check(isinstance(getattr(self, name), bool),
                   f"{name} must be True or False, got {getattr(self, name)!r}")
        _check(self.detokenize or not self.stop,
               "stop strings are only supported when detokenize is True (they are matched in "
               "the text): set detokenize=True, or use stop_token_ids")
        _check(self.logprobs is None or (_int(self.logprobs)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got "
               f"{self.logprobs!r}")
        _check(self.prompt_logprobs != -1,
               f"prompt_logprobs=-1 (the whole vocabulary) is not supported: ask for at most "
               f"{MAX_LOGPROBS} alternatives per prompt token (vLLM too refuses -1 unless its "
               f"max_logprobs covers the vocabulary)")
        _check(self.prompt_logprobs is None or (_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got "
               f"{self.prompt_logprobs!r}")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        allowed = "a dict of token id (an integer >= 0) -> finite number"
        _check(isinstance(self.logit_bias, dict),
               f"logit_bias must be None or {allowed}, got {self.logit_bias!r}")
        bias = {}
        for token, value in self.logit_bias.items():
            token, value = _as_python_number(token), _as_python_number(value)
            _check(_int(token) and token >= 0 and _finite(value),
                   f"logit_bias must be {allowed}, got {{{token!r}: {value!r}}}")
            bias[token] = float(value)
        self.logit_bias = bias or None  # {} changes nothing

    def _validate_allowed_token_ids(self) -> None:
        if self.allowed_token_ids is None:
            return
        allowed = "None (any token) or a non-empty list of token ids (integers >= 0)"
        ids = _as_list("allowed_token_ids", self.allowed_token_ids, allowed)
        ids = [_as_python_number(t) for t in ids]
        _check(bool(ids) and all(_int(t) and t >= 0 for t in ids),
               f"allowed_token_ids must be {allowed}, got {self.allowed_token_ids!r}")
        self.allowed_token_ids = ids

    def sample(self, j: int) -> SamplingParams:
        """The params of sample j of n: one sample, a seeded one with seed + j (the server's
        rule for n choices; wrapped into the signed 64-bit range), so the samples differ. Only
        sample 0 computes the prompt's log-probabilities (the others may read the prefix
        cache); the prompt's output carries them for all."""
        seed = self.seed if self.seed is None else (self.seed + j - SEED_MIN) % 2**64 + SEED_MIN
        return replace(self, n=1, seed=seed,
                       prompt_logprobs=self.prompt_logprobs if j == 0 else None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """True when sampling needs the request's token history."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def shapes_logits(self) -> bool:
        """True when logit_bias or allowed_token_ids change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None


def _as_list(name: str, value, allowed: str) -> list:
    """None -> [], a list or tuple -> a list; anything else (a lone number) is refused."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return list(value)


def _as_python_number(x):
    """numpy integers and floats as Python's; anything else as it is."""
    if isinstance(x, numbers.Integral) and not isinstance(x, (int, bool)):
        return int(x)
    if isinstance(x, numbers.Real) and not isinstance(x, (int, float, bool)):
        return float(x)
    return x


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
