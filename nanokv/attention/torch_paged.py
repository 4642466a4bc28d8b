"""PyTorch paged attention over the float KV pool: the reference path, on CPU and CUDA.

Decodes on CPU attend request by request over their own blocks in place (the copy of a gather
costs more there than the attention itself); on CUDA as one padded, masked batch. Prefill chunks
attend with SDPA over their request's blocks. Steps with per-layer block tables address each
layer in flat layer-slice ids (`KVPool.flat_layers`). Layers with a sliding window
(`KVLayout.sliding_windows`) get the step's metadata built for their window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from nanokv.attention.backend import AttentionBackend
from nanokv.attention.common import CommonAttentionMetadata
from nanokv.cache.kv_pool import KVPool, write_slots
from nanokv.layers.attention import AttentionMetadata, PrefillSeq, paged_attention


@dataclass
class PoolStep:
    """The step's kernel metadata: one per sliding window the layers have (None: the whole
    context), or one per layer (per-layer tables)."""

    by_window: dict[int | None, AttentionMetadata] | None
    per_layer: list[AttentionMetadata] | None
    write_plan: object


class TorchPagedBackend(AttentionBackend):
    name = "torch"
    description = "PyTorch paged attention over the float pool"
    supports_soft_cap = True

    def __init__(self, kv_cache: KVPool, device: torch.device,
                 soft_cap: float | None = None) -> None:
        super().__init__(kv_cache, device, soft_cap)
        self.block_size = kv_cache.layout.block_size
        self.per_request_decode = device.type == "cpu"

    @classmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        if not isinstance(kv_cache, KVPool):
            return f"it reads the float KV pool only (the cache is {kv_cache.kv_cache_dtype})", True
        return None

    # ---- metadata ------------------------------------------------------------------------------
    def build(self, common: CommonAttentionMetadata) -> PoolStep:
        if common.per_layer is not None:  # each layer writes its own slices: its own slots
            layout = self.kv_cache.layout
            return PoolStep(None, [self._kernel_metadata(c, layout.window(layer))
                                   for layer, c in enumerate(common.per_layer)],
                            common.write_plan)
        # the pool's write plan is the step's slot mapping as a tensor: not made twice
        base = kernel_metadata(common, self.device, common.write_plan, self.soft_cap)
        by_window = by_layer_window(base, self.kv_cache.layout.sliding_windows)
        if common.num_decodes:  # the prefill chunks shared; each window its own decode addressing
            for meta in by_window.values():
                self._decode_metadata(meta, common)
        return PoolStep(by_window, None, common.write_plan)

    def _kernel_metadata(self, c: CommonAttentionMetadata, window: int | None
                         ) -> AttentionMetadata:
        meta = replace(kernel_metadata(c, self.device, soft_cap=self.soft_cap), window=window)
        if c.num_decodes:
            self._decode_metadata(meta, c)
        return meta

    def _decode_metadata(self, meta: AttentionMetadata, c: CommonAttentionMetadata) -> None:
        if self.per_request_decode:
            meta.decode_context_lens = c.decode_context_lens
            meta.decode_block_lists = c.decode_block_tables
        else:
            meta.decode_block_tables, meta.decode_mask = padded_decode_tables(
                c.decode_block_tables, c.decode_context_lens, self.block_size, self.device,
                meta.window)

    # ---- one layer -----------------------------------------------------------------------------
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_pre: torch.Tensor, step: PoolStep, scale: float) -> torch.Tensor:
        if step.per_layer is not None:
            meta = step.per_layer[layer]
            k_cache, v_cache = self.kv_cache.flat_layers()
            write_slots(k_cache, v_cache, meta.slot_mapping, k, v)
        else:
            meta = step.by_window[self.kv_cache.layout.window(layer)]
            self.kv_cache.write_layer(layer, step.write_plan, k, v, k_pre)
            k_cache, v_cache = self.kv_cache.layer(layer)
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)


def by_layer_window(meta: AttentionMetadata, windows: tuple[int | None, ...]
                    ) -> dict[int | None, AttentionMetadata]:
    """A step's metadata for each sliding window the layers have (`KVLayout.sliding_windows`;
    None: the whole context): copies of `meta` sharing its tensors, each with its window."""
    return {window: replace(meta, window=window) for window in set(windows) or {None}}


def kernel_metadata(c: CommonAttentionMetadata, device: torch.device,
                    slot_mapping: torch.Tensor | None = None,
                    soft_cap: float | None = None) -> AttentionMetadata:
    """The PyTorch kernels' metadata of a step's prefill chunks (decodes: the backend's choice),
    the step's K/V written by the caller. slot_mapping: the step's slots as a tensor when the
    caller has one (a write plan's), else made here; soft_cap: the model's attention logit
    soft-cap (None: none)."""
    if slot_mapping is None:
        slot_mapping = torch.tensor(c.slot_mapping, dtype=torch.long, device=device)
    prefills = [PrefillSeq(p.query_start, p.query_len, p.context_len,
                           torch.tensor(p.block_table, dtype=torch.long, device=device))
                for p in c.prefills]
    return AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=c.num_decode_tokens,
                             decode_block_tables=None, decode_mask=None, prefills=prefills,
                             write_cache=False, soft_cap=soft_cap)


def padded_decode_tables(tables: list[list[int]], context_lens: list[int], block_size: int,
                         device: torch.device, window: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables of different lengths as one [B, max_blocks] int64 tensor (0-padded) and the
    mask of each request's real slots, [B, 1, 1, max_blocks * block_size] bool (with a sliding
    `window`, its last `window` slots)."""
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                          device=device)  # [B, max_blocks]
    lens = torch.tensor(context_lens, device=device)
    span = torch.arange(width * block_size, device=device)
    mask = span[None, :] < lens[:, None]  # [B, S]
    if window is not None:
        mask &= span[None, :] >= lens[:, None] - window
    return padded, mask[:, None, None, :]
