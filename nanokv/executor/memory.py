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


# Peak live bytes of a quantized store's decode read, in units of one layer's K and V in float32
# over the blocks read (codes gathered and unpacked, dequantized float32, keys rotated, the fresh
# token put in). Measured on CPU (RSS high-water mark of `quantized_paged_attention` decoding
# 128 blocks of 64 tokens x 8 heads x 128): int8 1.75, kvquant 4-bit 2.7, 2-bit 2.0; the float
# pool's own gather is 1.06 in these units (not reserved: the float path is unchanged).
DEQUANT_SCRATCH_FACTOR = {"kvquant": 3.0}
DEFAULT_DEQUANT_SCRATCH_FACTOR = 2.0  # int8, fp8


def decode_dequant_bytes_per_block(layout, kv_cache_dtype: str) -> int:
    """Dequantization buffers a decode step needs per KV block it reads.

    A quantized store's decode dequantizes every block the batch reads, one layer at a time,
    into float32 K and V. The tokens one step reads are bounded by the pool (all running
    requests decoding), so the buffers are reserved per block of the pool.
    """
    per_block = 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * 4
    factor = DEQUANT_SCRATCH_FACTOR.get(kv_cache_dtype, DEFAULT_DEQUANT_SCRATCH_FACTOR)
    return int(factor * per_block)


# Without an explicit kv_cache_memory a CPU pool takes at most this much (vLLM's CPU backend
# defaults to 4 GiB too): the pool is zero-filled, so every byte of it is resident.
CPU_DEFAULT_MAX_KV_BYTES = 4 * 2**30


def plan_kv_blocks(*, bytes_per_block: int, device: torch.device, kv_cache_memory: int | None,
                   fraction: float, activation_bytes: int, max_useful_blocks: int,
                   fixed_bytes: int = 0, scratch_bytes_per_block: int = 0) -> MemoryPlan:
    """Blocks of `bytes_per_block` that fit the budget after `fixed_bytes` (a quantized store's
    cost that does not grow with the pool: staging, codebooks). Without an explicit
    kv_cache_memory, `scratch_bytes_per_block` (a quantized store's dequantization buffers,
    which grow with the tokens a decode step reads) is reserved next to each block."""
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, "kv_cache_memory"
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * fraction) - activation_bytes
        source = f"{fraction:.2f} x free GPU memory - peak activations"
    else:
        budget = int((available_host_memory() - activation_bytes) * fraction)
        source = f"{fraction:.2f} x (available RAM - peak activations)"
        if budget > CPU_DEFAULT_MAX_KV_BYTES:  # RAM is shared with everything else on a host
            budget = CPU_DEFAULT_MAX_KV_BYTES
            source += f", capped at {CPU_DEFAULT_MAX_KV_BYTES / 2**30:g} GiB on CPU"
    if kv_cache_memory is not None:
        scratch_bytes_per_block = 0  # an explicit budget is the pool's alone
    elif scratch_bytes_per_block:
        source += " - decode dequantization buffers"
    if fixed_bytes:
        source += f" - {fixed_bytes / 2**20:.1f} MiB fixed store cost"
    num_blocks = max(0, budget - fixed_bytes) // (bytes_per_block + scratch_bytes_per_block)
    if kv_cache_memory is None and num_blocks > max_useful_blocks:
        num_blocks = max_useful_blocks
        source += f", capped at max_num_seqs full-length requests ({max_useful_blocks} blocks)"
    if num_blocks < 1:
        fixed = f" after the store's fixed {fixed_bytes} bytes" if fixed_bytes else ""
        raise ValueError(f"the KV budget of {budget} bytes holds no block of {bytes_per_block} "
                         f"bytes{fixed}; raise kv_cache_memory or lower block_size"
                         + (" (or max_num_seqs: kvquant stages one partial block per running "
                            "request)" if fixed_bytes else ""))
    return MemoryPlan(num_blocks, num_blocks * bytes_per_block + fixed_bytes, source)
