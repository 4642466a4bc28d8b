"""One layer's KVQuant codec, and the simulated (quantize-dequantize) path used by calibration.

`LayerCodec` binds a `KVQuantConfig` to one layer (its bits, codebooks, key thresholds); the store
and `fake_quantize_sequence` both go through it, so calibration measures exactly what the store
holds: values (and per-token keys) quantized token by token, per-channel keys block by block
(the trailing partial block in full precision: the store's staging), sinks excluded from the
statistics and kept in `sparse_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.quant.kvquant import (
    SPARSE_DTYPES,
    KVQuantConfig,
    QuantizedBlocks,
    dequantize_blocks,
    quantize_blocks,
)


@dataclass
class LayerCodec:
    bits: int
    per_channel_keys: bool
    outlier_fraction: float
    sparse_dtype: torch.dtype
    key_codebook: torch.Tensor | None = None
    value_codebook: torch.Tensor | None = None
    key_thresholds: torch.Tensor | None = None  # [2, Hkv, D]

    @classmethod
    def from_config(cls, config: KVQuantConfig, layer: int,
                    device: torch.device | str = "cpu") -> LayerCodec:
        def dev(t):
            return None if t is None else t.to(device)

        return cls(bits=config.bits_of(layer), per_channel_keys=config.per_channel_keys,
                   outlier_fraction=config.outlier_fraction,
                   sparse_dtype=SPARSE_DTYPES[config.sparse_dtype],
                   key_codebook=dev(config.codebook(layer, "key")),
                   value_codebook=dev(config.codebook(layer, "value")),
                   key_thresholds=dev(config.thresholds(layer)))

    def per_token(self, kind: str) -> bool:
        """Values (and keys without per-channel statistics) are quantized token by token, as
        they are written; per-channel keys wait for their block to fill."""
        return kind == "value" or not self.per_channel_keys

    def quantize(self, kind: str, x: torch.Tensor, valid: torch.Tensor) -> QuantizedBlocks:
        """kind 'key' | 'value'; x: [n, B, H, D]; valid: [n, B] (False = sink slot)."""
        if kind == "key":
            return quantize_blocks(x, valid, bits=self.bits, per_channel=self.per_channel_keys,
                                   codebook=self.key_codebook,
                                   outlier_fraction=self.outlier_fraction,
                                   thresholds=self.key_thresholds, sparse_dtype=self.sparse_dtype)
        return quantize_blocks(x, valid, bits=self.bits, per_channel=False,
                               codebook=self.value_codebook,
                               outlier_fraction=self.outlier_fraction,
                               sparse_dtype=self.sparse_dtype)

    def dequantize(self, kind: str, q: QuantizedBlocks) -> torch.Tensor:
        """-> float32 [n, B, H, D] (sinks not restored: the caller owns them)."""
        if kind == "key":
            return dequantize_blocks(q, bits=self.bits, per_channel=self.per_channel_keys,
                                     codebook=self.key_codebook)
        return dequantize_blocks(q, bits=self.bits, per_channel=False,
                                 codebook=self.value_codebook)


def fake_quantize_sequence(x: torch.Tensor, codec: LayerCodec, kind: str, block_size: int,
                           num_sink_tokens: int = 0) -> torch.Tensor:
    """What the store returns for sequences written from position 0, slot = position.

    x: [batch, T, H, D] (pre-RoPE keys or values) -> same shape and dtype. Per-token kinds are
    quantized token by token (outliers per token); per-channel keys block by block, the
    trailing partial block unchanged (staged in full precision). Positions < num_sink_tokens come
    back rounded to the sparse dtype.
    """
    batch, length, heads, dim = x.shape
    out = x.clone()
    pos = torch.arange(length, device=x.device)
    if codec.per_token(kind):
        groups, full = x.reshape(-1, 1, heads, dim), length  # [batch * T, 1, H, D]
        valid = (pos >= num_sink_tokens).repeat(batch).unsqueeze(1)  # [batch * T, 1]
    else:
        full = length // block_size * block_size
        groups = x[:, :full].reshape(-1, block_size, heads, dim)  # [batch * nb, B, H, D]
        valid = (pos[:full] >= num_sink_tokens).view(-1, block_size).repeat(batch, 1)
    if full:
        deq = codec.dequantize(kind, codec.quantize(kind, groups, valid))
        out[:, :full] = deq.reshape(batch, full, heads, dim).to(x.dtype)
    sinks = min(num_sink_tokens, full)
    if sinks:
        out[:, :sinks] = x[:, :sinks].to(codec.sparse_dtype).to(x.dtype)
    return out
