"""Chained block hashes for prefix caching.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys). Extra keys carry anything
else that changes what a block's K/V hold: the KV dtype, a KV policy (the engine's), a tenant's
cache salt and the LoRA adapter (the request's: `request_extra_keys`).
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0


def request_extra_keys(engine_keys: tuple, cache_salt: str | None, lora_int_id: int) -> tuple:
    """A request's extra keys: the engine's, then its cache salt and its LoRA adapter (K/V
    computed under an adapter is that adapter's). The block manager and the replicas' router
    (nanokv/replicas/prefix_hashes.py) both build them here."""
    extra = engine_keys
    if cache_salt is not None:
        extra += (("salt", cache_salt),)
    if lora_int_id:
        extra += (("lora", lora_int_id),)
    return extra


def hash_block(parent_hash: int, token_ids: list[int] | tuple[int, ...], extra_keys: tuple) -> int:
    """64-bit chained hash (sha256 truncated; deterministic across processes)."""
    h = hashlib.sha256()
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest()[:8], "little")
