"""Tensor-parallel layers (Megatron-LM's split, as vLLM and nano-vLLM use it) and how the
loader cuts a checkpoint tensor into this rank's shard.

    ColumnParallelLinear   W [out/N, in]: rank r computes output columns r*out/N.. (packed
                           q/k/v and gate/up: each packed part split separately, so a rank holds
                           its query heads, its KV heads, its slice of the MLP); no communication
    RowParallelLinear      W [out, in/N] over the column-parallel output: partial sums, then an
                           all-reduce; the bias is added once, after it
    VocabParallelEmbedding rows [r*V'/N, (r+1)*V'/N) of the table (V' = V padded to a multiple
                           of N): ids outside the shard look up zeros, then an all-reduce
    ParallelLMHead         the same rows of the LM head: local logits [T, V'/N], gathered on
                           rank 0 as [T, V] (None on the other ranks)

Every layer's weight is this rank's shard only; `param_shard` tells the loader which part of
the checkpoint's full tensor that is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.distributed.parallel_state import TensorParallel
from nanokv.layers import native_linear
from nanokv.layers.linear import Linear
from nanokv.utils import cdiv


@dataclass(frozen=True)
class Shard:
    """This rank's part of a checkpoint tensor along `dim`; `full`: the tensor's length along
    `dim` when it is not N x the shard (a padded vocabulary)."""

    dim: int
    rank: int
    size: int
    full: int | None = None

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full if self.full is not None else local_shape[self.dim] * self.size
        return tuple(shape)

    def take(self, tensor: torch.Tensor, local_shape: tuple[int, ...]) -> torch.Tensor:
        """The shard of a full tensor (zero rows past a padded vocabulary's end)."""
        n = local_shape[self.dim]
        start = self.rank * n
        part = tensor.narrow(self.dim, start, max(0, min(n, tensor.shape[self.dim] - start)))
        if part.shape[self.dim] == n:
            return part
        out = torch.zeros(local_shape, dtype=tensor.dtype)
        out.narrow(self.dim, 0, part.shape[self.dim]).copy_(part)
        return out


class ColumnParallelLinear(Linear):
    """`out_features`: this rank's output columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp


class RowParallelLinear(Linear):
    """`in_features`: this rank's input columns; the output is summed over ranks (reduce
    False: left as this rank's partial sum, for the caller to reduce, and no bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel, reduce: bool = True) -> None:
        if bias and not reduce:
            raise ValueError("a row-parallel layer left unreduced cannot add its bias once")
        super().__init__(in_features, out_features, bias)
        self.tp = tp
        self.reduce = reduce

    def row_amax(self) -> torch.Tensor:
        """The whole rows' ranges, over every rank's columns (int8 scales equal on all ranks:
        one process's codes)."""
        return self.tp.max_reduce(super().row_amax())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear.forward without the bias: it is added once, after the sum
        if self.panels is not None:  # int8 codes (Linear.quantize_int8)
            y = native_linear.panel_linear(x, self.panels, self.out_features, None,
                                           trusted=True, scale=self.scale)
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        else:
            y = F.linear(x, self.weight)
        if self.reduce:
            self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = cdiv(vocab_size, tp.size)  # this rank's rows (the last one padded)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        self.int8: nn.Module | None = None  # int8 weights: this rank's rows (`use_int8`)

    def use_int8(self, table: nn.Module) -> None:
        """Look this rank's rows up in `table` (an `Int8Embedding` of them) from now on; the
        float rows are freed."""
        self.int8 = table
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        mine = (local >= 0) & (local < self.rows)
        rows = local.clamp(0, self.rows - 1)
        x = F.embedding(rows, self.weight) if self.int8 is None else self.int8(rows)  # [T, hidden]
        x = x * mine.unsqueeze(1).to(x.dtype)
        return self.tp.all_reduce(x)


class ParallelLMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, cdiv(vocab_size, tp.size), bias=False)
        self.tp = tp
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [N, hidden] -> logits [N, vocab] on rank 0, None on the others."""
        logits = self.tp.gather(super().forward(x), dim=-1)  # [N, V'] on rank 0
        return None if logits is None else logits[:, :self.vocab_size]


def column_linear(in_features: int, out_features: int, bias: bool,
                  tp: TensorParallel | None) -> Linear:
    """A plain Linear without tensor parallelism; sizes are this rank's."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, out_features, bias, tp)


def row_linear(in_features: int, out_features: int, bias: bool,
               tp: TensorParallel | None, reduce: bool = True) -> Linear:
    """reduce False: a tensor-parallel layer leaves its partial sum (`RowParallelLinear`)."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp, reduce)


def param_shard(model: nn.Module, name: str) -> Shard | None:
    """How parameter `name` of a tensor-parallel model is cut from the checkpoint's tensor
    (None: every rank holds all of it)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
        return Shard(0, module.tp.rank, module.tp.size, full=module.vocab_size)
    if isinstance(module, ColumnParallelLinear):  # weight and bias
        return Shard(0, module.tp.rank, module.tp.size)
    if isinstance(module, RowParallelLinear) and leaf == "weight":
        return Shard(1, module.tp.rank, module.tp.size)
    return None
