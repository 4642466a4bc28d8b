"""Prefill attention for every prefill chunk of a step in one launch (variable lengths).

Each chunk c has query rows [query_start[c], query_start[c] + query_len[c]) of the batch and
context_len[c] cached slots after this step; its first past = context_len - query_len slots are
its cached prefix, read in place through its block table, and its own tokens attend causally to
each other with their fresh K/V (rows of k, v; for the float pool equal to what was just
written, for codes the full-precision values, as the quantized reference does).

Grid (query tile, chunk, KV head): a program takes BLOCK_M query tokens of its chunk times all
query heads of its GQA group as the rows of one tile, so K/V tiles are read once per group; the
grid covers the longest chunk, tiles past a shorter chunk's end return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton.paged_kv import PagedKV
from nanokv.kernels.triton.paged_tile import LOG2E, attend_paged_span, attend_tile, dot_dtype

# per-step values (where the packed step tensors sit, the tables' width): not specialised on
_PER_STEP = ["table_ptr", "stride_table", "query_start_ptr", "query_len_ptr", "context_ptr"]


@triton.jit(do_not_specialize=_PER_STEP, do_not_specialize_on_alignment=_PER_STEP)
def _prefill_kernel(
        q_ptr, stride_qt, stride_qh, k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
        k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_ss,
        table_ptr, stride_table, query_start_ptr, query_len_ptr, context_ptr,
        out_ptr, stride_ot, stride_oh, qk_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
        D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_M
    chunk = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    query_len = tl.load(query_len_ptr + chunk)
    if row0 >= query_len:
        return
    query_start = tl.load(query_start_ptr + chunk)
    past = tl.load(context_ptr + chunk) - query_len

    r = tl.arange(0, BLOCK_M * G_PAD)  # rows: token-major, the group's heads inside
    tok = row0 + r // G_PAD  # [R] token of the chunk
    g = r % G_PAD
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    row_mask = (tok < query_len) & (g < GROUP)
    q_row = (query_start + tok).to(tl.int64) * stride_qt + (kv_head * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                other=0.0).to(DOT_DTYPE)  # [R, D_PAD]

    m_i = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)

    # the cached prefix: every row sees all of it
    table = table_ptr + chunk * stride_table
    m_i, l_i, acc = attend_paged_span(
        q, m_i, l_i, acc, 0, past, table, kv_head, k_cache_ptr, v_cache_ptr, stride_cb,
        stride_cs, stride_ch, k_scale_ptr, v_scale_ptr, stride_sb, stride_ss, d, d_mask,
        qk_scale, BLOCK_SIZE, TILE_N, KV_FORMAT, DOT_DTYPE)

    # the chunk's own tokens, causal: token i sees own tokens j <= i
    own_end = tl.minimum(query_len, row0 + BLOCK_M)
    for start in range(0, own_end, TILE_N):
        j = start + tl.arange(0, TILE_N)
        j_mask = j < own_end
        kv_row = (query_start + j).to(tl.int64)  # [TILE_N]
        jd_mask = j_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_row[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=jd_mask, other=0.0)
        v = tl.load(v_ptr + kv_row[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=jd_mask, other=0.0)
        causal = j_mask[None, :] & (j[None, :] <= tok[:, None])  # [R, TILE_N]
        m_i, l_i, acc = attend_tile(q, k, v, 1.0, 1.0, causal, m_i, l_i, acc, qk_scale,
                                    False, DOT_DTYPE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_row = (query_start + tok).to(tl.int64) * stride_ot + (kv_head * GROUP + g) * stride_oh
    tl.store(out_ptr + o_row[:, None] + d[None, :], out, mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                      query_start: torch.Tensor, query_len: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int, out: torch.Tensor, scale: float, block_rows: int = 64,
                      tile_n: int = 64, num_warps: int = 4) -> None:
    """q, out: [T, Hq, D]; k, v: [T, Hkv, D] (after RoPE, the step's fresh K/V); per chunk
    (int32 [C]): query_start, query_len, context_lens (cached slots after this step) and
    block_tables [C, max_blocks]; max_query_len: the longest chunk's (a host int). A program
    takes block_rows rows (query tokens x the GQA group's heads). Writes out's rows of the
    chunks."""
    num_q_heads, dim = q.shape[1], q.shape[2]
    heads = kv.num_kv_heads
    if dim != kv.head_dim or num_q_heads % heads or k.shape != (q.shape[0], heads, dim) \
            or v.shape != k.shape or out.shape != q.shape:
        raise ValueError(f"q, out must be [T, a multiple of {heads}, {kv.head_dim}] and k, v "
                         f"[T, {heads}, {kv.head_dim}], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(out.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, out)) or block_tables.stride(1) != 1:
        raise ValueError("q, k, v, out need a contiguous head dim, block tables contiguous rows")
    tensors = (query_start, query_len, context_lens, block_tables)
    if any(t.dtype != torch.int32 for t in tensors):
        raise ValueError("the chunk tensors must be int32")
    for size in (block_rows, tile_n):
        if size < 16 or size & (size - 1):
            raise ValueError(f"block_rows and tile_n must be powers of two >= 16, got "
                             f"{block_rows} and {tile_n}")
    group = num_q_heads // heads
    g_pad = triton.next_power_of_2(group)
    block_m = max(1, block_rows // g_pad)  # query tokens per program
    num_chunks = query_len.shape[0]
    if num_chunks == 0 or max_query_len < 1:
        return
    k_scales, v_scales = kv.scale_tensors()
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), num_chunks, heads)](
        q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.k, kv.v, *kv.cache_strides(), k_scales, v_scales, *kv.scale_strides(),
        block_tables, block_tables.stride(0), query_start, query_len, context_lens,
        out, out.stride(0), out.stride(1), scale * LOG2E,
        GROUP=group, HEAD_DIM=dim, G_PAD=g_pad, D_PAD=max(16, triton.next_power_of_2(dim)),
        BLOCK_SIZE=kv.block_size, BLOCK_M=block_m, TILE_N=tile_n, KV_FORMAT=kv.kv_format,
        DOT_DTYPE=dot_dtype(_prefill_kernel, q.dtype), num_warps=num_warps)
