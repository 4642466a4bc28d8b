"""One layer's KV cache as the Triton kernels read and write it (no Triton import here).

    k, v       [num_blocks, block_size, Hkv, D]: the float pool's layer views, or uint8 codes
    k_scales,  [num_blocks, block_size, Hkv] float32, one per token and KV head (codes only)
    v_scales
    kv_format  FLOAT, INT8, FP8_E4M3 or FP8_E5M2 (how an element is stored: `codes.py`)

K and V share their strides (the kernels take one set); the head dim is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT, INT8, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3
FORMATS = {"int8": INT8, "fp8_e4m3": FP8_E4M3, "fp8_e5m2": FP8_E5M2}  # the codes' formats
CODE_MAX = {INT8: 127.0, FP8_E4M3: 448.0, FP8_E5M2: 57344.0}  # the largest |code value|


@dataclass(frozen=True)
class PagedKV:
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None
    kv_format: int = FLOAT

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.k.shape != self.v.shape or self.k.stride() != self.v.stride():
            raise ValueError(f"k and v caches must be [num_blocks, block_size, Hkv, D] with the "
                             f"same strides, got {tuple(self.k.shape)} {self.k.stride()} and "
                             f"{tuple(self.v.shape)} {self.v.stride()}")
        if self.k.stride(-1) != 1:
            raise ValueError("the caches' head dim must be contiguous")
        if self.kv_format == FLOAT:
            if not self.k.is_floating_point():
                raise ValueError(f"a float cache must hold floats, got {self.k.dtype}")
            return
        if self.kv_format not in CODE_MAX:
            raise ValueError(f"kv_format must be one of {sorted(FORMATS.values())} or FLOAT, "
                             f"got {self.kv_format}")
        if self.k.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8, got {self.k.dtype}")
        want = tuple(self.k.shape[:3])
        for s in (self.k_scales, self.v_scales):
            if s is None or tuple(s.shape) != want or s.dtype != torch.float32 or s.stride(-1) != 1:
                raise ValueError(f"codes need float32 scales {list(want)} with a contiguous head "
                                 f"axis, got {None if s is None else (tuple(s.shape), s.dtype)}")
        if self.k_scales.stride() != self.v_scales.stride():
            raise ValueError("k and v scales must share their strides")

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    def cache_strides(self) -> tuple[int, int, int]:
        """(block, slot, head) strides of k and v, in elements."""
        return self.k.stride(0), self.k.stride(1), self.k.stride(2)

    def scale_strides(self) -> tuple[int, int]:
        """(block, slot) strides of the scales (0, 0 for the float pool)."""
        if self.k_scales is None:
            return 0, 0
        return self.k_scales.stride(0), self.k_scales.stride(1)

    def scale_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales, or the caches themselves as placeholders the kernels never read."""
        if self.k_scales is None:
            return self.k, self.v
        return self.k_scales, self.v_scales
