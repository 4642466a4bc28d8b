"""The KV-cache interface: one engine's K/V storage for all layers, indexed by block id.

Two kinds implement it: the float pool (`nanokv/cache/kv_pool.py`, one contiguous tensor) and the
quantized stores (`nanokv/quant/store.py` and its subclasses). Everything else talks to the
interface only:

  * memory planning asks the kind's `KVCacheSpec` (bytes per block, fixed bytes, decode scratch
    per block) before anything is allocated;
  * each step, the runner calls `begin_step(slot_mapping, positions)` once (host bookkeeping,
    slot positions recorded) and the attention backend calls `write_layer(layer, plan, k, v, k_pre)`
    per layer, then reads the cache in its own way (`nanokv/attention/`);
  * the block manager calls `release(block_ids)` when blocks' ref counts reach zero;
  * KV policies read `policy_view(request)` (per layer dense `[nb, B, Hkv, D]` K/V with keys
    after RoPE, and a block table into them), and the policy runner writes their plan back with
    `copy_blocks` (copy-on-write) and `apply_plan`, then frees the blocks the plan dropped.

A kind registers under its `kv_cache_dtype` name in `nanokv/cache/registry.py` and declares, as
class attributes, what it can do: `supports_layer_slices` (per-layer block tables, which
per-layer policy budgets need), `begin_step_on_device` (its `begin_step` takes device tensors)
and `engine_options` (the engine options it reads beyond `kv_cache_dtype`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from nanokv.cache.layout import KVLayout


@dataclass(frozen=True)
class KVCacheSpec:
    """What a KV cache of one kind costs, known before it is allocated (vLLM's KVCacheSpec)."""

    kv_cache_dtype: str  # resolved name: "float32" for the float pool, "fp8_e4m3", "kvquant" ...
    bytes_per_block: int  # every byte that grows with the pool, per block (slot positions too)
    fixed_bytes: int = 0  # bytes that do not grow with the pool (staging, codebooks)
    # transient bytes the decode attention needs per block it reads (dequantized copies); the
    # tokens one step reads are bounded by the pool, so planning reserves this per pool block
    scratch_bytes_per_block: int = 0

    def pool_bytes(self, num_blocks: int) -> int:
        return self.fixed_bytes + num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class KVCacheOptions:
    """The engine options a KV cache kind may read (plain data, validated by the kind)."""

    kv_cache_dtype: str
    max_num_seqs: int  # running requests: a kind staging partial blocks needs one each
    kv_quant_bits: int | None = None
    kv_quant_config: str | None = None


class LayerReads(Sequence):
    """A view's layers read when indexed: `[layer]` -> (k, v) `[nb, B, Hkv, D]` of the view's
    blocks, dense copies made by `read(layer, block_ids)`. Iterating holds one layer at a time,
    not every layer at once (a 32k-token request of a 28-layer model is 7 GB of float32 K/V);
    `blocks(layer, indexes)` reads only some of the view's blocks. Valid while those blocks keep
    their content: a policy plan is applied before the request's dropped blocks are freed."""

    def __init__(self, num_layers: int, block_ids: torch.Tensor,
                 read: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.num_layers = num_layers
        self.block_ids = block_ids  # [nb] the view's table 0..nb-1 maps to these cache blocks
        self.read = read

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(layer, int):
            raise TypeError(f"a layer index is an int, got {type(layer).__name__}")
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"layer {layer} of {self.num_layers}")
        return self.read(layer % self.num_layers, self.block_ids)

    def blocks(self, layer: int, indexes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the view's blocks at `indexes` [m] (into its table): each [m, B, Hkv, D]."""
        return self.read(layer, self.block_ids[indexes])


@dataclass
class KVView:
    """One request's cache as KV policies see it: per layer (k, v) `[nb, B, Hkv, D]` with keys
    after RoPE (a list of the cache's own tensors, or `LayerReads` copying one layer when
    indexed), the block table into them, and (where the cache needs them to write a plan back)
    each slot's RoPE position `[nb * B]`."""

    layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    block_table: list[int]
    positions: torch.Tensor | None
    request_id: str

    def blocks(self, layer: int, indexes: Sequence[int] | torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V of the table's entries at `indexes` [m] only (a lazy view reads
        just those blocks): each [m, B, Hkv, D]."""
        if isinstance(self.layers, LayerReads):
            device = self.layers.block_ids.device
            return self.layers.blocks(layer, torch.as_tensor(indexes, dtype=torch.long,
                                                             device=device))
        k, v = self.layers[layer]
        table = torch.as_tensor(self.block_table, dtype=torch.long, device=k.device)
        table = table[torch.as_tensor(indexes, dtype=torch.long, device=k.device)]  # [m]
        return k[table], v[table]


class KVCache(ABC):
    """K/V of every layer for `num_blocks` blocks of `layout.block_size` slots."""

    supports_layer_slices: ClassVar[bool] = False
    # True: a policy's extra scoring forward pass (KVzip's reconstruction) can run over it
    supports_reconstruction: ClassVar[bool] = False
    engine_options: ClassVar[frozenset[str]] = frozenset()  # read beyond kv_cache_dtype
    # True: a rejected draft token's slot may simply be written again (speculative decoding):
    # its K/V stands alone (nothing else of its block depends on it), or waits in staging
    # until its block fills (quantizes_full_blocks)
    supports_speculation: ClassVar[bool] = False
    # True: a block's K/V is fixed when its last slot is written (quantized with statistics of
    # all its tokens); until then its slots are staged and may be written again. Speculative
    # drafts then stop before a block's last slot: only a known token fills a block
    quantizes_full_blocks: ClassVar[bool] = False
    # True: `begin_step` takes the step's slots and positions as device tensors (no host values
    # needed: the runner's one upload serves it); False: host lists (its bookkeeping reads them)
    begin_step_on_device: ClassVar[bool] = False

    layout: KVLayout
    num_blocks: int
    device: torch.device
    slot_positions: torch.Tensor  # [num_blocks, block_size] int32 RoPE position, -1 = empty
    pre_rope_keys: bool = False  # keys are stored before RoPE (rotated when read)

    # ---- what it costs -------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def settings_from_options(cls, options: KVCacheOptions, layout: KVLayout) -> dict:
        """Validate the engine options for this kind (raise ValueError naming what is allowed)
        and turn them into its constructor settings; runs before the model loads."""

    @classmethod
    def shard_settings(cls, settings: dict, rank: int, size: int) -> dict:
        """The settings of tensor-parallel rank `rank` of `size`, whose cache holds its share of
        the KV heads (`settings` cover every head). The same unless a setting is per head."""
        return settings

    @classmethod
    @abstractmethod
    def spec(cls, layout: KVLayout, settings: dict) -> KVCacheSpec:
        """The cost of a cache of this kind with these settings (nothing allocated)."""

    @classmethod
    @abstractmethod
    def create(cls, layout: KVLayout, num_blocks: int, device: torch.device, settings: dict,
               rotary=None) -> KVCache:
        """Allocate it. `rotary` (the model's RotaryEmbedding) rotates keys stored before RoPE
        and un-rotates kept keys a policy writes back."""

    @property
    @abstractmethod
    def kv_cache_dtype(self) -> str:
        """The resolved storage name (logs, metrics)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Every byte allocated (codes, scales, staging, slot positions ...)."""

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes by category (codes, scales, outliers, sinks, staging, bookkeeping); empty when
        there is nothing to break down."""
        return {}

    # ---- one step ------------------------------------------------------------------------------
    @abstractmethod
    def begin_step(self, slot_mapping: Sequence[int], positions: Sequence[int]):
        """Host bookkeeping once per step for its T new tokens (flat slots, RoPE positions);
        records the slot positions. Returns the write plan every layer's `write_layer` takes."""

    @abstractmethod
    def write_layer(self, layer: int, plan, k: torch.Tensor, v: torch.Tensor,
              k_pre: torch.Tensor) -> None:
        """Store one layer's new K/V: k (after RoPE), k_pre (before), v: `[T, Hkv, D]`."""

    # ---- blocks --------------------------------------------------------------------------------
    def release(self, block_ids: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """The block manager freed these blocks (ref count 0). Default: nothing to drop."""

    @abstractmethod
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V, positions): (source, destination) pairs."""

    def copy_slices(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy layer slices (flat ids `layer * num_blocks + block`): per-layer block tables."""
        raise ValueError(f"the {self.kv_cache_dtype} KV cache has no per-layer block tables")

    def extra_keys(self) -> tuple:
        """Prefix-cache extra keys: blocks are only shared between identical storage."""
        return (("kv_cache_dtype", self.kv_cache_dtype),)

    # ---- KV policies ---------------------------------------------------------------------------
    @abstractmethod
    def policy_view(self, request) -> KVView:
        """The request's cache as dense per-layer K/V for scoring (see KVView)."""

    @abstractmethod
    def apply_plan(self, request, plan, view: KVView) -> None:
        """Write a policy's `CompressionPlan` (chosen on `view`) into the request's blocks. The
        request still holds every block of the view: the caller frees the blocks past
        `plan.num_blocks` afterwards."""

    def check_policy(self, policy) -> None:
        """Raise ValueError when this cache cannot serve the policy (where they meet)."""
        check_policy_support(self, policy)


def check_policy_support(cache, policy) -> None:
    """What a cache class (or instance) can do against what the policy needs: a policy that
    scores by reconstruction is refused for that first, whatever its layer budgets."""
    if policy.needs_reconstruction and not cache.supports_reconstruction:
        raise_reconstruction_unsupported(policy.name)
    if policy.per_layer_budgets and not cache.supports_layer_slices:
        raise_layer_slices_needed(policy.name)


def raise_reconstruction_unsupported(policy_name: str) -> None:
    raise ValueError(f"kv_policy {policy_name!r} scores the cache with an extra forward pass, "
                     f"which needs the float KV pool (kv_cache_dtype 'auto') and "
                     f"tensor_parallel_size 1")


def raise_layer_slices_needed(policy_name: str) -> None:
    raise ValueError(f"kv_policy {policy_name!r} gives layers different budgets, which needs "
                     f"per-layer block tables over the float KV pool: use kv_cache_dtype "
                     f"'auto' with it")
