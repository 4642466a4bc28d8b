"""KVQuant's quantize-on-write in C (`layers/csrc/kvquant_quantize.c`): per token (values) and
per channel (keys, when their block fills).

The PyTorch path (`LayerCodec.quantize`, then `KVQuantStore._put`) runs about 40 small ops per
layer and step: at a decode step of 8 requests the per-token part is 5 ms of a 70 ms step on the
Qwen3-0.6B shape here, and in a 4096-token prefill chunk the per-channel keys' top-k outlier
search is about 10% of the step. The kernels quantize straight into the store's buffers with the
same outliers, statistics and codes (tests/unit/test_kvquant_write.py holds them to the PyTorch
path byte for byte). Built on first use like the decode kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from nanokv.layers.native_build import LazyLibrary

SOURCE = Path(__file__).resolve().parent.parent / "layers" / "csrc" / "kvquant_quantize.c"
SPARSE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
INDEX_BYTES = {torch.uint8: 1, torch.int16: 2, torch.int32: 4}
MAX_HEAD_DIM, MAX_CAPACITY = 1024, 256


def _setup(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kvquant_quantize_tokens.argtypes = [p, p, p, i64, i64, i64, i64, p, i64, p, p, p, p,
                                            i64, p, i64]
    lib.kvquant_quantize_tokens.restype = ctypes.c_int
    lib.kvquant_quantize_blocks.argtypes = [p, p, p, i64, i64, i64, i64, i64, p, p, i64, p, p,
                                            p, p, i64, p, i64]
    lib.kvquant_quantize_blocks.restype = ctypes.c_int


_LIBRARY = LazyLibrary(SOURCE, _setup)


def native_write_available() -> bool:
    return _LIBRARY.available()


def fits(x: torch.Tensor, buffers: dict[str, torch.Tensor], bits: int) -> bool:
    """Can a kernel write x into these buffers (codes, offset, half, oidx, oval): per token
    x [T, H, D], per channel x [n, B, H, D]."""
    oidx, oval = buffers["oidx"], buffers["oval"]
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() in (3, 4)
            and x.shape[-1] <= MAX_HEAD_DIM and bits in (2, 3, 4, 8)
            and oidx.dtype in INDEX_BYTES
            and (x.dim() == 4 or (oidx.shape[-1] <= MAX_CAPACITY and oidx.dtype != torch.int32))
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


def quantize_blocks(x: torch.Tensor, valid: torch.Tensor, block_ids: torch.Tensor,
                    buffers: dict[str, torch.Tensor], bits: int, codebook: torch.Tensor | None,
                    thresholds: torch.Tensor | None) -> None:
    """Quantize n full key blocks x [n, B, H, D] (float32) per channel into the buffers at
    block_ids [n]; valid [n, B] bool (False: a sink slot, left out of the statistics and the
    outliers); thresholds [2, H, D] (calibrated lower, upper) or None (z-scores). buffers: the
    layer's `codes` [nb, B, H, P], `offset` / `half` [nb, H, D] fp16, `oidx` / `oval`
    [nb, H, cap]."""
    if not fits(x, buffers, bits) or x.dim() != 4 or buffers["oidx"].dtype == torch.uint8:
        raise ValueError(f"kvquant_quantize_blocks takes float32 CPU x [n, B, H, D <= "
                         f"{MAX_HEAD_DIM}] and contiguous CPU buffers, got x {tuple(x.shape)} "
                         f"{x.dtype} {x.device}")
    n, bsz, heads, dim = x.shape
    if valid.shape != (n, bsz) or block_ids.shape != (n,):
        raise ValueError(f"valid must be [{n}, {bsz}] and block_ids [{n}], got "
                         f"{tuple(valid.shape)} and {tuple(block_ids.shape)}")
    if n and not (0 <= int(block_ids.min()) and int(block_ids.max())
                  < buffers["offset"].shape[0]):
        raise ValueError(f"block_ids must lie in [0, {buffers['offset'].shape[0]})")
    if thresholds is not None and tuple(thresholds.shape) != (2, heads, dim):
        raise ValueError(f"thresholds must be [2, {heads}, {dim}], got "
                         f"{tuple(thresholds.shape)}")
    x = x.contiguous()
    valid = valid.to(torch.uint8).contiguous()
    block_ids = block_ids.to(torch.int64).contiguous()
    book = None if codebook is None else codebook.float().cpu().contiguous()
    limits = None if thresholds is None else thresholds.float().cpu().contiguous()
    oidx, oval = buffers["oidx"], buffers["oval"]
    status = _LIBRARY.get().kvquant_quantize_blocks(
        x.data_ptr(), valid.data_ptr(), block_ids.data_ptr(), n, bsz, heads, dim, bits,
        None if book is None else book.data_ptr(), None if limits is None else limits.data_ptr(),
        oidx.shape[-1], buffers["codes"].data_ptr(), buffers["offset"].data_ptr(),
        buffers["half"].data_ptr(), oidx.data_ptr(), INDEX_BYTES[oidx.dtype], oval.data_ptr(),
        SPARSE_KINDS[oval.dtype])
    if status == 2:
        raise MemoryError("kvquant_quantize_blocks could not allocate its scratch buffers")
    if status != 0:  # fits() checked the shapes
        raise RuntimeError("kvquant_quantize_blocks refused its inputs")
