"""Linear layer with a oneDNN fast path on CPU.

On CPUs, PyTorch's default fp32 GEMM (MKL) is markedly slower here than oneDNN with a weight
reordered once into its blocked layout (docs/results/engine). `pack()` does that reorder after
the weights are loaded; `F.linear` on the plain weight stays as the reference path
(`linear_backend="torch"`). A float32 weight is packed into column panels for the panel kernel
too (`pack_panels`, `native_linear`): a decode step's few rows read it at close to the memory's
speed, where oneDNN's blocking for a few rows does not. Which of the two copies a layer keeps is
measured once per weight shape at load (`keep_faster_path`). With weight-only int8
(`quantize_int8`) the panels hold int8 codes and `scale` one float per output row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.layers import int8_weights, native_linear


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
        self.panels: torch.Tensor | None = None  # column panels of the weight (native_linear)
        self.scale: torch.Tensor | None = None  # int8 panels: the scale per output row
        self.keep_float = False  # left float by the model's int8 quantization (a MoE router)

    def pack(self) -> None:
        """Reorder the weight for oneDNN (CPU, float32/bfloat16 only)."""
        if self.weight.device.type != "cpu" or self.weight.dtype not in (torch.float32,
                                                                         torch.bfloat16):
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def free_plain(self) -> None:
        """Drop the plain weight where a packed copy or the panels stand in for it (saves one
        copy of the weights); a no-op otherwise."""
        if self.packed is not None or self.panels is not None:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype),
                                       requires_grad=False)

    def pack_panels(self) -> bool:
        """Pack the weight into column panels for the panel kernel (float32 on CPU, the kernel
        built); returns whether it did."""
        if (self.weight.device.type != "cpu" or self.weight.dtype != torch.float32
                or not native_linear.panel_linear_available()):
            return False
        if self.bias is not None and (self.bias.dtype != torch.float32
                                      or self.bias.shape != (self.out_features,)):
            return False  # forward trusts the panels and bias it packed with
        self.panels = native_linear.pack_panels(self.weight.detach())
        return True

    def quantize_int8(self) -> None:
        """Replace the weight by int8 codes in column panels with a scale per output row
        (`int8_weights`, weight-only, CPU float32; the plain weight freed). Raises ValueError
        where the panel kernel cannot run it."""
        if self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            raise ValueError(f"int8 weights run on CPU with float32 activations; this layer is "
                             f"{self.weight.dtype} on {self.weight.device.type}")
        native_linear.load_panel_linear()  # raises NativeKernelUnavailable with the reason
        codes, self.scale = int8_weights.quantize_rows(self.weight, self.row_amax())
        self.panels = native_linear.panels_of(codes)  # [P, K, 32] int8
        self.packed = None
        self.free_plain()

    def row_amax(self) -> torch.Tensor:
        """Each output row's largest weight magnitude [out] (its int8 scale x 127)."""
        return int8_weights.row_amax(self.weight)

    def keep_faster_path(self, rows: Sequence[int] = native_linear.HEAD_ROWS,
                         repeats: int = 3) -> bool:
        """For a layer holding both the panels and oneDNN's packed copy (at load): time both
        at `rows` rows, keep the faster, free the other and return whether it was the panels. The
        inputs come from a generator of their own (the global one, seeded by the engine, is
        left as it was)."""
        if self.panels is None or self.packed is None:
            raise ValueError("keep_faster_path needs a layer with both panels and a packed copy")
        panels, packed = self.panels, self.packed

        def time_paths(rows: int) -> tuple[float, float]:
            x = torch.randn(rows, self.in_features,
                            generator=torch.Generator().manual_seed(rows))
            return tuple(native_linear.median_seconds(
                (lambda: native_linear.panel_linear(x, panels, self.out_features, self.bias,
                                                    trusted=True),
                 lambda: torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [],
                                                            "")), repeats))

        keep_panels = native_linear.panels_win(time_paths, rows)
        if keep_panels:
            self.packed = None
        else:
            self.panels = None
        return keep_panels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return native_linear.panel_linear(x, self.panels, self.out_features, self.bias,
                                              trusted=True, scale=self.scale)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
