"""A projection with LoRA adapters: base(x) plus, for each adapter in the step, its rows'
scaling * B (A x).

The adapters live in `max_loras` slots of zero-padded weights, one pair of tensors per layer,
laid out for plain matmuls: A^T [slots, in, shards * R] and B^T [slots, R, out]
(R = max_lora_rank). A packed projection such as q/k/v has one shard per checkpoint projection:
shard k owns columns [kR, kR + r) of A^T and its own output columns of B^T, so one matmul gives
every shard's x A^T and one more per shard adds its part. The scheduler puts each adapter's rows
side by side (`LoRAStep`: slices of the batch), so a step adds, per slice and shard,
`(x A^T) B^T` into the base output's rows and columns in place (`addmm_`; measured on a Zen 4
EPYC at 8 rows, 2.2-2.6x faster than one matmul over a block-diagonal B^T, which reads B^T once
per shard). Zero padding adds nothing, so adapters of any rank <= R and any subset of
projections share the slots; rows of no adapter are left as the base computed them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRAStep:
    """This step's adapter rows: (slot, first row, end row) slices of the batch, each of one
    adapter. Empty: no row has an adapter."""

    slices: list[tuple[int, int, int]] = field(default_factory=list)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, shards: list[tuple[str, int]], max_loras: int,
                 max_rank: int, step: LoRAStep) -> None:
        """base: the projection (a `Linear`); shards: its output's parts in order, as
        (checkpoint projection name, output features); step: the manager's, shared by every
        LoRALinear of the model."""
        super().__init__()
        self.base = base
        self.shard_names = [name for name, _ in shards]
        ends = list(itertools.accumulate(size for _, size in shards))
        if ends[-1] != base.out_features:
            raise ValueError(f"LoRA shards {shards} do not add up to the projection's "
                             f"{base.out_features} outputs")
        self.shard_columns = list(zip([0, *ends[:-1]], ends))  # each shard's [first, end)
        self.max_rank = max_rank
        self.step = step
        # the plain weight's device and dtype (an empty tensor once a packed copy replaced it)
        weight_like = dict(device=base.weight.device, dtype=base.weight.dtype)
        width = len(shards) * max_rank
        self.lora_a = torch.zeros(max_loras, base.in_features, width,
                                  **weight_like)  # A^T [S, in, shards * R]
        self.lora_b = torch.zeros(max_loras, max_rank, base.out_features,
                                  **weight_like)  # B^T [S, R, out]: each shard its columns

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds an adapter's (A [r, in], scaled B [out_shard, r]) by shard name;
        shards it does not adapt get zeros."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for k, (name, (first, last)) in enumerate(zip(self.shard_names, self.shard_columns)):
            if name in weights:
                shard_a, shard_b = weights[name]
                r = shard_a.shape[0]
                a[:, k * self.max_rank:k * self.max_rank + r] = shard_a.T
                b[:r, first:last] = shard_b.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        y = self.base(x)
        r = self.max_rank
        for slot, start, end in self.step.slices:
            u = x[start:end] @ self.lora_a[slot]  # [n, shards * R]
            b = self.lora_b[slot]  # [R, out]
            for k, (first, last) in enumerate(self.shard_columns):
                # the shard's output columns of the slice's rows += u_k B_k^T, in place
                y[start:end, first:last].addmm_(u[:, k * r:(k + 1) * r], b[:, first:last])
        return y
