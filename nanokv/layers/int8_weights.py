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

The input embedding is quantized the same way, a scale per token's row (`Int8Embedding`, rows
dequantized as they are looked up); a tied one reads the LM head's codes, so the model keeps no
float copy of its vocabulary matrix (llama.cpp quantizes its token embedding too).
"""

from __future__ import annotations

import torch
from torch import nn

from nanokv.layers.native_linear import PANEL, panels_of

QUANTIZATIONS = ("int8",)  # values of EngineConfig.quantization (None: the checkpoint's dtype)


CHUNK_BYTES = 16 * 2**20  # float32 rows quantized at a time: no weight-sized temporaries


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> each row's largest magnitude [N] float32 (no [N, K] temporary)."""
    return torch.linalg.vector_norm(weight.detach(), float("inf"), dim=1,
                                    dtype=torch.float32)


def quantize_rows(weight: torch.Tensor,
                  amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] int8, scale [N] float32). amax [N]: each row's
    largest magnitude where the rows hold more than these K columns (a tensor-parallel rank's
    shard of a row-parallel weight: the whole row's, so every rank's codes are one process's).
    Done a few MiB of rows at a time: a vocabulary-sized LM head takes no float copies of
    itself beside it."""
    w = weight.detach()
    amax = row_amax(w) if amax is None else amax  # [N]
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    codes = torch.empty(w.shape, dtype=torch.int8)
    rows = max(1, CHUNK_BYTES // (4 * max(1, w.shape[1])))
    for start in range(0, w.shape[0], rows):
        part = w[start:start + rows].float() / scale[start:start + rows, None]  # [rows, K]
        codes[start:start + rows] = part.round_().clamp_(-127, 127)
    return codes, scale.contiguous()


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8, scale [N] -> the float32 weight they stand for."""
    return codes.float() * scale[:, None]


class Int8Embedding(nn.Module):
    """An embedding table held as int8 codes in column panels with a scale per row (a weight
    [V, H] as `Linear.quantize_int8` holds it: panels [P, H, 32], scale [V]); a tied model's
    are its LM head's own tensors. Looked-up rows are dequantized: ids [T] -> [T, H] float32."""

    def __init__(self, panels: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if panels.dtype != torch.int8 or panels.dim() != 3 or panels.shape[2] != PANEL:
            raise ValueError(f"Int8Embedding takes int8 panels [P, H, {PANEL}], got "
                             f"{panels.dtype} {tuple(panels.shape)}")
        if scale.dim() != 1 or scale.shape[0] > panels.shape[0] * PANEL:
            raise ValueError(f"scale must be [rows <= {panels.shape[0] * PANEL}], got "
                             f"{tuple(scale.shape)}")
        self.panels, self.scale = panels, scale

    @classmethod
    def of(cls, weight: torch.Tensor) -> Int8Embedding:
        """A float table [V, H] quantized a row at a time (`quantize_rows`)."""
        codes, scale = quantize_rows(weight)
        return cls(panels_of(codes), scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.panels[ids // PANEL, :, ids % PANEL]  # [T, H]: row r in panel r // 32
        return codes.float() * self.scale[ids, None]
