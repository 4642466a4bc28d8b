"""Triton kernels over the paged KV cache, read and written in place (the `triton` attention
backend, `nanokv/attention/triton_paged.py`).

    paged_kv.py            PagedKV: one layer's cache as the kernels see it (no Triton import)
    codes.py               int8 / fp8 codes <-> values, in registers (exact, round half to even)
    paged_tile.py          a tile of a request's tokens through its block table; the online softmax
    kv_write.py            the step's K/V to their slots (quantized on the way for codes)
    decode.py              flash-decoding: (request, KV head, split) programs, then the merge
    prefill.py             all prefill chunks of a step in one launch (cached prefix + causal;
                           decode's view over codes and staged blocks)
    kvquant_decode.py      decode over the KVQuant / KIVI codes in place (`triton_quantized`)
    kvquant_read.py        a prefill chunk's blocks of those codes decoded into a scratch float
                           cache, which prefill.py then reads
    kvquant_write.py       KVQuant's quantize-on-write: per token, and per channel as blocks fill;
                           staging and sink rows (padded entries skipped: CUDA graphs)
    interpreter_compat.py  Triton 3.6's interpreter with numpy >= 2.4 (runtime loop bounds)

This package's own module imports no Triton: `triton_unavailable()` says whether Triton can be
imported (the backends and the stores' Triton writes ask it). Importing a kernel module imports
Triton and defines the kernels; with TRITON_INTERPRET=1 set
before that, they run in Triton's interpreter on CPU tensors (how the tests check them against
the dense reference). Tile sizes are constexpr arguments of the launchers.
"""

from __future__ import annotations

import importlib
from functools import cache


@cache
def triton_unavailable() -> str | None:
    """Why Triton cannot be imported here, or None (imports nothing of the kernels)."""
    try:
        importlib.import_module("triton")
    except Exception as e:  # not installed, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None
