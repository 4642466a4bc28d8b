"""What a simulation replays on: the engine's KV and scheduling settings, and how requests are
admitted (`nanokv/sim/simulator.py` says what each setting does in the replay)."""

from __future__ import annotations

from dataclasses import dataclass

from nanokv.validation import check_fraction, check_int

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
    # the window every layer attends over (`KVLayout.common_window`): a request's blocks behind
    # its next token's window are freed after each step, as the engine does; None: none
    sliding_window: int | None = None
    # each layer's window of a model whose layers mix windows and full attention
    # (`KVLayout.mixed_windows`): replayed with the engine's hybrid KV cache manager (its
    # requests sliced as the engine slices them); None: every layer keeps every block
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be 'arrival' or 'recorded', got "
                             f"{self.admission!r}")
        if self.compression_ratio is not None:
            check_fraction("compression ratio", self.compression_ratio, low_open=False,
                           high_open=True, meaning=" (fraction removed)")
        if self.eviction_ratio is not None:  # as `advise` and PagedEviction's pool pressure
            check_fraction("eviction ratio", self.eviction_ratio)
        if self.layer_windows is not None:
            if self.sliding_window is not None:
                raise ValueError("give sliding_window (every layer's window) or layer_windows "
                                 "(windows beside full layers), not both")
            for w in self.layer_windows:
                if w is not None:
                    check_int("a layer window", w, 1)
            if all(w is None for w in self.layer_windows) or None not in self.layer_windows:
                raise ValueError(f"layer_windows must mix windowed (an int) and full (None) "
                                 f"layers, got {self.layer_windows!r}")
            if self.compression_ratio is not None or self.eviction_ratio is not None:
                raise ValueError("a model with sliding windows runs without a KV policy (as "
                                 "the engine): leave compression_ratio and eviction_ratio unset")
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1)
            if self.compression_ratio is not None or self.eviction_ratio is not None:
                raise ValueError("a model with a sliding window on every layer runs without a "
                                 "KV policy (as the engine): leave compression_ratio and "
                                 "eviction_ratio unset")
