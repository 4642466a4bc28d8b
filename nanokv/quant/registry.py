"""Direct construction of quantized stores by `kv_cache_dtype` name (tests, benchmarks, tools).

The engine goes through `nanokv.cache.registry` (the one table of KV cache kinds); these two
helpers build a store, or describe its memory, from explicit store options instead of engine
options:

    kvquant_config, num_staging_blocks, staging_dtype   kvquant
    pre_rope_keys                                       int8 / fp8
"""

from __future__ import annotations

import torch

from nanokv.cache.layout import KVLayout
from nanokv.cache.registry import KV_CACHE_DTYPES, kv_cache_class
from nanokv.quant.store import MemoryReport, QuantizedKVStore

_KVQUANT_OPTIONS = {"kvquant_config": "config", "num_staging_blocks": "num_staging_blocks",
                    "staging_dtype": "staging_dtype"}
_OPTIONS = set(_KVQUANT_OPTIONS) | {"pre_rope_keys"}

__all__ = ["KV_CACHE_DTYPES", "make_kv_store", "store_memory"]


def _store_settings(kv_cache_dtype: str, options: dict) -> tuple[type[QuantizedKVStore], dict]:
    cls = kv_cache_class(kv_cache_dtype)
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ValueError(f"unknown store option(s) {unknown}; allowed: {sorted(_OPTIONS)}")
    if kv_cache_dtype != "kvquant":
        for name in _KVQUANT_OPTIONS:
            if options.get(name) is not None:
                raise ValueError(f"{name} only applies to kv_cache_dtype 'kvquant'")
    elif options.get("pre_rope_keys") is not None:
        raise ValueError("for kvquant set pre_rope_keys in its KVQuantConfig")
    settings = {_KVQUANT_OPTIONS.get(k, k): v for k, v in options.items() if v is not None}
    return cls, settings


def make_kv_store(kv_cache_dtype: str, layout: KVLayout, num_blocks: int,
                  device: torch.device | str = "cpu", **options) -> QuantizedKVStore | None:
    """The store for `kv_cache_dtype` (None for 'auto', the float pool)."""
    cls, settings = _store_settings(kv_cache_dtype, options)
    if kv_cache_dtype == "auto":
        return None
    return cls.from_settings(layout, num_blocks, device, **settings)


def store_memory(kv_cache_dtype: str, layout: KVLayout, num_blocks: int,
                 **options) -> MemoryReport:
    """The memory a store of this size takes, from its buffer specs (nothing allocated)."""
    cls, settings = _store_settings(kv_cache_dtype, options)
    if kv_cache_dtype == "auto":
        raise ValueError("kv_cache_dtype 'auto' has no store: use KVLayout.bytes_per_block")
    if kv_cache_dtype == "kvquant" and settings.get("num_staging_blocks") is None:
        raise ValueError("kvquant needs num_staging_blocks (>= max_num_seqs)")
    specs = cls.specs_for(layout, num_blocks, settings)
    specs.append(_positions_spec(num_blocks, layout.block_size))
    return MemoryReport.from_specs(cls.kv_cache_dtype, num_blocks, layout.block_size, specs)


def _positions_spec(num_blocks: int, block_size: int):
    from nanokv.quant.store import BufferSpec

    return BufferSpec("slot_positions", (num_blocks, block_size), torch.int32, "bookkeeping")
