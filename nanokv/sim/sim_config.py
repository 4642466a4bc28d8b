"""What a simulation replays on: the engine's KV and scheduling settings, and how requests are
admitted (`nanokv/sim/simulator.py` says what each setting does in the replay)."""

from __future__ import annotations

from dataclasses import dataclass

ADMISSIONS = ("arrival", "recorded")


@dataclass(frozen=True)
class SimConfig:
    block_size: int
    num_blocks: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    bytes_per_block: int = 0  # the KV cache kind's spec (KV bytes per request)
    compression_ratio: float | None = None
    eviction_ratio: float | None = None
    window_s: float = 60.0  # hit rate over time: buckets of arrivals this long
    check_invariants: bool = False  # run scheduler.check_invariants() after every step (slow)
    fast_forward: bool = True  # batch runs of pure decode steps that change no block (exact)
    admission: str = "arrival"  # or "recorded": at the served run's own step boundaries

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be 'arrival' or 'recorded', got "
                             f"{self.admission!r}")
        for name in ("compression_ratio", "eviction_ratio"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < 1:
                raise ValueError(f"{name} must be in [0, 1), got {v}")
