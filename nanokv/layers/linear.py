"""Linear layer with a oneDNN fast path on CPU.

On CPUs, PyTorch's default fp32 GEMM (MKL) is markedly slower here than oneDNN with a weight
reordered once into its blocked layout (docs/results/engine). `pack()` does that reorder after
the weights are loaded; `F.linear` on the plain weight stays as the reference path
(`linear_backend="torch"`). A layer with `few_rows` set (the tied LM head, which keeps its plain
matrix) takes at most 16 rows through the few-rows C kernel (`native_linear`) instead; where it
holds the packed weight too, fewer than `onednn_from_rows` (`measure_few_rows`, at load: which
path is faster depends on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.layers import native_linear


def onednn_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4))
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), w, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN-blocked copy of the weight
        # a few rows at a time (a decode step's LM head): the few-rows C kernel on the plain
        # weight (`native_linear`), set by the model where it keeps the plain matrix; with the
        # packed copy too, from onednn_from_rows rows on oneDNN instead (never by default)
        self.few_rows = False
        self.onednn_from_rows = native_linear.MAX_ROWS + 1

    def pack(self, drop_plain: bool = False) -> None:
        """Reorder the weight for oneDNN (CPU, float32/bfloat16 only)."""
        if self.weight.device.type != "cpu" or self.weight.dtype not in (torch.float32,
                                                                         torch.bfloat16):
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        if drop_plain:  # keep only the blocked copy: saves one copy of the weights
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype),
                                       requires_grad=False)

    def measure_few_rows(self, repeats: int = 3) -> int:
        """Set and return `onednn_from_rows` for a few-rows layer holding the packed weight
        too: both paths timed at native_linear.CROSSOVER_ROWS rows (the inputs from a generator
        of their own: the global one, seeded by the engine, is left as it was)."""
        if not (self.few_rows and self.packed is not None):
            raise ValueError("measure_few_rows needs a few-rows layer with a packed weight")

        def time_paths(rows: int) -> tuple[float, float]:
            x = torch.randn(rows, self.in_features,
                            generator=torch.Generator().manual_seed(rows))
            kernel_s, onednn_s = native_linear.median_seconds(
                (lambda: native_linear.small_m_linear(x, self.weight, self.bias),
                 lambda: self._onednn(x)), repeats)
            return kernel_s, onednn_s

        self.onednn_from_rows = native_linear.onednn_crossover(time_paths)
        return self.onednn_from_rows

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows and native_linear.fits(x, self.weight) and (
                self.packed is None or x.shape[0] < self.onednn_from_rows):
            return native_linear.small_m_linear(x, self.weight, self.bias)
        if self.packed is not None:
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)
