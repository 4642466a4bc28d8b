"""Quantized KV storage: int8, fp8 (e4m3 / e5m2) and KVQuant (2 / 3 / 4 bits, per-channel
pre-RoPE keys, per-token values, nuq codebooks, dense-and-sparse outliers, attention sinks).

    packing.py         pack / unpack 2, 3, 4, 8-bit codes into uint8
    int8.py, fp8.py    per-token-per-head quantize / dequantize
    kvquant.py         KVQuantConfig; quantize / dequantize of whole blocks
    codec.py           one layer's codec; fake_quantize_sequence (simulation = the store's path)
    codebook.py        Fisher-weighted k-means
    store.py           the QuantizedKVStore contract, WritePlan, MemoryReport
    pertoken_store.py  Int8KVStore, FP8KVStore
    kvquant_store.py   KVQuantStore (staging of partial blocks, sparse outliers, sinks)
    registry.py        kv_cache_dtype -> store (make_kv_store, store_memory)
    attention.py       paged attention over a store + its dequantize-then-dense oracle
    calibrate.py       offline calibration (Fisher, thresholds, codebooks), then the rule
    precision_rule.py  the cheapest precision within a relative perplexity (and KL) bound
    engine_measure.py  candidates measured on the engine's own store (decode-like protocol)
    simulated_measure.py  the fast estimate: quantization simulated inside the HF model
    scoring.py         perplexity, KL and top-1 of a candidate's logits on scored windows
    calibration_file.py  the calibration JSON (schema, loader with validation)
    cli.py             `nanokv calibrate`
"""

from nanokv.quant.kvquant import KVQuantConfig
from nanokv.quant.kvquant_store import KVQuantStore
from nanokv.quant.pertoken_store import FP8KVStore, Int8KVStore
from nanokv.quant.registry import KV_CACHE_DTYPES, make_kv_store, store_memory
from nanokv.quant.store import MemoryReport, QuantizedKVStore, WritePlan

__all__ = ["KV_CACHE_DTYPES", "FP8KVStore", "Int8KVStore", "KVQuantConfig", "KVQuantStore",
           "MemoryReport", "QuantizedKVStore", "WritePlan", "make_kv_store", "store_memory"]
