"""Gemma 2's decoder (`Gemma2ForCausalLM`: Gemma 2 2B / 9B / 27B), as Hugging Face's Gemma2
computes it: Gemma 3's decoder (`nanokv/models/gemma3.py`: four norms a layer with 1 + w
weights, the embedding scaled by sqrt(hidden), the query_pre_attn_scalar scale, the gelu-tanh
MLP, sliding layers and full ones in turn by `layer_types`, the final logit soft-cap, 30 in the
released checkpoints) with no q / k norms, one RoPE for every layer (`rope_theta`), and the
attention logit soft-cap applied (attn_logit_softcapping, 50 in the released checkpoints: each
scaled score s becomes c * tanh(s / c) before the softmax; the attention backend applies it,
`AttentionBackend.supports_soft_cap`, on the float KV pool).
"""

from __future__ import annotations

import math

from nanokv.layers.rotary import RotaryEmbedding
from nanokv.models.gemma3 import Gemma3ForCausalLM
from nanokv.utils import head_dim_of


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    qk_norm = False

    def make_rotary(self, cfg, max_positions: int) -> RotaryEmbedding:
        """One RoPE, every layer's (`sliding_rotary` is the same one)."""
        self.sliding_rotary = RotaryEmbedding(cfg, head_dim_of(cfg), max_positions)
        return self.sliding_rotary

    @staticmethod
    def attention_soft_cap(cfg) -> float | None:
        """attn_logit_softcapping (50 in the released checkpoints; None: none)."""
        cap = getattr(cfg, "attn_logit_softcapping", None)
        if cap is None:
            return None
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
            raise ValueError(f"attn_logit_softcapping must be a finite number > 0 or null, "
                             f"got {cap!r}")
        return float(cap)
