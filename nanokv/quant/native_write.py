"""KVQuant's per-token quantize-on-write in C (`layers/csrc/kvquant_quantize.c`).

The PyTorch path (`LayerCodec.quantize` on groups of one slot, then `KVQuantStore._put`) runs
about 40 small ops per layer and step: at a decode step of 8 requests that is 5 ms of a 70 ms
step on the Qwen3-0.6B shape here. The kernel quantizes each token-head straight into the
store's buffers, with the same outliers, statistics and codes (tests/unit/test_kvquant_write.py
holds it to the PyTorch path byte for byte). Built on first use like the decode kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from nanokv.layers.native_attention import LazyLibrary, NativeKernelUnavailable

SOURCE = Path(__file__).resolve().parent.parent / "layers" / "csrc" / "kvquant_quantize.c"
SPARSE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
INDEX_BYTES = {torch.uint8: 1, torch.int16: 2}
MAX_HEAD_DIM, MAX_CAPACITY = 1024, 256


def _setup(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kvquant_quantize_tokens.argtypes = [p, p, p, i64, i64, i64, i64, p, i64, p, p, p, p,
                                            i64, p, i64]
    lib.kvquant_quantize_tokens.restype = ctypes.c_int


_LIBRARY = LazyLibrary(SOURCE, _setup)


def native_write_available() -> bool:
    try:
        _LIBRARY.get()
    except NativeKernelUnavailable:
        return False
    return True


def fits(x: torch.Tensor, buffers: dict[str, torch.Tensor], bits: int) -> bool:
    """Can the kernel write x [T, H, D] into these buffers (codes, offset, half, oidx, oval)."""
    oidx, oval = buffers["oidx"], buffers["oval"]
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3
            and x.shape[2] <= MAX_HEAD_DIM and oidx.shape[-1] <= MAX_CAPACITY
            and bits in (2, 3, 4, 8) and oidx.dtype in INDEX_BYTES
            and oval.dtype in SPARSE_KINDS
            and all(b.device.type == "cpu" and b.is_contiguous() for b in buffers.values()))


def quantize_tokens(x: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor,
                    buffers: dict[str, torch.Tensor], bits: int,
                    codebook: torch.Tensor | None) -> None:
    """Quantize each token-head of x [T, H, D] (float32) into the per-token buffers at the flat
    slots [T]; valid [T] bool (False: a sink token, no outliers). buffers: the layer's `codes`
    [nb, B, H, P], `offset` / `half` [nb, B, H] fp16, `oidx` / `oval` [nb, B, H, cap]."""
    if not fits(x, buffers, bits):
        raise ValueError(f"kvquant_quantize_tokens takes float32 CPU x [T, H, D <= "
                         f"{MAX_HEAD_DIM}] and contiguous CPU buffers, got x {tuple(x.shape)} "
                         f"{x.dtype} {x.device}")
    num_tokens, heads, dim = x.shape
    if valid.shape != (num_tokens,) or slots.shape != (num_tokens,):
        raise ValueError(f"valid and slots must be [{num_tokens}], got {tuple(valid.shape)} and "
                         f"{tuple(slots.shape)}")
    total = buffers["offset"].shape[0] * buffers["offset"].shape[1]
    if num_tokens and not (0 <= int(slots.min()) and int(slots.max()) < total):
        raise ValueError(f"slots must lie in [0, {total})")
    x = x.contiguous()
    valid = valid.to(torch.uint8).contiguous()
    slots = slots.to(torch.int64).contiguous()
    book = None if codebook is None else codebook.float().cpu().contiguous()
    oidx, oval = buffers["oidx"], buffers["oval"]
    status = _LIBRARY.get().kvquant_quantize_tokens(
        x.data_ptr(), valid.data_ptr(), slots.data_ptr(), num_tokens, heads, dim, bits,
        None if book is None else book.data_ptr(), oidx.shape[-1], buffers["codes"].data_ptr(),
        buffers["offset"].data_ptr(), buffers["half"].data_ptr(), oidx.data_ptr(),
        INDEX_BYTES[oidx.dtype], oval.data_ptr(), SPARSE_KINDS[oval.dtype])
    if status != 0:  # fits() checked the shapes
        raise RuntimeError("kvquant_quantize_tokens refused its inputs")
