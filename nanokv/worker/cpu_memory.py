"""CPU memory settings for inference: glibc keeps freed activation memory for the next step, and
PyTorch's allocator asks for transparent huge pages on large buffers.

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

Huge pages (`request_huge_pages`): a decode step reads the KV pool and every weight once, a few
KiB per 4 KiB page, so with the kernel's default pages most reads also miss the TLB. PyTorch's
CPU allocator madvises its buffers of 2 MiB and more for transparent huge pages when
`THP_MEM_ALLOC_ENABLE=1`, which it reads at its first CPU allocation; the engine sets it before
loading the model where the kernel lends huge pages on request (THP `madvise` or `always`) and
the user has not set it (`THP_MEM_ALLOC_ENABLE=0` keeps 4 KiB pages). On a Zen 4 EPYC the
long-context peer preset ran 3-12% faster with it in every pair, KVQuant and int8
(docs/results/peers/long_context/results.md). It does nothing where a CPU tensor was allocated
before in the process (PyTorch has read the variable then): the engine logs how much of its
memory is in huge pages.
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

THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch: madvise(MADV_HUGEPAGE) on buffers >= 2 MiB
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

_applied: bool | None = None


def glibc_tunables() -> str:
    """The same settings as a GLIBC_TUNABLES value, for another process (a peer engine in
    `benchmarks/run_peers.sh`): glibc reads it when that process starts."""
    return (f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_MAX}:glibc.malloc.mmap_max=0:"
            f"glibc.malloc.trim_threshold={TRIM_THRESHOLD}")


def proc_status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon); RuntimeError where the
    file has no such field."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; a no-op
    elsewhere): memory freed between live allocations stays resident otherwise (the loader
    calls it as each weight's float copy is replaced by its int8 codes)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


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


def huge_pages_lent() -> bool:
    """Whether the kernel gives transparent huge pages to memory that asks (THP `always` or
    `madvise`; Linux only)."""
    try:
        with open(THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def request_huge_pages() -> bool:
    """Set THP_MEM_ALLOC_ENABLE=1 for PyTorch's CPU allocator where the kernel lends huge pages
    and the user has not set it; returns whether it is on (the user's value wins)."""
    if THP_ENV in os.environ:
        return os.environ[THP_ENV] not in ("", "0")
    if not huge_pages_lent():
        return False
    os.environ[THP_ENV] = "1"
    return True


def huge_page_share() -> tuple[int, int] | None:
    """(bytes in transparent huge pages, resident bytes) of this process, None where the kernel
    does not report them."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return (int(fields["AnonHugePages"].split()[0]) * 1024,
                int(fields["Rss"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        return None
