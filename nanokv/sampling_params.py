"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request samples its output.

    temperature == 0 means greedy decoding (argmax); top_k, top_p and seed are then ignored.
    """

    temperature: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    top_p: float = 1.0
    seed: int | None = None  # per-request generator: same seed, same output
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # evaluation: return the logits of every prompt position (RequestOutput.prompt_logits,
    # [num_prompt_tokens, vocab]); such a request computes its whole prompt (no prefix hits)
    return_prompt_logits: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
               f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.seed is None or isinstance(self.seed, int),
               f"seed must be an integer or None, got {self.seed!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
               f"got {self.min_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a list of non-empty strings, got {self.stop!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
