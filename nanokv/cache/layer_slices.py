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
`base_lengths[l] + (num_computed_tokens - base_computed)` slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanokv.utils import cdiv


class LayerSlices:
    def __init__(self, tables: list[list[int]], base_lengths: list[int], base_computed: int,
                 block_size: int, num_pool_blocks: int) -> None:
        if len(tables) != len(base_lengths) or not tables:
            raise ValueError("need one table and one length per layer")
        self.tables = [list(t) for t in tables]  # per layer: flat slice ids, in slot order
        self.base_lengths = list(base_lengths)
        self.base_computed = base_computed
        self.block_size = block_size
        self.num_pool_blocks = num_pool_blocks

    @property
    def num_layers(self) -> int:
        return len(self.tables)

    def lengths(self, num_computed_tokens: int) -> list[int]:
        """Slots each layer holds once `num_computed_tokens` tokens are computed."""
        grown = num_computed_tokens - self.base_computed
        if grown < 0:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} is below the "
                             f"{self.base_computed} computed at compression")
        return [n + grown for n in self.base_lengths]

    def slices_needed(self, num_slots_per_layer: Sequence[int]) -> int:
        return sum(cdiv(n, self.block_size) for n in num_slots_per_layer)

    def blocks_needed(self, num_slots_per_layer: Sequence[int]) -> int:
        """Pool blocks that hold these per-layer lengths when slices are packed."""
        return cdiv(self.slices_needed(num_slots_per_layer), self.num_layers)

    def slice_block(self, slice_id: int) -> int:
        return slice_id % self.num_pool_blocks

    def free_slices(self, block_table: Sequence[int]) -> list[int]:
        """Slices of the request's blocks no layer uses, in block-table order (own layer first
        is the caller's choice)."""
        used = {s for t in self.tables for s in t}
        return [layer * self.num_pool_blocks + b for b in block_table
                for layer in range(self.num_layers)
                if layer * self.num_pool_blocks + b not in used]

    def reserve(self, block_table: Sequence[int], num_slots_per_layer: Sequence[int]) -> None:
        """Extend each layer's table to cover its slots, taking free slices of `block_table`.
        The block manager grew the table by `blocks_needed` first; raises if it did not."""
        needs = [cdiv(n, self.block_size) - len(table)
                 for n, table in zip(num_slots_per_layer, self.tables)]
        if max(needs) <= 0:  # most decode steps: every layer's last slice has room
            return
        free = self.free_slices(block_table)
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
        if len(block_table) > self.blocks_needed(self.lengths(num_computed_tokens)):
            raise RuntimeError(f"{len(block_table)} blocks held for per-layer lengths "
                                 f"{self.lengths(num_computed_tokens)}")
