"""The fast estimate of `nanokv calibrate --measure simulated`: KV quantization simulated inside the
Hugging Face model.

Forward hooks on each layer's key module (the k_proj output, or k_norm's for Qwen3: the pre-RoPE
key) and v_proj replace K and V by what the candidate's store would give back
(`fake_quantize_sequence`, the store's own codec: full blocks quantized, the trailing partial
block and the sinks in full precision; int8 per token, before RoPE). A window is one forward pass,
so, unlike the engine, every token also reads its own block quantized (the engine keeps the
partial block's keys in full precision until it fills), and no chunk ever reads fresh K/V of
earlier tokens: a harsher estimate than what the engine does (docs/results/kvquant/calibration.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nanokv.quant.calibration_file import Calibration, Candidate
from nanokv.quant.codec import LayerCodec, fake_quantize_sequence
from nanokv.quant.int8 import dequantize_int8, quantize_int8
from nanokv.quant.kvquant import SPARSE_DTYPES
from nanokv.quant.precision_rule import Measurement
from nanokv.quant.scoring import ScoredWindows, log_probs, measurement
from nanokv.utils import head_dim_of

if TYPE_CHECKING:
    from nanokv.quant.calibrate import CalibrationSettings


def kv_modules(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(module whose output is the cached pre-RoPE key, v_proj) per decoder layer."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected model.model.layers[i].self_attn")
    out = []
    for layer in layers:
        attn = layer.self_attn
        out.append((getattr(attn, "k_norm", None) or attn.k_proj, attn.v_proj))
    return out


def kv_heads(model) -> tuple[int, int]:
    cfg = model.config
    dim = head_dim_of(cfg)
    return cfg.num_key_value_heads, dim


def as_heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1], heads, dim)  # [b, s, H, D]


def simulate(model, candidate: Candidate, calib: Calibration, settings: CalibrationSettings):
    """Install hooks that quantize-dequantize K (pre-RoPE) and V as the candidate stores them.
    Returns the hook handles (remove them when done)."""
    heads, dim = kv_heads(model)
    handles = []
    if candidate.kv_cache_dtype == "auto":
        return handles
    widths = candidate.layer_bits or (candidate.bits,) * calib.num_layers
    sparse = SPARSE_DTYPES["float16"]
    for layer, (k_mod, v_mod) in enumerate(kv_modules(model)):
        bits = widths[layer]
        if candidate.kv_cache_dtype == "int8":
            fn = _int8_fn
        elif bits is None:
            continue
        else:
            books = calib.codebooks.get(bits) if settings.nuq else None
            codec = LayerCodec(
                bits=bits, per_channel_keys=settings.per_channel_keys,
                outlier_fraction=settings.outlier_fraction, sparse_dtype=sparse,
                key_codebook=None if books is None else torch.tensor(books[0][layer]),
                value_codebook=None if books is None else torch.tensor(books[1][layer]),
                key_thresholds=None if calib.key_thresholds is None
                else calib.key_thresholds[layer])
            fn = _kvquant_fn(codec, settings)
        for kind, mod in (("key", k_mod), ("value", v_mod)):
            def hook(_m, _i, out, fn=fn, kind=kind):
                x = as_heads(out, heads, dim)
                return fn(x.float(), kind).to(out.dtype).reshape(out.shape)
            handles.append(mod.register_forward_hook(hook))
    return handles


def _int8_fn(x: torch.Tensor, kind: str) -> torch.Tensor:
    return dequantize_int8(*quantize_int8(x))


def _kvquant_fn(codec: LayerCodec, settings: CalibrationSettings):
    def fn(x: torch.Tensor, kind: str) -> torch.Tensor:
        return fake_quantize_sequence(x, codec, kind, settings.block_size,
                                      settings.num_sink_tokens)
    return fn


class SimulatedMeasure:
    """candidate -> Measurement from the Hugging Face model with `simulate`'s hooks: each window
    in one forward pass, scored on the same tokens as the engine measure."""

    def __init__(self, model, calib: Calibration, settings: CalibrationSettings,
                 windows: ScoredWindows, on_window: Callable[[], None] = lambda: None) -> None:
        self.model, self.calib, self.settings, self.windows = model, calib, settings, windows
        self.on_window = on_window
        self.reference: list[torch.Tensor] | None = None

    def __call__(self, candidate: Candidate) -> Measurement:
        if self.reference is None:
            self.reference = log_probs(self.scored_logits(Candidate("auto")))
        return measurement(self.windows, self.scored_logits(candidate), self.reference)

    @torch.no_grad()
    def scored_logits(self, candidate: Candidate) -> list[torch.Tensor]:
        handles = simulate(self.model, candidate, self.calib, self.settings)
        out = []
        try:
            for window in self.windows.windows:
                ids = torch.tensor([window])  # [1, n]
                logits = self.model(input_ids=ids).logits[0]  # [n, V]
                out.append(self.windows.scored_logits(logits).float())
                self.on_window()
        finally:
            for h in handles:
                h.remove()
        return out
