"""RMSNorm computed in float32, as Hugging Face Llama/Qwen do, optionally fused with the
residual add before it (`forward(x, residual)`, as vLLM's and nano-vLLM's decoder layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.layers import native_elementwise


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.native = False  # the C kernels on float32 CPU tensors (use_native_elementwise)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum written into
        `residual` in place on the C path."""
        fast = self.native and native_elementwise.fits_rows(x, self.weight)
        if residual is not None:
            if fast and native_elementwise.fits_rows(residual, self.weight) \
                    and residual.shape == x.shape:
                return native_elementwise.add_rms_norm(x, residual, self.weight, self.eps)
            residual = x + residual
            return self(residual), residual
        if fast:
            return native_elementwise.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 == self.weight.dtype:  # one fused op, bitwise the same
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
