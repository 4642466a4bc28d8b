"""A prefill chunk's attention over a quantized store as decode would see it ("decode's view").

Decoding token n reads every earlier token from the store and its own K/V fresh. A prefill chunk
does the same for each of its tokens, so a sequence's outputs do not depend on how its prompt is
chunked or on how much of it a prefix-cache hit supplies. Token n (logical index: past + row)
sees
  - itself fresh (the step's k, v);
  - an earlier token j "final" (the store's codes, as read after the step's write) when the store
    quantizes per token, or when j's block was full once n was written (j // B < n // B, or n is
    the last slot of its block, n % B == B - 1);
  - otherwise (same block, still filling, in a store that stages blocks) "staged": what a read of
    the partial block returned then (`QuantizedKVStore.staged_rows`; for the past's partial
    block, a read made before the step's write).

With a sliding window of W tokens, token n sees only tokens j > n - W (itself included).

`decode_view_attention` runs on CPU as a few flash calls merged by their log-sum-exp (groups of
about GROUP_ROWS query rows: the part of the context every row of a group sees final, without a
mask, and a small masked window around the group); `decode_view_attention_masked` is the
reference path (SDPA calls with an explicit mask: one over the whole context, or with a sliding
window one per tile of rows over the slots their windows cover), taken elsewhere and with a
window. The oracle of both is `nanokv.quant.attention.reference_quantized_attention` (float64,
dense).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanokv.cache.layout import window_start
from nanokv.layers.attention import _FLASH_CPU, WINDOW_TILE

GROUP_ROWS = 128  # query rows per flash call (a multiple of the block size, at least one block)


def visible(rows: torch.Tensor, keys: torch.Tensor, block_size: int, stages: bool,
            window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which version of key j each query n sees: (final [R, K], staged [R, K]) bool, for query
    indexes rows [R] and key indexes keys [K] (logical positions; the diagonal is fresh); with a
    window, none of the keys j <= n - window."""
    n, j = rows[:, None], keys[None, :]
    earlier = j < n
    if window is not None:
        earlier &= j > n - window
    if not stages:
        return earlier, torch.zeros_like(earlier)
    full = (j // block_size < n // block_size) | (n % block_size == block_size - 1)
    return earlier & full, earlier & ~full


def decode_view_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                          k_fin: torch.Tensor, v_fin: torch.Tensor,
                          staged: tuple[torch.Tensor, torch.Tensor] | None, past: int,
                          block_size: int, scale: float, window: int | None = None
                          ) -> torch.Tensor:
    """q: [L, Hq, D]; k_new (after RoPE), v_new: [L, Hkv, D] the chunk's fresh rows; k_fin, v_fin:
    [past + L, Hkv, D] the sequence as read after the write (keys after RoPE); staged: None for
    a per-token store, else (k, v) [past + L - start, Hkv, D], rows start = past // B * B on, as
    staged (None for a side the store does not stage: its final rows). Returns [L, Hq, D].

    Parts merged by their log-sum-exp, each a flash call without a mask where it can be: every
    token's own fresh K/V (the diagonal, elementwise); a per-token store's earlier tokens as one
    prefix call and one causal call shifted by a row (row i sees final rows < i); a staging
    store's, the blocks before the chunk's first in one call (no mask), then per group of rows
    starting on a block edge the chunk's blocks before the group's (no mask) and the group's
    own slots: for a group of one block (block sizes from GROUP_ROWS on, the default sizes) its
    earlier slots staged (the chunk's causally, one row off) and, for the block's last slot,
    final, all without a mask; for a group of several blocks, a masked window. With a sliding
    `window` (token n sees tokens j > n - window), a part whose keys some of its rows' windows
    leave goes by tiles of max(window, WINDOW_TILE) rows, each over the keys from its first
    row's window start on, masked (`_window_parts`): O(L (tile + window)) work, not O(L^2)."""
    if not (_FLASH_CPU is not None and q.device.type == "cpu"
            and q.dtype == k_fin.dtype == k_new.dtype == torch.float32):
        return decode_view_attention_masked(q, k_new, v_new, k_fin, v_fin, staged, past,
                                            block_size, scale, window)
    (length, num_q, dim), num_kv = q.shape, k_new.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    # [1, Hkv, past + L, D], contiguous: the kernel reads strided keys far slower
    k_ctx = k_fin.transpose(0, 1).unsqueeze(0).contiguous()
    v_ctx = v_fin.transpose(0, 1).unsqueeze(0).contiguous()
    # the diagonal: o = v_n, lse = q_n . k_n * scale (query heads in their KV head's group)
    q_grouped = q.reshape(length, num_kv, num_q // num_kv, dim)  # [L, Hkv, G, D]
    lse = torch.einsum("lhgd,lhd->lhg", q_grouped, k_new).reshape(length, num_q)
    lse = lse.mul_(scale).t().unsqueeze(0).contiguous()  # [1, Hq, L]
    out = v_new.unsqueeze(2).expand(length, num_kv, num_q // num_kv, dim)  # [L, Hkv, G, D]
    out = out.reshape(length, num_q, dim).transpose(0, 1).unsqueeze(0).clone(
        memory_format=torch.contiguous_format)  # [1, Hq, L, D], merged in place: never v's
    start = past // block_size * block_size
    if staged is not None:  # [1, Hkv, past + L - start, D]; a side not staged: final (a view)
        k_stg, v_stg = (ctx[:, :, start:] if x is None else x.transpose(0, 1).unsqueeze(0)
                        .contiguous() for x, ctx in zip(staged, (k_ctx, v_ctx)))

    def fold(lo: int, hi: int, keys: slice, stg: bool = False, causal: bool = False) -> None:
        """Rows [lo, hi) (logical) attend to keys (logical slice) of the final or, with stg, the
        staged sequence; causal: row lo + i sees keys.start .. keys.start + i; each row only
        the keys inside its window."""
        kx, vx, off = (k_stg, v_stg, start) if stg else (k_ctx, v_ctx, 0)
        if window is not None and keys.start < hi - window:  # the last rows' windows cut keys
            for a, b, ks, seen in _window_parts(lo, hi, keys, causal, window, q.device):
                rows = slice(a - past, b - past)
                o, o_lse = _FLASH_CPU(qh[:, :, rows], kx[:, :, ks.start - off:ks.stop - off],
                                      vx[:, :, ks.start - off:ks.stop - off], 0.0, False,
                                      attn_mask=_additive(seen, q.dtype), scale=scale)[:2]
                none = ~seen.any(1)  # [R] rows that see none of these keys: no share
                _merge(out[:, :, rows], lse[:, :, rows], o.masked_fill(none[:, None], 0.0),
                       o_lse.masked_fill(none, float("-inf")))
            return
        rows = slice(lo - past, hi - past)
        at = slice(keys.start - off, keys.stop - off)
        _merge(out[:, :, rows], lse[:, :, rows],
               *_FLASH_CPU(qh[:, :, rows], kx[:, :, at], vx[:, :, at], 0.0, causal,
                           scale=scale)[:2])

    if staged is None:
        if past:
            fold(past, past + length, slice(0, past))
        if length > 1:  # rows 1.. see the chunk's final rows before them: causal, one row off
            fold(past + 1, past + length, slice(past, past + length - 1), causal=True)
        return out.squeeze(0).transpose(0, 1)  # [L, Hq, D]
    if start:  # the blocks before the chunk's first: final for every row, one call
        fold(past, past + length, slice(0, start))
    group = max(1, GROUP_ROWS // block_size) * block_size
    a = past
    while a < past + length:
        b = min(past + length, (a // group + 1) * group)  # rows [a, b): logical indexes
        w = a // block_size * block_size  # keys before w: final for every row of the group
        if w > start:  # the chunk's blocks before the group's
            fold(a, b, slice(start, w))
        if group == block_size:  # one block: no mask
            last = w + block_size - 1  # the block's last slot: sees the block final
            end = min(b, last)  # rows [a, end) see the block's earlier slots staged
            if a > w and end > a:  # the past's slots of the block
                fold(a, end, slice(w, a), stg=True)
            if end - a > 1:  # the chunk's, one row off
                fold(a + 1, end, slice(a, end - 1), stg=True, causal=True)
            if last < b:
                fold(last, last + 1, slice(w, last))
        elif b - 1 > w:  # the window [w, b - 1) of several blocks: final or staged, masked
            rows = slice(a - past, b - past)  # (the last key is no row's earlier token)
            final, stg = visible(torch.arange(a, b, device=q.device),
                                 torch.arange(w, b - 1, device=q.device), block_size, True,
                                 window)
            seen = torch.cat([final, stg], dim=1)  # [R, 2 (b - 1 - w)]
            if bool(seen.any()):
                mask = _additive(seen, q.dtype)
                kw = torch.cat([k_ctx[:, :, w:b - 1], k_stg[:, :, w - start:b - 1 - start]], 2)
                vw = torch.cat([v_ctx[:, :, w:b - 1], v_stg[:, :, w - start:b - 1 - start]], 2)
                o_win, lse_win = _FLASH_CPU(qh[:, :, rows], kw, vw, 0.0, False, attn_mask=mask,
                                            scale=scale)[:2]
                # a row that sees nothing in the window (its block's first) has lse 0 there
                lse_win = lse_win.masked_fill(~seen.any(1), float("-inf"))
                _merge(out[:, :, rows], lse[:, :, rows], o_win, lse_win)
        a = b
    return out.squeeze(0).transpose(0, 1)  # [L, Hq, D]


def _window_parts(lo: int, hi: int, keys: slice, causal: bool, window: int,
                  device: torch.device):
    """A part of the flash path (rows [lo, hi) over keys, causal: row lo + i sees keys.start ..
    keys.start + i) cut by a sliding window (row n sees keys j > n - window): yields per tile of
    max(window, WINDOW_TILE) rows (a, b, the keys any of them sees, seen [b - a, len(keys)]
    bool)."""
    step = max(window, WINDOW_TILE)
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        stop = min(keys.stop, keys.start + b - lo) if causal else keys.stop
        first = max(keys.start, a + 1 - window)  # row a's window start: no row sees before
        if first >= stop:
            continue
        n = torch.arange(a, b, device=device)[:, None]  # [R, 1] logical row
        j = torch.arange(first, stop, device=device)[None, :]  # [1, K] logical key
        seen = j > n - window
        if causal:
            seen &= j - keys.start <= n - lo
        yield a, b, slice(first, stop), seen


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive one the flash kernel takes: 0 where seen, -inf elsewhere."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
        ~seen, float("-inf"))


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor) -> None:
    """Fold a part (o [1, H, R, D], o_lse [1, H, R]) into out, lse in place: softmax over the
    union of their keys."""
    w = torch.sigmoid(o_lse - lse).unsqueeze(-1)  # the part's share; -inf lse: 0
    out.add_((o - out).mul_(w))
    lse.copy_(torch.logaddexp(lse, o_lse))


def decode_view_attention_masked(q, k_new, v_new, k_fin, v_fin, staged, past: int,
                                 block_size: int, scale: float, window: int | None = None,
                                 tile: int = WINDOW_TILE) -> torch.Tensor:
    """`decode_view_attention` with explicit masks (the reference path; the path off CPU
    float32 and with a sliding window): one SDPA call over [final; staged; fresh] keys, or with
    a `window` one per tile of max(window, tile) rows over the keys their windows cover, so the
    work is O(L (tile + window)), not O(L (past + L))."""
    length = q.shape[0]
    rows = length if window is None else max(window, tile)
    if rows >= length:
        return _masked_rows(q, k_new, v_new, k_fin, v_fin, staged, past, block_size, scale,
                            window, 0, length)
    return torch.cat([_masked_rows(q, k_new, v_new, k_fin, v_fin, staged, past, block_size,
                                   scale, window, a, min(a + rows, length))
                      for a in range(0, length, rows)])  # [L, Hq, D]


def _masked_rows(q, k_new, v_new, k_fin, v_fin, staged, past: int, block_size: int,
                 scale: float, window: int | None, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of the chunk (logical indexes past + a ..) in one SDPA call over the keys
    from the first row's window start on: [final; staged; fresh], masked. Returns [b - a, Hq,
    D]."""
    lo, hi = window_start(past + a + 1, window), past + b  # the keys any of the rows sees
    final, stg = visible(torch.arange(past + a, hi, device=q.device),
                         torch.arange(lo, hi, device=q.device), block_size, staged is not None,
                         window)  # [R, hi - lo] each
    keys, values, seen = [k_fin[lo:hi]], [v_fin[lo:hi]], [final]
    if staged is not None:
        start = past // block_size * block_size  # staged rows from here on
        s0 = max(lo, start)
        keys.append(k_fin[s0:hi] if staged[0] is None else staged[0][s0 - start:hi - start])
        values.append(v_fin[s0:hi] if staged[1] is None else staged[1][s0 - start:hi - start])
        seen.append(stg[:, s0 - lo:])
    keys.append(k_new[a:b].to(k_fin.dtype))
    values.append(v_new[a:b].to(v_fin.dtype))
    seen.append(torch.eye(b - a, dtype=torch.bool, device=q.device))
    kh = torch.cat(keys).transpose(0, 1).unsqueeze(0)  # [1, Hkv, K, D]
    vh = torch.cat(values).transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).unsqueeze(0), kh, vh,
                                       attn_mask=torch.cat(seen, dim=1), scale=scale,
                                       enable_gqa=True)  # [1, Hq, R, D]
    return o.squeeze(0).transpose(0, 1)
