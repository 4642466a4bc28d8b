"""The shape every KV cache of one engine shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

POSITION_BYTES = 4  # each slot records its token's RoPE position as int32


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the compute dtype (the float pool stores K/V in it)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, in the compute dtype."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        """A float-pool block: its K/V plus each slot's recorded position."""
        return self.block_size * (self.bytes_per_token + POSITION_BYTES)
