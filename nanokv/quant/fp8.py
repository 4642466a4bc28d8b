"""fp8 KV storage (e4m3 or e5m2), one float32 scale per token and KV head.

    scale = max |x| / FMAX over the head dim (FMAX: 448 for e4m3fn, 57344 for e5m2)
    stored = (x / scale) cast to torch.float8_e4m3fn / torch.float8_e5m2, kept as its uint8 bits

Works on any device PyTorch casts float8 on (CPU included); no fp8 arithmetic is needed.
Relative error of a normal number: at most 2**-4 (e4m3, 3 mantissa bits) or 2**-3 (e5m2).
"""

from __future__ import annotations

import torch

from nanokv.quant.int8 import row_scale

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALE_DTYPE = torch.float32
_TINY = torch.finfo(torch.float32).tiny


def fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
    return FP8_FORMATS[fmt]


def fp8_max(fmt: str) -> float:
    return float(torch.finfo(fp8_dtype(fmt)).max)


def quantize_fp8(x: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (codes uint8 [..., D] holding fp8 bits, scale float32 [...])."""
    dt, fmax = fp8_dtype(fmt), fp8_max(fmt)
    xf = x.float()
    scale = row_scale(xf, fmax)  # [...]
    scaled = (xf / scale.clamp_min(_TINY).unsqueeze(-1)).clamp_(-fmax, fmax)
    return scaled.to(dt).view(torch.uint8), scale.to(SCALE_DTYPE)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes uint8 [..., D] (fp8 bits), scale [...] -> [..., D] in `dtype`."""
    values = codes.view(fp8_dtype(fmt)).float()
    return (values * scale.float().unsqueeze(-1)).to(dtype)
