"""Per-layer block tables for a request whose layers hold different numbers of tokens.

A pool block spans all layers: block b of the pool is the `num_layers` *layer slices*
`kv[:, l, b]`. With one block table shared by all layers, a policy with per-layer budgets
(PyramidKV) would hold ceil(max_l C_l / B) blocks: the largest layer's budget decides. Here each
layer l gets its own table of layer slices instead, addressed in the flattened pool
`kv.view(2, num_layers * num_blocks, B, Hkv, D)` as `slice = l' * num_blocks + b` (l' need not
be l: a layer may borrow another layer's slice of a block the request holds). The request then
holds only

    ceil( sum_l ceil(C_l / B) / num_layers )   blocks

and the block manager still sees whole blocks (ref counts, freeing, preemption unchanged). No torch
here: this is bookkeeping the scheduler and block manager use; the runner turns it into per-layer
slot mappings and block tables.

Lengths grow together: every layer gets each new token, so layer l holds
`base_lengths[l] + (num_computed_tokens - base_computed) - offsets[l]` slots.

Sliding windows (a model whose layers mix windowed and full attention, Gemma 3): `windows`
gives each layer's window (None: the whole context). A windowed layer drops the slices its
window has passed from the front of its table (`drop_passed`; `offsets[l]` counts the slots
dropped, a multiple of B), and those slices, now free, take the other layers' new tokens: the
request then holds about ceil((F * ceil(n / B) + W * (window / B + 1)) / L) blocks for F full
and W windowed layers, instead of ceil(n / B). A layer's table then starts at slot
`offsets[l]`; its lengths and slot indices count from there (a window's start, length - W, is
the same counted from either end).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence, Set

from nanokv.utils import cdiv


class LayerSlices:
    def __init__(self, tables: list[list[int]], base_lengths: list[int], base_computed: int,
                 block_size: int, num_pool_blocks: int,
                 windows: Sequence[int | None] | None = None) -> None:
        if len(tables) != len(base_lengths) or not tables:
            raise ValueError("need one table and one length per layer")
        if windows is not None and len(windows) != len(tables):
            raise ValueError(f"need one window per layer ({len(tables)}), got {len(windows)}")
        self.tables = [list(t) for t in tables]  # per layer: flat slice ids, in slot order
        self.base_lengths = list(base_lengths)
        self.base_computed = base_computed
        self.block_size = block_size
        self.num_pool_blocks = num_pool_blocks
        # per layer: its sliding window (None: whole context); None: no layer drops slices
        self.windows = None if windows is None else list(windows)
        self.offsets = [0] * len(tables)  # per layer: slots dropped from its table's front

    @property
    def num_layers(self) -> int:
        return len(self.tables)

    def lengths(self, num_computed_tokens: int) -> list[int]:
        """Slots each layer holds once `num_computed_tokens` tokens are computed."""
        grown = num_computed_tokens - self.base_computed
        if grown < 0:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} is below the "
                             f"{self.base_computed} computed at compression")
        return [n + grown - o for n, o in zip(self.base_lengths, self.offsets)]

    def drop_passed(self, next_slot: int) -> int:
        """Drop, from each windowed layer's table, the slices wholly before the window of the
        token at (request) slot `next_slot`, which sees slots [next_slot + 1 - W, next_slot]:
        no query of it or after it reads them. Returns the number of slices dropped."""
        if self.windows is None:
            return 0
        bs, dropped = self.block_size, 0
        for layer, window in enumerate(self.windows):
            if window is None:
                continue
            passed = max(0, next_slot + 1 - window) // bs - self.offsets[layer] // bs
            if passed > 0:
                del self.tables[layer][:passed]
                self.offsets[layer] += passed * bs
                dropped += passed
        return dropped

    def slices_needed(self, num_slots_per_layer: Sequence[int]) -> int:
        return sum(cdiv(n, self.block_size) for n in num_slots_per_layer)

    def blocks_needed(self, num_slots_per_layer: Sequence[int]) -> int:
        """Pool blocks that hold these per-layer lengths when slices are packed."""
        return cdiv(self.slices_needed(num_slots_per_layer), self.num_layers)

    def slice_block(self, slice_id: int) -> int:
        return slice_id % self.num_pool_blocks

    def free_slices(self, block_table: Sequence[int], pinned: Set[int] = frozenset()
                    ) -> list[int]:
        """Slices of the request's blocks no layer uses, in block-table order (own layer first
        is the caller's choice); none of the blocks in `pinned` (shared with another request:
        their content is not the request's to overwrite)."""
        used = {s for t in self.tables for s in t}
        return [layer * self.num_pool_blocks + b for b in block_table if b not in pinned
                for layer in range(self.num_layers)
                if layer * self.num_pool_blocks + b not in used]

    def slices_wanted(self, num_slots_per_layer: Sequence[int]) -> int:
        """Slices the layers' tables must grow by to cover these lengths."""
        return sum(max(0, cdiv(n, self.block_size) - len(table))
                   for n, table in zip(num_slots_per_layer, self.tables))

    def used_blocks(self) -> set[int]:
        """The pool blocks some layer holds a slice of."""
        return {self.slice_block(s) for t in self.tables for s in t}

    def pack(self, block_table: Sequence[int], pinned: Set[int] = frozenset()
             ) -> list[tuple[int, int]]:
        """Move slices out of the request's emptiest blocks into the free slices of its fullest
        (none into a `pinned` block) until the kept blocks hold every used slice, when that
        frees at least one block; returns the (source, destination) moves, the tables already
        pointing at the destinations (the caller copies the data and frees the emptied blocks).
        A windowed layer's dropped slices leave each block with a few used ones (the full
        layers' older tokens): packing turns them back into whole free blocks."""
        used = Counter(self.slice_block(s) for t in self.tables for s in t)
        if len(block_table) <= cdiv(sum(used.values()), self.num_layers):
            return []
        outside, room, kept = sum(used.values()), 0, set()
        for b in sorted(block_table, key=lambda b: (-used[b], b in pinned)):  # fullest first
            if room >= outside:
                break
            kept.add(b)
            outside -= used[b]
            room += 0 if b in pinned else self.num_layers - used[b]
        if len(kept) == len(block_table):
            return []
        taken = {s for t in self.tables for s in t}
        free = [layer * self.num_pool_blocks + b for b in block_table
                if b in kept and b not in pinned for layer in range(self.num_layers)
                if layer * self.num_pool_blocks + b not in taken]
        moves = []
        for table in self.tables:
            for i, s in enumerate(table):
                if self.slice_block(s) not in kept:
                    table[i] = free.pop()
                    moves.append((s, table[i]))
        return moves

    def reserve(self, block_table: Sequence[int], num_slots_per_layer: Sequence[int],
                pinned: Set[int] = frozenset()) -> list[int]:
        """Extend each layer's table to cover its slots, taking free slices of `block_table`
        (none of a `pinned` block's). The block manager grew the table first; raises if it did
        not. Returns the slices taken."""
        needs = [cdiv(n, self.block_size) - len(table)
                 for n, table in zip(num_slots_per_layer, self.tables)]
        if max(needs) <= 0:  # most decode steps: every layer's last slice has room
            return []
        free = self.free_slices(block_table, pinned)
        taken = []
        for layer, need in enumerate(needs):
            for _ in range(max(0, need)):
                if not free:
                    raise RuntimeError("layer slices exhausted: the block table was not grown "
                                       "by blocks_needed() first")
                # prefer the layer's own slice (keeps a layer's data in its own pool view)
                own = [s for s in free if s // self.num_pool_blocks == layer]
                pick = own[0] if own else free[0]
                free.remove(pick)
                self.tables[layer].append(pick)
                taken.append(pick)
        return taken

    def slot(self, layer: int, index: int) -> int:
        """Flat slot (in `num_layers * num_blocks * B`) of layer's slot `index`."""
        bs = self.block_size
        return self.tables[layer][index // bs] * bs + index % bs

    def check(self, block_table: Sequence[int], num_computed_tokens: int) -> None:
        """Every slice belongs to a block of the table, none is used twice, each layer's table
        covers exactly its length."""
        owned = set(block_table)
        seen: set[int] = set()
        for layer, (table, n) in enumerate(zip(self.tables, self.lengths(num_computed_tokens))):
            if len(table) < cdiv(n, self.block_size):
                raise RuntimeError(f"layer {layer} table of {len(table)} slices is short of "
                                     f"{n} slots")
            for s in table:
                if self.slice_block(s) not in owned:
                    raise RuntimeError(f"layer {layer} uses slice {s} of a block the request "
                                         f"does not hold")
                if s in seen:
                    raise RuntimeError(f"slice {s} used twice")
                seen.add(s)
        if self.windows is not None:  # the slices a window dropped wait for new tokens
            idle = set(block_table) - self.used_blocks()
            if idle:
                raise RuntimeError(f"blocks {sorted(idle)} are held but no layer uses them")
        elif len(block_table) > self.blocks_needed(self.lengths(num_computed_tokens)):
            raise RuntimeError(f"{len(block_table)} blocks held for per-layer lengths "
                                 f"{self.lengths(num_computed_tokens)}")
