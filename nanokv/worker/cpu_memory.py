"""glibc malloc settings for CPU inference: keep freed activation memory for the next step.

PyTorch's CPU allocator calls malloc for every tensor. glibc serves large requests with a fresh
mmap (threshold 128 KiB, raised dynamically only after such a block is freed) and returns the
top of the heap to the OS beyond a trim threshold, so each prefill step's activations (tens of
MB per tensor) are new pages, and page faults take a large share of a prefill step. With the mmap
threshold at its maximum (32 MiB), no mmap at all for blocks above it (a 4096-token chunk's MLP
activation of a 0.6B model is 50 MB: M_MMAP_MAX 0, so these come from the heap too) and no
trimming, freed activations are reused (figures in docs/results/engine). vLLM's CPU backend
gets the same effect by preloading tcmalloc. (Where the heap cannot grow, glibc still falls back
to mmap.)

Applied once, on Linux with glibc, when the engine runs on CPU; skipped when the user set glibc's
own malloc environment (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES`),
which then wins. The cost: up to one step's peak activations stay in the process after a step
(the pool is sized with that peak reserved anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4  # the most blocks served by mmap at once: 0, every block from the heap
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # the largest an int takes: the heap top is kept
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_applied: bool | None = None


def glibc_tunables() -> str:
    """The same settings as a GLIBC_TUNABLES value, for another process (a peer engine in
    `benchmarks/run_peers.sh`): glibc reads it when that process starts."""
    return (f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_MAX}:glibc.malloc.mmap_max=0:"
            f"glibc.malloc.trim_threshold={TRIM_THRESHOLD}")


def tune_glibc_malloc() -> bool:
    """Set the thresholds (once per process). True when they are in effect."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
                    and mallopt(M_MMAP_MAX, 0)
                    and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
