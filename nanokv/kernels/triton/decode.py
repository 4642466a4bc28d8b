"""Decode attention over the paged cache, read in place (flash-decoding).

Grid (request, KV head, split): each program takes all query heads of its GQA group and a
contiguous share of its request's cached tokens (its own context length only, through its block
table), with an online softmax; a second kernel merges the splits. With one split the first
kernel writes the output itself. Codes are dequantized in registers: scores are
`q . code * k_scale`, values `p * v_scale . code`.

The step's own token attends with its fresh K/V (rows of k, v), as the quantized stores'
reference does (`nanokv.quant.attention`); for the float pool it equals what was just written.
A request with context length 0 (a padded row) attends to nothing and outputs zeros.

No host synchronisation: the grid depends only on (rows, KV heads, num_splits); each program
reads its row's context length on the device. Values that change from step to step (the split
count, the block tables' width and where they sit) are not compile-time specialisations, so a
running engine compiles each kernel once per cache format, not once per batch shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton.paged_kv import PagedKV
from nanokv.kernels.triton.paged_tile import (
    LOG2E,
    attend_paged_span,
    capped,
    dot_dtype,
    soft_cap_constant,
)

MAX_SPLITS = 64  # the most splits the kernels take (triton_paged.SPLIT_CAP: all of them)
_PER_STEP = ["table_ptr", "stride_table", "context_ptr", "stride_context", "num_splits",
             "window"]


@triton.jit
def own_token_state(q, k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh, b, kv_head,
                    split, context, d, d_mask, qk_scale, G_PAD: tl.constexpr,
                    D_PAD: tl.constexpr, SOFT_CAP: tl.constexpr):
    """The online softmax state a split starts from: split 0 of a live row starts with the
    step's own token (m = its score, l = 1, acc = its value), every other empty."""
    own = (split == 0) & (context > 0)
    k_own = tl.load(k_ptr + b * stride_kt + kv_head * stride_kh + d, mask=d_mask & own,
                    other=0.0).to(tl.float32)
    v_own = tl.load(v_ptr + b * stride_vt + kv_head * stride_vh + d, mask=d_mask & own,
                    other=0.0).to(tl.float32)
    s_own = capped(tl.sum(q.to(tl.float32) * k_own[None, :], 1) * qk_scale, SOFT_CAP)  # [G_PAD]
    m_i = tl.where(own, s_own, float("-inf"))
    l_i = tl.where(own, 1.0, 0.0) + tl.zeros([G_PAD], tl.float32)
    acc = tl.where(own, 1.0, 0.0) * v_own[None, :] + tl.zeros([G_PAD, D_PAD], tl.float32)
    return m_i, l_i, acc


@triton.jit
def store_split(out_ptr, stride_ot, stride_oh, part_m_ptr, part_l_ptr, part_acc_ptr, b, q_head,
                g_mask, d, d_mask, split, num_splits, m_i, l_i, acc, GROUP: tl.constexpr,
                D_PAD: tl.constexpr, DIRECT_OUT: tl.constexpr):
    """A split's result: the output itself with one split, else its partials [rows, Hq,
    num_splits] (m, l) and [rows, Hq, num_splits, D_PAD] (acc) for the merge kernel."""
    if DIRECT_OUT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ot + q_head[:, None] * stride_oh + d[None, :], out,
                 mask=g_mask[:, None] & d_mask[None, :])
    else:
        part = (b * (tl.num_programs(1) * GROUP) + q_head) * num_splits + split  # [G_PAD]
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=g_mask[:, None])


@triton.jit(do_not_specialize=_PER_STEP, do_not_specialize_on_alignment=_PER_STEP)
def _decode_split_kernel(
        q_ptr, stride_qt, stride_qh, k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
        k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_ss,
        table_ptr, stride_table, context_ptr, stride_context,
        out_ptr, stride_ot, stride_oh, part_m_ptr, part_l_ptr, part_acc_ptr, qk_scale,
        num_splits, window, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
        D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        DIRECT_OUT: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr,
        SOFT_CAP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_ptr + b * stride_context)
    past = tl.maximum(context - 1, 0)  # cached tokens; the last one is the step's own
    # a sliding window (window > 0) sees the last `window` tokens, its own included
    first = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(past - first, 0), num_splits), TILE_N) * TILE_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, past)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_head = kv_head * GROUP + g  # [G_PAD]
    q = tl.load(q_ptr + b * stride_qt + q_head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)  # [G_PAD, D_PAD]

    m_i, l_i, acc = own_token_state(q, k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                                    b, kv_head, split, context, d, d_mask, qk_scale, G_PAD,
                                    D_PAD, SOFT_CAP)

    table = table_ptr + b * stride_table
    m_i, l_i, acc = attend_paged_span(
        q, m_i, l_i, acc, lo, hi, hi, table, kv_head, k_cache_ptr, v_cache_ptr, stride_cb,
        stride_cs, stride_ch, k_scale_ptr, v_scale_ptr, stride_sb, stride_ss, d, d_mask,
        qk_scale, BLOCK_SIZE, TILE_N, KV_FORMAT, DOT_DTYPE, False, 0, False, SOFT_CAP)

    store_split(out_ptr, stride_ot, stride_oh, part_m_ptr, part_l_ptr, part_acc_ptr, b, q_head,
                g_mask, d, d_mask, split, num_splits, m_i, l_i, acc, GROUP, D_PAD, DIRECT_OUT)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ot, stride_oh,
                         num_splits, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         S_PAD: tl.constexpr):
    """One (row, query head): the splits' (m, l, acc) merged; zeros when no split saw a token."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    part = (b * tl.num_programs(1) + head) * num_splits + s  # [S_PAD]
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :], mask=s_mask[:, None],
                  other=0.0)  # [S_PAD, D_PAD]
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [S_PAD]; 0 when empty
    total = tl.sum(w * l_s, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)  # [D_PAD]
    tl.store(out_ptr + b * stride_ot + head * stride_oh + d, out, mask=d < HEAD_DIM)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
                     scale: float, num_splits: int = 1, tile_n: int = 64,
                     num_warps: int = 4, num_stages: int | None = None,
                     window: int | None = None, soft_cap: float | None = None) -> None:
    """q, out: [B, Hq, D]; k, v: [B, Hkv, D] the step's own (fresh) K/V; block_tables:
    [B, max_blocks] int32 (any row stride); context_lens: [B] int32 cached slots after this
    step, the own token included (0: a padded row, output zeros). num_stages: the compiler's
    software-pipelining depth of the key-tile loop (None: Triton's default, 3 on NVIDIA GPUs;
    1 none). window: a sliding window, each row over its last `window` slots (None: all).
    soft_cap: the scores c * tanh(scores / c) before the softmax (None: none). Writes out."""
    rows, num_q_heads, dim = q.shape
    heads = kv.num_kv_heads
    _check(q, k, v, out, kv, block_tables, context_lens, num_splits, tile_n, num_stages)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if rows == 0:
        return
    group = num_q_heads // heads
    d_pad = max(16, triton.next_power_of_2(dim))
    part_m, part_l, parts = split_partials(out, num_splits, d_pad)
    k_scales, v_scales = kv.scale_tensors()
    _decode_split_kernel[(rows, heads, num_splits)](
        q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.k, kv.v, *kv.cache_strides(), k_scales, v_scales, *kv.scale_strides(),
        block_tables, block_tables.stride(0), context_lens, context_lens.stride(0),
        out, out.stride(0), out.stride(1), part_m, part_l, parts, scale * LOG2E, num_splits,
        window or 0, GROUP=group, HEAD_DIM=dim, G_PAD=max(16, triton.next_power_of_2(group)),
        D_PAD=d_pad,
        BLOCK_SIZE=kv.block_size, TILE_N=tile_n, DIRECT_OUT=num_splits == 1,
        KV_FORMAT=kv.kv_format, DOT_DTYPE=dot_dtype(_decode_split_kernel, q.dtype),
        SOFT_CAP=soft_cap_constant(soft_cap), num_warps=num_warps, **stages(num_stages))
    merge_splits(part_m, part_l, parts, out, num_splits, d_pad)


def split_partials(out: torch.Tensor, num_splits: int, d_pad: int):
    """(m, l, acc) partials of a split decode into out [B, Hq, D]; with one split no buffers
    (the kernel writes out itself: out stands in). A CUDA graph keeps them in its pool."""
    if num_splits == 1:
        return out, out, out
    rows, num_q_heads = out.shape[:2]
    part_m = torch.empty(rows, num_q_heads, num_splits, dtype=torch.float32, device=out.device)
    parts = torch.empty(rows, num_q_heads, num_splits, d_pad, dtype=torch.float32,
                        device=out.device)
    return part_m, torch.empty_like(part_m), parts


def merge_splits(part_m, part_l, parts, out: torch.Tensor, num_splits: int, d_pad: int) -> None:
    """The splits' partials merged into out (nothing to do with one split)."""
    if num_splits > 1:
        _decode_merge_kernel[out.shape[:2]](
            part_m, part_l, parts, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=out.shape[2], D_PAD=d_pad, S_PAD=max(16, triton.next_power_of_2(num_splits)))


def _check(q, k, v, out, kv: PagedKV, block_tables, context_lens, num_splits, tile_n,
           num_stages) -> None:
    rows, num_q_heads, dim = q.shape
    heads = kv.num_kv_heads
    if dim != kv.head_dim or num_q_heads % heads:
        raise ValueError(f"q must be [B, a multiple of {heads} heads, {kv.head_dim}], "
                         f"got {tuple(q.shape)}")
    if k.shape != (rows, heads, dim) or v.shape != k.shape or out.shape != q.shape:
        raise ValueError(f"k, v must be [{rows}, {heads}, {dim}] and out like q, got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(out.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, out)):
        raise ValueError("q, k, v and out need a contiguous head dim")
    if block_tables.dim() != 2 or block_tables.shape[0] != rows or context_lens.shape != (rows,):
        raise ValueError(f"block_tables must be [{rows}, max_blocks] and context_lens [{rows}], "
                         f"got {tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if block_tables.stride(1) != 1:
        raise ValueError("block table rows must be contiguous")
    if not 1 <= num_splits <= MAX_SPLITS or tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}] and tile_n a power of two "
                         f">= 16, got {num_splits} and {tile_n}")
    check_num_stages(num_stages)


def check_num_stages(num_stages: int | None) -> None:
    if num_stages is not None and not 1 <= num_stages <= 4:
        raise ValueError(f"num_stages must be None (Triton's default), 1 (no pipelining) to 4, "
                         f"got {num_stages}")


def stages(num_stages: int | None) -> dict:
    """The launch option for a kernel's pipelining depth (none: Triton's default)."""
    return {} if num_stages is None else {"num_stages": num_stages}
