"""How many KV blocks fit: from an explicit budget, or from the memory left after weights and
peak activations (CUDA: free device memory; CPU: MemAvailable; the activation peak is measured
by executor/profiler.py, with `estimate_activation_bytes` as the fallback)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MemoryPlan:
    num_blocks: int
    budget_bytes: int
    source: str  # how the budget was found (printed at start-up)


def available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def estimate_activation_bytes(cfg, num_tokens: int, num_seqs: int, dtype: torch.dtype) -> int:
    """Upper estimate of the live tensors of one forward of `num_tokens` tokens."""
    elem = torch.empty(0, dtype=dtype).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    per_token = 4 * cfg.hidden_size + qkv + 3 * cfg.intermediate_size
    logits = num_seqs * cfg.vocab_size * 4
    return 2 * num_tokens * per_token * elem + logits


def plan_kv_blocks(*, bytes_per_block: int, device: torch.device, kv_cache_memory: int | None,
                   fraction: float, activation_bytes: int, max_useful_blocks: int) -> MemoryPlan:
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, "kv_cache_memory"
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * fraction) - activation_bytes
        source = f"{fraction:.2f} x free GPU memory - peak activations"
    else:
        budget = int((available_host_memory() - activation_bytes) * fraction)
        source = f"{fraction:.2f} x (available RAM - peak activations)"
    num_blocks = budget // bytes_per_block
    if kv_cache_memory is None and num_blocks > max_useful_blocks:
        num_blocks = max_useful_blocks
        source += f", capped at max_num_seqs full-length requests ({max_useful_blocks} blocks)"
    if num_blocks < 1:
        raise ValueError(f"the KV budget of {budget} bytes holds no block of {bytes_per_block} "
                         f"bytes; raise kv_cache_memory or lower block_size")
    return MemoryPlan(num_blocks, num_blocks * bytes_per_block, source)
