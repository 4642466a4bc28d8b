"""KIVI's quantize-on-write as a Triton kernel: the store's write on CUDA, where its PyTorch path
(`KIVIStore._quantize_blocks`) runs some 30 small ops per token kind when a block fills.

    quantize_blocks   a program quantizes one (filling block, KV head) group of B slots x D
                      channels, each slot read from the staging rows or from the step's new
                      tokens (the plan's `quant_src`): keys per channel over the block's B slots,
                      values per slot in groups of G channels, into the codes and the min /
                      scale buffers at the block's id

The staging writes are `kvquant_write.scatter_rows`. Padded entries (block id -1) are skipped, so
a decode step replayed from a CUDA graph runs the same launches whatever its rows hold.

The rules are the PyTorch path's (`kivi_store.quantize_groups`): min and scale = (max - min) /
(2^b - 1) rounded OUTWARD to fp16 (min down, scale up, saturating at +-65504), codes
round((x - min) / scale) half to even, clamped to [0, 2^b - 1] (scale 0: divided by 1), packed as
`nanokv.quant.packing.pack`. Divisions are IEEE (`div_rn`), so the bytes are the same.

On CPU it runs in Triton's interpreter (TRITON_INTERPRET=1, the tests:
tests/unit/test_kivi_triton_write.py holds it to the PyTorch path's bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton.codes import round_half_even
from nanokv.kernels.triton.kvquant_write import (
    X_DTYPES,
    block_slots,
    block_warps,
    pack_store,
    pow2,
)
from nanokv.quant.packing import packed_dim


@triton.jit
def _fp16_outward(x, UP: tl.constexpr):
    """float32 -> fp16 rounded toward +inf (UP) or -inf, saturating at +-65504: (fp16 bits as
    int16, its float32 value); `kivi_store._fp16_outward`, nextafter included."""
    h = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
    half = h.to(tl.float16)
    near = half.to(tl.float32)
    bits = half.to(tl.int16, bitcast=True).to(tl.int32)
    if UP:
        wrong = near < h
        # one step toward +inf: up in magnitude when positive, down when negative, 0 -> 0x0001
        step = tl.where(near > 0, bits + 1, tl.where(near < 0, bits - 1, 1))
    else:
        wrong = near > h
        step = tl.where(near > 0, bits - 1, tl.where(near < 0, bits + 1, 0x8001))
    bits = tl.where(wrong, step, bits)
    out = (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True)
    return out, out.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _min_scale(lo, hi, LEVELS: tl.constexpr):
    """A group's min and scale (max - min) / LEVELS rounded outward to fp16: (min bits, min,
    scale bits, the codes' divisor: the scale, or 1 where it is 0)."""
    lo16, lo = _fp16_outward(lo, False)
    scale16, scale = _fp16_outward(tl.div_rn(hi - lo, tl.full(hi.shape, LEVELS, tl.float32)),
                                   True)
    return lo16, lo, scale16, tl.where(scale > 0, scale, 1.0)


@triton.jit
def _round_code(y, LEVELS: tl.constexpr):
    """round(y) half to even, clamped to [0, LEVELS] (clamped first: the same for integer
    bounds, and within `round_half_even`'s range)."""
    return round_half_even(tl.minimum(tl.maximum(y, 0.0), LEVELS * 1.0))


@triton.jit
def _quantize_blocks_kernel(
        x_ptr, stride_xt, stride_xh, staging_ptr, src_ptr, block_ptr, codes_ptr, min_ptr,
        scale_ptr, STAGED: tl.constexpr, PER_CHANNEL: tl.constexpr, H: tl.constexpr,
        B: tl.constexpr, B_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        G: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, LEVELS: tl.constexpr):
    """One program per (filling block q, KV head): slot s of block q is staging row src[q, s]
    (< STAGED) or the step's token src[q, s] - STAGED. Block id -1: a padded entry."""
    q = tl.program_id(0) // H
    h = tl.program_id(0) % H
    blk = tl.load(block_ptr + q).to(tl.int64)
    if blk < 0:
        return
    s = tl.arange(0, B_PAD)
    d = tl.arange(0, D_PAD)
    in_block = (s < B)[:, None] & (d < D)[None, :]  # [B_PAD, D_PAD]
    staged, old, new = block_slots(x_ptr, stride_xt, stride_xh, staging_ptr, src_ptr, q, h, s,
                                   d, in_block, STAGED, H, B, D)
    x = tl.where(staged[:, None], old.to(tl.float32), new.to(tl.float32))  # as `.float()`
    if PER_CHANNEL:  # keys: one group per channel, over the block's slots
        lo16, lo, scale16, step = _min_scale(tl.min(tl.where(in_block, x, float("inf")), 0),
                                             tl.max(tl.where(in_block, x, float("-inf")), 0),
                                             LEVELS)  # [D_PAD] each
        codes = _round_code(tl.div_rn(x - lo[None, :], step[None, :]), LEVELS)
        stat = (blk * H + h) * D + d
        tl.store(min_ptr + stat, lo16, mask=d < D)
        tl.store(scale_ptr + stat, scale16, mask=d < D)
    else:  # values: groups of G channels of each slot
        NG: tl.constexpr = D_PAD // G
        xg = tl.reshape(x, (B_PAD, NG, G))
        ok = tl.reshape(in_block, (B_PAD, NG, G))
        lo16, lo, scale16, step = _min_scale(tl.min(tl.where(ok, xg, float("inf")), 2),
                                             tl.max(tl.where(ok, xg, float("-inf")), 2),
                                             LEVELS)  # [B_PAD, NG] each
        codes = tl.reshape(_round_code(tl.div_rn(xg - lo[:, :, None], step[:, :, None]),
                                       LEVELS), (B_PAD, D_PAD))
        g = tl.arange(0, NG)
        stat = ((blk * B + s) * H + h)[:, None] * (D // G) + g[None, :]
        kept = (s < B)[:, None] & (g < D // G)[None, :]
        tl.store(min_ptr + stat, lo16, mask=kept)
        tl.store(scale_ptr + stat, scale16, mask=kept)
    codes = tl.where(in_block, codes, 0)
    pack_store(codes, ((blk * B + s) * H + h) * P, s < B, codes_ptr, P, B_PAD, D_PAD, BITS)


def fits(group_size: int) -> bool:
    """Whether the kernel takes this value group size (a power of two: the channels' reshape)."""
    return group_size >= 1 and group_size & (group_size - 1) == 0


def quantize_blocks(x: torch.Tensor, staging: torch.Tensor, quant_src: torch.Tensor,
                    block_ids: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor,
                    scale: torch.Tensor, bits: int, per_channel: bool,
                    group_size: int = 0) -> None:
    """Quantize the n blocks that fill this step into codes [nb, B, H, P] uint8 and lo / scale
    (fp16; keys, per_channel: [nb, H, D]; values: [nb, B, H, D / group_size]) at block_ids [n]
    (-1: a padded entry, skipped): slot s of block i is staging row quant_src[i, s] of staging
    [S * B, H, D] when that is below S * B, else the step's token x[quant_src[i, s] - S * B]
    (x [T, H, D], a contiguous head dim)."""
    n, bsz = quant_src.shape
    heads, dim = x.shape[1], x.shape[2]
    problems = []
    if x.dim() != 3 or x.dtype not in X_DTYPES or x.stride(-1) != 1:
        problems.append(f"x [T, H, D] {x.dtype} with a contiguous head dim (float32, bfloat16, "
                        f"float16)")
    if bits not in (2, 4):
        problems.append(f"bits {bits} (2, 4)")
    if not per_channel and (not fits(group_size) or dim % group_size):
        problems.append(f"group_size {group_size} (a power of two dividing head_dim {dim})")
    if block_ids.shape != (n,):
        problems.append(f"block_ids {tuple(block_ids.shape)} ([{n}])")
    if staging.shape[1:] != (heads, dim) or not staging.is_contiguous():
        problems.append(f"staging {tuple(staging.shape)} (contiguous [S * B, {heads}, {dim}])")
    stat_shape = (heads, dim) if per_channel else (bsz, heads, dim // max(group_size, 1))
    if tuple(lo.shape[1:]) != stat_shape or lo.shape != scale.shape \
            or lo.dtype != torch.float16 or scale.dtype != torch.float16:
        problems.append(f"lo / scale {tuple(lo.shape)} {lo.dtype} (fp16 [nb, "
                        f"{', '.join(map(str, stat_shape))}])")
    if tuple(codes.shape[1:]) != (bsz, heads, packed_dim(dim, bits)) or codes.dtype != torch.uint8:
        problems.append(f"codes {tuple(codes.shape)} {codes.dtype}")
    if any(b.device != x.device or not b.is_contiguous() for b in (codes, lo, scale)):
        problems.append("buffers contiguous and on x's device")
    if problems:
        raise ValueError("kivi quantize_blocks: unsupported " + "; ".join(problems))
    if n == 0:
        return
    _quantize_blocks_kernel[(n * heads,)](
        x, x.stride(0), x.stride(1), staging, quant_src.contiguous(), block_ids.contiguous(),
        codes, lo.view(torch.int16), scale.view(torch.int16), STAGED=staging.shape[0],
        PER_CHANNEL=per_channel, H=heads, B=bsz, B_PAD=pow2(bsz), D=dim,
        D_PAD=pow2(dim, max(8, group_size)), G=1 if per_channel else group_size,
        P=packed_dim(dim, bits), BITS=bits, LEVELS=2 ** bits - 1,
        num_warps=block_warps(pow2(bsz) * pow2(dim, 8)), enable_fp_fusion=False)
