"""The float KV pool: ONE contiguous tensor for all layers, with per-layer views.

    kv[0 = key | 1 = value, layer, block, slot in block, kv head, head dim]

Next to it, `slot_positions[block, slot]` records the RoPE position of the token in each slot
(-1 when empty): after eviction a slot index no longer equals its token's position.
Registered as kv_cache_dtype "auto" (K/V in the compute dtype); see `kv_cache.py` for the
interface.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanokv.cache.kv_cache import KVCache, KVCacheOptions, KVCacheSpec, KVView
from nanokv.cache.layout import KVLayout

__all__ = ["KVLayout", "KVPool"]


class KVPool(KVCache):
    supports_layer_slices = True
    supports_reconstruction = True
    supports_speculation = True
    begin_step_on_device = True

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        # zeros, not empty: padded slots are masked out, but 0 * NaN would still poison a sum
        self.kv = torch.zeros(2, layout.num_layers, num_blocks, layout.block_size,
                              layout.num_kv_heads, layout.head_dim,
                              dtype=layout.dtype, device=self.device)
        self.slot_positions = torch.full((num_blocks, layout.block_size), -1,
                                         dtype=torch.int32, device=self.device)

    # ---- the kind ------------------------------------------------------------------------------
    @classmethod
    def settings_from_options(cls, options: KVCacheOptions, layout: KVLayout) -> dict:
        return {}

    @classmethod
    def spec(cls, layout: KVLayout, settings: dict) -> KVCacheSpec:
        return KVCacheSpec(str(layout.dtype).removeprefix("torch."), layout.bytes_per_block)

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int, device: torch.device, settings: dict,
               rotary=None) -> KVPool:
        return cls(layout, num_blocks, device)

    @property
    def kv_cache_dtype(self) -> str:
        return str(self.layout.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.slot_positions.nbytes

    # ---- views ---------------------------------------------------------------------------------
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer: k_cache, v_cache, each [num_blocks, block_size, Hkv, D]."""
        return self.kv[0, index], self.kv[1, index]

    def flat_layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of all layers as one table of layer slices, each
        [num_layers * num_blocks, block_size, Hkv, D]: slice l * num_blocks + b is layer l's part
        of block b (per-layer block tables index this; see nanokv.cache.layer_slices)."""
        lay = self.layout
        flat = self.kv.view(2, lay.num_layers * self.num_blocks, lay.block_size,
                            lay.num_kv_heads, lay.head_dim)  # [2, L * N, B, Hkv, D]
        return flat[0], flat[1]

    # ---- one step ------------------------------------------------------------------------------
    def begin_step(self, slot_mapping: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Records the positions; the plan is the slot mapping as a tensor `[T]`."""
        slots = torch.as_tensor(slot_mapping, dtype=torch.long, device=self.device)
        self.slot_positions.view(-1)[slots] = torch.as_tensor(
            positions, dtype=torch.int32, device=self.device)
        return slots

    def write_layer(self, layer: int, plan: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              k_pre: torch.Tensor) -> None:
        k_cache, v_cache = self.layer(layer)
        write_slots(k_cache, v_cache, plan, k, v)

    # ---- blocks --------------------------------------------------------------------------------
    def copy_slices(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy layer slices (K and V): (source, destination) flat slice ids."""
        if not pairs:
            return
        k_flat, v_flat = self.flat_layers()
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        k_flat[dst] = k_flat[src]
        v_flat[dst] = v_flat[src]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V, slot positions): (source, destination)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        self.kv[:, :, dst] = self.kv[:, :, src]
        self.slot_positions[dst] = self.slot_positions[src]

    # ---- KV policies ---------------------------------------------------------------------------
    def policy_view(self, request) -> KVView:
        """The pool's own layer views and the request's block table itself (not a copy:
        copy-on-write replaces shared blocks in it before `apply_plan` writes)."""
        layers = [self.layer(i) for i in range(self.layout.num_layers)]
        return KVView(layers, request.block_table, None, request.request_id)

    def apply_plan(self, request, plan, view: KVView) -> None:
        from nanokv.policies.apply import apply_compression

        apply_compression(plan, view.layers, view.block_table, self.slot_positions)


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache / v_cache: [num_blocks, B, Hkv, D] (or flat layer slices); k, v: [T, Hkv, D]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
