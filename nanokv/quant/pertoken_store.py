"""int8 and fp8 (e4m3 / e5m2) KV stores: one scale per token and KV head, written at once.

Per token there is nothing to wait for, so no staging: a token is quantized when it is written.
Keys are stored as the engine gives them (after RoPE by default, as vLLM does); with
`pre_rope_keys=True` they are stored before RoPE and rotated on reading.
Bytes per token: 2 * L * Hkv * (D + 4) (1-byte codes + a float32 scale per head).
"""

from __future__ import annotations

import torch

from nanokv.cache.kv_cache import KVCacheOptions
from nanokv.cache.layout import KVLayout
from nanokv.quant import native_int8
from nanokv.quant.fp8 import dequantize_fp8, fp8_dtype, quantize_fp8
from nanokv.quant.int8 import SCALE_DTYPE, dequantize_int8, quantize_int8
from nanokv.quant.store import BufferSpec, QuantizedKVStore, Rope, WritePlan


class PerTokenKVStore(QuantizedKVStore):
    """Base of the per-token stores; subclasses give `_quantize` / `_dequantize`."""

    supports_speculation = True  # a slot's codes and scale stand alone

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu",
                 pre_rope_keys: bool = False, slot_positions: torch.Tensor | None = None) -> None:
        super().__init__(layout, num_blocks, device, pre_rope_keys, slot_positions)
        self._allocate(self.buffer_specs())

    @classmethod
    def from_settings(cls, layout: KVLayout, num_blocks: int, device: torch.device | str,
                      pre_rope_keys: bool = False) -> PerTokenKVStore:
        return cls(layout, num_blocks, device, pre_rope_keys)

    @classmethod
    def settings_from_options(cls, options: KVCacheOptions, layout: KVLayout) -> dict:
        return {"pre_rope_keys": False}  # after RoPE, as vLLM stores them

    @classmethod
    def specs_for(cls, layout: KVLayout, num_blocks: int, settings: dict) -> list[BufferSpec]:
        lay, nb = layout, num_blocks
        codes = (lay.num_layers, nb, lay.block_size, lay.num_kv_heads, lay.head_dim)
        scales = codes[:-1]
        return [BufferSpec("k_codes", codes, torch.uint8, "codes"),
                BufferSpec("v_codes", codes, torch.uint8, "codes"),
                BufferSpec("k_scales", scales, SCALE_DTYPE, "scales"),
                BufferSpec("v_scales", scales, SCALE_DTYPE, "scales")]

    def _block_axis(self, name: str) -> int | None:
        return 1  # every buffer is [L, num_blocks, ...]

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write(self, layer: int, plan: WritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        for name, x in (("k", k), ("v", v)):
            self._write_rows(x, plan.slot_mapping,
                             self.buffers[f"{name}_codes"][layer].view(-1, heads, dim),
                             self.buffers[f"{name}_scales"][layer].view(-1, heads))

    def _write_rows(self, x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor,
                    scales: torch.Tensor) -> None:
        """x [T, Hkv, D] quantized into rows `slots` of codes [S, Hkv, D] and scales [S, Hkv]
        (the PyTorch path)."""
        q, scale = self._quantize(x)  # [T, Hkv, D], [T, Hkv]
        codes.index_copy_(0, slots, q)
        scales.index_copy_(0, slots, scale)

    def read_blocks(self, layer: int, block_ids: torch.Tensor, rope: Rope | None = None):
        ids = block_ids.long().flatten()
        out = []
        for name in ("k", "v"):
            codes = self.buffers[f"{name}_codes"][layer][ids]  # [n, B, Hkv, D]
            scale = self.buffers[f"{name}_scales"][layer][ids]  # [n, B, Hkv]
            out.append(self._dequantize(codes, scale).to(self.layout.dtype))
        return self._rotate(out[0], ids, rope), out[1]


class Int8KVStore(PerTokenKVStore):
    kv_cache_dtype = "int8"

    def _write_rows(self, x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor,
                    scales: torch.Tensor) -> None:
        """On CPU with float32 rows, quantize-on-write in C (`native_int8`: the same bytes in one
        pass); otherwise the PyTorch path."""
        if native_int8.fits(x, codes, scales) and native_int8.native_int8_available():
            native_int8.quantize_write(x, slots, codes, scales)
        else:
            super()._write_rows(x, slots, codes, scales)

    def _quantize(self, x):
        return quantize_int8(x)

    def _dequantize(self, codes, scale):
        return dequantize_int8(codes, scale)


class FP8KVStore(PerTokenKVStore):
    """fmt 'e4m3' (torch.float8_e4m3fn, max 448) or 'e5m2' (torch.float8_e5m2, max 57344)."""

    kv_cache_dtype = "fp8_e4m3"
    fmt = "e4m3"

    @classmethod
    def from_settings(cls, layout: KVLayout, num_blocks: int, device: torch.device | str,
                      pre_rope_keys: bool = False) -> FP8KVStore:
        return cls(layout, num_blocks, device, cls.fmt, pre_rope_keys)

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu",
                 fmt: str = "e4m3", pre_rope_keys: bool = False,
                 slot_positions: torch.Tensor | None = None) -> None:
        fp8_dtype(fmt)  # validates
        self.fmt = fmt
        self.kv_cache_dtype = f"fp8_{fmt}"
        super().__init__(layout, num_blocks, device, pre_rope_keys, slot_positions)

    def _quantize(self, x):
        return quantize_fp8(x, self.fmt)

    def _dequantize(self, codes, scale):
        return dequantize_fp8(codes, scale, self.fmt)


class FP8E4M3KVStore(FP8KVStore):
    kv_cache_dtype = "fp8_e4m3"
    fmt = "e4m3"


class FP8E5M2KVStore(FP8KVStore):
    kv_cache_dtype = "fp8_e5m2"
    fmt = "e5m2"
