"""int8 quantize-on-write in C (`layers/csrc/int8_quantize.c`): one pass per layer and step
that scales, rounds and stores each token-head row at its slot, instead of the PyTorch path's
eight-odd small ops and two scatters (`quantize_int8`, then index_copy_; about 4% of a decode
step of 8 short requests on the Qwen3-0.6B shape, and a few percent of a prefill chunk). Byte for
byte the PyTorch path's codes and scales (tests/unit/test_int8_write.py). Built on first use like
the decode kernels."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from nanokv.layers.native_build import LazyLibrary

SOURCE = Path(__file__).resolve().parent.parent / "layers" / "csrc" / "int8_quantize.c"


def _setup(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.int8_quantize_write.argtypes = [p, p, i64, i64, i64, i64, p, p]
    lib.int8_quantize_write.restype = ctypes.c_int


_LIBRARY = LazyLibrary(SOURCE, _setup)


def native_int8_available() -> bool:
    return _LIBRARY.available()


def fits(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Can the kernel write x [T, H, D] float32 into codes [S, H, D] uint8 and scales [S, H]
    float32 (contiguous CPU buffers)?"""
    return (x.dim() == 3 and x.dtype == torch.float32 and x.device.type == "cpu"
            and codes.dtype == torch.uint8 and scales.dtype == torch.float32
            and codes.dim() == 3 and codes.shape[1:] == x.shape[1:]
            and scales.shape == codes.shape[:2] and codes.device.type == "cpu"
            and scales.device.type == "cpu" and codes.is_contiguous()
            and scales.is_contiguous())


def quantize_write(x: torch.Tensor, slot_mapping: torch.Tensor, codes: torch.Tensor,
                   scales: torch.Tensor) -> None:
    """codes[slot_mapping[t]], scales[slot_mapping[t]] = quantize_int8(x[t]) for `fits`
    buffers; slot_mapping [T] int64 slots in [0, S)."""
    if not fits(x, codes, scales):
        raise ValueError(f"int8 write takes float32 CPU x [T, H, D] and contiguous buffers "
                         f"codes uint8 [S, H, D], scales float32 [S, H]; got x "
                         f"{tuple(x.shape)} {x.dtype}, codes {tuple(codes.shape)} "
                         f"{codes.dtype}, scales {tuple(scales.shape)} {scales.dtype}")
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (x.shape[0],):
        raise ValueError(f"slot_mapping must be [{x.shape[0]}], got {tuple(slots.shape)}")
    x = x.contiguous()
    status = _LIBRARY.get().int8_quantize_write(
        x.data_ptr(), slots.data_ptr(), x.shape[0], x.shape[1], x.shape[2], codes.shape[0],
        codes.data_ptr(), scales.data_ptr())
    if status != 0:
        raise IndexError(f"slot_mapping holds slots outside [0, {codes.shape[0]})")
