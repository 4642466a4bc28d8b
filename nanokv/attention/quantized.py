"""PyTorch attention over a quantized KV store: the blocks a step reads are dequantized (keys
rotated to their slot's position when stored before RoPE), then attended with SDPA; the step's
own tokens attend with their fresh, full-precision K/V. Layers with a sliding window
(`KVLayout.sliding_windows`) get the step's metadata built for their window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.attention.backend import AttentionBackend
from nanokv.attention.common import CommonAttentionMetadata
from nanokv.attention.torch_paged import by_layer_window, kernel_metadata, padded_decode_tables
from nanokv.layers.attention import AttentionMetadata
from nanokv.quant.attention import quantized_paged_attention, read_staged_pasts
from nanokv.quant.store import QuantizedKVStore


@dataclass
class StoreStep:
    by_window: dict[int | None, AttentionMetadata]  # a sliding window (None: none) -> its own
    write_plan: object


class QuantizedTorchBackend(AttentionBackend):
    name = "torch"
    description = "PyTorch over the quantized store (dequantize, then attend)"
    dequantizes_blocks = True

    @classmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        if not isinstance(kv_cache, QuantizedKVStore):
            return "it reads quantized stores only", True
        return None

    def build(self, common: CommonAttentionMetadata) -> StoreStep:
        if common.per_layer is not None:
            raise RuntimeError("per-layer block tables need the float KV pool")
        base = kernel_metadata(common, self.device, common.write_plan.slot_mapping)
        by_window = by_layer_window(base, self.kv_cache.layout.sliding_windows)
        if common.num_decodes:  # the prefill chunks shared; each window its own decode mask
            for window, meta in by_window.items():
                meta.decode_block_tables, meta.decode_mask = padded_decode_tables(
                    common.decode_block_tables, common.decode_context_lens,
                    self.kv_cache.block_size, self.device, window)
        return StoreStep(by_window, common.write_plan)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_pre: torch.Tensor, step: StoreStep, scale: float) -> torch.Tensor:
        meta = step.by_window[self.kv_cache.layout.window(layer)]
        return write_prefill_then_decode(self.kv_cache, layer, q, k, v, k_pre, step.write_plan,
                                         meta, 0, scale, None)



# ---- for backends that decode with their own kernel and prefill through this path ------------
def prefill_only_metadata(common: CommonAttentionMetadata, device: torch.device
                          ) -> AttentionMetadata | None:
    """The PyTorch path's metadata for the step's prefill chunks alone (None without any)."""
    if common.per_layer is not None:
        raise RuntimeError("per-layer block tables need the float KV pool")
    if not common.prefills:
        return None
    meta = kernel_metadata(common, device, common.write_plan.slot_mapping)
    meta.num_decode_tokens = 0
    return meta


def write_prefill_then_decode(store: QuantizedKVStore, layer: int, q: torch.Tensor,
                              k: torch.Tensor, v: torch.Tensor, k_pre: torch.Tensor, plan,
                              prefill_meta: AttentionMetadata | None, num_decode_tokens: int,
                              scale: float, decode, read_past=None) -> torch.Tensor:
    """One layer of such a backend: the store writes the step's K/V, the prefill rows go
    through the PyTorch path (`read_past`: its reader of a chunk's sequence), then
    decode(q, k, v) -> [nd, Hq, D] fills the first num_decode_tokens rows (decode None: the
    PyTorch path's decodes too, prefill_meta then the whole step's)."""
    staged_pasts = None
    if prefill_meta is not None and prefill_meta.prefills:  # what the write quantizes away
        staged_pasts = read_staged_pasts(store, layer, prefill_meta.prefills, plan,
                                         store.rope)
    store.write_layer(layer, plan, k, v, k_pre)
    if prefill_meta is not None:
        out = quantized_paged_attention(q, k, v, k_pre if store.pre_rope_keys else k, store,
                                        layer, prefill_meta, plan, scale, store.rope, read_past,
                                        staged_pasts)
    else:
        out = torch.empty_like(q)
    nd = num_decode_tokens
    if nd:
        out[:nd] = decode(q[:nd], k[:nd], v[:nd]).to(out.dtype)
    return out
