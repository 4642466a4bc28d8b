"""The CPU decode-attention kernel (`csrc/decode_attention.c`): built once, loaded with ctypes.

The PyTorch per-request path (`attention._decode_per_request`) issues a dozen small ops per
request and layer and reads K and V through GEMMs that pack their operands; this kernel reads
each request's K/V rows once, in place, in one pass, so the decode step is bound by memory
bandwidth (figures in docs/results/engine). It is compiled on first use with the system C
compiler into a cache directory and loaded with ctypes (`native_build`). No compiler, or a build
that fails: `attention_backend="auto"` falls back to the PyTorch path and says why.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from nanokv.cache.layout import window_start
from nanokv.layers.native_build import NativeKernelUnavailable, build_library
from nanokv.utils import cdiv

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"

_kernel = None  # the loaded ctypes function, once built
_error: str | None = None  # why it could not be built (cached: no retry per step)


@dataclass
class DecodeRuns:
    """Each decode request's cached slots as runs of consecutive pool slots (CSR layout).

    Request i's runs are `run_start[j], run_len[j]` for j in `[run_ptr[i], run_ptr[i + 1])`."""

    run_ptr: torch.Tensor  # [B + 1] int64
    run_start: torch.Tensor  # [R] int64, first pool slot of the run
    run_len: torch.Tensor  # [R] int64, slots in the run


def slot_runs(blocks: list[int], context: int, block_size: int,
              start: int = 0) -> list[tuple[int, int]]:
    """A request's slots [start, context) as runs of consecutive pool slots: (first pool slot,
    slots in the run). Blocks allocated together are usually consecutive, and one run is one
    contiguous view. `start` > 0: a sliding window's first slot (those before it not read)."""
    runs: list[tuple[int, int]] = []
    for j in range(start // block_size, cdiv(context, block_size)):
        lo, hi = max(start, j * block_size), min(context, (j + 1) * block_size)
        first = blocks[j] * block_size + lo - j * block_size
        if runs and runs[-1][0] + runs[-1][1] == first:
            runs[-1] = (runs[-1][0], runs[-1][1] + hi - lo)
        else:
            runs.append((first, hi - lo))
    return runs


def build_decode_runs(block_tables: list[list[int]], context_lens: list[int],
                      block_size: int, window: int | None = None) -> DecodeRuns:
    """Runs of consecutive slots, from host block tables (once per step, shared by the layers
    of one window): each request's last `window` slots, all of them without one."""
    ptr, starts, lens = [0], [], []
    for blocks, context in zip(block_tables, context_lens):
        for first_slot, n in slot_runs(blocks, context, block_size,
                                       window_start(context, window)):
            starts.append(first_slot)
            lens.append(n)
        ptr.append(len(starts))
    return DecodeRuns(torch.tensor(ptr, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
                      torch.tensor(lens, dtype=torch.int64))


def load_decode_kernel():
    """The kernel function; raises NativeKernelUnavailable (with the reason) when it cannot be
    built here. Built at most once per process."""
    global _kernel, _error
    if _kernel is None and _error is None:
        try:
            fn = build_library(SOURCE).decode_attention
        except NativeKernelUnavailable as e:
            _error = str(e)
        except OSError as e:  # the .so did not load
            _error = f"loading the built kernel failed: {e}"
        else:
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            fn.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, ctypes.c_float]
            fn.restype = ctypes.c_int
            _kernel = fn
    if _kernel is None:
        raise NativeKernelUnavailable(_error)
    return _kernel


def native_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            runs: DecodeRuns, scale: float,
                            soft_cap: float | None = None) -> torch.Tensor:
    """q: [B, Hq, D] float32; caches: [num_blocks, block_size, Hkv, D] contiguous float32.
    soft_cap: scores c * tanh(scores / c) before the softmax (None: none). Returns [B, Hq, D]."""
    num_requests, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.device.type == "cpu" and k_cache.device.type == "cpu"):
        raise ValueError("the native decode kernel needs float32 CPU tensors and contiguous caches")
    if runs.run_ptr.numel() != num_requests + 1:
        raise ValueError(f"decode runs cover {runs.run_ptr.numel() - 1} requests, "
                         f"q has {num_requests}")
    qs = (q * scale).contiguous()  # [B, Hq, D]
    out = torch.empty_like(qs)
    status = load_decode_kernel()(
        qs.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        runs.run_ptr.data_ptr(), runs.run_start.data_ptr(), runs.run_len.data_ptr(),
        num_requests, num_q_heads, num_kv_heads, head_dim, soft_cap or 0.0)
    if status != 0:
        raise MemoryError("native decode attention could not allocate its scratch buffers")
    return out
