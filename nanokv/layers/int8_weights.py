"""Weight-only int8 quantization of linear layers (`quantization="int8"`, CPU).

Each output row of a weight [N, K] gets one scale, symmetric round-to-nearest:

    scale[n] = max_k |w[n, k]| / 127   (1 for an all-zero row)
    code[n, k] = round(w[n, k] / scale[n]) in [-127, 127]     w ~ code * scale[:, None]

Under tensor parallelism the scales are the whole rows' (`Linear.row_amax`): a row-parallel
shard takes the maximum over the ranks, so each rank holds its part of one process's codes.

The codes go into the panel kernel's column panels (`native_linear.panels_of`), which widens
them to float32 in registers and scales each output once (`csrc/panel_linear.c`): a quarter of
the bytes of a float32 weight, read once per step; activations stay float32 (W8A32, as
gpt-fast's int8 weight-only mode; llama.cpp's Q8_0 keeps a scale per 32 weights instead): no
calibration, error at most half a step, scale / 2, per weight. `dequantize` is the reference
(tests: F.linear over it).
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("int8",)  # values of EngineConfig.quantization (None: the checkpoint's dtype)


def quantize_rows(weight: torch.Tensor,
                  amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] int8, scale [N] float32). amax [N]: each row's
    largest magnitude where the rows hold more than these K columns (a tensor-parallel rank's
    shard of a row-parallel weight: the whole row's, so every rank's codes are one process's)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if amax is None else amax  # [N]
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale.contiguous()


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8, scale [N] -> the float32 weight they stand for."""
    return codes.float() * scale[:, None]
