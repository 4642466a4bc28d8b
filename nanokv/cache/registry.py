"""`kv_cache_dtype` names -> KV cache kinds (classes implementing `nanokv.cache.kv_cache.KVCache`).

    auto        the float pool in the compute dtype (KVPool)
    int8        symmetric int8, float32 scale per token and head
    fp8         = fp8_e4m3 (vLLM's convention)
    fp8_e4m3    torch.float8_e4m3fn codes, float32 scale per token and head
    fp8_e5m2    torch.float8_e5m2 codes, float32 scale per token and head
    kvquant     KVQuant: 2/3/4-bit per-channel pre-RoPE keys, non-uniform codebooks,
                dense-and-sparse outliers, full-precision sinks (kv_quant_bits, kv_quant_config)
    kivi        KIVI: 2/4-bit per-channel keys and per-token values, the partial block in full
                precision (kv_quant_bits)

Adding a kind is one file with its class plus one line in `_KINDS`. Entries are import paths,
loaded on first use, so this table costs nothing to import and names no module it does not need.
"""

from __future__ import annotations

import importlib

from nanokv.cache.kv_cache import KVCache, KVCacheOptions
from nanokv.cache.layout import KVLayout

_KINDS = {
    "auto": "nanokv.cache.kv_pool:KVPool",
    "int8": "nanokv.quant.pertoken_store:Int8KVStore",
    "fp8": "nanokv.quant.pertoken_store:FP8E4M3KVStore",
    "fp8_e4m3": "nanokv.quant.pertoken_store:FP8E4M3KVStore",
    "fp8_e5m2": "nanokv.quant.pertoken_store:FP8E5M2KVStore",
    "kvquant": "nanokv.quant.kvquant_store:KVQuantStore",
    "kivi": "nanokv.quant.kivi_store:KIVIStore",
}
KV_CACHE_DTYPES = tuple(_KINDS)
OPTION_NAMES = ("kv_quant_bits", "kv_quant_config")  # read by some kinds only


def kv_cache_class(kv_cache_dtype: str) -> type[KVCache]:
    if kv_cache_dtype not in _KINDS:
        raise ValueError(f"kv_cache_dtype must be one of {list(_KINDS)}, got {kv_cache_dtype!r}")
    module, name = _KINDS[kv_cache_dtype].split(":")
    return getattr(importlib.import_module(module), name)


def kv_cache_settings(options: KVCacheOptions, layout: KVLayout) -> tuple[type[KVCache], dict]:
    """The kind of `options.kv_cache_dtype` and its validated settings; raises ValueError before
    anything is allocated (an option the kind does not read, bad values, a bad calibration)."""
    cls = kv_cache_class(options.kv_cache_dtype)
    for name in OPTION_NAMES:
        if getattr(options, name) is not None and name not in cls.engine_options:
            readers = sorted(d for d in _KINDS if name in kv_cache_class(d).engine_options)
            raise ValueError(f"{name} applies to kv_cache_dtype "
                             f"{', '.join(repr(d) for d in readers)} only, got kv_cache_dtype "
                             f"{options.kv_cache_dtype!r}")
    return cls, cls.settings_from_options(options, layout)
