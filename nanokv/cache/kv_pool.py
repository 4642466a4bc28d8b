"""The KV pool: ONE contiguous tensor for all layers, with per-layer views.

    kv[0 = key | 1 = value, layer, block, slot in block, kv head, head dim]

Next to it, `slot_positions[block, slot]` records the RoPE position of the token in each slot
(-1 when empty): after eviction a slot index no longer equals its token's position.

With a quantized KV cache (`kv_cache_dtype` other than auto) the K/V live in a
`nanokv.quant.QuantizedKVStore` indexed by the same block ids; the pool is then made with
`allocate_kv=False` and only holds `slot_positions`, which the store shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        # + 4 bytes per slot for its recorded position
        return self.block_size * (self.bytes_per_token + 4)


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device,
                 allocate_kv: bool = True) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        # zeros, not empty: padded slots are masked out, but 0 * NaN would still poison a sum
        self.kv = torch.zeros(2, layout.num_layers, num_blocks, layout.block_size,
                              layout.num_kv_heads, layout.head_dim,
                              dtype=layout.dtype, device=device) if allocate_kv else None
        self.slot_positions = torch.full((num_blocks, layout.block_size), -1,
                                         dtype=torch.int32, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer: k_cache, v_cache, each [num_blocks, block_size, Hkv, D]."""
        if self.kv is None:
            raise RuntimeError("this pool holds no float K/V (a quantized store does)")
        return self.kv[0, index], self.kv[1, index]

    def flat_layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of all layers as one table of layer slices, each
        [num_layers * num_blocks, block_size, Hkv, D]: slice l * num_blocks + b is layer l's part
        of block b (per-layer block tables index this; see nanokv.cache.layer_slices)."""
        if self.kv is None:
            raise RuntimeError("this pool holds no float K/V (a quantized store does)")
        lay = self.layout
        flat = self.kv.view(2, lay.num_layers * self.num_blocks, lay.block_size,
                            lay.num_kv_heads, lay.head_dim)  # [2, L * N, B, Hkv, D]
        return flat[0], flat[1]

    def copy_slices(self, pairs: list[tuple[int, int]]) -> None:
        """Copy layer slices (K and V): (source, destination) flat slice ids."""
        if not pairs:
            return
        k_flat, v_flat = self.flat_layers()
        src = torch.tensor([p[0] for p in pairs], device=k_flat.device)
        dst = torch.tensor([p[1] for p in pairs], device=k_flat.device)
        k_flat[dst] = k_flat[src]
        v_flat[dst] = v_flat[src]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V, slot positions): (source, destination)."""
        if not pairs:
            return
        if self.kv is None:
            raise RuntimeError("this pool holds no float K/V: copy blocks in the quantized store")
        src = torch.tensor([p[0] for p in pairs], device=self.kv.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.kv.device)
        self.kv[:, :, dst] = self.kv[:, :, src]
        self.slot_positions[dst] = self.slot_positions[src]

    @property
    def nbytes(self) -> int:
        return (0 if self.kv is None else self.kv.nbytes) + self.slot_positions.nbytes
