"""Paged attention over a quantized KV store, and its dequantize-then-dense reference.

Same batch layout as `nanokv.layers.attention.paged_attention` (decodes first, then prefill
chunks). The tokens of the current step attend with their own fresh, full-precision K/V (KVQuant:
prefill attends in full precision; what is stored is compressed); every earlier token comes
from the store, dequantized, its key rotated to the position recorded for its slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanokv.layers.attention import (
    AttentionMetadata,
    PrefillSeq,
    chunk_over_prefix,
    dense_reference_attention,
)
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.quant.store import QuantizedKVStore, Rope, WritePlan


def rope_from_rotary(rotary: RotaryEmbedding) -> Rope:
    """The model's RoPE as a store `Rope`: (positions [n], x [n, Hkv, D]) -> rotated x."""
    return rotary.rotate


def quantized_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              k_store: torch.Tensor, store: QuantizedKVStore, layer: int,
                              meta: AttentionMetadata, plan: WritePlan | None, scale: float,
                              rope: Rope | None, read_past=None) -> torch.Tensor:
    """q: [T, Hq, D] and k: [T, Hkv, D] after RoPE; v: [T, Hkv, D]; k_store: the keys the store
    keeps (before RoPE when `store.pre_rope_keys`, else the same as k). read_past(layer,
    block_table, num_slots) -> (keys after RoPE, values) [num_slots, Hkv, D] decodes a prefill
    chunk's cached prefix in place of `store.read_blocks` (a native kernel). Returns [T, Hq, D]."""
    if meta.write_cache:
        store.write(layer, plan, k_store, v)
    rope = rope if store.pre_rope_keys else None
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode(q[:nd], k[:nd], v[:nd], store, layer, meta, scale, rope)
    for seq in meta.prefills:
        sl = slice(seq.query_start, seq.query_start + seq.query_len)
        out[sl] = _prefill(q[sl], k[sl], v[sl], store, layer, seq, scale, rope, read_past)
    return out


def _decode(q, k, v, store, layer, meta: AttentionMetadata, scale, rope) -> torch.Tensor:
    tables = meta.decode_block_tables  # [B, max_blocks]
    bsz, heads, dim = q.shape[0], k.shape[1], k.shape[2]
    kc, vc = store.read_blocks(layer, tables.flatten(), rope)  # [B * max_blocks, bs, Hkv, D]
    kc = kc.reshape(bsz, -1, heads, dim)  # [B, S, Hkv, D]
    vc = vc.reshape(bsz, -1, heads, dim)
    last = meta.decode_mask.reshape(bsz, -1).sum(-1) - 1  # [B] slot of the new token
    rows = torch.arange(bsz, device=q.device)
    kc[rows, last] = k.to(kc.dtype)  # the step's own token: fresh
    vc[rows, last] = v.to(vc.dtype)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),
                                       attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)  # [B, Hq, D]


def _prefill(q, k, v, store, layer, seq: PrefillSeq, scale, rope, read_past=None
             ) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    past = seq.context_len - seq.query_len
    if past == 0:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                           enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
    heads, dim = k.shape[1], k.shape[2]
    if read_past is None:
        kc, vc = store.read_blocks(layer, seq.block_table, rope)  # [nb, bs, Hkv, D]
        kc, vc = kc.reshape(-1, heads, dim)[:past], vc.reshape(-1, heads, dim)[:past]
    else:
        kc, vc = read_past(layer, seq.block_table, past)  # [past, Hkv, D]
    o = chunk_over_prefix(qh, kc, vc, k.to(kc.dtype), v.to(vc.dtype), scale)
    return o.squeeze(0).transpose(0, 1)  # [L, Hq, D]


def reference_quantized_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                  store: QuantizedKVStore, layer: int, block_table,
                                  num_past: int, scale: float,
                                  rope: Rope | None = None) -> torch.Tensor:
    """The oracle: dequantize the past (`store.read`), append the fresh K/V, attend densely in
    float64. q: [L, Hq, D]; k_new (after RoPE), v_new: [L, Hkv, D]."""
    k_past, v_past = store.read(layer, block_table, num_past,
                                rope if store.pre_rope_keys else None)
    k = torch.cat([k_past.to(k_new.dtype), k_new])
    v = torch.cat([v_past.to(v_new.dtype), v_new])
    return dense_reference_attention(q, k, v, scale)
