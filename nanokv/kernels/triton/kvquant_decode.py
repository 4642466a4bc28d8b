"""Decode attention over the KVQuant and KIVI stores, their codes read in place (flash-decoding).

Grid (request, KV head, split) as `decode.py`; a split is a run of whole blocks, UNROLL of them an
iteration of its loop (each block's loads independent of the one before, for the compiler to issue
together; blocks past the split masked out). A block's rows are decoded in registers: codes of 2,
3, 4 or 8 bits unpacked from their packed rows, turned into their centroids (a non-uniform
codebook's table `lut`, read; a uniform grid's `code * step + base`, computed: no load), mapped
by the block's per-channel key statistics / the token's value statistics (`centroid * half +
offset`), the values' dense-and-sparse
outliers' deltas (exact - decoded, as the store keeps them) added to their decoded entries, the
sink rows and a staged (partial) block's full-precision rows in place of theirs. Keys stored before
RoPE are decoded once as two halves (channels below and above D / 2, each the other's rotate-half
partner), rotated to their slots' positions in registers and dotted with the query's two halves.
The key outliers (before or after RoPE) are not put in the tile: the block's entries, loaded as
vectors, add their corrections to the scores (`_key_outlier_scores`). Nothing is written back to
memory; the step's own token attends with its fresh K/V, as in
`nanokv.quant.attention.reference_quantized_attention`, the oracle of the tests.

The layout (`QuantLayerViews`, one layer, every tensor contiguous):

    k_codes  [nb, B, Hkv, PK] uint8      v_codes  [nb, B, Hkv, PV] uint8
    k_off,   [nb, Hkv, D] fp16           v_off,   [nb, B, Hkv, G] fp16 (G groups of D / G
    k_half   (per channel, per block)    v_half    channels: KIVI; KVQuant G = 1)
    k_oidx   [nb, Hkv, CK] slot * D + ch v_oidx   [nb, B, Hkv, CV] channel (unused: out of
    k_oval   [nb, Hkv, CK] (deltas)      v_oval    range or < 0; deltas)
    sink_slot [nb, NS] int16 (the slot of sink p, -1 none); k_sink, v_sink [nb, NS, Hkv, D]
    staging_index [nb] int32 (-1 none); k_stage [S, B, Hkv, D] (and v_stage for KIVI)
    k_lut, v_lut [2^bits] float32 (read for non-uniform codebooks; uniform grids: k_grid, v_grid)
    positions [nb, B] int32 and cos, sin [P, D] (keys before RoPE)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton import decode
from nanokv.kernels.triton.decode import (
    MAX_SPLITS,
    check_num_stages,
    own_token_state,
    store_split,
)
from nanokv.kernels.triton.paged_tile import LOG2E, attend_scores, dot, dot_dtype


@dataclass(frozen=True)
class QuantLayerViews:
    """One layer of a KVQuant / KIVI store as the kernel reads it (shapes: the module doc)."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_off: torch.Tensor
    k_half: torch.Tensor
    v_off: torch.Tensor
    v_half: torch.Tensor
    k_lut: torch.Tensor
    v_lut: torch.Tensor
    k_bits: int
    v_bits: int
    staging_index: torch.Tensor
    k_stage: torch.Tensor
    v_stage: torch.Tensor | None = None
    k_oidx: torch.Tensor | None = None
    k_oval: torch.Tensor | None = None
    v_oidx: torch.Tensor | None = None
    v_oval: torch.Tensor | None = None
    sink_slot: torch.Tensor | None = None
    k_sink: torch.Tensor | None = None
    v_sink: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # a uniform grid's (step, base): centroid = code * step + base, computed, not looked up;
    # None: read the table (a non-uniform codebook)
    k_grid: tuple[float, float] | None = None
    v_grid: tuple[float, float] | None = None

    def centroid_args(self) -> dict:
        """The kernels' constexprs for the two sides' centroids."""
        out = {}
        for side, grid in (("K", self.k_grid), ("V", self.v_grid)):
            step, base = grid if grid is not None else (0.0, 0.0)
            out.update({f"{side}_TABLE": grid is None, f"{side}_STEP": step,
                        f"{side}_BASE": base})
        return out


@triton.jit
def _codes(rows, d, m, BITS: tl.constexpr, PACKED: tl.constexpr):
    """The codes [N, D_PAD] (int32) of channels d of packed rows starting at `rows` [N]."""
    return _code_at(rows[:, None], d[None, :], m, BITS, PACKED)


@triton.jit
def _code_at(row, c, m, BITS: tl.constexpr, PACKED: tl.constexpr):
    """The code (int32) of channel c in the packed row at `row` (any shapes that broadcast;
    0 where not m): bit c * BITS of the row's little-endian bit stream (8 codes in 3 bytes at 3
    bits)."""
    if BITS == 8:
        return tl.load(row + c, mask=m, other=0).to(tl.int32)
    bit = c * BITS
    byte = bit // 8
    lo = tl.load(row + byte, mask=m, other=0).to(tl.int32)
    if 8 % BITS == 0:  # 2 or 4 bits: a code never spans two bytes
        return (lo >> (bit % 8)) & ((1 << BITS) - 1)
    hi = tl.load(row + byte + 1, mask=m & (byte + 1 < PACKED), other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit
def _centroids(lut_ptr, code, m, TABLE: tl.constexpr, STEP: tl.constexpr, BASE: tl.constexpr):
    """Each code's centroid (float32, code's shape): a non-uniform codebook's table entry
    (TABLE), else the uniform grid's code * STEP + BASE, with no load (`kvquant.decode`: STEP
    2 / (2^bits - 1), BASE -1; KIVI: the code itself)."""
    if TABLE:
        return tl.load(lut_ptr + code, mask=m, other=0.0)
    return code.to(tl.float32) * STEP + BASE


@triton.jit
def key_rows(blk, g, s, dd, m, staged, kc_ptr, k_off_ptr, k_half_ptr, sink_slot_ptr,
             k_sink_ptr, k_stage_ptr, k_lut_ptr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, PACKED: tl.constexpr,
             NUM_SINKS: tl.constexpr, TABLE: tl.constexpr, STEP: tl.constexpr,
             BASE: tl.constexpr):
    """Block blk's key rows of KV head g, slots s [B], channels dd [D_PAD] -> [B, D_PAD] float32
    (before RoPE when the store keeps them so), without their outliers (`_key_outlier_scores`
    adds what they change in the scores)."""
    rows = kc_ptr + ((blk * BLOCK_SIZE + s) * HKV + g) * PACKED
    code = _codes(rows, dd, m, BITS, PACKED)
    stat = (blk * HKV + g) * HEAD_DIM + dd  # per channel, per block
    half = tl.load(k_half_ptr + stat, mask=dd < HEAD_DIM, other=0.0).to(tl.float32)
    off = tl.load(k_off_ptr + stat, mask=dd < HEAD_DIM, other=0.0).to(tl.float32)
    x = _centroids(k_lut_ptr, code, m, TABLE, STEP, BASE) * half[None, :] + off[None, :]
    for p in range(NUM_SINKS):
        slot = tl.load(sink_slot_ptr + blk * NUM_SINKS + p).to(tl.int32)
        sink = tl.load(k_sink_ptr + ((blk * NUM_SINKS + p) * HKV + g) * HEAD_DIM + dd,
                       mask=dd < HEAD_DIM, other=0.0).to(tl.float32)
        x = tl.where(s[:, None] == slot, sink[None, :], x)
    stage = tl.maximum(staged, 0).to(tl.int64)
    exact = tl.load(k_stage_ptr + ((stage * BLOCK_SIZE + s[:, None]) * HKV + g) * HEAD_DIM
                    + dd[None, :], mask=m & (staged >= 0), other=0.0).to(tl.float32)
    return tl.where(staged >= 0, exact, x)


@triton.jit
def value_rows(blk, g, s, d, m, staged, vc_ptr, v_off_ptr, v_half_ptr, v_oidx_ptr, v_oval_ptr,
               sink_slot_ptr, v_sink_ptr, v_stage_ptr, v_lut_ptr, HKV: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr,
               PACKED: tl.constexpr, GROUPS: tl.constexpr, CAP: tl.constexpr,
               NUM_SINKS: tl.constexpr, STAGED: tl.constexpr, TABLE: tl.constexpr,
               STEP: tl.constexpr, BASE: tl.constexpr):
    """Block blk's value rows of KV head g -> [B, D_PAD] float32."""
    row = (blk * BLOCK_SIZE + s) * HKV + g  # [B] (block, slot, head)
    code = _codes(vc_ptr + row * PACKED, d, m, BITS, PACKED)
    stat = row[:, None] * GROUPS + d[None, :] // (HEAD_DIM // GROUPS)  # per token (and group)
    half = tl.load(v_half_ptr + stat, mask=m, other=0.0).to(tl.float32)
    off = tl.load(v_off_ptr + stat, mask=m, other=0.0).to(tl.float32)
    x = _centroids(v_lut_ptr, code, m, TABLE, STEP, BASE) * half + off
    for e in range(CAP):
        ch = tl.load(v_oidx_ptr + row * CAP + e).to(tl.int32)  # [B]
        delta = tl.load(v_oval_ptr + row * CAP + e).to(tl.float32)
        x = tl.where(d[None, :] == ch[:, None], x + delta[:, None], x)
    for p in range(NUM_SINKS):
        slot = tl.load(sink_slot_ptr + blk * NUM_SINKS + p).to(tl.int32)
        sink = tl.load(v_sink_ptr + ((blk * NUM_SINKS + p) * HKV + g) * HEAD_DIM + d,
                       mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        x = tl.where(s[:, None] == slot, sink[None, :], x)
    if STAGED:  # values of a partial block wait in full precision too (KIVI)
        stage = tl.maximum(staged, 0).to(tl.int64)
        exact = tl.load(v_stage_ptr + ((stage * BLOCK_SIZE + s[:, None]) * HKV + g) * HEAD_DIM
                        + d[None, :], mask=m & (staged >= 0), other=0.0).to(tl.float32)
        x = tl.where(staged >= 0, exact, x)
    return x


@triton.jit
def _key_outlier_scores(blk, g, s, staged, q_row, g_mask, k_oidx_ptr, k_oval_ptr, sink_slot_ptr,
                        pos_ptr, cos_ptr, sin_ptr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                        NUM_SINKS: tl.constexpr, ROPE: tl.constexpr, G_PAD: tl.constexpr,
                        DOT_DTYPE: tl.constexpr):
    """What block blk's key outliers (KV head g) add to the scores [G_PAD, B] of rows q (at
    q_row [G_PAD, 1]) over keys decoded without them. An outlier at (slot, c) changes the key
    there by its stored delta (exact - decoded); kept before RoPE, it changes the rotated key by
    delta (cos, sin) at (c, c + HALF) for c < HALF, by delta (-sin, cos) at (c - HALF, c) above.
    So each query's score at that slot changes by the products with q. None on a staged block
    (exact rows) or at a sink slot (its full-precision row), as `key_rows` puts them in place.

    CHUNK entries at a time (all of a small block's at once): their index, delta, position,
    cos / sin and query channels are loaded as vectors (each level of that chain once a chunk,
    not once an entry), and the per-entry products [G_PAD, CHUNK] are summed into their slots by
    a dot with the entries' one-hot slots [CHUNK, B] (float32, IEEE products). Chunks keep both
    operands small at any block size (a block of 256 keeps 328 entries at 1%)."""
    corr = tl.zeros([G_PAD, BLOCK_SIZE], tl.float32)
    for e0 in range(0, CAP, CHUNK):
        corr += _key_outlier_chunk(blk, g, s, e0, staged, q_row, g_mask, k_oidx_ptr, k_oval_ptr,
                                   sink_slot_ptr, pos_ptr, cos_ptr, sin_ptr, HKV, HEAD_DIM,
                                   BLOCK_SIZE, CAP, CHUNK, NUM_SINKS, ROPE, DOT_DTYPE)
    return corr


@triton.jit
def key_outlier_entries(blk, g, e0, staged, k_oidx_ptr, k_oval_ptr, sink_slot_ptr,
                        HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        CAP: tl.constexpr, CHUNK: tl.constexpr, NUM_SINKS: tl.constexpr):
    """Block blk's key outlier entries [e0, e0 + CHUNK) of KV head g, loaded as vectors:
    (used, slot, channel, delta) [CHUNK] each. Not used (delta 0): an empty entry, any entry of
    a staged block (its rows are exact) or one at a sink slot (its full-precision row)."""
    e = e0 + tl.arange(0, CHUNK)
    entry = (blk * HKV + g) * CAP + e  # [CHUNK]
    idx = tl.load(k_oidx_ptr + entry, mask=e < CAP, other=-1).to(tl.int32)
    used = (idx >= 0) & (idx < BLOCK_SIZE * HEAD_DIM) & (staged < 0)
    idx = tl.where(used, idx, 0)
    slot = idx // HEAD_DIM
    c = idx % HEAD_DIM
    for p in tl.static_range(NUM_SINKS):
        used = used & (slot != tl.load(sink_slot_ptr + blk * NUM_SINKS + p).to(tl.int32))
    delta = tl.load(k_oval_ptr + entry, mask=used, other=0.0).to(tl.float32)
    return used, slot, c, delta


@triton.jit
def _key_outlier_chunk(blk, g, s, e0, staged, q_row, g_mask, k_oidx_ptr, k_oval_ptr,
                       sink_slot_ptr, pos_ptr, cos_ptr, sin_ptr, HKV: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAP: tl.constexpr,
                       CHUNK: tl.constexpr, NUM_SINKS: tl.constexpr, ROPE: tl.constexpr,
                       DOT_DTYPE: tl.constexpr):
    """_key_outlier_scores of the entries [e0, e0 + CHUNK) -> [G_PAD, B]."""
    used, slot, c, delta = key_outlier_entries(blk, g, e0, staged, k_oidx_ptr, k_oval_ptr,
                                               sink_slot_ptr, HKV, HEAD_DIM, BLOCK_SIZE, CAP,
                                               CHUNK, NUM_SINKS)
    q_mask = g_mask[:, None] & used[None, :]  # [G_PAD, CHUNK]
    if ROPE:
        HALF = HEAD_DIM // 2
        ch = c % HALF
        pos = tl.maximum(tl.load(pos_ptr + blk * BLOCK_SIZE + slot, mask=used, other=0), 0)
        at = pos.to(tl.int64) * HEAD_DIM + ch
        cos = tl.load(cos_ptr + at, mask=used, other=0.0)
        sin = tl.load(sin_ptr + at, mask=used, other=0.0)
        upper = c >= HALF
        d_lo = tl.where(upper, -delta * sin, delta * cos)
        d_hi = tl.where(upper, delta * cos, delta * sin)
        q_lo = tl.load(q_row + ch[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)
        q_hi = tl.load(q_row + HALF + ch[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)
        add = q_lo.to(tl.float32) * d_lo[None, :] + q_hi.to(tl.float32) * d_hi[None, :]
    else:
        q_c = tl.load(q_row + c[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)
        add = q_c.to(tl.float32) * delta[None, :]  # [G_PAD, CHUNK]
    one_hot = tl.where(slot[:, None] == s[None, :], 1.0, 0.0)  # [CHUNK, B]
    return tl.dot(add, one_hot, input_precision="ieee")


_PER_STEP = ["table_ptr", "stride_table", "context_ptr", "stride_context", "num_splits",
             "window"]


@triton.jit(do_not_specialize=_PER_STEP, do_not_specialize_on_alignment=_PER_STEP)
def _kvquant_decode_kernel(
        q_ptr, stride_qt, stride_qh, k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
        kc_ptr, vc_ptr, k_off_ptr, k_half_ptr, v_off_ptr, v_half_ptr, k_oidx_ptr, k_oval_ptr,
        v_oidx_ptr, v_oval_ptr, sink_slot_ptr, k_sink_ptr, v_sink_ptr, staging_index_ptr,
        k_stage_ptr, v_stage_ptr, k_lut_ptr, v_lut_ptr, pos_ptr, cos_ptr, sin_ptr,
        table_ptr, stride_table, context_ptr, stride_context,
        out_ptr, stride_ot, stride_oh, part_m_ptr, part_l_ptr, part_acc_ptr, qk_scale,
        num_splits, window, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
        D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr,
        K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_PACKED: tl.constexpr,
        V_PACKED: tl.constexpr, V_GROUPS: tl.constexpr, K_CAP: tl.constexpr,
        V_CAP: tl.constexpr, K_CAP_CHUNK: tl.constexpr, NUM_SINKS: tl.constexpr,
        ROPE: tl.constexpr,
        STAGED_V: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_DTYPE: tl.constexpr,
        H_PAD: tl.constexpr, UNROLL: tl.constexpr, K_TABLE: tl.constexpr,
        K_STEP: tl.constexpr, K_BASE: tl.constexpr, V_TABLE: tl.constexpr,
        V_STEP: tl.constexpr, V_BASE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_ptr + b * stride_context)
    past = tl.maximum(context - 1, 0)  # cached tokens; the last one is the step's own
    # a sliding window (window > 0) sees the last `window` tokens, its own included: the
    # blocks from the one holding its first slot, split in runs of whole blocks
    first = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    first_block = first // BLOCK_SIZE
    per_split = tl.cdiv(tl.maximum(tl.cdiv(past, BLOCK_SIZE) - first_block, 0), num_splits)
    lo = first_block + split * per_split
    hi = tl.minimum(lo + per_split, tl.cdiv(past, BLOCK_SIZE))

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    s = tl.arange(0, BLOCK_SIZE)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_head = kv_head * GROUP + g  # [G_PAD]
    q = tl.load(q_ptr + b * stride_qt + q_head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

    m_i, l_i, acc = own_token_state(q, k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                                    b, kv_head, split, context, d, d_mask, qk_scale, G_PAD,
                                    D_PAD, 0.0)  # no soft-cap (TritonQuantizedBackend)

    q_row = q_ptr + b * stride_qt + q_head[:, None] * stride_qh  # [G_PAD, 1]
    if ROPE:  # rotate-half: channel c < HALF pairs with c + HALF
        HALF = HEAD_DIM // 2
        dh = tl.arange(0, H_PAD)  # the first half's channels, the second half's minus HALF
        dh_mask = dh < HALF
        q_lo = tl.load(q_row + dh[None, :], mask=g_mask[:, None] & dh_mask[None, :],
                       other=0.0).to(DOT_DTYPE)
        q_hi = tl.load(q_row + HALF + dh[None, :], mask=g_mask[:, None] & dh_mask[None, :],
                       other=0.0).to(DOT_DTYPE)
    table = table_ptr + b * stride_table
    for j0 in range(lo, hi, UNROLL):  # UNROLL blocks an iteration, each its own loads
        for u in tl.static_range(UNROLL):
            j = j0 + u
            if UNROLL == 1:
                blk = tl.load(table + j).to(tl.int64)
                live = (j * BLOCK_SIZE + s < past) & (j * BLOCK_SIZE + s >= first)  # [B]
            else:  # the last iteration may run past the split: those blocks see no keys
                blk = tl.load(table + j, mask=j < hi, other=0).to(tl.int64)
                live = (j * BLOCK_SIZE + s < past) & (j * BLOCK_SIZE + s >= first) & (j < hi)
            m = live[:, None] & d_mask[None, :]
            staged = tl.load(staging_index_ptr + blk)
            if ROPE:
                # each half decoded once (outliers aside), rotated to the slots' positions in
                # registers: lo' = lo cos - hi sin, hi' = hi cos + lo sin (cos, sin the same on
                # both halves); scores = q_lo . lo' + q_hi . hi', plus each outlier's correction
                mh = live[:, None] & dh_mask[None, :]
                k_lo = key_rows(blk, kv_head, s, dh, mh, staged, kc_ptr, k_off_ptr, k_half_ptr,
                                 sink_slot_ptr, k_sink_ptr, k_stage_ptr, k_lut_ptr, HKV, HEAD_DIM,
                                 BLOCK_SIZE, K_BITS, K_PACKED, NUM_SINKS, K_TABLE, K_STEP, K_BASE)
                k_hi = key_rows(blk, kv_head, s, dh + HALF, mh, staged, kc_ptr, k_off_ptr,
                                 k_half_ptr, sink_slot_ptr, k_sink_ptr, k_stage_ptr, k_lut_ptr,
                                 HKV, HEAD_DIM, BLOCK_SIZE, K_BITS, K_PACKED, NUM_SINKS, K_TABLE,
                                 K_STEP, K_BASE)
                pos = tl.maximum(tl.load(pos_ptr + blk * BLOCK_SIZE + s, mask=live, other=0), 0)
                at = pos.to(tl.int64)[:, None] * HEAD_DIM + dh[None, :]
                cos = tl.load(cos_ptr + at, mask=mh, other=0.0)
                sin = tl.load(sin_ptr + at, mask=mh, other=0.0)
                r_lo = tl.where(mh, k_lo * cos - k_hi * sin, 0.0).to(DOT_DTYPE)
                r_hi = tl.where(mh, k_hi * cos + k_lo * sin, 0.0).to(DOT_DTYPE)
                scores = dot(q_lo, tl.trans(r_lo), DOT_DTYPE) + dot(q_hi, tl.trans(r_hi), DOT_DTYPE)
            else:
                k = key_rows(blk, kv_head, s, d, m, staged, kc_ptr, k_off_ptr, k_half_ptr,
                              sink_slot_ptr, k_sink_ptr, k_stage_ptr, k_lut_ptr, HKV, HEAD_DIM,
                              BLOCK_SIZE, K_BITS, K_PACKED, NUM_SINKS, K_TABLE, K_STEP, K_BASE)
                scores = dot(q, tl.trans(tl.where(m, k, 0.0).to(DOT_DTYPE)), DOT_DTYPE)
            if K_CAP > 0:  # the key outliers as score corrections, a chunk of entries at a time
                scores += _key_outlier_scores(blk, kv_head, s, staged, q_row, g_mask, k_oidx_ptr,
                                              k_oval_ptr, sink_slot_ptr, pos_ptr, cos_ptr,
                                              sin_ptr, HKV, HEAD_DIM, BLOCK_SIZE, K_CAP,
                                              K_CAP_CHUNK, NUM_SINKS, ROPE, G_PAD, DOT_DTYPE)
            v = value_rows(blk, kv_head, s, d, m, staged, vc_ptr, v_off_ptr, v_half_ptr,
                            v_oidx_ptr, v_oval_ptr, sink_slot_ptr, v_sink_ptr, v_stage_ptr,
                            v_lut_ptr, HKV, HEAD_DIM, BLOCK_SIZE, V_BITS, V_PACKED, V_GROUPS,
                            V_CAP, NUM_SINKS, STAGED_V, V_TABLE, V_STEP, V_BASE)
            v = tl.where(m, v, 0.0)
            m_i, l_i, acc = attend_scores(scores, v, 1.0, live[None, :], m_i, l_i, acc, qk_scale,
                                          False, DOT_DTYPE, 0.0)

    store_split(out_ptr, stride_ot, stride_oh, part_m_ptr, part_l_ptr, part_acc_ptr, b, q_head,
                g_mask, d, d_mask, split, num_splits, m_i, l_i, acc, GROUP, D_PAD, DIRECT_OUT)


def kvquant_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             layer: QuantLayerViews, block_tables: torch.Tensor,
                             context_lens: torch.Tensor, out: torch.Tensor, scale: float,
                             num_splits: int = 1, num_warps: int = 4,
                             num_stages: int | None = None, unroll: int = 1,
                             window: int | None = None) -> None:
    """q, out: [B, Hq, D]; k (after RoPE), v: [B, Hkv, D] the step's own K/V; block_tables
    [B, max_blocks] int32 (contiguous rows); context_lens [B] int32: cached slots after this
    step, the own token included (0: a padded row, output zeros); window: a sliding window,
    each row over its last `window` slots (None: all). Writes out."""
    rows, num_q_heads, dim = q.shape
    nb, block_size, heads, k_packed = layer.k_codes.shape
    if k.shape != (rows, heads, dim) or v.shape != k.shape or out.shape != q.shape \
            or num_q_heads % heads:
        raise ValueError(f"q, out must be [B, a multiple of {heads}, D] and k, v [B, {heads}, D], "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 \
            or block_tables.stride(-1) != 1:
        raise ValueError("block_tables (contiguous rows) and context_lens must be int32")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    check_num_stages(num_stages)
    if unroll not in (1, 2, 4):
        raise ValueError(f"unroll must be 1, 2 or 4 blocks an iteration, got {unroll}")
    if block_size & (block_size - 1):
        raise ValueError(f"the kernel takes power-of-two block sizes, got {block_size}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if rows == 0:
        return
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    group = num_q_heads // heads
    d_pad = max(16, triton.next_power_of_2(dim))
    part_m, part_l, parts = decode.split_partials(out, num_splits, d_pad)
    none = layer.k_lut  # a placeholder for the buffers a layout lacks (never read)
    rope = layer.cos is not None
    num_sinks = 0 if layer.sink_slot is None else layer.sink_slot.shape[-1]
    k_cap = 0 if layer.k_oidx is None else layer.k_oidx.shape[-1]
    v_cap = 0 if layer.v_oidx is None else layer.v_oidx.shape[-1]
    _kvquant_decode_kernel[(rows, heads, num_splits)](
        q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        layer.k_codes, layer.v_codes, layer.k_off, layer.k_half, layer.v_off, layer.v_half,
        _or(layer.k_oidx, none), _or(layer.k_oval, none), _or(layer.v_oidx, none),
        _or(layer.v_oval, none), _or(layer.sink_slot, none), _or(layer.k_sink, none),
        _or(layer.v_sink, none), layer.staging_index, layer.k_stage, _or(layer.v_stage, none),
        layer.k_lut, layer.v_lut, _or(layer.positions, none), _or(layer.cos, none),
        _or(layer.sin, none), block_tables, block_tables.stride(0), context_lens,
        context_lens.stride(0), out, out.stride(0), out.stride(1), part_m, part_l, parts,
        scale * LOG2E, num_splits, window or 0, GROUP=group, HEAD_DIM=dim,
        G_PAD=max(16, triton.next_power_of_2(group)), D_PAD=d_pad, BLOCK_SIZE=block_size,
        HKV=heads, K_BITS=layer.k_bits, V_BITS=layer.v_bits, K_PACKED=k_packed,
        V_PACKED=layer.v_codes.shape[-1], V_GROUPS=layer.v_half.shape[-1], K_CAP=k_cap,
        V_CAP=v_cap, K_CAP_CHUNK=min(64, max(16, triton.next_power_of_2(k_cap))),
        NUM_SINKS=num_sinks, ROPE=rope, STAGED_V=layer.v_stage is not None,
        DIRECT_OUT=num_splits == 1, DOT_DTYPE=dot_dtype(_kvquant_decode_kernel, q.dtype),
        H_PAD=max(16, triton.next_power_of_2(dim // 2)), UNROLL=unroll, num_warps=num_warps,
        **layer.centroid_args(), **decode.stages(num_stages))
    decode.merge_splits(part_m, part_l, parts, out, num_splits, d_pad)


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    return placeholder if t is None else t
