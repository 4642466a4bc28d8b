"""A KVQuant / KIVI store's blocks decoded into dense K/V: the blocks of a step's prefill chunks
(read after the step's write; the pasts' partial blocks also before it, from given staging
rows), which the paged prefill kernel (`prefill.py`) then reads as float caches.

Why a copy here, where decode reads the codes in place: a prefill chunk's query tiles each read
the whole prefix, so decoding in place would decode every block once per tile of the chunk;
decoded once into a scratch cache of the layout's dtype, each block costs one write and one read
per tile. It is the CPU backend's choice too (`kvquant_read` in
`layers/csrc/quant_decode_attention.c`).

Grid (block of the list, KV head, tile of ROWS slots). A tile's rows are decoded as the decode
kernel decodes them (`kvquant_decode.key_rows` / `value_rows`: codes, codebook, statistics,
value outliers, sinks, staged rows), the key outliers' deltas added in the tile (a float32 dot
of the entries' one-hot slots [ROWS, CHUNK] by their deltas at their channels [CHUNK, D]), and
keys stored before RoPE rotated to their slots' positions (rotate-half, the table's two halves
read as they are). Output: block i of the list -> block i of k_out / v_out [n, B, Hkv, D], as
`QuantizedKVStore.read_blocks` (the oracle of the tests) returns them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton.kvquant_decode import (
    QuantLayerViews,
    key_outlier_entries,
    key_rows,
    value_rows,
)

ROWS = 16  # slots a program decodes (a block of 16 is one program a KV head)


@triton.jit
def _key_outliers_at(blk, g, s, cols, staged, k_oidx_ptr, k_oval_ptr, sink_slot_ptr,
                     HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     CAP: tl.constexpr, CHUNK: tl.constexpr, NUM_SINKS: tl.constexpr,
                     ROWS: tl.constexpr, C_PAD: tl.constexpr):
    """Block blk's key outlier deltas (KV head g) at slots s [ROWS], channels cols [C_PAD] ->
    [ROWS, C_PAD] float32 (0 where none): what to add to the keys `key_rows` decodes."""
    corr = tl.zeros([ROWS, C_PAD], tl.float32)
    for e0 in range(0, CAP, CHUNK):
        used, slot, c, delta = key_outlier_entries(blk, g, e0, staged, k_oidx_ptr, k_oval_ptr,
                                                   sink_slot_ptr, HKV, HEAD_DIM, BLOCK_SIZE,
                                                   CAP, CHUNK, NUM_SINKS)
        at_slot = tl.where(used[None, :] & (slot[None, :] == s[:, None]), 1.0, 0.0)  # [ROWS, C]
        at_col = tl.where(c[:, None] == cols[None, :], delta[:, None], 0.0)  # [CHUNK, C_PAD]
        corr += tl.dot(at_slot, at_col, input_precision="ieee")  # one entry a (slot, channel)
    return corr


@triton.jit
def _kvquant_read_kernel(
        ids_ptr, kc_ptr, vc_ptr, k_off_ptr, k_half_ptr, v_off_ptr, v_half_ptr, k_oidx_ptr,
        k_oval_ptr, v_oidx_ptr, v_oval_ptr, sink_slot_ptr, k_sink_ptr, v_sink_ptr,
        staging_index_ptr, rows_ptr, k_stage_ptr, v_stage_ptr, k_lut_ptr, v_lut_ptr, pos_ptr,
        cos_ptr, sin_ptr, k_out_ptr, v_out_ptr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        H_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr, K_BITS: tl.constexpr,
        V_BITS: tl.constexpr, K_PACKED: tl.constexpr, V_PACKED: tl.constexpr,
        V_GROUPS: tl.constexpr, K_CAP: tl.constexpr, V_CAP: tl.constexpr,
        K_CAP_CHUNK: tl.constexpr, NUM_SINKS: tl.constexpr, ROPE: tl.constexpr,
        STAGED_V: tl.constexpr, ROWS: tl.constexpr, K_TABLE: tl.constexpr,
        K_STEP: tl.constexpr, K_BASE: tl.constexpr, V_TABLE: tl.constexpr,
        V_STEP: tl.constexpr, V_BASE: tl.constexpr, GIVEN_ROWS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    s = tl.program_id(2) * ROWS + tl.arange(0, ROWS)  # [ROWS] slots of the block
    blk = tl.load(ids_ptr + i).to(tl.int64)
    if GIVEN_ROWS:  # the caller's staging row of each block
        staged = tl.load(rows_ptr + i)
    else:
        staged = tl.load(staging_index_ptr + blk)
    d = tl.arange(0, D_PAD)
    m = (s < BLOCK_SIZE)[:, None] & (d < HEAD_DIM)[None, :]  # [ROWS, D_PAD]
    out_row = ((i * BLOCK_SIZE + s) * HKV + g) * HEAD_DIM  # [ROWS] (block, slot, head)
    if ROPE:  # rotate-half: out = x cos + (-x_hi, x_lo) sin, halves decoded separately
        HALF = HEAD_DIM // 2
        dh = tl.arange(0, H_PAD)
        mh = (s < BLOCK_SIZE)[:, None] & (dh < HALF)[None, :]
        lo = key_rows(blk, g, s, dh, mh, staged, kc_ptr, k_off_ptr, k_half_ptr, sink_slot_ptr,
                      k_sink_ptr, k_stage_ptr, k_lut_ptr, HKV, HEAD_DIM, BLOCK_SIZE, K_BITS,
                      K_PACKED, NUM_SINKS, K_TABLE, K_STEP, K_BASE)
        hi = key_rows(blk, g, s, dh + HALF, mh, staged, kc_ptr, k_off_ptr, k_half_ptr,
                      sink_slot_ptr, k_sink_ptr, k_stage_ptr, k_lut_ptr, HKV, HEAD_DIM,
                      BLOCK_SIZE, K_BITS, K_PACKED, NUM_SINKS, K_TABLE, K_STEP, K_BASE)
        if K_CAP > 0:
            lo += _key_outliers_at(blk, g, s, dh, staged, k_oidx_ptr, k_oval_ptr, sink_slot_ptr,
                                   HKV, HEAD_DIM, BLOCK_SIZE, K_CAP, K_CAP_CHUNK, NUM_SINKS,
                                   ROWS, H_PAD)
            hi += _key_outliers_at(blk, g, s, dh + HALF, staged, k_oidx_ptr, k_oval_ptr,
                                   sink_slot_ptr, HKV, HEAD_DIM, BLOCK_SIZE, K_CAP, K_CAP_CHUNK,
                                   NUM_SINKS, ROWS, H_PAD)
        pos = tl.load(pos_ptr + blk * BLOCK_SIZE + s, mask=s < BLOCK_SIZE, other=0)
        at = tl.maximum(pos, 0).to(tl.int64)[:, None] * HEAD_DIM + dh[None, :]  # -1: unwritten
        cos_lo = tl.load(cos_ptr + at, mask=mh, other=0.0)
        sin_lo = tl.load(sin_ptr + at, mask=mh, other=0.0)
        cos_hi = tl.load(cos_ptr + at + HALF, mask=mh, other=0.0)
        sin_hi = tl.load(sin_ptr + at + HALF, mask=mh, other=0.0)
        k_at = k_out_ptr + out_row[:, None] + dh[None, :]
        tl.store(k_at, lo * cos_lo - hi * sin_lo, mask=mh)
        tl.store(k_at + HALF, hi * cos_hi + lo * sin_hi, mask=mh)
    else:
        k = key_rows(blk, g, s, d, m, staged, kc_ptr, k_off_ptr, k_half_ptr, sink_slot_ptr,
                     k_sink_ptr, k_stage_ptr, k_lut_ptr, HKV, HEAD_DIM, BLOCK_SIZE, K_BITS,
                     K_PACKED, NUM_SINKS, K_TABLE, K_STEP, K_BASE)
        if K_CAP > 0:
            k += _key_outliers_at(blk, g, s, d, staged, k_oidx_ptr, k_oval_ptr, sink_slot_ptr,
                                  HKV, HEAD_DIM, BLOCK_SIZE, K_CAP, K_CAP_CHUNK, NUM_SINKS, ROWS,
                                  D_PAD)
        tl.store(k_out_ptr + out_row[:, None] + d[None, :], k, mask=m)
    v = value_rows(blk, g, s, d, m, staged, vc_ptr, v_off_ptr, v_half_ptr, v_oidx_ptr,
                   v_oval_ptr, sink_slot_ptr, v_sink_ptr, v_stage_ptr, v_lut_ptr, HKV, HEAD_DIM,
                   BLOCK_SIZE, V_BITS, V_PACKED, V_GROUPS, V_CAP, NUM_SINKS, STAGED_V, V_TABLE,
                   V_STEP, V_BASE)
    tl.store(v_out_ptr + out_row[:, None] + d[None, :], v, mask=m)


def kvquant_read_blocks(layer: QuantLayerViews, block_ids: torch.Tensor, k_out: torch.Tensor,
                        v_out: torch.Tensor, num_warps: int = 8,
                        staging_rows: torch.Tensor | None = None) -> None:
    """Decode blocks block_ids [n] (int32 / int64, on the store's device) of the layer into
    k_out, v_out [>= n, B, Hkv, D] (contiguous; keys rotated to their slots' positions when the
    store keeps them before RoPE): block_ids[i] -> k_out[i], v_out[i]. staging_rows [n] int32:
    each block's staging row (-1: none) in place of the store's `staging_index` (a partial
    block's before the step's plan freed it: `nanokv.quant.staging.staging_rows_before`)."""
    block_size, heads = layer.k_codes.shape[1:3]
    n = block_ids.numel()
    dim = k_out.shape[-1]
    if k_out.shape != v_out.shape or k_out.dim() != 4 or k_out.shape[0] < n \
            or tuple(k_out.shape[1:]) != (block_size, heads, dim) \
            or not (k_out.is_contiguous() and v_out.is_contiguous()):
        raise ValueError(f"k_out, v_out must be contiguous [>= {n}, {block_size}, {heads}, D], "
                         f"got {tuple(k_out.shape)} and {tuple(v_out.shape)}")
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids must be a 1-D int32 / int64 tensor, got "
                         f"{tuple(block_ids.shape)} {block_ids.dtype}")
    if block_size < ROWS or block_size & (block_size - 1):
        raise ValueError(f"the kernel takes power-of-two block sizes >= {ROWS}, got {block_size}")
    if n == 0:
        return
    if staging_rows is not None and (staging_rows.shape != (n,)
                                     or staging_rows.dtype != torch.int32):
        raise ValueError(f"staging_rows must be int32 [{n}], got {tuple(staging_rows.shape)} "
                         f"{staging_rows.dtype}")
    none = layer.k_lut  # a placeholder for the buffers a layout lacks (never read)
    rope = layer.cos is not None
    if rope and layer.cos.shape[-1] != dim:
        raise ValueError(f"keys before RoPE are rotated over the whole head: cos / sin tables "
                         f"[P, {dim}], got {tuple(layer.cos.shape)}")
    k_cap = 0 if layer.k_oidx is None else layer.k_oidx.shape[-1]

    def opt(t: torch.Tensor | None) -> torch.Tensor:
        return none if t is None else t

    _kvquant_read_kernel[(n, heads, block_size // ROWS)](
        block_ids, layer.k_codes, layer.v_codes, layer.k_off, layer.k_half, layer.v_off,
        layer.v_half, opt(layer.k_oidx), opt(layer.k_oval), opt(layer.v_oidx), opt(layer.v_oval),
        opt(layer.sink_slot), opt(layer.k_sink), opt(layer.v_sink), layer.staging_index,
        layer.staging_index if staging_rows is None else staging_rows, layer.k_stage,
        opt(layer.v_stage), layer.k_lut, layer.v_lut, opt(layer.positions), opt(layer.cos),
        opt(layer.sin), k_out, v_out, HEAD_DIM=dim,
        D_PAD=max(16, triton.next_power_of_2(dim)),
        H_PAD=max(16, triton.next_power_of_2(dim // 2)), BLOCK_SIZE=block_size, HKV=heads,
        K_BITS=layer.k_bits, V_BITS=layer.v_bits, K_PACKED=layer.k_codes.shape[-1],
        V_PACKED=layer.v_codes.shape[-1], V_GROUPS=layer.v_half.shape[-1], K_CAP=k_cap,
        V_CAP=0 if layer.v_oidx is None else layer.v_oidx.shape[-1],
        K_CAP_CHUNK=min(64, max(16, triton.next_power_of_2(k_cap))),
        NUM_SINKS=0 if layer.sink_slot is None else layer.sink_slot.shape[-1], ROPE=rope,
        STAGED_V=layer.v_stage is not None, ROWS=ROWS, GIVEN_ROWS=staging_rows is not None,
        num_warps=num_warps,
        **layer.centroid_args())
