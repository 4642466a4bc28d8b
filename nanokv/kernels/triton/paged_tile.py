"""The pieces the decode and prefill kernels share: reading one tile of a request's cached
tokens through its block table, in place, and folding a tile of keys/values into the online
softmax state.

A cache tensor is the pool's per-layer view [num_blocks, block_size, Hkv, D] (float elements or
uint8 codes, the head dim contiguous); scales are [num_blocks, block_size, Hkv] float32. Token t
of a request lives in block `table[t // BLOCK_SIZE]` at slot `t % BLOCK_SIZE`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from nanokv.kernels.triton import interpreter_compat
from nanokv.kernels.triton.codes import code_values

interpreter_compat.apply()  # the kernels' runtime loop bounds under TRITON_INTERPRET=1

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): the kernels' softmax runs in base 2


def soft_cap_constant(soft_cap: float | None) -> float:
    """A model's attention logit soft-cap c as the kernels' SOFT_CAP constexpr: c * log2(e), the
    cap in the softmax's base-2 units (c tanh(x / c) scales with them); 0.0 for none."""
    if soft_cap is None:
        return 0.0
    if not soft_cap > 0:
        raise ValueError(f"an attention logit soft-cap must be > 0, got {soft_cap}")
    return float(soft_cap) * LOG2E


@triton.jit
def capped(s, SOFT_CAP: tl.constexpr):
    """Scores s (scaled, base-2 units) soft-capped: SOFT_CAP * tanh(s / SOFT_CAP), tanh from
    e = exp(-2|x|) in (0, 1] (sign(x) (1 - e) / (1 + e): no overflow at any score); s itself
    when SOFT_CAP is 0 (Gemma 2's attention logit soft-cap, `soft_cap_constant`)."""
    if SOFT_CAP > 0:
        x = s / SOFT_CAP
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        s = SOFT_CAP * tl.where(x < 0, -t, t)
    return s


@triton.jit
def paged_slots(table_ptr, t, t_mask, kv_head, stride_cb, stride_cs, stride_ch, stride_sb,
                stride_ss, BLOCK_SIZE: tl.constexpr):
    """Where tokens t [N] of one request (block-table row at table_ptr), one KV head, live:
    (row [N], the element offset of each token's head row in a cache tensor; scale [N], the
    offset of its scale). One block-table read for the tile's keys, values and scales."""
    blk = tl.load(table_ptr + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    slot = t % BLOCK_SIZE
    row = blk * stride_cb + slot * stride_cs + kv_head * stride_ch
    scale = blk * stride_sb + slot * stride_ss + kv_head
    return row, scale


@triton.jit
def load_paged_rows(cache_ptr, row, t_mask, d, d_mask, KV_FORMAT: tl.constexpr):
    """The head rows at element offsets row [N] (`paged_slots`) -> [N, D_PAD]: the pool's
    elements, or the codes' float32 values (scale not applied)."""
    x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=t_mask[:, None] & d_mask[None, :],
                other=0)
    if KV_FORMAT != 0:
        x = code_values(x, KV_FORMAT)
    return x


@triton.jit
def attend_tile(q, k, v, k_scale, v_scale, col_mask, m_i, l_i, acc, qk_scale,
                SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Fold one tile into the online softmax of rows q [R, D_PAD] (in DOT_DTYPE).

    k, v: [N, D_PAD] (values before their scale when SCALED: k_scale, v_scale [N]);
    col_mask: [R, N] or [1, N], the keys each row may see; m_i, l_i: [R] running max (log2
    units) and sum; acc: [R, D_PAD] float32. qk_scale = softmax scale * log2(e); SOFT_CAP:
    `capped`'s. Returns (m_i, l_i, acc)."""
    s = dot(q, tl.trans(k.to(DOT_DTYPE)), DOT_DTYPE)
    if SCALED:
        s = s * k_scale[None, :]
    return attend_scores(s, v, v_scale, col_mask, m_i, l_i, acc, qk_scale, SCALED, DOT_DTYPE,
                         SOFT_CAP)


@triton.jit
def dot(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b in float32 accumulation; exact products (not TF32) when the operands are float32."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def attend_scores(s, v, v_scale, col_mask, m_i, l_i, acc, qk_scale, SCALED: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Fold a tile's raw scores s [R, N] (q . k, float32) and its values v [N, D_PAD] into the
    online softmax state (attend_tile's second half, for kernels that make their scores
    themselves)."""
    s = tl.where(col_mask, capped(s * qk_scale, SOFT_CAP), float("-inf"))  # [R, N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALED:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), DOT_DTYPE)
    return m_new, l_i, acc


@triton.jit
def attend_paged_span(q, m_i, l_i, acc, lo, hi, row_end, table_ptr, kv_head, k_cache_ptr,
                      v_cache_ptr, stride_cb, stride_cs, stride_ch, k_scale_ptr, v_scale_ptr,
                      stride_sb, stride_ss, d, d_mask, qk_scale, BLOCK_SIZE: tl.constexpr,
                      TILE_N: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      ROW_END: tl.constexpr, row_start, ROW_START: tl.constexpr,
                      SOFT_CAP: tl.constexpr):
    """Fold a request's cached tokens [lo, hi) (block-table row at table_ptr, one KV head), read
    in place tile by tile, into the online softmax of rows q [R, D_PAD]: every row sees every
    one of them (decode's split, prefill's cached prefix), or with ROW_END row r only those
    before row_end[r] (a prefill's decode view; row_end [R], unused without ROW_END), and with
    ROW_START only those from row_start[r] on (a sliding window; row_start [R]).
    Returns (m_i, l_i, acc)."""
    for start in range(lo, hi, TILE_N):
        t = start + tl.arange(0, TILE_N)
        t_mask = t < hi
        row, at = paged_slots(table_ptr, t, t_mask, kv_head, stride_cb, stride_cs, stride_ch,
                              stride_sb, stride_ss, BLOCK_SIZE)
        k = load_paged_rows(k_cache_ptr, row, t_mask, d, d_mask, KV_FORMAT)  # [TILE_N, D_PAD]
        v = load_paged_rows(v_cache_ptr, row, t_mask, d, d_mask, KV_FORMAT)
        k_scale = 1.0
        v_scale = 1.0
        if KV_FORMAT != 0:
            k_scale = tl.load(k_scale_ptr + at, mask=t_mask, other=0.0)  # [TILE_N]
            v_scale = tl.load(v_scale_ptr + at, mask=t_mask, other=0.0)
        seen = t_mask[None, :]  # [1, TILE_N], or [R, TILE_N] with ROW_END
        if ROW_END:
            seen = seen & (t[None, :] < row_end[:, None])
        if ROW_START:
            seen = seen & (t[None, :] >= row_start[:, None])
        m_i, l_i, acc = attend_tile(q, k, v, k_scale, v_scale, seen, m_i, l_i, acc, qk_scale,
                                    KV_FORMAT != 0, DOT_DTYPE, SOFT_CAP)
    return m_i, l_i, acc


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(kernel, dtype: torch.dtype):
    """The type the kernels multiply in for a model in `dtype`: the model's own on a GPU;
    float32 for bfloat16 in the interpreter, whose dot cannot multiply bfloat16 (it would
    multiply the bit patterns), so there the probabilities are not rounded to bfloat16."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {dtype}")
    if dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction):
        return tl.float32
    return _TL_DTYPES[dtype]
