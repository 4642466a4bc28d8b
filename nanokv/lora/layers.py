"""A projection with LoRA adapters: base(x) plus, for each adapter in the step, its rows'
scaling * B (A x).

The adapters live in `max_loras` slots of zero-padded weights, one pair of tensors per layer:
A [slots, shards * R, in] and B [slots, out, R] (R = max_lora_rank; a packed projection such as
q/k/v has one shard per checkpoint projection, each with its own R columns of A's output and its
rows of B). A step's rows are grouped by slot (`LoRAStep`): each group is two small matmuls,
added into its rows. A slot's zero padding adds nothing, so adapters of any rank <= R share the
slots; rows of no adapter are left as the base computed them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRAStep:
    """This step's rows by adapter slot: (slot, row indexes [n] int64 on the device, or None
    when every row of the batch is that slot's). Empty: no row has an adapter."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, shards: list[tuple[str, int]], max_loras: int,
                 max_rank: int, step: LoRAStep) -> None:
        """base: the projection (a `Linear`); shards: its output's parts in order, as
        (checkpoint projection name, output features); step: the manager's, shared by every
        LoRALinear of the model."""
        super().__init__()
        self.base = base
        self.shard_names = [name for name, _ in shards]
        self.shard_sizes = [size for _, size in shards]
        if sum(self.shard_sizes) != base.out_features:
            raise ValueError(f"LoRA shards {shards} do not add up to the projection's "
                             f"{base.out_features} outputs")
        self.max_rank = max_rank
        self.step = step
        # the plain weight's device and dtype (an empty tensor once a packed copy replaced it)
        weight_like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_a = torch.zeros(max_loras, len(shards) * max_rank, base.in_features,
                                  **weight_like)  # [S, shards * R, in]
        self.lora_b = torch.zeros(max_loras, base.out_features, max_rank,
                                  **weight_like)  # [S, out, R]

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds an adapter's (A [r, in], scaled B [out_shard, r]) by shard name;
        shards it does not adapt get zeros."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        row, r_max = 0, self.max_rank
        for k, (name, size) in enumerate(zip(self.shard_names, self.shard_sizes)):
            if name in weights:
                a, b = weights[name]
                r = a.shape[0]
                self.lora_a[slot, k * r_max:k * r_max + r] = a
                self.lora_b[slot, row:row + size, :r] = b
            row += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        y = self.base(x)
        for slot, rows in self.step.groups:
            xs = x if rows is None else x.index_select(0, rows)  # [n, in]
            u = xs @ self.lora_a[slot].T  # [n, shards * R]
            b = self.lora_b[slot]  # [out, R]
            if len(self.shard_sizes) == 1:
                delta = u @ b.T  # [n, out]
            else:  # each shard's R columns of u through its rows of B
                delta = torch.cat([u[:, k * self.max_rank:(k + 1) * self.max_rank] @ part.T
                                   for k, part in enumerate(b.split(self.shard_sizes))],
                                  dim=-1)  # [n, out]
            if rows is None:
                y += delta
            else:
                y.index_add_(0, rows, delta)
        return y

