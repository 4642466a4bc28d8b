"""Prefill attention for every prefill chunk of a step in one launch (variable lengths).

Each chunk c has query rows [query_start[c], query_start[c] + query_len[c]) of the batch and
context_len[c] cached slots after this step (the step's K/V already written); its first
past = context_len - query_len slots are its cached prefix, read in place through its block
table. What token n of the chunk (slot n of its sequence) sees (`VIEW`, a constexpr):

    FRESH      the float pool: the prefix, and its own tokens j <= n with their fresh K/V (rows
               of k, v: equal to what was just written)
    PER_TOKEN  int8 / fp8 codes, decode's view (as `reference_quantized_attention`): every
               earlier slot j < n from the cache (the chunk's own as the step wrote them), itself
               fresh: a prefill's outputs do not depend on how its prompt was chunked
    STAGED     a store that stages partial blocks (KVQuant's keys, KIVI), its blocks decoded into
               a float scratch cache, decode's view: an earlier j as the store held it once n
               was written, from the scratch (its codes, read after the write) when j's block
               was full by then (j // B < n // B, or n the last slot of its block), else from a
               second, staged cache (`stage_tables`: keys, and values with STAGED_V, as a read of
               a partial block returns them; other values from the scratch); itself fresh

Grid (query tile, chunk, KV head): a program takes BLOCK_M query tokens of its chunk times all
query heads of its GQA group as the rows of one tile, so K/V tiles are read once per group; the
grid covers the longest chunk, tiles past a shorter chunk's end return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton.paged_kv import FLOAT, PagedKV
from nanokv.kernels.triton.paged_tile import (
    LOG2E,
    attend_paged_span,
    attend_tile,
    capped,
    dot_dtype,
    load_paged_rows,
    paged_slots,
    soft_cap_constant,
)

# per-step values (where the packed step tensors sit, the tables' width) and the layer's window:
# not specialised on
_PER_STEP = ["table_ptr", "stride_table", "query_start_ptr", "query_len_ptr", "context_ptr",
             "stage_table_ptr", "stride_stage", "window"]
FRESH, PER_TOKEN, STAGED = 0, 1, 2  # VIEW: what a chunk's token sees of its earlier ones


@triton.jit(do_not_specialize=_PER_STEP, do_not_specialize_on_alignment=_PER_STEP)
def _prefill_kernel(
        q_ptr, stride_qt, stride_qh, k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
        k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_ss,
        table_ptr, stride_table, query_start_ptr, query_len_ptr, context_ptr,
        k_stage_ptr, v_stage_ptr, stage_table_ptr, stride_stage,
        out_ptr, stride_ot, stride_oh, qk_scale, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
        D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr,
        VIEW: tl.constexpr, STAGED_V: tl.constexpr, WINDOWED: tl.constexpr,
        SOFT_CAP: tl.constexpr):
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

    table = table_ptr + chunk * stride_table
    own_end = tl.minimum(query_len, row0 + BLOCK_M)
    # with WINDOWED, row slot n = past + tok sees slots [n + 1 - window, n] only (every view):
    # the tile's first row the earliest
    row_start = past + tok + 1 - window  # [R]
    lo = 0
    if WINDOWED:
        lo = tl.maximum(past + row0 + 1 - window, 0)
    if VIEW == 0:  # FRESH
        # the cached prefix: every row sees all of it (its window's part)
        m_i, l_i, acc = attend_paged_span(
            q, m_i, l_i, acc, tl.minimum(lo, past), past, past, table, kv_head, k_cache_ptr,
            v_cache_ptr, stride_cb, stride_cs, stride_ch, k_scale_ptr, v_scale_ptr, stride_sb,
            stride_ss, d, d_mask, qk_scale, BLOCK_SIZE, TILE_N, KV_FORMAT, DOT_DTYPE, False,
            row_start, WINDOWED, SOFT_CAP)

        # the chunk's own tokens, causal: token i sees own tokens j <= i (and j >= i + 1 - W)
        for start in range(tl.maximum(lo - past, 0), own_end, TILE_N):
            j = start + tl.arange(0, TILE_N)
            j_mask = j < own_end
            kv_row = (query_start + j).to(tl.int64)  # [TILE_N]
            jd_mask = j_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv_row[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                        mask=jd_mask, other=0.0)
            v = tl.load(v_ptr + kv_row[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                        mask=jd_mask, other=0.0)
            causal = j_mask[None, :] & (j[None, :] <= tok[:, None])  # [R, TILE_N]
            if WINDOWED:
                causal = causal & (past + j[None, :] >= row_start[:, None])
            m_i, l_i, acc = attend_tile(q, k, v, 1.0, 1.0, causal, m_i, l_i, acc, qk_scale,
                                        False, DOT_DTYPE, SOFT_CAP)
    else:  # decode's view
        n = past + tok  # [R] each row's slot in its sequence
        hi = past + own_end  # the tile's last row's slot + 1
        final_end = n  # [R] row n reads the cache's slots [0, final_end) (PER_TOKEN: all j < n)
        if VIEW == 2:  # STAGED: the blocks full once n was written
            final_end = tl.where(n % BLOCK_SIZE == BLOCK_SIZE - 1, n, n - n % BLOCK_SIZE)
        m_i, l_i, acc = attend_paged_span(
            q, m_i, l_i, acc, lo, hi, final_end, table, kv_head, k_cache_ptr, v_cache_ptr,
            stride_cb, stride_cs, stride_ch, k_scale_ptr, v_scale_ptr, stride_sb, stride_ss, d,
            d_mask, qk_scale, BLOCK_SIZE, TILE_N, KV_FORMAT, DOT_DTYPE, True, row_start,
            WINDOWED, SOFT_CAP)
        if VIEW == 2:  # slots [final_end, n) of row n's block, still filling: as staged
            # the chunk's staged blocks, from the one holding its slot `past` (float)
            stage = stage_table_ptr + chunk * stride_stage - past // BLOCK_SIZE
            for start in range((past + row0) // BLOCK_SIZE * BLOCK_SIZE, hi, TILE_N):
                t = start + tl.arange(0, TILE_N)
                t_mask = t < hi
                row, _ = paged_slots(stage, t, t_mask, kv_head, stride_cb, stride_cs,
                                     stride_ch, 0, 0, BLOCK_SIZE)
                k = load_paged_rows(k_stage_ptr, row, t_mask, d, d_mask, 0)  # [TILE_N, D_PAD]
                if STAGED_V:
                    v = load_paged_rows(v_stage_ptr, row, t_mask, d, d_mask, 0)
                else:  # values are per token: the scratch's
                    row, _ = paged_slots(table, t, t_mask, kv_head, stride_cb, stride_cs,
                                         stride_ch, 0, 0, BLOCK_SIZE)
                    v = load_paged_rows(v_cache_ptr, row, t_mask, d, d_mask, 0)
                seen = t_mask[None, :] & (t[None, :] >= final_end[:, None]) \
                    & (t[None, :] < n[:, None])  # [R, TILE_N]
                if WINDOWED:
                    seen = seen & (t[None, :] >= row_start[:, None])
                m_i, l_i, acc = attend_tile(q, k, v, 1.0, 1.0, seen, m_i, l_i, acc, qk_scale,
                                            False, DOT_DTYPE, SOFT_CAP)
        # the row's own token, fresh (rows of k, v)
        rd_mask = row_mask[:, None] & d_mask[None, :]
        own = (query_start + tok).to(tl.int64)[:, None]  # [R, 1]
        k = tl.load(k_ptr + own * stride_kt + kv_head * stride_kh + d[None, :], mask=rd_mask,
                    other=0.0).to(tl.float32)  # [R, D_PAD]
        v = tl.load(v_ptr + own * stride_vt + kv_head * stride_vh + d[None, :], mask=rd_mask,
                    other=0.0).to(tl.float32)
        s = capped(tl.sum(q.to(tl.float32) * k, 1) * qk_scale, SOFT_CAP)  # [R]
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_row = (query_start + tok).to(tl.int64) * stride_ot + (kv_head * GROUP + g) * stride_oh
    tl.store(out_ptr + o_row[:, None] + d[None, :], out, mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                      query_start: torch.Tensor, query_len: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int, out: torch.Tensor, scale: float, block_rows: int = 64,
                      tile_n: int = 64, num_warps: int = 4,
                      stage_tables: torch.Tensor | None = None,
                      k_stage: torch.Tensor | None = None,
                      v_stage: torch.Tensor | None = None, window: int | None = None,
                      soft_cap: float | None = None) -> None:
    """q, out: [T, Hq, D]; k, v: [T, Hkv, D] (after RoPE, the step's fresh K/V); per chunk
    (int32 [C]): query_start, query_len, context_lens (cached slots after this step) and
    block_tables [C, max_blocks]; max_query_len: the longest chunk's (a host int). A program
    takes block_rows rows (query tokens x the GQA group's heads). Writes out's rows of the
    chunks. The view (module doc): PER_TOKEN for codes; STAGED when stage_tables is given
    (kv: a float scratch holding the final read of every block of each chunk's context):
    stage_tables [C, w] int32, the rows of k_stage (and v_stage, or None: values from kv)
    [n, B, Hkv, D] holding each chunk's blocks from the one of its slot `past` on, as
    staged. window: a sliding window (any view), each token over its last `window` slots, its
    own included (None: all). soft_cap: the scores c * tanh(scores / c) before the softmax
    (None: none)."""
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
    view = PER_TOKEN if kv.kv_format != FLOAT else FRESH
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if stage_tables is not None:
        stage = (k_stage, k_stage if v_stage is None else v_stage)
        if kv.kv_format != FLOAT or any(x.stride() != kv.k.stride() or x.dtype != kv.k.dtype
                                        for x in stage) \
                or stage_tables.dtype != torch.int32 or stage_tables.stride(1) != 1:
            raise ValueError("a staged view needs a float kv and staged caches of its strides and "
                             "dtype, int32 stage tables of contiguous rows")
        view = STAGED
    else:  # placeholders, never read
        stage, stage_tables = (kv.k, kv.v), block_tables
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), num_chunks, heads)](
        q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.k, kv.v, *kv.cache_strides(), k_scales, v_scales, *kv.scale_strides(),
        block_tables, block_tables.stride(0), query_start, query_len, context_lens,
        *stage, stage_tables, stage_tables.stride(0),
        out, out.stride(0), out.stride(1), scale * LOG2E, window or 0,
        GROUP=group, HEAD_DIM=dim, G_PAD=g_pad, D_PAD=max(16, triton.next_power_of_2(dim)),
        BLOCK_SIZE=kv.block_size, BLOCK_M=block_m, TILE_N=tile_n, KV_FORMAT=kv.kv_format,
        DOT_DTYPE=dot_dtype(_prefill_kernel, q.dtype), VIEW=view,
        STAGED_V=v_stage is not None, WINDOWED=window is not None,
        SOFT_CAP=soft_cap_constant(soft_cap), num_warps=num_warps)
