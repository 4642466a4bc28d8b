"""PyTorch attention over a quantized KV store: the blocks a step reads are dequantized (keys
rotated to their slot's position when stored before RoPE), then attended with SDPA; the step's
own tokens attend with their fresh, full-precision K/V."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.attention.backend import AttentionBackend
from nanokv.attention.common import CommonAttentionMetadata
from nanokv.attention.torch_paged import padded_decode_tables
from nanokv.layers.attention import AttentionMetadata, PrefillSeq
from nanokv.quant.attention import quantized_paged_attention
from nanokv.quant.store import QuantizedKVStore


@dataclass
class StoreStep:
    meta: AttentionMetadata
    write_plan: object


class QuantizedTorchBackend(AttentionBackend):
    name = "torch"
    description = "PyTorch over the quantized store (dequantize, then attend)"

    @classmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        if not isinstance(kv_cache, QuantizedKVStore):
            return "it reads quantized stores only", True
        return None

    def build(self, common: CommonAttentionMetadata) -> StoreStep:
        if common.per_layer is not None:
            raise RuntimeError("per-layer block tables need the float KV pool")
        dev = self.device
        prefills = [PrefillSeq(p.query_start, p.query_len, p.context_len,
                               torch.tensor(p.block_table, dtype=torch.long, device=dev))
                    for p in common.prefills]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(common.slot_mapping, dtype=torch.long, device=dev),
            num_decode_tokens=common.num_decode_tokens, decode_block_tables=None,
            decode_mask=None, prefills=prefills, write_cache=False)
        if common.num_decodes:
            meta.decode_block_tables, meta.decode_mask = padded_decode_tables(
                common.decode_block_tables, common.decode_context_lens,
                self.kv_cache.block_size, dev)
        return StoreStep(meta, common.write_plan)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_pre: torch.Tensor, step: StoreStep, scale: float) -> torch.Tensor:
        store = self.kv_cache
        store.write_layer(layer, step.write_plan, k, v, k_pre)
        return quantized_paged_attention(q, k, v, None, store, layer, step.meta, None, scale,
                                         store.rope)
