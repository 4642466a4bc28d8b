"""Host bookkeeping of blocks that are quantized when they fill (KVQuant's per-channel keys,
KIVI's keys and values): how many slots each block holds, and the full-precision staging row a
partial block keeps its tokens in until then. No torch, no device sync: the stores turn the
plan into index tensors once per step (`read_filling` reads a store's staging rows).

A block is filled in slot order; writing slot 0 restarts it, and writing slot j of a partial
block that holds more restarts it from j (speculative decoding: the slots of rejected draft
tokens are written again; a full block, quantized, cannot be). One staging row per partial block
suffices (a request has at most one), and a block that fills in a step frees its row before the
step's new partial blocks take theirs. Every check runs before any state changes, so a refused
step leaves the bookkeeping as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StagingPlan:
    """One step's writes, grouped by block (token indices into the step, in batch order)."""

    completing: list[tuple[int, list[int], int]]  # (block, tokens, slots held before): fills
    partial: list[tuple[int, list[int], int]]  # the same for blocks that stay partial
    # per completing block the source of each of its B slots: a flat staging slot
    # (row * B + slot, < rows * B) or rows * B + the token's index in the step
    quant_src: list[list[int]] = field(default_factory=list)
    stage_src: list[int] = field(default_factory=list)  # tokens written to staging ...
    stage_dst: list[int] = field(default_factory=list)  # ... at these flat staging slots
    row_changes: dict[int, int] = field(default_factory=dict)  # block -> its row now (-1: none)

    @property
    def quant_blocks(self) -> list[int]:
        return [b for b, _, _ in self.completing]


class BlockStaging:
    def __init__(self, num_blocks: int, block_size: int, num_rows: int, label: str,
                 staged: bool = True) -> None:
        """staged=False: blocks are only counted (nothing waits for its block to fill)."""
        self.block_size = block_size
        self.num_rows = num_rows if staged else 0
        self.label = label  # the store, for error messages
        self.staged = staged
        self.fill = np.zeros(num_blocks, dtype=np.int64)  # slots written since slot 0
        self.row = np.full(num_blocks, -1, dtype=np.int64)  # staging row or -1
        self.free_rows = list(range(self.num_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self.free_rows)

    def plan(self, slots: Sequence[int]) -> StagingPlan:
        """Validate a step's flat slots, advance the blocks' fill, assign and free rows."""
        bsz = self.block_size
        groups: dict[int, list[int]] = {}  # block -> its tokens, in batch order
        for t, s in enumerate(slots):
            groups.setdefault(s // bsz, []).append(t)
        starts = {}
        for b, toks in groups.items():
            first, fill = slots[toks[0]] % bsz, int(self.fill[b])
            if first == 0 or first < fill < bsz:  # slot 0: fresh; a partial block rewound
                fill = first
            got = [slots[t] % bsz for t in toks]
            if got != list(range(fill, fill + len(toks))):
                raise RuntimeError(f"{self.label}: block {b}: slots {got} written out of order; "
                                   f"it holds {fill} slots (blocks fill in slot order; slot 0 "
                                   f"restarts a block, an earlier slot a partial one)")
            if self.staged and fill and self.row[b] < 0:
                raise RuntimeError(f"{self.label}: block {b} has {fill} slots but no staged "
                                   f"tokens (released while in use?)")
            starts[b] = fill
        if self.staged:
            need = sum(1 for b, toks in groups.items()
                       if starts[b] + len(toks) < bsz and self.row[b] < 0)
            freed = sum(1 for b, toks in groups.items()
                        if starts[b] + len(toks) == bsz and self.row[b] >= 0)
            if need > len(self.free_rows) + freed:
                raise RuntimeError(f"{self.label}: all {self.num_rows} staging blocks are in use "
                                   f"({need} more needed for partial blocks): raise "
                                   f"num_staging_blocks (>= running requests) or call release() "
                                   f"when blocks are freed")
        plan = StagingPlan([], [])
        for b, toks in groups.items():
            self.fill[b] = starts[b] + len(toks)
            (plan.completing if self.fill[b] == bsz else plan.partial).append(
                (b, toks, starts[b]))
        if not self.staged:
            return plan
        staged_slots = self.num_rows * bsz
        for b, toks, fill in plan.completing:  # first: their staging rows become free
            row = int(self.row[b])
            plan.quant_src.append([row * bsz + j for j in range(fill)]
                                  + [staged_slots + t for t in toks])
            if row >= 0:
                self.free_rows.append(row)
                self.row[b] = -1
                plan.row_changes[b] = -1
        for b, toks, _ in plan.partial:
            row = int(self.row[b])
            if row < 0:
                row = self.free_rows.pop()
                self.row[b] = row
                plan.row_changes[b] = row
            plan.stage_src += toks
            plan.stage_dst += [row * bsz + slots[t] % bsz for t in toks]
        return plan

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """The block manager freed these blocks: their rows go back, a partial block's content
        is gone (full blocks stay readable for prefix hits). Returns the blocks that lost a
        row."""
        dropped = []
        for b in block_ids:
            row = int(self.row[b])
            if row >= 0:
                self.free_rows.append(row)
                self.row[b] = -1
                dropped.append(b)
            if self.fill[b] < self.block_size:
                self.fill[b] = 0
        return dropped

    def copy(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Whole-block copies (source, destination): the destination takes the source's fill,
        and a row of its own when the source is partial. Returns the (source row, destination
        row) pairs whose staged tokens the store must copy; raises, changing nothing, when the
        rows run short."""
        staged_src = [(s, d) for s, d in pairs if self.row[s] >= 0]
        need = sum(1 for _, d in staged_src if self.row[d] < 0)
        if need > len(self.free_rows):
            raise RuntimeError(f"{self.label}: copy_blocks needs {need} staging blocks, "
                               f"{len(self.free_rows)} are free")
        for s, d in pairs:
            self.fill[d] = self.fill[s]
            if self.row[d] >= 0 and self.row[s] < 0:  # dst had staging, src has none
                self.free_rows.append(int(self.row[d]))
                self.row[d] = -1
        row_copies = []
        for s, d in staged_src:
            if self.row[d] < 0:
                self.row[d] = self.free_rows.pop()
            row_copies.append((int(self.row[s]), int(self.row[d])))
        return row_copies


def staging_rows_before(store, plan, blocks: Sequence[int]) -> list[int]:
    """The staging row each of `blocks` held when the step began (-1: none), for a store with
    a `BlockStaging` (KVQuant, KIVI) and the step's plan (host indexes: `plan.host`). The plan
    already gave back the row of a block the step fills; its staged tokens stay there until the
    layer's write quantizes the block (a read in between finds no row through
    `staging_index`)."""
    bs = store.block_size
    freed = {b: src[0] // bs for b, src in zip(plan.host.quant_blocks, plan.host.quant_src)
             if src[0] < store.staging.num_rows * bs}  # filled from its row: it had one
    return [freed.get(b, int(store.staging.row[b])) for b in blocks]


def read_filling(store, layer: int, plan, block: int, count: int, rope=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` slots of `block`, a partial block of a staging store when the step
    began, as a read returned them then (the write quantizes them when the step fills the
    block): (k, after RoPE when `rope` is given, v) [count, Hkv, D] in the layout's dtype. Call
    after `plan_write` and before the layer's `write` (`staging_rows_before`). A side the store
    does not stage (no `staging_<side>` buffer) comes from its codes."""
    row = staging_rows_before(store, plan, [block])[0]
    if row < 0:
        raise RuntimeError(f"block {block} held no staged tokens when the step began")
    staging = [store.buffers.get(f"staging_{name}") for name in ("k", "v")]
    codes = None  # the block's codes decoded, only for a side without staging (KVQuant's v)
    if any(x is None for x in staging):
        ids = torch.tensor([block], dtype=torch.long, device=store.device)
        codes = store.read_blocks(layer, ids)  # (k, v) [1, B, Hkv, D] each
    # staged rows copied: the write may stage the step's new partial block in that row
    k, v = (codes[side][0, :count] if x is None
            else x[layer][row, :count].to(store.layout.dtype, copy=True)
            for side, x in enumerate(staging))
    if rope is not None:
        k = rope(store.slot_positions[block, :count].long(), k)
    return k, v
