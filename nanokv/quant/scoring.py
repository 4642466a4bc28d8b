"""Scoring a KV precision candidate on held-out windows: perplexity over the scored tokens, KL
divergence and top-1 agreement against the full-precision next-token distributions on the same
tokens. Shared by the two measures of `nanokv calibrate` (the engine's store, the simulation).

The first `context_fraction` of each window is context; the tokens from `split` on are scored,
teacher-forced: logits row t predicts token t + 1, so rows split - 1 .. n - 2 score tokens
split .. n - 1 (the convention of `nanokv eval`'s perplexity and kl tasks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanokv.quant.precision_rule import Measurement


@dataclass(frozen=True)
class ScoredWindows:
    windows: tuple[tuple[int, ...], ...]  # token ids, all of one length
    split: int  # the first scored position

    @classmethod
    def of(cls, windows, context_fraction: float) -> ScoredWindows:
        check_context_fraction(context_fraction)
        windows = tuple(tuple(int(t) for t in w) for w in windows)
        if not windows or len({len(w) for w in windows}) != 1:
            raise ValueError("the evaluation windows must be one or more token lists of one "
                             "length")
        n = len(windows[0])
        split = int(n * context_fraction)
        if not 1 <= split < n:
            raise ValueError(f"context_fraction {context_fraction} of {n}-token windows leaves "
                             f"no context or nothing to score: use longer windows")
        return cls(windows, split)

    @property
    def length(self) -> int:
        return len(self.windows[0])

    @property
    def num_scored(self) -> int:
        return len(self.windows) * (self.length - self.split)

    def scored_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """A window's logits over all its positions [n, V] -> the scored rows [n - split, V]."""
        return logits[self.split - 1:self.length - 1]

    def targets(self, index: int) -> torch.Tensor:
        return torch.tensor(self.windows[index][self.split:])


def check_context_fraction(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"context_fraction must be in (0, 1) (the share of each window read "
                         f"as context before the scored tokens), got {value!r}")


def log_probs(scored: list[torch.Tensor]) -> list[torch.Tensor]:
    """The reference: log-softmax of each window's scored logits (float32)."""
    return [lg.float().log_softmax(-1) for lg in scored]


def measurement(windows: ScoredWindows, scored: list[torch.Tensor],
                reference: list[torch.Tensor]) -> Measurement:
    """Perplexity of `scored` (one [n - split, V] per window), and the mean KL(reference ||
    scored) and top-1 agreement per scored token, `reference` being log-probabilities."""
    nll = kl = 0.0
    agree = count = 0
    for i, (lg, p_log) in enumerate(zip(scored, reference)):
        q_log = lg.float().log_softmax(-1)  # [T, V]
        target = windows.targets(i)
        nll += float(-q_log.gather(1, target.unsqueeze(1)).sum())
        kl += float((p_log.exp() * (p_log - q_log)).sum())
        agree += int((p_log.argmax(-1) == q_log.argmax(-1)).sum())
        count += len(target)
    return Measurement(math.exp(nll / count), kl / count, agree / count)
