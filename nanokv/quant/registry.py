"""`kv_cache_dtype` names -> quantized KV stores.

    auto        the float pool (no store; `make_kv_store` returns None)
    int8        Int8KVStore: symmetric int8, float32 scale per token and head
    fp8         = fp8_e4m3 (vLLM's convention)
    fp8_e4m3    FP8KVStore(torch.float8_e4m3fn storage)
    fp8_e5m2    FP8KVStore(torch.float8_e5m2 storage)
    kvquant     KVQuantStore (needs a KVQuantConfig, default: 4-bit uniform, 1% outliers,
                1 sink; `load_calibration(path).kvquant_config()` for the calibrated one)

Adding a store = one file with a `QuantizedKVStore` subclass + one entry in `_FACTORIES`.
"""

from __future__ import annotations

import torch

from nanokv.cache.kv_pool import KVLayout
from nanokv.quant.kvquant import KVQuantConfig
from nanokv.quant.kvquant_store import KVQuantStore
from nanokv.quant.pertoken_store import FP8KVStore, Int8KVStore
from nanokv.quant.store import MemoryReport, QuantizedKVStore


def _int8(layout, num_blocks, device, slot_positions, pre_rope_keys=False, **_):
    return Int8KVStore(layout, num_blocks, device, pre_rope_keys, slot_positions)


def _fp8(fmt):
    def build(layout, num_blocks, device, slot_positions, pre_rope_keys=False, **_):
        return FP8KVStore(layout, num_blocks, device, fmt, pre_rope_keys, slot_positions)
    return build


def _kvquant(layout, num_blocks, device, slot_positions, kvquant_config=None,
             num_staging_blocks=None, staging_dtype=None, **_):
    if num_staging_blocks is None:
        raise ValueError("kvquant needs num_staging_blocks (>= max_num_seqs)")
    return KVQuantStore(layout, num_blocks, kvquant_config or KVQuantConfig(),
                        num_staging_blocks, device, slot_positions, staging_dtype)


_FACTORIES = {"int8": _int8, "fp8": _fp8("e4m3"), "fp8_e4m3": _fp8("e4m3"),
              "fp8_e5m2": _fp8("e5m2"), "kvquant": _kvquant}
KV_CACHE_DTYPES = ("auto",) + tuple(_FACTORIES)
_OPTIONS = {"kvquant_config", "num_staging_blocks", "staging_dtype", "pre_rope_keys"}


def make_kv_store(kv_cache_dtype: str, layout: KVLayout, num_blocks: int,
                  device: torch.device | str = "cpu", slot_positions: torch.Tensor | None = None,
                  **options) -> QuantizedKVStore | None:
    """The store for `kv_cache_dtype` (None for 'auto'). Options: kvquant_config,
    num_staging_blocks, staging_dtype (kvquant), pre_rope_keys (int8 / fp8)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ValueError(f"unknown store option(s) {unknown}; allowed: {sorted(_OPTIONS)}")
    if kv_cache_dtype != "kvquant":
        for name in ("kvquant_config", "num_staging_blocks", "staging_dtype"):
            if options.get(name) is not None:
                raise ValueError(f"{name} only applies to kv_cache_dtype 'kvquant'")
    elif options.get("pre_rope_keys") is not None:
        raise ValueError("for kvquant set pre_rope_keys in its KVQuantConfig")
    if kv_cache_dtype == "auto":
        return None
    options = {k: v for k, v in options.items() if v is not None}
    return _FACTORIES[kv_cache_dtype](layout, num_blocks, device, slot_positions, **options)


def store_memory(kv_cache_dtype: str, layout: KVLayout, num_blocks: int,
                 **options) -> MemoryReport:
    """The memory a store of this size would take, without allocating it (for pool sizing:
    bytes per block = store_memory(.., 2).total - store_memory(.., 1).total)."""
    store = make_kv_store(kv_cache_dtype, layout, 1, "meta", **options)
    if store is None:
        raise ValueError("kv_cache_dtype 'auto' has no store: use KVLayout.bytes_per_block")
    store.num_blocks = num_blocks
    return store.memory()
