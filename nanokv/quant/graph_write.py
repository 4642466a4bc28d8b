"""Static write plans for decode steps replayed from CUDA graphs, shared by the stores whose
write is Triton's (KVQuant, KIVI).

A graph replays the same launches with the same tensors every step, so a store's step plan
(`plan_write`: index lists of any length) is copied into static tensors of max_batch entries a
part, one token a row: staging (and sink) writes at their token's row, filling blocks first,
everything else -1, which the Triton write kernels skip. The plan of a batch of b rows is the
first b entries of each part.

    graph = store.graph_write_plan(max_batch)                  # once
    host, entries, quant_src = padded_entries(graph, plan, batch)   # per step: common parts
    ... the store adds its own parts (sinks) and flags ...
    graph.fill(entries, quant_src, token_valid, quant_valid)  # two non-blocking copies
    views = graph.views(batch)                                 # the same views every step
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# the parts every staged store's graph plan fills (a store may add more after them)
COMMON_PARTS = ("slot_mapping", "positions", "stage_dst", "quant_blocks")


@dataclass
class HostWritePlan:
    """A step's write indexes on the host, as `plan_write` made them (a graph plan's source)."""

    slots: list[int]
    positions: list[int]
    stage_src: list[int]
    stage_dst: list[int]
    quant_blocks: list[int]
    quant_src: list[list[int]]


@dataclass
class GraphViews:
    """A batch's views of a graph plan's static tensors."""

    part: dict[str, torch.Tensor]  # each [batch] int64
    quant_src: torch.Tensor  # [batch, B] int64
    token_valid: torch.Tensor  # [batch] bool
    quant_valid: torch.Tensor  # [batch, B] bool
    rows: torch.Tensor  # [batch] int64 0, 1, ...: the staging (and sink) writes' token


@dataclass
class GraphWritePlan:
    """Static write indexes for decode steps of up to max_batch rows (module doc)."""

    max_batch: int
    block_size: int
    parts: tuple[str, ...]  # the int64 parts filled each step, in order
    # int64 [(len(parts) + B) * max_batch]: the parts, max_batch entries each, then
    # quant_src [max_batch, B]
    ints: torch.Tensor
    flags: torch.Tensor  # bool [(1 + B) * max_batch]: token_valid, then quant_valid [max_batch, B]
    rows: torch.Tensor  # int64 [max_batch] 0, 1, ... (fixed)

    @classmethod
    def allocate(cls, parts: tuple[str, ...], block_size: int, max_batch: int,
                 device: torch.device) -> GraphWritePlan:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        ints = torch.full(((len(parts) + block_size) * max_batch,), -1, dtype=torch.long,
                          device=device)
        flags = torch.zeros((1 + block_size) * max_batch, dtype=torch.bool, device=device)
        return cls(max_batch, block_size, parts, ints, flags,
                   torch.arange(max_batch, device=device))

    def fill(self, entries: dict[str, np.ndarray], quant_src: np.ndarray,
             token_valid: np.ndarray, quant_valid: np.ndarray) -> None:
        """One step's padded entries ([max_batch] each, [max_batch, B] for quant_src and
        quant_valid) into the static tensors: two copies that do not wait for queued work."""
        ints = np.concatenate([entries[name] for name in self.parts] + [quant_src.reshape(-1)])
        self.ints.copy_(torch.from_numpy(ints), non_blocking=True)
        flags = np.concatenate([token_valid, quant_valid.reshape(-1)])
        self.flags.copy_(torch.from_numpy(flags), non_blocking=True)

    def views(self, batch: int) -> GraphViews:
        m, bsz = self.max_batch, self.block_size
        part = {name: self.ints[i * m:i * m + batch] for i, name in enumerate(self.parts)}
        start = len(self.parts) * m
        return GraphViews(part, self.ints[start:start + m * bsz].view(m, bsz)[:batch],
                          self.flags[:batch], self.flags[m:].view(m, bsz)[:batch],
                          self.rows[:batch])


def padded_entries(graph: GraphWritePlan, plan, batch: int
                   ) -> tuple[HostWritePlan | None, dict[str, np.ndarray], np.ndarray]:
    """The step's host plan (`plan.host`; None: no rows), its common parts padded to the
    graph's max_batch, and quant_src [max_batch, B] (a store's own parts start padded, -1).
    Refuses a plan without host lists and a batch not between the step's tokens and max_batch."""
    host = None if plan is None else plan.host
    if plan is not None and host is None:
        raise ValueError("fill_graph_write needs a plan from plan_write")
    n = 0 if host is None else len(host.slots)
    m, bsz = graph.max_batch, graph.block_size
    if not n <= batch <= m:
        raise ValueError(f"batch must be between the step's {n} tokens and max_batch {m}, "
                         f"got {batch}")
    entries = {name: np.full(m, -1, dtype=np.int64) for name in graph.parts}
    quant_src = np.zeros((m, bsz), dtype=np.int64)
    if n:
        entries["slot_mapping"][:n] = host.slots
        entries["positions"][:n] = host.positions
        entries["stage_dst"][host.stage_src] = host.stage_dst  # at their token's row
        nq = len(host.quant_blocks)  # <= n: a token fills at most one block
        entries["quant_blocks"][:nq] = host.quant_blocks
        quant_src[:nq] = np.asarray(host.quant_src, dtype=np.int64).reshape(nq, bsz)
    return host, entries, quant_src
