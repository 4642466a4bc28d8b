"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral.

The attention, norms and RoPE are Llama's (`llama.py`); a sparse layer's MLP is a
`SparseMoeBlock`: a router picks each token's top-k experts (softmax over all experts, then
the k largest, renormalized where the config says so), each expert is a SiLU MLP, and a token's
output is its experts' outputs weighted by their router probabilities (plus, in Qwen2-MoE, a
shared expert scaled by a sigmoid gate).

    router logits [T, E] -> top-k (weights, experts) [T, k]
    assignments sorted by expert: expert e runs once on its rows x[rows_e] [n_e, hidden]
    out[rows_e] += weight * expert_e(x[rows_e])      (experts in ascending order, as HF sums)

Tensor parallelism splits every expert's intermediate width like a dense MLP's (column-parallel
gate/up, row-parallel down); the router is replicated, and the block all-reduces once, after its
experts are summed. Checkpoints hold one tensor per expert and projection (Hugging Face's saved
layout); the loader packs each expert's gate and up as for a dense MLP.

The expert loop syncs with the host (how many rows each expert gets), so these models run
without CUDA graphs (`cuda_graphs = False`).
"""

from __future__ import annotations

import torch
from torch import nn

from nanokv.distributed.parallel_state import TensorParallel
from nanokv.layers.linear import Linear
from nanokv.models.llama import (
    LinearBiases,
    LlamaMLP,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    _windows_of_layer_types,
)
from nanokv.models.moe_shape import MoEShape, moe_shape


def route(logits: torch.Tensor, top_k: int, normalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in `dtype`, expert ids [T, k]): softmax in
    float32 over all experts, the k largest, renormalized to sum to 1 when `normalize`."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, moe: MoEShape, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize = moe.num_experts, moe.top_k, moe.normalize
        self.tp = tp
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.gate.keep_float = True  # not quantized: its top-k choices follow small changes
        self.experts = nn.ModuleList(
            LlamaMLP(cfg, False, tp, moe.expert_width, reduce=False)
            for _ in range(moe.num_experts))
        self.shared_expert = (LlamaMLP(cfg, False, tp, moe.shared_width, reduce=False)
                              if moe.shared_width else None)
        self.shared_expert_gate = (Linear(cfg.hidden_size, 1, bias=False)
                                   if moe.shared_width else None)
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.keep_float = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        weights, experts = route(self.gate(x), self.top_k, self.normalize, x.dtype)  # [T, k]
        out = self.routed(x, weights, experts)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor,
               experts: torch.Tensor) -> torch.Tensor:
        """Each expert once over the rows routed to it. x [T, hidden], weights and experts
        [T, k] -> [T, hidden]."""
        flat = experts.flatten()  # [T * k], assignment a = token a // k
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k  # [T * k] the token of each sorted assignment
        scale = weights.flatten()[order].unsqueeze(1)  # [T * k, 1]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                mine = rows[start:start + n]
                out.index_add_(0, mine, expert(x[mine]) * scale[start:start + n])
            start += n
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by a dense [T, E] routing matrix (zero off
        the top k): the plain formula `forward` computes sparsely, for tests."""
        weights, experts = route(self.gate(x), self.top_k, self.normalize, x.dtype)
        dense = x.new_zeros(x.shape[0], self.num_experts)  # [T, E]
        dense.scatter_(1, experts, weights)
        out = sum(dense[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class _MoEMixin:
    """A sparse layer's MLP is a `SparseMoeBlock`; the others keep the dense one."""

    cuda_graphs = False  # the expert loop reads each expert's row count on the host

    @classmethod
    def make_mlp(cls, cfg, layer: int, biases: LinearBiases,
                 tp: TensorParallel | None) -> nn.Module:
        moe = moe_shape(cfg)
        if moe is not None and moe.sparse_layers[layer]:
            return SparseMoeBlock(cfg, moe, tp)
        return super().make_mlp(cfg, layer, biases, tp)


class Qwen3MoeForCausalLM(_MoEMixin, Qwen3ForCausalLM):
    """Qwen3's attention (q/k norms, `attention_bias`); `sliding_window` on every layer when
    the config uses one (its config class sets it to None otherwise)."""

    layer_windows = classmethod(MistralForCausalLM.layer_windows.__func__)


class Qwen2MoeForCausalLM(_MoEMixin, Qwen2ForCausalLM):
    """Qwen2's attention with `qkv_bias`; a shared expert beside the routed ones; windows on
    the layers `layer_types` marks."""

    @staticmethod
    def biases(cfg) -> LinearBiases:
        return LinearBiases(qkv=bool(getattr(cfg, "qkv_bias", True)))

    layer_windows = classmethod(_windows_of_layer_types)


class MixtralForCausalLM(_MoEMixin, MistralForCausalLM):
    """Mistral's attention; every layer sparse. Its checkpoint names the block
    `block_sparse_moe` and an expert's gate / down / up projections w1 / w2 / w3."""

    packed_modules = {
        **{name: part for name, part in MistralForCausalLM.packed_modules.items()
           if part[0] == "qkv_proj"},
        "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
    }

    @staticmethod
    def checkpoint_name(name: str) -> str:
        name = MistralForCausalLM.checkpoint_name(name)
        if ".mlp." not in name:
            return name
        return name.replace(".mlp.", ".block_sparse_moe.").replace(".down_proj.", ".w2.")
