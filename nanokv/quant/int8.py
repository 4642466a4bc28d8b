"""int8 KV storage: symmetric, one float32 scale per token and KV head (vLLM's `int8`).

    scale = max |x| / 127 over the head dim;  code = round(x / scale) in [-127, 127]
    dequantized = code * scale;  |x - dequantized| <= scale / 2

Codes are returned as uint8 bytes (the int8 bit pattern) so every quantized store keeps one
storage dtype.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
SCALE_DTYPE = torch.float32
_TINY = torch.finfo(torch.float32).tiny


def row_scale(xf: torch.Tensor, code_max: float) -> torch.Tensor:
    """max |x| / code_max over the last dim: [...], float32, correctly rounded on every device.
    CUDA divides by a host scalar as a multiply by its reciprocal (448 * (1 / 448) != 1), so the
    divisor is a tensor on x's device, as the Triton write divides (`tl.div_rn`)."""
    amax = xf.abs().amax(-1)
    return amax / torch.full_like(amax, code_max)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (codes uint8 [..., D] holding int8 bits, scale float32 [...])."""
    xf = x.float()
    scale = row_scale(xf, INT8_MAX)  # [...]
    codes = torch.round(xf / scale.clamp_min(_TINY).unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8).view(torch.uint8), scale.to(SCALE_DTYPE)


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes uint8 [..., D] (int8 bits), scale [...] -> [..., D] in `dtype`."""
    return (codes.view(torch.int8).float() * scale.float().unsqueeze(-1)).to(dtype)
