"""Paged attention over a quantized KV store, and its dequantize-then-dense reference.

Same batch layout as `nanokv.layers.attention.paged_attention` (decodes first, then prefill
chunks). Every token attends as it would decoding alone: to itself with its fresh,
full-precision K/V, and to every earlier token as the store held it when this token was
written, dequantized, its key rotated to the position recorded for its slot
(`nanokv.quant.decode_view`). So a sequence's outputs do not depend on how its prompt is
chunked or how much of it a prefix-cache hit supplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanokv.cache.layout import window_start
from nanokv.layers.attention import AttentionMetadata, PrefillSeq
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.quant.decode_view import decode_view_attention
from nanokv.quant.staging import read_filling
from nanokv.quant.store import QuantizedKVStore, Rope, WritePlan
from nanokv.utils import cdiv


def rope_from_rotary(rotary: RotaryEmbedding) -> Rope:
    """The model's RoPE as a store `Rope`: (positions [n], x [n, Hkv, D]) -> rotated x."""
    return rotary.rotate


def quantized_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              k_store: torch.Tensor | None, store: QuantizedKVStore, layer: int,
                              meta: AttentionMetadata, plan: WritePlan | None, scale: float,
                              rope: Rope | None, read_past=None, staged_pasts=None
                              ) -> torch.Tensor:
    """q: [T, Hq, D] and k: [T, Hkv, D] after RoPE; v: [T, Hkv, D]; k_store: the keys the store
    keeps (before RoPE when `store.pre_rope_keys`, else the same as k; None: k). plan: the step's
    write plan (it writes here when `meta.write_cache`; its positions round staged keys).
    read_past(layer, block_table, num_slots) -> (keys after RoPE, values) [num_slots, Hkv, D]
    reads a chunk's sequence in place of `store.read_blocks` (a native kernel). staged_pasts:
    `read_staged_pasts` made before the write (when the caller wrote). `meta.window`: each
    token sees only the newest `window` tokens, its own included (the decode mask is built
    for it). Returns [T, Hq, D]."""
    k_store = k if k_store is None else k_store
    if meta.write_cache:
        staged_pasts = read_staged_pasts(store, layer, meta.prefills, plan, rope)
        store.write(layer, plan, k_store, v)
    rope = rope if store.pre_rope_keys else None
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode(q[:nd], k[:nd], v[:nd], store, layer, meta, scale, rope)
    for i, seq in enumerate(meta.prefills):
        sl = slice(seq.query_start, seq.query_start + seq.query_len)
        positions = plan.positions[sl] if plan is not None else None
        out[sl] = _prefill(q[sl], k[sl], v[sl], k_store[sl], positions, store, layer, seq, scale,
                           rope, read_past, staged_pasts[i] if staged_pasts else None,
                           meta.window)
    return out


def read_staged_pasts(store: QuantizedKVStore, layer: int, prefills: list[PrefillSeq],
                      plan: WritePlan, rope: Rope | None
                      ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Before a layer's write (after the step's `plan_write`): for each prefill chunk that fills
    its past's partial block in a store that stages blocks, that block's staged rows (k after
    RoPE, v) [past % B, Hkv, D], which the write quantizes away (`staging.read_filling`); None
    for the others (their staged rows stay readable)."""
    bs = store.block_size
    out = []
    for seq in prefills:
        past = seq.context_len - seq.query_len
        start = past // bs * bs
        if not store.stages_blocks or not start < past < start + bs - 1 < seq.context_len:
            out.append(None)  # no query sees such a block staged once the write filled it
            continue
        block = int(seq.block_table[start // bs])
        out.append(read_filling(store, layer, plan, block, past - start,
                                rope if store.pre_rope_keys else None))
    return out


def _decode(q, k, v, store, layer, meta: AttentionMetadata, scale, rope) -> torch.Tensor:
    tables = meta.decode_block_tables  # [B, max_blocks]
    bsz, heads, dim = q.shape[0], k.shape[1], k.shape[2]
    kc, vc = store.read_blocks(layer, tables.flatten(), rope)  # [B * max_blocks, bs, Hkv, D]
    kc = kc.reshape(bsz, -1, heads, dim)  # [B, S, Hkv, D]
    vc = vc.reshape(bsz, -1, heads, dim)
    mask = meta.decode_mask.reshape(bsz, -1)  # [B, S]: a window's last slots, or all of them
    span = torch.arange(mask.shape[1], device=q.device)
    last = torch.where(mask, span, 0).amax(-1)  # [B] slot of the new token: the last one seen
    rows = torch.arange(bsz, device=q.device)
    kc[rows, last] = k.to(kc.dtype)  # the step's own token: fresh
    vc[rows, last] = v.to(vc.dtype)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),
                                       attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)  # [B, Hq, D]


def _prefill(q, k, v, k_store, positions, store, layer, seq: PrefillSeq, scale, rope,
             read_past=None, staged_past=None, window: int | None = None) -> torch.Tensor:
    """One chunk in decode's view (`nanokv.quant.decode_view`): its sequence read after the
    write (final), and the staged rows of its blocks that were filling; with a `window`, each
    token over its newest `window` tokens."""
    bs = store.block_size
    past = seq.context_len - seq.query_len
    # the blocks before the one holding the first token's window start: seen by no token of the
    # chunk, not read; indexes below are from the first block read (whole blocks: the staging
    # arithmetic holds)
    skip = window_start(past + 1, window) // bs
    table, total, past = seq.block_table[skip:], seq.context_len - skip * bs, past - skip * bs
    heads, dim = k.shape[1], k.shape[2]
    if read_past is None:
        kc, vc = store.read_blocks(layer, table[:cdiv(total, bs)], rope)
        kc, vc = kc.reshape(-1, heads, dim)[:total], vc.reshape(-1, heads, dim)[:total]
    else:
        kc, vc = read_past(layer, table, total)  # [total, Hkv, D]
    kc, vc = kc.to(q.dtype), vc.to(q.dtype)
    staged = None
    if store.stages_blocks:
        ks, vs = store.staged_rows(k, v, k_store, positions)
        start = past // bs * bs
        k_old, v_old = staged_past if staged_past is not None \
            else (kc[start:past], vc[start:past])  # the past's partial block, if any
        staged = tuple(None if x is None else torch.cat([old.to(q.dtype), x.to(q.dtype)])
                       for old, x in ((k_old, ks), (v_old, vs)))  # None: read final
    return decode_view_attention(q, k.to(q.dtype), v.to(q.dtype), kc, vc, staged, past, bs,
                                 scale, window)


def reference_quantized_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                  store: QuantizedKVStore, layer: int, block_table,
                                  num_past: int, scale: float, rope: Rope | None = None,
                                  k_store: torch.Tensor | None = None,
                                  positions: torch.Tensor | None = None,
                                  staged_past: tuple[torch.Tensor, torch.Tensor] | None = None,
                                  window: int | None = None) -> torch.Tensor:
    """The oracle, dense in float64: each of a step's L tokens of one sequence attends as it
    would decoding alone (decode's view), so a sequence's outputs do not depend on how its
    prompt is chunked or how much of it a prefix-cache hit supplies. Token n sees
      - itself fresh (k_new, v_new);
      - an earlier token j as the store held it once n was written: its codes when the store
        quantizes per token, or when j's block was full by then (an earlier block, or n the
        last slot of its own); else (j in n's block, still filling) as staged (`staged_rows`).
    Call after the step's write. q: [L, Hq, D]; k_new (after RoPE), v_new: [L, Hkv, D];
    k_store, positions: the keys as written and their positions (only where the store's staging
    dtype rounds staged keys); staged_past: (k, v) [num_past % B, Hkv, D] of the past's partial
    block read before the step's write, needed when the store stages blocks and the step fills
    that block. window: token n sees only tokens j > n - window (its newest `window`, itself
    included)."""
    length, bs = q.shape[0], store.block_size
    earliest = num_past + length - 1  # tokens that are earlier than some query: [0, earliest)
    k_fin, v_fin = store.read(layer, block_table, earliest,
                              rope if store.pre_rope_keys else None)  # [earliest, Hkv, D]
    k_fin, v_fin = k_fin.to(k_new.dtype), v_fin.to(v_new.dtype)
    k_stg, v_stg = k_fin.clone(), v_fin.clone()  # as staged (rows a block's codes never held)
    n = num_past + torch.arange(length, device=q.device)[:, None]  # [L, 1] query index
    j = torch.arange(earliest, device=q.device)[None, :]  # [1, earliest]
    earlier = j < n
    if window is not None:
        earlier &= j > n - window
    if store.stages_blocks:
        ks, vs = store.staged_rows(k_new, v_new, k_new if k_store is None else k_store,
                                   positions) if length > 1 else (None, None)
        if ks is not None:
            k_stg[num_past:] = ks[:length - 1]
        if vs is not None:
            v_stg[num_past:] = vs[:length - 1]
        start = num_past // bs * bs  # the past's partial block, if any
        if start < num_past < start + bs - 1 <= earliest:  # a query sees it staged, but the
            if staged_past is None:  # step's write filled it
                raise ValueError("staged_past is needed: the step fills a staged partial block")
            k_stg[start:num_past], v_stg[start:num_past] = staged_past
        full = (j // bs < n // bs) | (n % bs == bs - 1)  # j's block full once n is written
        final, staged = earlier & full, earlier & ~full
    else:
        final, staged = earlier, torch.zeros_like(earlier)
    num_q, num_kv = q.shape[1], k_new.shape[1]
    qd = q.double()

    def scores(k):  # [S, Hkv, D] -> [Hq, L, S]
        kd = k.double().repeat_interleave(num_q // num_kv, dim=1)
        return torch.einsum("lhd,shd->hls", qd, kd) * scale

    fresh = (scores(k_new).diagonal(dim1=1, dim2=2)).unsqueeze(-1)  # [Hq, L, 1]
    logits = torch.cat([scores(k_fin).masked_fill(~final, float("-inf")),
                        scores(k_stg).masked_fill(~staged, float("-inf")), fresh], dim=-1)
    probs = logits.softmax(-1)  # [Hq, L, 2 * earliest + 1]
    values = [x.double().repeat_interleave(num_q // num_kv, dim=1) for x in (v_fin, v_stg)]
    out = torch.einsum("hls,shd->lhd", probs[..., :earliest], values[0]) \
        + torch.einsum("hls,shd->lhd", probs[..., earliest:-1], values[1])
    v_own = v_new.double().repeat_interleave(num_q // num_kv, dim=1)  # [L, Hq, D]
    out = out + probs[..., -1].transpose(0, 1).unsqueeze(-1) * v_own
    return out.to(q.dtype)  # [L, Hq, D]
