"""Write the step's new K/V into the paged cache at their slots, quantizing on the way for codes.

Rows are (token, KV head) pairs; a program writes BLOCK_R of them, token t's to slot
`slot_mapping[t]` (block = slot // block_size). A slot < 0 writes nothing, so padded rows (a CUDA
graph's batch larger than the step) are harmless. For codes, each (token, head) row gets
scale = max |x| / CODE_MAX and codes = round(x / scale), as `quantize_int8` / `quantize_fp8`
(the reference: `PerTokenKVStore.write`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton.codes import encode_codes
from nanokv.kernels.triton.paged_kv import CODE_MAX, PagedKV

_TINY = 1.1754943508222875e-38  # the smallest normal float32: a zero row's scale divisor


@triton.jit
def _store_rows(x, cache_ptr, scale_ptr, elem, scale_elem, mask, row_mask,
                KV_FORMAT: tl.constexpr, CODE_MAX: tl.constexpr, TINY: tl.constexpr):
    """x [R, D_PAD] (one (token, head) per row) -> cache elements at `elem`; for codes, one
    scale per row at `scale_elem`."""
    if KV_FORMAT == 0:
        tl.store(cache_ptr + elem, x, mask=mask)
    else:
        xf = x.to(tl.float32)
        scale = tl.div_rn(tl.max(tl.abs(xf), 1), CODE_MAX)  # [R]
        y = tl.div_rn(xf, tl.maximum(scale, TINY)[:, None])
        y = tl.minimum(tl.maximum(y, -CODE_MAX), CODE_MAX)
        tl.store(cache_ptr + elem, encode_codes(y, KV_FORMAT), mask=mask)
        tl.store(scale_ptr + scale_elem, scale, mask=row_mask)


# per step: the row count (T * Hkv), and where the slots sit (a view into the step's upload)
@triton.jit(do_not_specialize=["num_rows"], do_not_specialize_on_alignment=["slot_ptr"])
def _write_kv_kernel(k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh, slot_ptr,
                     num_rows, k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch,
                     k_scale_ptr, v_scale_ptr, stride_sb, stride_ss,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, D_PAD: tl.constexpr,
                     KV_FORMAT: tl.constexpr, CODE_MAX: tl.constexpr, TINY: tl.constexpr):
    """Rows are (token, KV head) pairs, token-major; a program writes BLOCK_R of them."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = r // NUM_KV_HEADS
    h = r % NUM_KV_HEADS
    slot = tl.load(slot_ptr + t, mask=r < num_rows, other=-1).to(tl.int64)
    row_mask = slot >= 0
    slot = tl.maximum(slot, 0)
    blk = slot // BLOCK_SIZE
    pos = slot % BLOCK_SIZE
    d = tl.arange(0, D_PAD)
    mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]  # [BLOCK_R, D_PAD]
    elem = (blk * stride_cb + pos * stride_cs + h * stride_ch)[:, None] + d[None, :]
    scale_elem = blk * stride_sb + pos * stride_ss + h
    k = tl.load(k_ptr + (t * stride_kt + h * stride_kh)[:, None] + d[None, :], mask=mask,
                other=0.0)
    _store_rows(k, k_cache_ptr, k_scale_ptr, elem, scale_elem, mask, row_mask, KV_FORMAT,
                CODE_MAX, TINY)
    v = tl.load(v_ptr + (t * stride_vt + h * stride_vh)[:, None] + d[None, :], mask=mask,
                other=0.0)
    _store_rows(v, v_cache_ptr, v_scale_ptr, elem, scale_elem, mask, row_mask, KV_FORMAT,
                CODE_MAX, TINY)


def write_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv: PagedKV,
             block_rows: int = 16) -> None:
    """k, v: [T, Hkv, D] (head dim contiguous); slot_mapping: [T] int (< 0: skip);
    block_rows: (token, head) rows per program, a power of two."""
    num_tokens, heads, dim = k.shape
    if v.shape != k.shape or heads != kv.num_kv_heads or dim != kv.head_dim:
        raise ValueError(f"k, v must be [T, {kv.num_kv_heads}, {kv.head_dim}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous head dim")
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if num_tokens == 0:
        return
    rows = num_tokens * heads
    k_scales, v_scales = kv.scale_tensors()
    _write_kv_kernel[(triton.cdiv(rows, block_rows),)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slot_mapping, rows,
        kv.k, kv.v, *kv.cache_strides(), k_scales, v_scales, *kv.scale_strides(),
        NUM_KV_HEADS=heads, HEAD_DIM=dim, BLOCK_SIZE=kv.block_size, BLOCK_R=block_rows,
        D_PAD=triton.next_power_of_2(dim), KV_FORMAT=kv.kv_format,
        CODE_MAX=CODE_MAX.get(kv.kv_format, 1.0), TINY=_TINY)
