"""The contract of a quantized KV store, its write plan and its memory report.

A store is the engine's KV cache (`nanokv.cache.kv_cache.KVCache`) when kv_cache_dtype is not
"auto". It is indexed by the SAME block ids
as the block manager (`[num_blocks, block_size]` slots, flat slot = block * block_size + slot),
so eviction, prefix caching and preemption work on it unchanged: a block's bytes (codes,
scales, zero-points, outliers, sinks) live at its block id, and freeing a block moves nothing.

One step (all layers) goes:

    plan = store.plan_write(slot_mapping, positions)   # once per step, host bookkeeping
    for each layer:
        store.write(layer, plan, k, v)                  # k pre-RoPE iff store.pre_rope_keys
        k_ctx, v_ctx = store.read_blocks(layer, block_ids, rope)   # dequantized, rotated

Contract:
  - a block is filled in slot order; writing slot 0 starts a fresh block (its old content, if
    any, is dropped), so a block reused after being freed needs no explicit reset;
  - `plan_write` records each slot's RoPE position (`slot_positions[block, slot]`) so keys kept
    before RoPE can be rotated after dequantizing; `read_blocks` rotates when given `rope`;
  - `release(block_ids)` is called when the block manager frees blocks (ref count 0); it drops
    only what a partial block holds (its staging), full blocks stay readable for prefix hits;
  - `copy_blocks(pairs)` copies whole blocks (copy-on-write before a KV policy rewrites them);
  - `memory()` counts every byte the store allocated (codes, scales, zero-points, outlier
    indices and values, sinks, staging, bookkeeping), and `specs_for` says the same before
    anything is allocated (pool sizing asks it through `spec`).

A new store is one file with a subclass (`specs_for`, `write`, `read_blocks`, `from_settings`,
and `settings_from_options` when it reads engine options) plus one line in
`nanokv/cache/registry.py`. KV policies, prefix caching, preemption, the memory plan and the
PyTorch attention backend then work on it unchanged.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from nanokv.cache.kv_cache import KVCache, KVCacheOptions, KVCacheSpec, KVView, LayerReads
from nanokv.cache.layout import POSITION_BYTES, KVLayout
from nanokv.utils import cdiv

# (positions [n] int64, x [n, Hkv, D]) -> x rotated to those positions
Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (layer, block ids [n] int64) -> (k, v) each [n, B, Hkv, D] in the layout's dtype, keys after
# RoPE: what `read_blocks(layer, ids, store.rope)` gives, from a faster reader
BlockReader = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

CATEGORIES = ("codes", "scales", "outliers", "sinks", "staging", "bookkeeping")


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    category: str  # one of CATEGORIES

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a store holds, by category; per token = over all num_blocks * block_size slots."""

    kv_cache_dtype: str
    num_blocks: int
    block_size: int
    codes: int
    scales: int  # scales, zero-points / offsets, half-ranges, codebooks
    outliers: int  # sparse indices + deltas
    sinks: int  # full-precision sink values + their slot table
    staging: int  # full-precision copies of not-yet-full blocks
    bookkeeping: int  # slot positions (when the store owns them), staging index

    @property
    def total(self) -> int:
        return (self.codes + self.scales + self.outliers + self.sinks + self.staging
                + self.bookkeeping)

    @property
    def bytes_per_token(self) -> float:
        return self.total / max(1, self.num_blocks * self.block_size)

    @property
    def bytes_per_token_excluding_staging(self) -> float:
        """What each further block costs per token (staging is a fixed cost)."""
        return (self.total - self.staging) / max(1, self.num_blocks * self.block_size)

    def ratio_to(self, layout: KVLayout) -> float:
        """This store's bytes per token / the float pool's (both with slot positions)."""
        return self.bytes_per_token / (layout.bytes_per_block / layout.block_size)

    @classmethod
    def from_specs(cls, kv_cache_dtype: str, num_blocks: int, block_size: int,
                   specs: Sequence[BufferSpec]) -> MemoryReport:
        sums = dict.fromkeys(CATEGORIES, 0)
        for spec in specs:
            sums[spec.category] += spec.nbytes
        return cls(kv_cache_dtype, num_blocks, block_size, **sums)


@dataclass
class WritePlan:
    """One step's writes, prepared once and applied to every layer."""

    slot_mapping: torch.Tensor  # [T] int64 flat slots
    positions: torch.Tensor  # [T] int64 RoPE positions


def as_list(x: Sequence[int] | torch.Tensor) -> list[int]:
    """Host list of ints (a tensor on an accelerator costs one sync: pass lists when you can)."""
    return x.tolist() if isinstance(x, torch.Tensor) else [int(i) for i in x]


class QuantizedKVStore(KVCache):
    """Quantized paged KV storage for all layers of one engine (see the module contract)."""

    kv_cache_dtype = ""
    # peak live bytes of a decode read per block read, in units of one layer's K and V in
    # float32 (codes gathered and unpacked, dequantized, keys rotated): reserved per pool block
    decode_scratch_factor: ClassVar[float] = 2.0
    # a policy's compaction re-writes kept tokens in chunks of at most this many bytes of float
    # K/V (all layers; at least one block): its transient memory, whatever the request's length
    compaction_chunk_bytes: ClassVar[int] = 64 << 20

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str,
                 pre_rope_keys: bool, slot_positions: torch.Tensor | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if not isinstance(pre_rope_keys, bool):
            raise ValueError(f"pre_rope_keys must be True or False, got {pre_rope_keys!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.device = torch.device(device)
        self.pre_rope_keys = pre_rope_keys
        self.owns_positions = slot_positions is None
        if slot_positions is None:
            slot_positions = torch.full((num_blocks, layout.block_size), -1, dtype=torch.int32,
                                        device=self.device)
        elif tuple(slot_positions.shape) != (num_blocks, layout.block_size):
            raise ValueError(f"slot_positions must be [{num_blocks}, {layout.block_size}], "
                             f"got {tuple(slot_positions.shape)}")
        self.slot_positions = slot_positions  # [num_blocks, block_size], -1 = never written
        self.buffers: dict[str, torch.Tensor] = {}
        self.rotary = None  # the model's RoPE (set by `create`): rotates pre-RoPE keys
        # what policy views read the blocks with: None = `read_blocks` (the reference); an
        # attention backend with its own reader of these codes installs it (`use_block_reader`)
        self.block_reader: BlockReader | None = None

    # ---- the KV cache kind ---------------------------------------------------------------------
    @classmethod
    def settings_from_options(cls, options: KVCacheOptions, layout: KVLayout) -> dict:
        """Constructor settings from the engine options (none by default)."""
        return {}

    @classmethod
    @abstractmethod
    def specs_for(cls, layout: KVLayout, num_blocks: int, settings: dict) -> list[BufferSpec]:
        """Every tensor a store of `num_blocks` blocks with these settings allocates."""

    @classmethod
    @abstractmethod
    def from_settings(cls, layout: KVLayout, num_blocks: int, device: torch.device | str,
                      **settings) -> QuantizedKVStore:
        """Build from `settings_from_options`' settings."""

    @classmethod
    def spec(cls, layout: KVLayout, settings: dict) -> KVCacheSpec:
        fixed = sum(b.nbytes for b in cls.specs_for(layout, 0, settings))
        one = sum(b.nbytes for b in cls.specs_for(layout, 1, settings))
        dense_block = 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * 4
        return KVCacheSpec(cls.kv_cache_dtype, one - fixed + layout.block_size * POSITION_BYTES,
                           fixed, int(cls.decode_scratch_factor * dense_block))

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int, device: torch.device, settings: dict,
               rotary=None) -> QuantizedKVStore:
        store = cls.from_settings(layout, num_blocks, device, **settings)
        store.rotary = rotary
        return store

    @property
    def rope(self) -> Rope | None:
        """What attention passes to `read_blocks`: the model's RoPE for pre-RoPE keys."""
        return self.rotary.rotate if self.pre_rope_keys and self.rotary is not None else None

    def memory_breakdown(self) -> dict[str, int]:
        m = self.memory()
        return {name: getattr(m, name) for name in CATEGORIES}

    # ---- the KV cache interface ----------------------------------------------------------------
    def begin_step(self, slot_mapping: Sequence[int], positions: Sequence[int]) -> WritePlan:
        return self.plan_write(slot_mapping, positions)

    def write_layer(self, layer: int, plan: WritePlan, k: torch.Tensor, v: torch.Tensor,
                    k_pre: torch.Tensor) -> None:
        self.write(layer, plan, k_pre if self.pre_rope_keys else k, v)

    # ---- decode steps through CUDA graphs (stores with a Triton write) -------------------------
    # the int64 parts of its graph write plan (`graph_write.GraphWritePlan`), in order
    graph_parts: ClassVar[tuple[str, ...]] = ()
    triton_write = False  # its write runs Triton kernels that skip padded entries

    def graph_write_plan(self, max_batch: int):
        """Static write indexes for decode steps of up to max_batch rows (the Triton write
        only: its kernels skip the padded entries); `fill_graph_write` fills them each step."""
        from nanokv.quant.graph_write import GraphWritePlan

        if not self.triton_write or not self.graph_parts:
            raise RuntimeError("a graph write plan needs the Triton write (triton_write)")
        return GraphWritePlan.allocate(self.graph_parts, self.block_size, max_batch,
                                       self.device)

    def use_block_reader(self, reader: BlockReader | None) -> None:
        """Read policy views with `reader` (an attention backend's kernel that decodes these
        codes as `read_blocks` does); None: back to `read_blocks`."""
        self.block_reader = reader

    def policy_view(self, request) -> KVView:
        """The request's blocks, each layer dequantized into a dense copy when the policy reads
        it (`LayerReads`; keys rotated to their slot's position), table `0..nb-1` over the
        blocks it holds now (copy-on-write may replace table entries before `apply_plan`), and
        each slot's recorded position. Read by the block reader installed now, else
        `read_blocks`."""
        nb = cdiv(request.num_cached_slots, self.block_size)
        ids = torch.tensor(request.block_table[:nb], dtype=torch.long, device=self.device)
        if self.pre_rope_keys and self.rope is None:
            raise RuntimeError("a store with pre-RoPE keys needs the model's rotary (create)")
        read = self.block_reader or functools.partial(self.read_blocks, rope=self.rope)
        layers = LayerReads(self.layout.num_layers, ids, read)  # the reader installed now
        return KVView(layers, list(range(nb)), self.slot_positions[ids].reshape(-1).long(),
                      request.request_id)

    def apply_plan(self, request, plan, view: KVView) -> None:
        """RE-WRITE the kept tokens through the store from the first changed block on, so every
        block is quantized again with its new content's statistics (a second rounding of those
        tokens). A store that keeps keys before RoPE records one position per slot, shared by
        all layers and heads, but a slot may now hold different tokens per layer (and head):
        the slot gets the position of layer 0 / head 0's token, p, and each stored key is the
        kept post-RoPE key rotated back by p, so reading it (rotation by p) gives exactly the
        kept key. For a slot whose token is the same everywhere this is the plain pre-RoPE key.

        A new block that takes one old full block's slots whole and in order, in every layer
        and head (StreamingLLM's window after the sinks' block, whole blocks a policy keeps), is
        copied, codes and all: exact, and nothing is rounded again.

        Chunk by chunk of whole blocks (`compaction_chunk_bytes` of float K/V, all layers): a
        chunk's kept tokens are read from the blocks that hold them (a `LayerReads` view reads
        only those), then written. Kept indexes ascend, so slot i's token comes from slot
        kept[i] >= i: a chunk never overwrites a block a later chunk reads (nor its recorded
        positions or staging)."""
        from nanokv.policies.compaction import flat_slots, whole_block_sources

        if len(set(plan.layer_num_slots)) > 1:
            raise ValueError("per-layer budgets need the float KV pool (kv_cache_dtype 'auto')")
        if view.request_id != request.request_id:
            raise RuntimeError("apply_plan() must follow policy_view() of the same request")
        bs, n = self.block_size, plan.num_slots
        start = plan.first_changed_block * bs
        new_slots = flat_slots(request.block_table, n, bs, self.device)  # [n]
        first = plan.kept[0]
        positions = view.positions[first if first.dim() == 1 else first[0]]  # head 0's: [n]
        lay = self.layout
        token_bytes = 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * lay.dtype.itemsize
        chunk = max(1, self.compaction_chunk_bytes // (token_bytes * bs)) * bs
        table = request.block_table  # copy-on-write made [first changed, num_blocks) private
        moves = whole_block_sources(plan.kept, bs, plan.first_changed_block, n // bs)
        for lo in range(start, n, chunk):
            hi = min(n, lo + chunk)
            copied = [j for j in range(lo // bs, cdiv(hi, bs)) if j in moves]
            rewrite = torch.ones(hi - lo, dtype=torch.bool)  # [hi - lo]: slots re-written
            for j in copied:
                rewrite[j * bs - lo:(j + 1) * bs - lo] = False
            slots = (torch.arange(lo, hi)[rewrite]).to(self.device)  # [r]
            kept_kv = [self._read_kept(view, layer, kept[..., slots])  # each [r, Hkv, D]
                       for layer, kept in enumerate(plan.kept)] if slots.numel() else []
            if hi == n:
                # the blocks past the new length are freed after this: a partial one's staging
                # row (its tokens read above) goes back now, for the new partial block (a
                # request's partial block is its own: prefix caching shares full blocks only)
                self.release(table[plan.num_blocks:])
            self.copy_blocks([(table[moves[j]], table[j]) for j in copied])
            if not kept_kv:
                continue
            write = self.plan_write(new_slots[slots].tolist(), positions[slots].tolist())
            for layer, (ks, vs) in enumerate(kept_kv):
                if self.pre_rope_keys:
                    ks = self.rotary.unrotate(positions[slots], ks)
                self.write(layer, write, ks.contiguous(), vs.contiguous())

    def _read_kept(self, view: KVView, layer: int, kept: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's kept tokens `kept` ([C] or per KV head [Hkv, C], indexes into the view's
        slots), reading only the view's m blocks that hold them: k, v each [C, Hkv, D]."""
        bs, heads, dim = self.block_size, self.layout.num_kv_heads, self.layout.head_dim
        blocks = torch.unique(kept // bs)  # [m] sorted indexes into the view's table
        k_blocks, v_blocks = view.blocks(layer, blocks)  # each [m, B, Hkv, D]
        keys = k_blocks.reshape(-1, heads, dim)  # [m * B, Hkv, D]
        values = v_blocks.reshape(-1, heads, dim)
        local = torch.searchsorted(blocks, kept // bs) * bs + kept % bs  # kept, into keys
        if kept.dim() == 1:
            return keys[local], values[local]
        head = torch.arange(kept.shape[0], device=kept.device)[:, None]  # [Hkv, 1]
        # [Hkv, C, D] -> [C, Hkv, D]
        return keys[local, head].transpose(0, 1), values[local, head].transpose(0, 1)

    def _allocate(self, specs: Sequence[BufferSpec]) -> None:
        # zeros: never-written slots dequantize to finite values (masked, but 0 * NaN = NaN)
        for spec in specs:
            self.buffers[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype,
                                                  device=self.device)

    # ---- the contract ----------------------------------------------------------------------
    def plan_write(self, slot_mapping: Sequence[int] | torch.Tensor,
                   positions: Sequence[int] | torch.Tensor) -> WritePlan:
        """Prepare one step's writes (flat slots and RoPE positions of its T tokens)."""
        slots = torch.as_tensor(slot_mapping, dtype=torch.long, device=self.device)
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device)
        if slots.shape != pos.shape:
            raise ValueError(f"{slots.numel()} slots but {pos.numel()} positions")
        self.slot_positions.view(-1)[slots] = pos.to(self.slot_positions.dtype)
        return WritePlan(slots, pos)

    @abstractmethod
    def write(self, layer: int, plan: WritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's k, v: [T, Hkv, D] (k before RoPE iff `pre_rope_keys`)."""

    @abstractmethod
    def read_blocks(self, layer: int, block_ids: torch.Tensor, rope: Rope | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized k, v of blocks [n] -> each [n, block_size, Hkv, D] in layout.dtype.
        Keys are rotated iff `rope` is given (only allowed when `pre_rope_keys`). Slots never
        written hold finite garbage: mask them."""

    # ---- what a read returns for a block still filling ----------------------------------------
    @property
    def stages_blocks(self) -> bool:
        """Whether a side (keys, values) of a block is kept unquantized until the block's last
        slot is written (per-block statistics): a read of a partial block then returns that
        side as written (`staged_rows`), and its codes only once the block is full. A per-token
        store quantizes every token as it is written (False)."""
        return False

    def staged_rows(self, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Fresh tokens' keys (after RoPE) and values as a read returns them while their block
        is still filling, for each side the store stages (rounded to its staging dtype); None
        for a side a read takes from its codes from the first write. k, v: [T, Hkv, D];
        k_store: the keys as written (before RoPE iff `pre_rope_keys`); positions [T]: their
        RoPE positions (used only when the staging dtype rounds the keys)."""
        return None, None

    def read(self, layer: int, block_table: torch.Tensor | Sequence[int], num_slots: int,
             rope: Rope | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `num_slots` slots -> k, v: [num_slots, Hkv, D]."""
        table = torch.as_tensor(block_table, dtype=torch.long, device=self.device)
        k, v = self.read_blocks(layer, table, rope)
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        return (k.reshape(-1, heads, dim)[:num_slots], v.reshape(-1, heads, dim)[:num_slots])

    def release(self, block_ids: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """The block manager freed these blocks (ref count 0). Default: nothing to drop."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V, positions): (source, destination) pairs,
        as `KVPool.copy_blocks` (copy-on-write before a KV policy rewrites shared blocks)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for name, buf in self.buffers.items():
            axis = self._block_axis(name)
            if axis == 0:
                buf[dst] = buf[src]
            elif axis == 1:
                buf[:, dst] = buf[:, src]
        self.slot_positions[dst] = self.slot_positions[src]

    def _block_axis(self, name: str) -> int | None:
        """The block-id axis of buffer `name` (None: not indexed by block)."""
        return 0

    def buffer_specs(self) -> list[BufferSpec]:
        """Every tensor this store allocates (what `memory()` counts)."""
        return self.specs_for(self.layout, self.num_blocks, self.settings)

    @property
    def settings(self) -> dict:
        """The settings `specs_for` needs to describe this store."""
        return {"pre_rope_keys": self.pre_rope_keys}

    def extra_keys(self) -> tuple:
        """Prefix-cache extra keys: blocks are only shared between identical settings."""
        return (("kv_cache_dtype", self.kv_cache_dtype), ("pre_rope_keys", self.pre_rope_keys))

    # ---- memory ----------------------------------------------------------------------------
    def memory(self) -> MemoryReport:
        specs = list(self.buffer_specs())
        if self.owns_positions:
            specs.append(BufferSpec("slot_positions", (self.num_blocks, self.block_size),
                                    self.slot_positions.dtype, "bookkeeping"))
        return MemoryReport.from_specs(self.kv_cache_dtype, self.num_blocks, self.block_size,
                                       specs)

    @property
    def nbytes(self) -> int:
        return self.memory().total

    def bytes_per_token(self) -> float:
        return self.memory().bytes_per_token

    # ---- helpers ---------------------------------------------------------------------------
    def _rotate(self, k: torch.Tensor, block_ids: torch.Tensor, rope: Rope | None):
        """k: [n, B, Hkv, D] pre-RoPE -> rotated to each slot's recorded position."""
        if rope is None:
            return k
        if not self.pre_rope_keys:
            raise ValueError("this store holds keys after RoPE: read them without `rope`")
        pos = self.slot_positions[block_ids].long().clamp_min(0)  # [n, B]; -1 = unwritten
        return rope(pos.flatten(), k.flatten(0, 1)).view_as(k)
