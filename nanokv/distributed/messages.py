"""The plain-data commands rank 0 sends to ranks 1..N-1 (pickled, over one pipe per rank).

Every command carries the KV cache operations rank 0's block manager and KV policies made since
the previous command (`kv_ops`: blocks released, copied), which a rank applies first, in order:
its cache then holds the same blocks as rank 0's. Commands that run collectives (a step, a
profile forward, a policy view) are run by every rank in the order rank 0 sent them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nanokv.scheduler.output import SchedulerOutput


@dataclass(frozen=True)
class KVOp:
    """One call rank 0 made on its own KV cache, repeated on every rank's."""

    method: Literal["release", "copy_blocks", "copy_slices"]
    args: list  # block ids, or (source, destination) pairs


@dataclass
class RequestRef:
    """What a KV cache reads of a request (`policy_view`, `apply_plan`), as plain data."""

    request_id: str
    block_table: list[int]
    num_cached_slots: int


@dataclass
class Command:
    kv_ops: list[KVOp] = field(default_factory=list)


@dataclass
class Profile(Command):
    """One forward of `num_tokens` tokens without a cache (the activation peak, before the
    pool is planned)."""

    num_tokens: int = 0


@dataclass
class BuildCache(Command):
    """Allocate this rank's KV cache (its KV heads) and the attention backend rank 0 chose."""

    kv_cache_dtype: str = "auto"
    settings: dict = field(default_factory=dict)
    num_blocks: int = 0
    attention_backend: str = "auto"
    sliding_windows: tuple = ()  # rank 0's KVLayout.sliding_windows


@dataclass
class Step(Command):
    sched: SchedulerOutput | None = None


@dataclass
class GatherView(Command):
    """Take the request's `policy_view` and keep it, for the `GatherLayer` reads and the
    `ApplyPlan` that follow (until the next `GatherView`)."""

    request: RequestRef | None = None


@dataclass
class GatherLayer(Command):
    """Gather one layer's K/V (this rank's heads) of the kept view's table entries at
    `indexes` on rank 0."""

    layer: int = 0
    indexes: list[int] = field(default_factory=list)


@dataclass
class ApplyPlan(Command):
    """Write a KV policy's plan (this rank's heads of it) with the view kept by the last
    `GatherView`; `block_table`: the request's table now (copy-on-write may have changed it)."""

    block_table: list[int] = field(default_factory=list)
    plan: object = None  # nanokv.policies.apply.CompressionPlan


@dataclass
class Stop(Command):
    pass
