"""KVQuant's quantize-on-write as Triton kernels: the CUDA counterpart of the C kernels
(`nanokv/layers/csrc/kvquant_quantize.c`, `nanokv.quant.native_write`), so that a step writes a
layer's keys and values in two launches where the store's PyTorch path runs about 40 small ops
per token kind (and some 130 more when a key block fills, top-k, sorts and scatters among them).

    quantize_tokens   per token (values, and keys without per-channel statistics): a program
                      quantizes BLOCK_R (token, KV head) rows of D channels into the per-token
                      buffers at the tokens' flat slots
    quantize_blocks   per channel (keys, when their block fills): a program quantizes one (block,
                      KV head) group of B slots x D channels, each slot read from the staging
                      rows or from the step's new keys (the plan's `quant_src`), into the
                      per-channel buffers at the block's id
    scatter_rows      a step's keys into their staging rows, and sink tokens into the sink
                      buffers, cast to the buffer's dtype

Every launcher takes padded entries (slot, block id or destination -1: nothing written), so a
decode step replayed from a CUDA graph runs the same launches whatever its rows hold
(`KVQuantStore.graph_write_plan`).

The rules are the C kernels' (and so the reference's, `nanokv.quant.kvquant.quantize_blocks`
followed by `KVQuantStore._put`): the `side` = cap / 2 highest and lowest scores are outliers,
ties to the lower index; an element picked by both ends is listed once; (max + min) / 2 and
(max - min) / 2 of the rest, clamped and rounded to fp16, normalise the others; codes are the
nearest centroid (midpoints counted, or the uniform grid rounded half to even) and packed as
`nanokv.quant.packing.pack`; each entry holds its delta to the dense decoding. Per-token lists
are the top side (highest first) then the bottom side (lowest first); per-channel lists are in
index order, unused entries last. Divisions and square roots are IEEE (`div_rn`, `sqrt_rn`)
and the launch turns off FMA contraction, so the dense decoding behind a delta is the reader's
multiply then add. The per-channel z-scores sum in float32 in another order than PyTorch's, so an
element whose score ties the last one picked within rounding may be chosen differently (as in
the C kernel, which sums in double). Sink slots (valid 0) are never outliers and stay out of the
per-channel statistics.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, the tests:
tests/unit/test_kvquant_triton_write.py holds them to the PyTorch path's bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton.codes import round_half_even
from nanokv.quant.kvquant import _EPS, _TINY  # the reference's span floor, half-range divisor
from nanokv.quant.native_write import INDEX_BYTES, SPARSE_KINDS  # the C kernels' buffer kinds
from nanokv.quant.packing import packed_dim

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_R = 4  # (token, head) rows a program of quantize_tokens


@triton.jit
def _fp16_round(x):
    """x clamped to +-65504 and rounded to fp16 (to nearest even): (fp16, its float32 value)."""
    h = tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)
    return h, h.to(tl.float32)


@triton.jit
def _group_stats(x, keep, AXIS: tl.constexpr, TINY: tl.constexpr):
    """(max + min) / 2 and (max - min) / 2 of x's kept elements along AXIS (0 where none is
    kept), rounded to fp16: (offset fp16, half fp16, offset, half, the codes' divisor
    max(half, TINY)), each float32."""
    lo = tl.min(tl.where(keep, x, float("inf")), AXIS)
    hi = tl.max(tl.where(keep, x, float("-inf")), AXIS)
    empty = lo == float("inf")  # every element an outlier (or a sink)
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    off16, off = _fp16_round((hi + lo) * 0.5)
    half16, hr = _fp16_round((hi - lo) * 0.5)
    return off16, half16, off, hr, tl.maximum(hr, TINY)


@triton.jit
def _encode(x, off, denom, mids_ptr, LEVELS: tl.constexpr, NUQ: tl.constexpr):
    """Elements -> codes (int32): normalised by the fp16 offset and half-range (denom = max(half,
    FLT_MIN)), clamped to [-1, 1], then the nearest centroid."""
    xn = tl.minimum(tl.maximum(tl.div_rn(x - off, denom), -1.0), 1.0)
    if NUQ:  # the midpoints below xn, counted (they ascend)
        n = tl.zeros(x.shape, tl.int32)
        for j in range(LEVELS):
            n += (tl.load(mids_ptr + j) < xn).to(tl.int32)
        return n
    r = round_half_even((xn + 1.0) * (LEVELS / 2.0))
    return tl.minimum(tl.maximum(r, 0), LEVELS)


@triton.jit
def _dense(codes, hr, off, book_ptr, LEVELS: tl.constexpr, NUQ: tl.constexpr):
    """Codes -> centroid * half + offset, as the reader computes it (no FMA at launch)."""
    if NUQ:
        centroid = tl.load(book_ptr + codes)
    else:
        centroid = codes.to(tl.float32) * (2.0 / LEVELS) - 1.0
    return centroid * hr + off


@triton.jit
def _store_sparse(ptr, x, mask, SPARSE_KIND: tl.constexpr):
    """float32 values (outliers' deltas, staged keys, sink tokens) -> a buffer of SPARSE_KIND:
    fp16 (0) or float32 (2) as they are; bfloat16 (1) as its bits, rounded to nearest even (the
    buffer is passed as int16; Triton's interpreter would truncate a plain cast)."""
    if SPARSE_KIND == 1:
        u = x.to(tl.uint32, bitcast=True)
        bits = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, bits)  # NaN: quiet
        tl.store(ptr, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    elif SPARSE_KIND == 0:
        tl.store(ptr, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _store_index(ptr, idx, mask, INDEX_BYTES: tl.constexpr):
    """Entry indexes (int32, -1 unused) -> the index buffer (uint8: 255 for unused)."""
    if INDEX_BYTES == 1:
        tl.store(ptr, tl.where(idx < 0, 255, idx).to(tl.uint8), mask=mask)
    elif INDEX_BYTES == 2:
        tl.store(ptr, idx.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, idx, mask=mask)


@triton.jit
def _row_pick(score, taken, d, ok, D_PAD: tl.constexpr):
    """Each row's highest score among the channels not yet taken (ties to the lower channel):
    its channel [R] (-1 where not ok) and where it is [R, D_PAD]."""
    cand = tl.where(taken == 0, score, float("-inf"))
    best = tl.max(cand, 1)
    i = tl.min(tl.where(cand == best[:, None], d[None, :], D_PAD), 1)
    i = tl.where(ok, i, -1)
    return i, d[None, :] == i[:, None]


@triton.jit
def _block_picks(score, e, none: tl.constexpr, PICKS: tl.constexpr):
    """The PICKS highest finite scores of a group's [B_PAD, D_PAD] elements (ties to the lower
    index e; padding's e is `none`), marked 1."""
    taken = tl.zeros(score.shape, tl.int32)
    for _ in range(PICKS):
        cand = tl.where(taken == 0, score, float("-inf"))
        best = tl.max(tl.max(cand, 1), 0)
        i = tl.min(tl.min(tl.where(cand == best, e, none), 1), 0)
        i = tl.where(best > float("-inf"), i, -1)  # none left: the entry stays unused
        taken = tl.where(e == i, 1, taken)
    return taken


@triton.jit
def pack_store(codes, base, row_mask, codes_ptr, P: tl.constexpr, R: tl.constexpr,
                D_PAD: tl.constexpr, BITS: tl.constexpr):
    """codes [R, D_PAD] int32 (0 past D) -> the R rows' P packed bytes at codes_ptr + base[r]
    (`nanokv.quant.packing.pack`: low bits first, 3-bit codes in 24-bit words)."""
    if BITS == 8:
        d = tl.arange(0, D_PAD)
        tl.store(codes_ptr + base[:, None] + d[None, :], codes.to(tl.uint8),
                 mask=row_mask[:, None] & (d < P)[None, :])
    elif BITS == 3:
        groups: tl.constexpr = D_PAD // 8
        grouped = tl.reshape(codes, (R, groups, 8))  # [R, G, 8]
        shifts = tl.arange(0, 8) * 3
        word = tl.sum(grouped << shifts[None, None, :], axis=2)  # [R, G], 24 bits each
        g = tl.arange(0, groups)
        for b in tl.static_range(3):
            byte = 3 * g + b
            tl.store(codes_ptr + base[:, None] + byte[None, :],
                     ((word >> (8 * b)) & 0xFF).to(tl.uint8),
                     mask=row_mask[:, None] & (byte < P)[None, :])
    else:
        per: tl.constexpr = 8 // BITS
        groups: tl.constexpr = D_PAD // per
        grouped = tl.reshape(codes, (R, groups, per))  # [R, G, codes a byte]
        shifts = tl.arange(0, per) * BITS
        word = tl.sum(grouped << shifts[None, None, :], axis=2)  # [R, G]
        g = tl.arange(0, groups)
        tl.store(codes_ptr + base[:, None] + g[None, :], word.to(tl.uint8),
                 mask=row_mask[:, None] & (g < P)[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _quantize_tokens_kernel(
        x_ptr, stride_xt, stride_xh, valid_ptr, slot_ptr, num_rows,
        codes_ptr, offset_ptr, half_ptr, oidx_ptr, oval_ptr, mids_ptr, book_ptr,
        H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr,
        CAP: tl.constexpr, CAP_PAD: tl.constexpr, SIDE: tl.constexpr, PICKS: tl.constexpr,
        BITS: tl.constexpr, LEVELS: tl.constexpr, NUQ: tl.constexpr,
        INDEX_BYTES: tl.constexpr, SPARSE_KIND: tl.constexpr, R: tl.constexpr,
        TINY: tl.constexpr):
    """Rows are (token, KV head) pairs, token-major; group g = slot * H + head."""
    r = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    t = tl.where(r < num_rows, r // H, 0)
    h = r % H
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row_ok = (r < num_rows) & (slot >= 0)  # slot -1: a padded row, nothing written
    pick_ok = row_ok & (tl.load(valid_ptr + t) != 0)  # a sink token has no outliers
    g = tl.where(row_ok, slot, 0) * H + h
    d = tl.arange(0, D_PAD)
    in_row = row_ok[:, None] & (d < D)[None, :]  # [R, D_PAD]
    x = tl.load(x_ptr + (t * stride_xt + h * stride_xh)[:, None] + d[None, :], mask=in_row,
                other=0.0).to(tl.float32)
    col = tl.arange(0, CAP_PAD)
    entry = tl.full((R, CAP_PAD), -1, tl.int32)  # each entry's channel (-1 unused)
    slot_of = tl.full((R, D_PAD), -1, tl.int32)  # each listed channel's entry (-1 none)
    top = tl.zeros((R, D_PAD), tl.int32)  # 1: picked by the top side
    seen = tl.zeros((R, D_PAD), tl.int32)  # 1: picked by the bottom side
    up = tl.where(in_row, x, float("-inf"))
    down = tl.where(in_row, -x, float("-inf"))  # the smallest first
    for j in range(PICKS):  # the largest channel not yet taken
        i, hit = _row_pick(up, top, d, pick_ok, D_PAD)
        top = tl.where(hit, 1, top)
        slot_of = tl.where(hit, j, slot_of)
        entry = tl.where(col[None, :] == j, i[:, None], entry)
    for j in range(PICKS):  # the smallest, ranked over every channel again
        i, hit = _row_pick(down, seen, d, pick_ok, D_PAD)
        seen = tl.where(hit, 1, seen)
        again = tl.sum(tl.where(hit, top, 0), 1) > 0  # the top side listed it already
        i = tl.where(again, -1, i)
        slot_of = tl.where(hit & (i >= 0)[:, None], SIDE + j, slot_of)
        entry = tl.where(col[None, :] == SIDE + j, i[:, None], entry)
    off16, half16, off, hr, denom = _group_stats(x, in_row & (slot_of < 0), 1, TINY)
    codes = _encode(x, off[:, None], denom[:, None], mids_ptr, LEVELS, NUQ)
    codes = tl.where(in_row, codes, 0)
    pack_store(codes, g * P, row_ok, codes_ptr, P, R, D_PAD, BITS)
    tl.store(offset_ptr + g, off16, mask=row_ok)
    tl.store(half_ptr + g, half16, mask=row_ok)
    if CAP > 0:
        delta = x - _dense(codes, hr[:, None], off[:, None], book_ptr, LEVELS, NUQ)
        listed = in_row & (slot_of >= 0)
        _store_sparse(oval_ptr + (g * CAP)[:, None] + slot_of, delta, listed, SPARSE_KIND)
        used = row_ok[:, None] & (col < CAP)[None, :]
        _store_sparse(oval_ptr + (g * CAP)[:, None] + col[None, :],
                      tl.zeros((R, CAP_PAD), tl.float32), used & (entry < 0), SPARSE_KIND)
        _store_index(oidx_ptr + (g * CAP)[:, None] + col[None, :], entry, used, INDEX_BYTES)


@triton.jit
def block_slots(x_ptr, stride_xt, stride_xh, staging_ptr, src_ptr, q, h, s, d, in_block,
                STAGED: tl.constexpr, H: tl.constexpr, B: tl.constexpr, D: tl.constexpr):
    """KV head h of filling block q as loaded: slot s is staging row src[q, s] (< STAGED) or
    the step's token src[q, s] - STAGED. Returns (staged [B_PAD], the staged rows, the new rows
    [B_PAD, D_PAD] each, 0 where the slot is the other kind), in their buffers' dtypes."""
    src = tl.load(src_ptr + q * B + s, mask=s < B, other=0).to(tl.int64)
    staged = src < STAGED
    row = tl.where(staged, src, 0)
    tok = tl.where(staged, 0, src - STAGED)
    old = tl.load(staging_ptr + ((row * H + h) * D)[:, None] + d[None, :],
                  mask=in_block & staged[:, None], other=0.0)
    new = tl.load(x_ptr + (tok * stride_xt + h * stride_xh)[:, None] + d[None, :],
                  mask=in_block & ~staged[:, None], other=0.0)
    return staged, old, new


@triton.jit
def _quantize_blocks_kernel(
        x_ptr, stride_xt, stride_xh, staging_ptr, src_ptr, valid_ptr, block_ptr, thr_ptr,
        codes_ptr, offset_ptr, half_ptr, oidx_ptr, oval_ptr, mids_ptr, book_ptr,
        STAGED: tl.constexpr, H: tl.constexpr, B: tl.constexpr, B_PAD: tl.constexpr,
        D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr, CAP: tl.constexpr,
        CAP_PAD: tl.constexpr, PICKS: tl.constexpr, BITS: tl.constexpr, LEVELS: tl.constexpr,
        NUQ: tl.constexpr, THRESHOLDS: tl.constexpr, INDEX_BYTES: tl.constexpr,
        SPARSE_KIND: tl.constexpr, EPS: tl.constexpr, TINY: tl.constexpr):
    """One program per (filling block q, KV head): slot s of block q is staging row src[q, s]
    (< STAGED) or the step's token src[q, s] - STAGED; element e = s * D + channel. Block id
    -1: a padded entry, nothing read or written."""
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
    ok = tl.load(valid_ptr + q * B + s, mask=s < B, other=0) != 0  # [B_PAD], False: a sink
    # a staged key passes through the new keys' dtype first, as the PyTorch path's `.to(x.dtype)`
    x = tl.where(staged[:, None], old.to(new.dtype).to(tl.float32), new.to(tl.float32))
    scored = in_block & ok[:, None]
    if THRESHOLDS:  # calibrated (lower, upper) [2, H, D]: the distance beyond, over the span
        lo_t = tl.load(thr_ptr + h * D + d, mask=d < D, other=0.0)
        hi_t = tl.load(thr_ptr + (H + h) * D + d, mask=d < D, other=0.0)
        span = tl.maximum(hi_t - lo_t, EPS)[None, :]
        up = tl.where(scored & (x > hi_t[None, :]), tl.div_rn(x - hi_t[None, :], span),
                      float("-inf"))
        down = tl.where(scored & (x < lo_t[None, :]), tl.div_rn(lo_t[None, :] - x, span),
                        float("-inf"))
    else:  # z-scores in each channel over the valid slots
        w = scored.to(tl.float32)
        count = tl.maximum(tl.sum(ok.to(tl.float32), 0), 1.0)
        mean = tl.div_rn(tl.sum(x * w, 0), count)  # [D_PAD]
        dev = x - mean[None, :]
        var = tl.div_rn(tl.sum(dev * dev * w, 0), count)
        z = tl.div_rn(dev, (tl.sqrt_rn(var) + EPS)[None, :])
        up = tl.where(scored, z, float("-inf"))
        down = tl.where(scored, -z, float("-inf"))
    none: tl.constexpr = B * D
    e = tl.where(in_block, s[:, None] * D + d[None, :], none)  # [B_PAD, D_PAD] (padding: none)
    top = _block_picks(up, e, none, PICKS)
    seen = _block_picks(down, e, none, PICKS)  # ranked over every element again
    listed = (top | seen) != 0  # an element picked by both ends is listed once
    off16, half16, off, hr, denom = _group_stats(x, scored & ~listed, 0, TINY)  # [D_PAD]
    stat = (blk * H + h) * D + d
    tl.store(offset_ptr + stat, off16, mask=d < D)
    tl.store(half_ptr + stat, half16, mask=d < D)
    codes = _encode(x, off[None, :], denom[None, :], mids_ptr, LEVELS, NUQ)
    codes = tl.where(in_block, codes, 0)
    pack_store(codes, ((blk * B + s) * H + h) * P, s < B, codes_ptr, P, B_PAD, D_PAD, BITS)
    if CAP > 0:
        delta = x - _dense(codes, hr[None, :], off[None, :], book_ptr, LEVELS, NUQ)
        # the list in index order: an element's entry is the count of listed ones before it
        marks = listed.to(tl.int32)
        in_slot = tl.cumsum(marks, 1) - marks  # listed before it in its slot
        per_slot = tl.sum(marks, 1)
        before = tl.cumsum(per_slot, 0) - per_slot  # listed in the slots before
        rank = before[:, None] + in_slot
        base = (blk * H + h) * CAP
        _store_sparse(oval_ptr + base + rank, delta, listed, SPARSE_KIND)
        _store_index(oidx_ptr + base + rank, e, listed, INDEX_BYTES)
        c = tl.arange(0, CAP_PAD)
        unused = (c >= tl.sum(per_slot, 0)) & (c < CAP)
        _store_sparse(oval_ptr + base + c, tl.zeros((CAP_PAD,), tl.float32), unused,
                      SPARSE_KIND)
        _store_index(oidx_ptr + base + c, tl.full((CAP_PAD,), -1, tl.int32), unused,
                     INDEX_BYTES)


@triton.jit
def _scatter_rows_kernel(x_ptr, stride_xt, stride_xh, src_ptr, dst_ptr, out_ptr,
                         H: tl.constexpr, D: tl.constexpr, HD_PAD: tl.constexpr,
                         OUT_KIND: tl.constexpr):
    """out[dst[i]] = x[src[i]] over every head, rounded to out's dtype (`_store_sparse`'s
    kinds) to nearest even; dst[i] < 0: skipped."""
    i = tl.program_id(0)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    src = tl.load(src_ptr + i).to(tl.int64)
    e = tl.arange(0, HD_PAD)  # element h * D + channel
    ok = (e < H * D) & (dst >= 0)
    row = tl.load(x_ptr + tl.maximum(src, 0) * stride_xt + (e // D) * stride_xh + e % D,
                  mask=ok, other=0.0).to(tl.float32)  # exact from any of X_DTYPES
    _store_sparse(out_ptr + tl.maximum(dst, 0) * (H * D) + e, row, ok, OUT_KIND)


def block_warps(elements: int) -> int:
    """Warps for a per-channel program of `elements` (padded B x D), by what sm_90 compiles at
    D = 128 (untimed): 4 up to blocks of 16 (168 registers a thread, no spills); 16 up to
    blocks of 64 (128 registers, 240 B of spills, where 4 warps spilled 920 B and 8 took 255
    registers and 288 B); 8 beyond (blocks of 256: 6.5 KB of spills and 32 KiB of shared
    memory, where 16 warps spilled 3.5 KB but took 128 KiB of shared memory, more than some
    GPUs have)."""
    if elements <= 2048:
        return 4
    return 16 if elements <= 8192 else 8


def pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def _check(x: torch.Tensor, buffers: dict[str, torch.Tensor], bits: int, what: str) -> None:
    oidx, oval = buffers["oidx"], buffers["oval"]
    problems = []
    if x.dtype not in X_DTYPES or x.stride(-1) != 1:
        problems.append(f"x {x.dtype} with a contiguous head dim (float32, bfloat16, float16)")
    if bits not in (2, 3, 4, 8):
        problems.append(f"bits {bits} (2, 3, 4, 8)")
    if oidx.dtype not in INDEX_BYTES or oval.dtype not in SPARSE_KINDS:
        problems.append(f"outlier buffers {oidx.dtype} / {oval.dtype}")
    if any(b.device != x.device or not b.is_contiguous() for b in buffers.values()):
        problems.append("buffers contiguous and on x's device")
    if problems:
        raise ValueError(f"{what}: unsupported " + "; ".join(problems))


def codebook_tables(codebook: torch.Tensor | None, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(midpoints, centroids, non-uniform) for the kernels; a dummy pair on the uniform grid."""
    if codebook is None:
        dummy = torch.zeros(1, dtype=torch.float32, device=device)
        return dummy, dummy, False
    book = codebook.to(device, torch.float32).contiguous()
    return ((book[1:] + book[:-1]) / 2).contiguous(), book, True


def _as_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool (or 0 / 1 integer) mask as uint8, without a copy for bool."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)


def _oval(buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    oval = buffers["oval"]
    return oval.view(torch.int16) if oval.dtype == torch.bfloat16 else oval


def _layer_args(buffers: dict[str, torch.Tensor], bits: int,
                tables: tuple[torch.Tensor, torch.Tensor, bool], dim: int) -> tuple[tuple, dict]:
    """What both quantize kernels take alike: the layer's buffers and the codebook tables (in the
    kernels' argument order), and the codes' and outliers' layout (constexprs, FMA off)."""
    mids, book, nuq = tables
    cap = buffers["oidx"].shape[-1]
    layer = (buffers["codes"], buffers["offset"], buffers["half"], buffers["oidx"],
             _oval(buffers), mids, book)
    meta = dict(D=dim, D_PAD=pow2(dim, 8), P=packed_dim(dim, bits), CAP=cap,
                CAP_PAD=pow2(cap), BITS=bits, LEVELS=2 ** bits - 1, NUQ=nuq,
                INDEX_BYTES=buffers["oidx"].element_size(),
                SPARSE_KIND=SPARSE_KINDS[buffers["oval"].dtype], TINY=_TINY,
                enable_fp_fusion=False)
    return layer, meta


def quantize_tokens(x: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor,
                    buffers: dict[str, torch.Tensor], bits: int,
                    tables: tuple[torch.Tensor, torch.Tensor, bool]) -> None:
    """Quantize each token-head of x [T, H, D] into the per-token buffers at the flat slots [T]
    (block * B + slot; -1: a padded token, skipped); valid [T] bool (False: a sink token, no
    outliers). buffers: the layer's `codes` [nb, B, H, P], `offset` / `half` [nb, B, H] fp16,
    `oidx` / `oval` [nb, B, H, cap]. tables: the codebook's `codebook_tables`, made once per
    layer and kind."""
    _check(x, buffers, bits, "quantize_tokens")
    num_tokens, heads, dim = x.shape
    if valid.shape != (num_tokens,) or slots.shape != (num_tokens,):
        raise ValueError(f"valid and slots must be [{num_tokens}], got {tuple(valid.shape)} and "
                         f"{tuple(slots.shape)}")
    if num_tokens == 0:
        return
    layer, meta = _layer_args(buffers, bits, tables, dim)
    cap = meta["CAP"]
    rows = num_tokens * heads
    _quantize_tokens_kernel[(triton.cdiv(rows, BLOCK_R),)](
        x, x.stride(0), x.stride(1), _as_bytes(valid.contiguous()), slots.contiguous(), rows,
        *layer, H=heads, SIDE=cap // 2, PICKS=min(cap // 2, dim), R=BLOCK_R, **meta)


def quantize_blocks(x: torch.Tensor, staging: torch.Tensor, quant_src: torch.Tensor,
                    valid: torch.Tensor, block_ids: torch.Tensor,
                    buffers: dict[str, torch.Tensor], bits: int,
                    tables: tuple[torch.Tensor, torch.Tensor, bool],
                    thresholds: torch.Tensor | None) -> None:
    """Quantize the n blocks that fill this step, per channel, into the buffers at block_ids
    [n] (-1: a padded entry, skipped): slot s of block i is staging row quant_src[i, s] of
    staging [S * B, H, D] when that is below S * B, else the step's key
    x[quant_src[i, s] - S * B] (x [T, H, D]); valid [n, B]
    bool (False: a sink slot, left out of the statistics and the outliers); thresholds [2, H, D]
    (calibrated lower, upper) or None (z-scores). buffers: the layer's `codes` [nb, B, H, P],
    `offset` / `half` [nb, H, D] fp16, `oidx` / `oval` [nb, H, cap]; tables: as
    `quantize_tokens`'s."""
    _check(x, buffers, bits, "quantize_blocks")
    n, bsz = quant_src.shape
    heads, dim = x.shape[1], x.shape[2]
    if valid.shape != (n, bsz) or block_ids.shape != (n,):
        raise ValueError(f"valid must be [{n}, {bsz}] and block_ids [{n}], got "
                         f"{tuple(valid.shape)} and {tuple(block_ids.shape)}")
    if staging.shape[1:] != (heads, dim) or not staging.is_contiguous():
        raise ValueError(f"staging must be contiguous [S * B, {heads}, {dim}], got "
                         f"{tuple(staging.shape)}")
    if thresholds is not None and tuple(thresholds.shape) != (2, heads, dim):
        raise ValueError(f"thresholds must be [2, {heads}, {dim}], got "
                         f"{tuple(thresholds.shape)}")
    if n == 0:
        return
    layer, meta = _layer_args(buffers, bits, tables, dim)
    mids = tables[0]
    limits = mids if thresholds is None else thresholds.to(x.device, torch.float32).contiguous()
    _quantize_blocks_kernel[(n * heads,)](
        x, x.stride(0), x.stride(1), staging, quant_src.contiguous(),
        _as_bytes(valid.contiguous()), block_ids.contiguous(), limits, *layer,
        STAGED=staging.shape[0], H=heads, B=bsz, B_PAD=pow2(bsz),
        PICKS=min(meta["CAP"] // 2, bsz * dim), THRESHOLDS=thresholds is not None, EPS=_EPS,
        num_warps=block_warps(pow2(bsz) * pow2(dim, 8)), **meta)


def scatter_rows(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, out: torch.Tensor
                 ) -> None:
    """out[dst[i]] = x[src[i]].to(out.dtype) for each i with dst[i] >= 0 (-1: a padded entry):
    the staged keys and the sink tokens. x [T, H, D] (contiguous head dim); src, dst [n]
    integers; out [M, H, D] contiguous. Destinations must be distinct."""
    if out.dim() != 3 or x.dim() != 3 or x.shape[1:] != out.shape[1:] or x.stride(-1) != 1 \
            or not out.is_contiguous() or out.device != x.device or x.dtype not in X_DTYPES \
            or out.dtype not in X_DTYPES:
        raise ValueError(f"scatter_rows: x must be [T, H, D] with a contiguous head dim and out "
                         f"a contiguous [M, H, D] on its device, both float32, bfloat16 or "
                         f"float16, got {tuple(x.shape)} {x.dtype} and {tuple(out.shape)} "
                         f"{out.dtype}")
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"scatter_rows: src and dst must be [n], got {tuple(src.shape)} and "
                         f"{tuple(dst.shape)}")
    if src.numel() == 0:
        return
    heads, dim = out.shape[1], out.shape[2]
    _scatter_rows_kernel[(src.numel(),)](
        x, x.stride(0), x.stride(1), src.contiguous(), dst.contiguous(),
        out.view(torch.int16) if out.dtype == torch.bfloat16 else out, H=heads, D=dim,
        HD_PAD=pow2(heads * dim), OUT_KIND=SPARSE_KINDS[out.dtype])
