"""Which engines can be split over N tensor-parallel ranks; checked before anything loads.

Supported: Llama / Mistral / Qwen2 / Qwen3 checkpoints and their mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE) whose query heads, KV heads and MLP widths (dense, each expert's, the
shared expert's) divide by N (the vocabulary need not: the last rank's share is padded), on CPU
(N processes on one host, gloo) or CUDA (N GPUs, NCCL); every KV policy; every KV cache kind
(each rank's holds its KV heads; KVQuant's calibrated key thresholds are cut by head:
`KVCache.shard_settings`).
"""

from __future__ import annotations

from nanokv.models.moe_shape import mlp_widths
from nanokv.utils import head_dim_of


def check_tensor_parallel(config, hf_config) -> None:
    """Raise ValueError naming what is wrong and what is allowed when the engine of `config`
    cannot run on `config.tensor_parallel_size` ranks."""
    n = config.tensor_parallel_size
    if n == 1:
        return
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if kv_heads % n:
        divisors = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and heads % d == 0]
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's "
                         f"{kv_heads} KV heads (each rank holds whole KV heads); allowed for "
                         f"this model: {divisors}")
    if heads % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's {heads} "
                         f"attention heads")
    for width in mlp_widths(hf_config):  # a dense MLP's, each expert's, the shared expert's
        if width % n:
            raise ValueError(f"tensor_parallel_size {n} does not divide the model's MLP width "
                             f"{width}")
    head_dim_of(hf_config)  # raises on a model whose heads do not tile hidden_size
    if config.device == "cuda" or (config.device == "auto" and _cuda_available()):
        import torch

        if torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size {n} needs {n} GPUs (one per rank); "
                             f"{torch.cuda.device_count()} visible")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
