"""The shape every KV cache of one engine shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.utils import cdiv

POSITION_BYTES = 4  # each slot records its token's RoPE position as int32


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the compute dtype (the float pool stores K/V in it)
    # per layer, the sliding window its queries attend over (the newest `window` tokens, their
    # own included), None: the whole context; empty: no layer has one
    sliding_windows: tuple[int | None, ...] = ()

    def window(self, layer: int) -> int | None:
        """The layer's sliding window, None when it attends over the whole context."""
        return self.sliding_windows[layer] if layer < len(self.sliding_windows) else None

    @property
    def common_window(self) -> int | None:
        """When every layer has a sliding window, the largest: no query attends further back,
        so a request's slots behind it can be freed. None when some layer sees the whole
        context."""
        return common_window(self.sliding_windows, self.num_layers)

    @property
    def mixed_windows(self) -> tuple[int | None, ...] | None:
        """Each layer's window when some layers have one and others see the whole context
        (Gemma 3, Qwen's `max_window_layers`), else None."""
        windows = tuple(self.window(layer) for layer in range(self.num_layers))
        if self.common_window is not None or all(w is None for w in windows):
            return None
        return windows

    def max_request_blocks(self, max_model_len: int, max_num_batched_tokens: int,
                           layer_windows: tuple[int | None, ...] | None = None) -> int:
        """The most blocks one request holds at once: its whole context, or fewer with a
        window on every layer (`window_request_blocks`) or, given `layer_windows`, with
        windowed layers that give back what their windows pass (`sliced_request_blocks`)."""
        whole = cdiv(max_model_len, self.block_size)
        if layer_windows is not None:
            return min(whole, sliced_request_blocks(max_model_len, layer_windows,
                                                    self.block_size, max_num_batched_tokens))
        window = self.common_window
        if window is None:
            return whole
        return min(whole, window_request_blocks(window, self.block_size, max_num_batched_tokens))

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, in the compute dtype."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        """A float-pool block: its K/V plus each slot's recorded position."""
        return self.block_size * (self.bytes_per_token + POSITION_BYTES)


def common_window(windows: tuple[int | None, ...], num_layers: int) -> int | None:
    """The largest of `num_layers` layers' sliding windows when every layer has one (None: a
    layer attends over the whole context, or none has a window)."""
    if len(windows) < num_layers or None in windows or not windows:
        return None
    return max(windows)


def window_start(context: int, window: int | None) -> int:
    """The first of a query's `context` slots (its own the last) that its sliding window of
    `window` tokens sees; 0 without a window."""
    return 0 if window is None else max(0, context - window)


def window_request_blocks(window: int, block_size: int, max_num_batched_tokens: int) -> int:
    """The most blocks a request holds at once when every layer attends over `window` tokens:
    the blocks behind its next token's window are freed after each step and a prefix hit takes
    none of them, so at most the window before a step's (up to max_num_batched_tokens) tokens
    and those tokens, from a block start: cdiv(W - 1 + T, B) + 1, as vLLM's sliding-window
    spec."""
    return cdiv(window - 1 + max_num_batched_tokens, block_size) + 1


def sliced_request_blocks(num_slots: int, layer_windows: tuple[int | None, ...],
                          block_size: int, max_num_batched_tokens: int) -> int:
    """The most blocks a request of `num_slots` slots holds when its windowed layers give back
    the slices their windows pass (`nanokv.cache.layer_slices`): each full layer's slices of
    them all, each windowed layer's of its window before a step's tokens and those tokens
    (`window_request_blocks`), packed into blocks of one slice a layer."""
    whole = cdiv(num_slots, block_size)
    slices = sum(whole if w is None else
                 min(whole, window_request_blocks(w, block_size, max_num_batched_tokens))
                 for w in layer_windows)
    return cdiv(slices, len(layer_windows))
