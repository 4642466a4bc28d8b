"""Paged attention in PyTorch (CPU and CUDA), and the dense reference used as the test oracle.

K/V of every new token are first written into the paged pool at its slot; then each query
attends over its request's cached slots. Slots are in logical order, so causality is by slot
index: query i of a chunk whose first slot is s0 sees slots [0, s0 + i], and with a sliding
window of W tokens (a layer of Mistral, Qwen2 / Qwen3 with use_sliding_window) the last W of them,
[s0 + i + 1 - W, s0 + i]: the blocks a request's window has left are freed (their slots leave the
table from the front), so the window is by slot index too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanokv.cache.layout import window_start
from nanokv.layers.native_attention import DecodeRuns, native_decode_attention, slot_runs
from nanokv.utils import cdiv


@dataclass
class PrefillSeq:
    """One request's prefill chunk inside the flattened batch."""

    query_start: int  # offset of its first token in the batch
    query_len: int
    context_len: int  # cached slots after this step (past + this chunk)
    block_table: torch.Tensor  # [num_blocks] int64, covering context_len slots


@dataclass
class AttentionMetadata:
    """The PyTorch paged-attention kernels' inputs for one step (an attention backend builds it
    once per step from the common description, `nanokv.attention.common`)."""

    slot_mapping: torch.Tensor  # [T] int64, flat pool slot of each new token
    num_decode_tokens: int  # the first tokens of the batch are single-token decodes
    decode_block_tables: torch.Tensor | None  # [B_dec, max_blocks] int64 (padded)
    decode_mask: torch.Tensor | None  # [B_dec, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSeq]
    write_cache: bool = True  # False: the caller wrote the step's K/V (a backend does)
    # Decodes take exactly one of three paths, by what the caller (an attention backend) set:
    # `decode_runs`: the C kernel (`native_attention.py`), the slots as runs;
    # `decode_context_lens` (+ `decode_block_lists`, host lists read without syncs): each request
    # over exactly its own slots in place, no padding, no mask (the CPU PyTorch path);
    # neither: one padded batch over `decode_block_tables` with `decode_mask` (CUDA)
    decode_context_lens: list[int] | None = None
    decode_block_lists: list[list[int]] | None = None
    decode_runs: DecodeRuns | None = None
    # the layers' sliding window: each query attends over its newest `window` slots (its own
    # included); None: over all of them. The decode addressing above is built for it.
    window: int | None = None
    # the model's attention logit soft-cap (Gemma 2): scores become c * tanh(scores / c) before
    # the softmax; None: none
    soft_cap: float | None = None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D].
    Returns [T, Hq, D]."""
    if meta.write_cache:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale)
    for seq in meta.prefills:
        sl = slice(seq.query_start, seq.query_start + seq.query_len)
        out[sl] = _prefill(q[sl], k[sl], v[sl], k_cache, v_cache, seq, scale, meta.window,
                           meta.soft_cap)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.decode_runs is not None:
        return native_decode_attention(q, k_cache, v_cache, meta.decode_runs, scale,
                                       meta.soft_cap)
    if meta.decode_context_lens is not None:
        return _decode_per_request(q, k_cache, v_cache, meta, scale)
    bsz = q.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    k = k_cache[meta.decode_block_tables]  # [B, max_blocks, block_size, Hkv, D]
    v = v_cache[meta.decode_block_tables]
    k = k.view(bsz, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    v = v.view(bsz, -1, num_kv_heads, head_dim).transpose(1, 2)
    qh = q.unsqueeze(2)  # [B, Hq, 1, D]
    o = attend(qh, k, v, scale, meta.soft_cap, mask=meta.decode_mask)
    return o.squeeze(2)  # [B, Hq, D]


def soft_cap_scores(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit soft-cap, c * tanh(scores / c), in place (scores already
    scaled); unchanged without one."""
    if soft_cap is None:
        return scores
    return scores.div_(soft_cap).tanh_().mul_(soft_cap)


SOFT_CAP_SCORE_BYTES = 64 << 20  # a soft-capped call's scores per tile of query rows, at most


def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, scale: float,
           soft_cap: float | None = None, mask: torch.Tensor | None = None,
           causal: bool = False) -> torch.Tensor:
    """SDPA (GQA), or with a logit soft-cap, which SDPA does not take, the same in explicit
    steps. qh: [B, Hq, L, D]; kh, vh: [B, Hkv, S, D]; mask: bool, broadcast to [B, Hq, L, S];
    causal: query i sees slots <= S - L + i (L == S wherever SDPA's is_causal is used).
    Returns [B, Hq, L, D]."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    bsz, num_q_heads, length, head_dim = qh.shape
    num_kv_heads, total = kh.shape[1], kh.shape[2]
    group = num_q_heads // num_kv_heads
    rows = max(1, SOFT_CAP_SCORE_BYTES // (4 * bsz * num_q_heads * total))
    keys = kh.float().transpose(2, 3)  # [B, Hkv, D, S]
    out = torch.empty_like(qh)
    for a in range(0, length, rows):
        b = min(length, a + rows)
        qg = qh[:, :, a:b].float().reshape(bsz, num_kv_heads, group * (b - a), head_dim)
        scores = torch.matmul(qg, keys).mul_(scale)  # [B, Hkv, g * t, S]
        scores = soft_cap_scores(scores, soft_cap).view(bsz, num_q_heads, b - a, total)
        seen = None
        if causal:  # query row r at slot S - L + r
            slots = torch.arange(a, b, device=qh.device)[:, None] + (total - length)  # [t, 1]
            seen = torch.arange(total, device=qh.device)[None, :] <= slots  # [t, S]
        if mask is not None:
            part = mask if mask.shape[-2] == 1 else mask[..., a:b, :]
            seen = part if seen is None else seen & part
        if seen is not None:
            scores.masked_fill_(~seen, float("-inf"))
        probs = scores.softmax(-1).to(vh.dtype)  # [B, Hq, t, S]
        o = torch.matmul(probs.view(bsz, num_kv_heads, group * (b - a), total), vh)
        out[:, :, a:b] = o.view(bsz, num_q_heads, b - a, head_dim)  # [B, Hkv, g*t, D] -> heads
    return out


def _decode_per_request(q, k_cache, v_cache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Each request over its own blocks, read in place (no gather copy): scores run by run of
    consecutive blocks (`q @ K^T` on the run's strided view), one softmax over the request's
    slots, then the sum of `P_run @ V_run`. On CPU the copy of a gather costs more than the
    attention itself."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * B, Hkv, D]
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)  # [B, Hq, D]
    for i, context in enumerate(meta.decode_context_lens):
        qg = q[i].view(num_kv_heads, group, head_dim)  # [Hkv, g, D]
        num_blocks = cdiv(context, block_size)
        blocks = (meta.decode_block_lists[i][:num_blocks] if meta.decode_block_lists is not None
                  else meta.decode_block_tables[i, :num_blocks].tolist())
        runs = slot_runs(blocks, context, block_size, window_start(context, meta.window))
        scores = [torch.matmul(qg, k_slots[s:s + n].permute(1, 2, 0))  # [Hkv, D, n] view
                  for s, n in runs]  # each [Hkv, g, n]
        probs = (scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1))
        probs = soft_cap_scores(probs.mul_(scale), meta.soft_cap).softmax(dim=-1)  # [Hkv, g, S]
        o, offset = None, 0
        for s, n in runs:
            part = torch.matmul(probs[..., offset:offset + n],
                                v_slots[s:s + n].transpose(0, 1))  # [Hkv, g, n] @ [Hkv, n, D]
            o = part if o is None else o.add_(part)
            offset += n
        out[i] = o.view(-1, head_dim)  # [Hkv, g, D] -> [Hq, D]
    return out


def _prefill(q, k, v, k_cache, v_cache, seq: PrefillSeq, scale: float,
             window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    past = seq.context_len - seq.query_len
    # the first query's window starts here: slots before it are seen by none of the chunk
    first = window_start(past + 1, window)
    if past == first:  # no past in view: attend over the chunk's own fresh K/V
        kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vh = v.transpose(0, 1).unsqueeze(0)
        if window is None or window >= seq.query_len:
            o = attend(qh, kh, vh, scale, soft_cap, causal=True)
        else:
            o = window_attention(qh, kh, vh, 0, window, scale, soft_cap=soft_cap)
    else:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        block_size = k_cache.shape[1]
        # the cached prefix in view; the chunk's own K/V are the fresh k, v (written to the same
        # slots)
        table = seq.block_table[first // block_size:]
        in_view = slice(first % block_size, first % block_size + past - first)
        kc = k_cache[table].view(-1, num_kv_heads, head_dim)[in_view]  # [P, Hkv, D]
        vc = v_cache[table].view(-1, num_kv_heads, head_dim)[in_view]
        if window is None:
            o = chunk_over_prefix(qh, kc, vc, k, v, scale, soft_cap)
        else:
            kh = torch.cat([kc, k]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, P + L, D]
            vh = torch.cat([vc, v]).transpose(0, 1).unsqueeze(0)
            o = window_attention(qh, kh, vh, past - first, window, scale, soft_cap=soft_cap)
    return o.squeeze(0).transpose(0, 1)  # [L, Hq, D]


WINDOW_TILE = 256  # with a sliding window, at least this many query rows per masked call


def window_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, num_past: int,
                     window: int, scale: float, tile: int = WINDOW_TILE,
                     soft_cap: float | None = None) -> torch.Tensor:
    """Queries over a sliding window: query i (slot P + i of kh's P + L) sees slots
    [P + i + 1 - window, P + i]. The queries go in tiles of max(window, tile), each over the
    slots its queries' windows cover (at most tile + window - 1), so the work is O(L (tile +
    window)), not O(L (P + L)) as one masked call over everything (`causal_mask`, the
    reference). qh: [1, Hq, L, D]; kh, vh: [1, Hkv, P + L, D]. Returns [1, Hq, L, D]."""
    length = qh.shape[2]
    step = max(window, tile)
    out = torch.empty_like(qh)
    for a in range(0, length, step):
        b = min(length, a + step)
        first = window_start(num_past + a + 1, window)  # the tile's first query's first slot
        mask = causal_mask(b - a, num_past + a - first, window, qh.device)  # [b - a, keys]
        out[:, :, a:b] = attend(qh[:, :, a:b], kh[:, :, first:num_past + b],
                                vh[:, :, first:num_past + b], scale, soft_cap, mask=mask)
    return out


def causal_mask(length: int, num_past: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """[L, P + L] bool: query i (slot P + i of the P + L in view) sees slots <= P + i, and with
    a window only the last `window` of those."""
    rows = torch.arange(length, device=device).unsqueeze(1) + num_past  # each query's slot
    cols = torch.arange(num_past + length, device=device).unsqueeze(0)
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunk_over_prefix(qh: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor,
                      k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
                      soft_cap: float | None = None) -> torch.Tensor:
    """A prefill chunk's attention over its cached prefix and itself, causal by position.

    qh: [1, Hq, L, D]; k_past, v_past: [P, Hkv, D] (P >= 1); k_new, v_new: [L, Hkv, D].
    Returns [1, Hq, L, D]. On CPU the two parts go through the flash kernel separately (the
    prefix without a mask, the chunk causal, which skips its upper triangle) and are merged by
    their log-sum-exp: o = o_past + (o_new - o_past) * sigmoid(lse_new - lse_past). One call with
    an explicit [L, P + L] mask (the reference, and the path elsewhere, and with a soft-cap)
    computes every block.
    """
    past = k_past.transpose(0, 1).unsqueeze(0)  # [1, Hkv, P, D]
    past_v = v_past.transpose(0, 1).unsqueeze(0)
    new = k_new.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    new_v = v_new.transpose(0, 1).unsqueeze(0)
    if soft_cap is None and _FLASH_CPU is not None and qh.device.type == "cpu" \
            and qh.dtype == k_past.dtype == k_new.dtype == torch.float32:
        o_past, lse_past = _FLASH_CPU(qh, past, past_v, 0.0, False, scale=scale)[:2]
        o_new, lse_new = _FLASH_CPU(qh, new, new_v, 0.0, True, scale=scale)[:2]
        w_new = torch.sigmoid(lse_new - lse_past).unsqueeze(-1)  # [1, Hq, L, 1]
        return o_past.add_(o_new.sub_(o_past).mul_(w_new))
    return chunk_over_prefix_masked(qh, past, past_v, new, new_v, scale, soft_cap)


def chunk_over_prefix_masked(qh, past, past_v, new, new_v, scale: float,
                             soft_cap: float | None = None) -> torch.Tensor:
    """`chunk_over_prefix`'s reference: one call over [prefix + chunk] with a causal mask.
    past / new: [1, Hkv, P or L, D]."""
    kh = torch.cat([past, new], dim=2)  # [1, Hkv, S, D] (the caller matches the dtypes)
    vh = torch.cat([past_v, new_v], dim=2)
    mask = causal_mask(qh.shape[2], past.shape[2], None, qh.device)  # [L, S]
    return attend(qh, kh, vh, scale, soft_cap, mask=mask)


def dense_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              scale: float, window: int | None = None,
                              soft_cap: float | None = None) -> torch.Tensor:
    """Obviously-correct causal attention for one sequence, in float64.

    q: [L, Hq, D] are the LAST L of the S tokens whose keys/values are k, v: [S, Hkv, D].
    `window`: each query sees only the newest `window` tokens (its own included); `soft_cap`:
    scores c * tanh(scores / c) before the softmax (Gemma 2).
    """
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_q_heads // num_kv_heads
    length, total = q.shape[0], k.shape[0]
    qd, kd, vd = q.double(), k.double(), v.double()
    kd = kd.repeat_interleave(group, dim=1)  # [S, Hq, D]
    vd = vd.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", qd, kd) * scale  # [Hq, L, S]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    past = total - length
    cols = torch.arange(total, device=q.device)
    position = torch.arange(length, device=q.device)[:, None] + past  # [L, 1] each query's
    allowed = cols[None, :] <= position  # [L, S]
    if window is not None:
        allowed &= cols[None, :] > position - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("hls,shd->lhd", probs, vd).to(q.dtype)  # [L, Hq, D]
