"""The KV cache as rank 0's block manager and KV policies see it under tensor parallelism.

Each rank's cache holds its KV heads (a `KVLayout` with num_kv_heads / N) for the SAME block ids:
the one block manager on rank 0 decides for all. This wrapper forwards what they do to rank 0's
own cache at once and queues it for the other ranks (`release`, `copy_blocks`, `copy_slices`
reach them before their next command). KV policies see every head: `policy_view` gathers the
request's blocks from all ranks on rank 0, one layer (or some blocks of it) when the policy
reads it (a policy then scores exactly as in one process:
per-head scores, sums over heads, block decisions and pool-pressure evictions alike), and
`apply_plan` sends each rank its heads' part of the plan (a kept-slot list shared by all heads
goes to every rank whole), written with the view that rank kept from the gather. So every rank
keeps the same blocks and slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from nanokv.cache.kv_cache import KVCache, KVView, LayerReads
from nanokv.distributed.messages import ApplyPlan, GatherLayer, GatherView, KVOp, RequestRef
from nanokv.utils import cdiv


class ShardedKVCache(KVCache):
    def __init__(self, local: KVCache, executor) -> None:
        """local: rank 0's own cache; executor: the `TensorParallelExecutor`."""
        self.local = local
        self.executor = executor
        self.layout = local.layout  # this rank's heads; views hold all ranks'
        self.num_blocks = local.num_blocks
        self.device = local.device
        self._held: KVView | None = None  # rank 0's own view of the last gather

    # what the local cache can do, this wrapper can
    supports_layer_slices = property(lambda self: self.local.supports_layer_slices)
    pre_rope_keys = property(lambda self: self.local.pre_rope_keys)
    slot_positions = property(lambda self: self.local.slot_positions)

    @classmethod
    def settings_from_options(cls, options, layout):
        raise TypeError("a ShardedKVCache wraps a rank's KV cache; it is not a KV cache kind")

    spec = create = settings_from_options

    @property
    def kv_cache_dtype(self) -> str:
        return self.local.kv_cache_dtype

    @property
    def nbytes(self) -> int:
        """Every rank's cache: N equal shards."""
        return self.local.nbytes * self.executor.size

    def memory_breakdown(self) -> dict[str, int]:
        return {k: v * self.executor.size for k, v in self.local.memory_breakdown().items()}

    def extra_keys(self) -> tuple:
        return self.local.extra_keys()

    def check_policy(self, policy) -> None:
        self.local.check_policy(policy)

    # ---- one step: each rank's runner writes its own cache ---------------------------------------
    def begin_step(self, slot_mapping, positions):
        return self.local.begin_step(slot_mapping, positions)

    def write_layer(self, layer, plan, k, v, k_pre) -> None:
        self.local.write_layer(layer, plan, k, v, k_pre)

    # ---- blocks: here now, on the other ranks before their next command --------------------------
    def release(self, block_ids: Sequence[int]) -> None:
        self.local.release(block_ids)
        self.executor.queue_kv_op(KVOp("release", list(block_ids)))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.local.copy_blocks(pairs)
        if pairs:
            self.executor.queue_kv_op(KVOp("copy_blocks", list(pairs)))

    def copy_slices(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.local.copy_slices(pairs)
        if pairs:
            self.executor.queue_kv_op(KVOp("copy_slices", list(pairs)))

    # ---- KV policies -----------------------------------------------------------------------------
    def policy_view(self, request) -> KVView:
        """Every rank's heads of the request's blocks: per layer [nb, B, Hkv, D] (all KV heads,
        in rank order = the model's order), table 0..nb-1. Each rank keeps its own view; a layer
        (or some of its blocks: `KVView.blocks`) is gathered on rank 0 when the policy reads it,
        until the next `policy_view`."""
        nb = cdiv(request.num_cached_slots, self.layout.block_size)
        ref = RequestRef(request.request_id, list(request.block_table), request.num_cached_slots)
        self.executor.send(GatherView(request=ref))
        held = self._held = self.local.policy_view(request)

        def gather(layer: int, indexes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if self._held is not held:  # the other ranks keep the newest view only
                raise RuntimeError("a tensor-parallel policy view is read only until the next "
                                   "policy_view()")
            entries = indexes.tolist()
            self.executor.send(GatherLayer(layer=layer, indexes=entries))
            with self.executor.guard():
                local = torch.stack(held.blocks(layer, entries))  # [2, m, B, Hkv / N, D]
                k, v = self.executor.tp.gather(local, dim=3)  # [2, m, B, Hkv, D] -> k, v
            return k, v

        layers = LayerReads(self.layout.num_layers, torch.arange(nb), gather)
        positions = held.positions
        if positions is not None:
            positions = positions[:nb * self.layout.block_size]
        return KVView(layers, list(range(nb)), positions, request.request_id)

    def apply_plan(self, request, plan, view: KVView) -> None:
        if self._held is None or self._held.request_id != request.request_id:
            raise RuntimeError("apply_plan() must follow policy_view() of the same request")
        heads = self.layout.num_kv_heads

        def part(rank: int):  # per-head kept slots: this rank's heads; shared ones: all
            kept = [k if k.dim() == 1 else k[rank * heads:(rank + 1) * heads].clone()
                    for k in plan.kept]
            return dataclasses.replace(plan, kept=kept)

        table = list(request.block_table)
        self.executor.send_each([ApplyPlan(block_table=table, plan=part(rank))
                                 for rank in range(1, self.executor.size)])
        held, self._held = self._held, None
        self.local.apply_plan(request, part(0), held)
