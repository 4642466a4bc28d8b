"""How many KV blocks the engine gets: the KV cache kind's spec against a memory budget.

The budget is explicit (`kv_cache_memory`), an exact block count (`num_kv_blocks`), or the memory
left after weights and peak activations (CUDA: free device memory; CPU: MemAvailable, at most
4 GiB); the activation peak is measured by `nanokv/worker/profiler.py`, with
`estimate_activation_bytes` as the fallback. The result is a plain `KVCachePlan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.cache.kv_cache import KVCacheSpec
from nanokv.models.moe_shape import mlp_token_width
from nanokv.utils import head_dim_of

# Without an explicit kv_cache_memory a CPU pool takes at most this much (vLLM's CPU backend
# defaults to 4 GiB too): the pool is zero-filled, so every byte of it is resident.
CPU_DEFAULT_MAX_KV_BYTES = 4 * 2**30


@dataclass(frozen=True)
class KVCachePlan:
    """What the engine allocates: the kind's spec, the block count and where it came from."""

    spec: KVCacheSpec
    num_blocks: int
    block_size: int
    max_model_len: int  # lowered to what the pool holds when it was not given
    source: str  # how the budget was found (printed at start-up)
    # the most blocks one request holds at once (`KVLayout.max_request_blocks`)
    blocks_per_request: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the pool holds at once."""
        return self.num_blocks / self.blocks_per_request


def available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def estimate_activation_bytes(cfg, num_tokens: int, num_seqs: int, dtype: torch.dtype) -> int:
    """Upper estimate of the live tensors of one forward of `num_tokens` tokens."""
    elem = torch.empty(0, dtype=dtype).element_size()
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim_of(cfg)
    per_token = 4 * cfg.hidden_size + qkv + 3 * mlp_token_width(cfg)
    logits = num_seqs * cfg.vocab_size * 4
    return 2 * num_tokens * per_token * elem + logits


@dataclass(frozen=True)
class KVBudget:
    """The bytes the KV cache may take, found once before anything is allocated."""

    nbytes: int
    source: str  # how it was found (printed at start-up)
    explicit: bool  # kv_cache_memory: transient decode buffers come out of other memory


def kv_budget(*, device: torch.device, kv_cache_memory: int | None, fraction: float,
              activation_bytes: int) -> KVBudget:
    """kv_cache_memory, or a fraction of the free memory after peak activations."""
    if kv_cache_memory is not None:
        return KVBudget(kv_cache_memory, "kv_cache_memory", True)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return KVBudget(int(free * fraction) - activation_bytes,
                        f"{fraction:.2f} x free GPU memory - peak activations", False)
    budget = int((available_host_memory() - activation_bytes) * fraction)
    source = f"{fraction:.2f} x (available RAM - peak activations)"
    if budget > CPU_DEFAULT_MAX_KV_BYTES:  # RAM is shared with everything else on a host
        budget = CPU_DEFAULT_MAX_KV_BYTES
        source += f", capped at {CPU_DEFAULT_MAX_KV_BYTES / 2**30:g} GiB on CPU"
    return KVBudget(budget, source, False)


def budget_blocks(spec: KVCacheSpec, budget: KVBudget, *, reserve_scratch: bool,
                  max_useful_blocks: int) -> tuple[int, str]:
    """Blocks of the spec that fit the budget after its fixed bytes. With `reserve_scratch`
    (the attention backend dequantizes the blocks it reads) and a budget taken from free memory,
    the spec's decode scratch is reserved next to each block; a backend that reads the codes in
    place needs none, and those bytes hold blocks. Returns the count and how it was found."""
    source = budget.source
    scratch = spec.scratch_bytes_per_block if reserve_scratch and not budget.explicit else 0
    if scratch:
        source += " - decode dequantization buffers"
    if spec.fixed_bytes:
        source += f" - {spec.fixed_bytes / 2**20:.1f} MiB fixed store cost"
    num_blocks = max(0, budget.nbytes - spec.fixed_bytes) // (spec.bytes_per_block + scratch)
    if not budget.explicit and num_blocks > max_useful_blocks:
        num_blocks = max_useful_blocks
        source += f", capped at max_num_seqs full-length requests ({max_useful_blocks} blocks)"
    if num_blocks < 1:
        fixed = f" after the store's fixed {spec.fixed_bytes} bytes" if spec.fixed_bytes else ""
        raise ValueError(f"the KV budget of {budget.nbytes} bytes holds no block of "
                         f"{spec.bytes_per_block + scratch} bytes{fixed}; raise kv_cache_memory "
                         f"or lower block_size" + (" (or max_num_seqs: the store stages one "
                                                   "partial block per running request)"
                                                   if spec.fixed_bytes else ""))
    return num_blocks, source
