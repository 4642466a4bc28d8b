"""Chained block hashes for prefix caching.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys). Extra keys carry anything
else that changes what a block's K/V hold: a tenant's cache salt, the KV dtype, a KV policy.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: list[int] | tuple[int, ...], extra_keys: tuple) -> int:
    """64-bit chained hash (sha256 truncated; deterministic across processes)."""
    h = hashlib.sha256()
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest()[:8], "little")
