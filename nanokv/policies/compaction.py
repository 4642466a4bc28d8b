"""Pure tensor operations on one layer's paged cache, for applying a policy's selection.

Layout (README): a layer's cache is `[num_blocks, B, Hkv, D]`; a request's logical slot j lives at
block `block_table[j // B]`, offset `j % B`. Nothing here touches the block manager: after
`compact_blocks` the engine frees the table's blocks past the returned count itself.
"""

from __future__ import annotations

import torch

from nanokv.layers.attention import soft_cap_scores
from nanokv.utils import cdiv


def flat_slots(block_table, num_slots: int, block_size: int, device=None) -> torch.Tensor:
    """[num_slots] int64: the flat pool slot (block * B + offset) of each logical slot."""
    table = torch.as_tensor(block_table, dtype=torch.long, device=device)
    if num_slots > table.numel() * block_size:
        raise ValueError(f"{num_slots} slots do not fit in a table of {table.numel()} blocks "
                         f"of {block_size}")
    j = torch.arange(num_slots, device=device)
    return table[j // block_size] * block_size + j % block_size


def gather_request_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table,
                      num_slots: int, copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's cached keys and values, dense: two `[num_slots, Hkv, D]` copies.
    copy=False: views of the caches where the table is 0, 1, 2 ... (as a quantized cache's
    policy view, itself a dense copy, is), for a caller that only reads them before the caches
    change; copies otherwise."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    nb = cdiv(num_slots, block_size)
    if not copy and isinstance(block_table, list) and block_table[:nb] == list(range(nb)) \
            and nb <= k_cache.shape[0]:
        return (k_cache[:nb].reshape(-1, num_kv_heads, head_dim)[:num_slots],  # [n, Hkv, D]
                v_cache[:nb].reshape(-1, num_kv_heads, head_dim)[:num_slots])
    flat = flat_slots(block_table, num_slots, block_size, k_cache.device)
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[flat]  # [n, Hkv, D]
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[flat]  # [n, Hkv, D]
    return keys, values


def whole_block_sources(kept, block_size: int, first: int, last: int) -> dict[int, int]:
    """The new full blocks first .. last-1 that a plan fills with one old block's slots whole,
    in order, in every layer and KV head: {new block index: old block index}. Such a block can
    be copied instead of re-written. kept: per layer `[C]` or `[Hkv, C]` (C >= last * B)."""
    if last <= first:
        return {}
    bs = block_size
    source = whole = None
    for k in kept:
        rows = (k.unsqueeze(0) if k.dim() == 1 else k)[:, first * bs:last * bs]  # [h, m * B]
        blocks = rows.reshape(rows.shape[0], last - first, bs)  # [h, m, B]
        src = blocks[..., 0] // bs  # [h, m]
        steps = src[..., None] * bs + torch.arange(bs, device=k.device)  # [h, m, B]
        ok = (blocks == steps).all(-1).all(0) & (src == src[:1]).all(0)  # [m]
        if source is None:
            source, whole = src[0], ok
        else:
            whole = whole & ok & (src[0] == source)
    return {first + i: int(source[i]) for i in torch.nonzero(whole).flatten().tolist()}


def compact_slots(cache: torch.Tensor, block_table, num_slots: int,
                  kept: torch.Tensor) -> int:
    """Move the kept slots of one per-slot tensor to the front of the request's blocks.

    cache: `[num_blocks, B, ...]` (a layer's k_cache / v_cache `[.., Hkv, D]`, or the pool's
    `slot_positions [num_blocks, B]`); kept: `[C]` shared or `[Hkv, C]` per KV head (then `cache`
    must be `[num_blocks, B, Hkv, ...]`), ascending slot indices < num_slots. Slots C .. num_slots-1
    keep stale data. Returns ceil(C / B), the number of leading blocks still in use.
    Source and destination overlap; the kept rows are gathered into a copy before writing.
    """
    block_size = cache.shape[1]
    if kept.dim() not in (1, 2):
        raise ValueError(f"kept must be [C] or [Hkv, C], got {tuple(kept.shape)}")
    c = kept.shape[-1]
    if c and (int(kept.min()) < 0 or int(kept.max()) >= num_slots):
        raise ValueError(f"kept slots must lie in [0, {num_slots})")
    flat = flat_slots(block_table, num_slots, block_size, cache.device)  # [n]
    rows = cache.view(-1, *cache.shape[2:])  # [num_blocks * B, ...]
    if kept.dim() == 1:
        moved = rows[flat[kept]]  # [C, ...]  (a copy: advanced indexing)
    else:
        num_heads = kept.shape[0]
        if cache.dim() < 3 or cache.shape[2] != num_heads:
            raise ValueError(f"per-head kept {tuple(kept.shape)} needs a cache [.., B, "
                             f"{num_heads}, ...], got {tuple(cache.shape)}")
        heads = torch.arange(num_heads, device=cache.device)[:, None]  # [Hkv, 1]
        moved = rows[flat[kept], heads]  # [Hkv, C, ...]
        moved = moved.transpose(0, 1)  # [C, Hkv, ...]
    rows.index_copy_(0, flat[:c], moved)
    return cdiv(c, block_size)


def compact_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table, num_slots: int,
                   kept: torch.Tensor) -> int:
    """Write the kept slots of one layer densely into the first ceil(C / B) blocks of the table.

    k_cache, v_cache: `[num_blocks, B, Hkv, D]`; kept: `[C]` or `[Hkv, C]` ascending. Returns the
    number of leading blocks still in use; the engine frees the rest of the table.
    """
    used = compact_slots(k_cache, block_table, num_slots, kept)
    compact_slots(v_cache, block_table, num_slots, kept)
    return used


def window_attention(q_window: torch.Tensor, keys: torch.Tensor, scale: float,
                     soft_cap: float | None = None) -> torch.Tensor:
    """Causal softmax probabilities of the last W queries over a request's n cached keys (the
    scores soft-capped, c * tanh(scores / c), with a `soft_cap`).

    q_window: `[W, Hq, D]` the queries (after RoPE) of slots n-W .. n-1; keys: `[n, Hkv, D]`
    (after RoPE). Query w sees slots <= n - W + w. GQA: query head h reads KV head h // (Hq/Hkv).
    Returns `[Hq, W, n]` float32, each row summing to 1.
    """
    w, num_q_heads, _ = q_window.shape
    n, num_kv_heads, _ = keys.shape
    if w > n or num_q_heads % num_kv_heads:
        raise ValueError(f"window of {w} queries x {num_q_heads} heads over {n} keys x "
                         f"{num_kv_heads} heads: need W <= n and Hq a multiple of Hkv")
    group = num_q_heads // num_kv_heads
    q = q_window.float().transpose(0, 1)  # [Hq, W, D]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    logits = torch.matmul(q, k.transpose(1, 2)).mul_(scale)  # [Hq, W, n]
    logits = soft_cap_scores(logits, soft_cap)
    visible = (torch.arange(n, device=keys.device)[None, :]
               <= torch.arange(n - w, n, device=keys.device)[:, None])  # [W, n]
    return logits.masked_fill(~visible, float("-inf")).softmax(-1)  # [Hq, W, n]
