"""Speculative decoding's counters (vLLM's spec_decode metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Since start: verification steps that carried drafts (`num_drafts`), their draft tokens,
    the accepted ones, and accepted ones by draft position (0: the first draft)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def since(self, earlier: SpecDecodeStats | None) -> SpecDecodeStats:
        """The counts after `earlier` (a snapshot of the same counters; None: all)."""
        if earlier is None:
            return self.copy()
        return SpecDecodeStats(
            self.num_speculative_tokens, self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.accepted_per_position, earlier.accepted_per_position)])

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_speculative_tokens, self.num_drafts,
                               self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))
