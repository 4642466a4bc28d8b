"""One tensor-parallel rank's place in its group, and the collectives the model's layers call.

The ranks are processes on one host: gloo over loopback on CPU, NCCL with one GPU per rank on
CUDA. The group is set up through a file store in a fresh temporary directory (no port to
choose or collide on).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# a collective that waits longer than this on a rank that is alive but stuck raises; a rank
# that died is noticed at once (its sockets close)
COLLECTIVE_TIMEOUT_S = 300


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank in a group of `size` ranks (the default torch.distributed group)."""

    rank: int
    size: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel outputs, the embedding)."""
        dist.all_reduce(x)
        return x

    def max_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Maximum over ranks, in place (a row-parallel weight's row ranges: int8 scales)."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's `x` (same shape) concatenated along `dim` in rank order, on rank 0;
        None on the other ranks."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=dim) if self.is_first else None


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_rank(rank: int, size: int, store_path: str, device_type: str) -> TensorParallel:
    """Join the group (blocks until all `size` ranks have joined)."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)  # "cuda" then means this rank's GPU
    dist.init_process_group(backend_for(device_type), init_method=f"file://{store_path}",
                            rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TensorParallel(rank, size)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
