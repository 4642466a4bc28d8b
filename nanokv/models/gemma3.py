"""Gemma 3's text decoder (`Gemma3ForCausalLM`: Gemma 3 1B; and the text part of the multimodal
4B / 12B / 27B checkpoints, `Gemma3ForConditionalGeneration`), as Hugging Face's Gemma3
computes it, on the Llama decoder's parts:

- every layer normalizes four times: before and after attention, before and after the MLP
  (`Gemma3DecoderLayer`: the residual adds stay fused into the norm that follows them);
- its RMSNorms scale by 1 + w (folded into w once the checkpoint is in: `loaded`), q / k norms
  as Qwen3;
- the embedding is multiplied by sqrt(hidden_size), in the weights' dtype;
- attention scales by query_pre_attn_scalar^-1/2, not head_dim^-1/2;
- the MLP's gate takes gelu with the tanh approximation (`hidden_activation`);
- sliding-window layers and full layers (`layer_types`) each have their own RoPE
  (`rope_parameters[layer_type]`: base 10k on the sliding layers, 1M on the full ones); the
  model's `rotary` is the full layers' (what a KV store would rotate pre-RoPE keys with: such
  stores are refused for it, `LLMEngine`);
- a final logit soft-cap where the config sets one (tanh(x / c) * c, Gemma 2's; Gemma 3 sets
  none). An attention logit soft-cap (which Hugging Face's Gemma 3 keeps in its config but does
  not apply) and bidirectional attention are refused.

Gemma 2 (`nanokv/models/gemma2.py`) is this decoder without q / k norms, with one RoPE and the
attention logit soft-cap applied.
"""

from __future__ import annotations

import torch
from torch import nn

from nanokv.attention.common import StepAttention
from nanokv.distributed.parallel_state import TensorParallel
from nanokv.layers.norm import RMSNorm
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.models.llama import (
    LinearBiases,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    _windows_of_layer_types,
)
from nanokv.utils import head_dim_of


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with a norm after attention and a norm on each side of the MLP."""

    def __init__(self, cfg, rotary: RotaryEmbedding, qk_norm: bool, biases: LinearBiases,
                 mlp: nn.Module, tp: TensorParallel | None) -> None:
        super().__init__(cfg, rotary, qk_norm, biases, mlp, tp)
        self.self_attn.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, step: StepAttention):
        """As `LlamaDecoderLayer.forward`: x is the previous layer's output after its
        post-feedforward norm, residual the stream before it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attn, captured = self.self_attn(h, positions, step)
        attn = self.post_attention_layernorm(attn)
        h, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual, captured


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, cfg, max_positions: int, tp: TensorParallel | None = None) -> None:
        self.check_config(cfg)
        super().__init__(cfg, max_positions, tp)
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        self._embed_scales: dict[torch.dtype, torch.Tensor] = {}  # by dtype (`embed`)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    def make_rotary(self, cfg, max_positions: int) -> RotaryEmbedding:
        """The full layers' RoPE (the model's `rotary`); the sliding layers' is
        `sliding_rotary` (None where no layer slides)."""
        head_dim = head_dim_of(cfg)
        self.sliding_rotary = (RotaryEmbedding(cfg, head_dim, max_positions, "sliding_attention")
                               if "sliding_attention" in cfg.layer_types else None)
        return RotaryEmbedding(cfg, head_dim, max_positions, "full_attention")

    def make_layer(self, cfg, layer: int, biases: LinearBiases,
                   tp: TensorParallel | None) -> nn.Module:
        """Each layer with its kind's RoPE."""
        rotary = self.rotary if cfg.layer_types[layer] == "full_attention" else self.sliding_rotary
        return Gemma3DecoderLayer(cfg, rotary, self.qk_norm, biases,
                                  self.make_mlp(cfg, layer, biases, tp), tp)

    @staticmethod
    def attention_soft_cap(cfg) -> float | None:
        """None; a config that sets attn_logit_softcapping is refused (Hugging Face's Gemma 3
        attention does not apply it: no one computation to match)."""
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"attn_logit_softcapping {cfg.attn_logit_softcapping} is not "
                             f"supported for Gemma 3 (Hugging Face's Gemma 3 attention does not "
                             f"apply it); supported: null")
        return None

    @staticmethod
    def check_config(cfg) -> None:
        """What nanokv does not run as Hugging Face does: refused, naming the field."""
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (a causal decoder "
                             "only); supported: false")
        types = getattr(cfg, "layer_types", None)
        if not types or len(types) != cfg.num_hidden_layers or not set(types) <= {
                "sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must name each of the {cfg.num_hidden_layers} "
                             f"layers 'sliding_attention' or 'full_attention', got {types!r}")

    @staticmethod
    def biases(cfg) -> LinearBiases:
        """`attention_bias` on q/k/v and o; no MLP bias."""
        attention = bool(getattr(cfg, "attention_bias", False))
        return LinearBiases(attention, attention, False)

    layer_windows = classmethod(_windows_of_layer_types)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        scale = self._embed_scales.get(x.dtype)
        if scale is None:  # float32, then x's dtype, as HF rounds it; made once, not per step
            scale = self._embed_scales[x.dtype] = torch.tensor(self.embed_scale).to(x.dtype)
        return x * scale

    def loaded(self) -> None:
        """Gemma's norms scale by 1 + w: w becomes 1 + w once (computed in float32, as HF)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.copy_(1.0 + module.weight.float())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text decoder of a multimodal Gemma 3 checkpoint (4B, 12B, 27B): built from its
    `text_config`, its weights under `language_model.`; the vision tower and the projector are
    not read (prompts are text or token ids; no image input)."""

    ignored_tensors = ("vision_tower.", "multi_modal_projector.")

    @staticmethod
    def text_config(cfg):
        return cfg.text_config

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return "language_model." + Gemma3ForCausalLM.checkpoint_name(name)
