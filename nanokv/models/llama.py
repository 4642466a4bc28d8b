"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened varlen batch.

Tokens of all requests in a step are concatenated: hidden states are [T, hidden]. q/k/v and
gate/up projections are packed into one matmul each; the loader splits the checkpoint's tensors
into them (see `packed_modules`).

With tensor parallelism (`tp`, nanokv/distributed) each rank builds the same model with its share
of the heads, of the MLP and of the vocabulary: column-parallel q/k/v and gate/up, row-parallel
o and down (all-reduced), vocabulary-parallel embedding and LM head. Without it (tp None) the
layers are the plain ones.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.attention.common import StepAttention
from nanokv.distributed.parallel_state import TensorParallel
from nanokv.distributed.tp_layers import (
    ParallelLMHead,
    VocabParallelEmbedding,
    column_linear,
    row_linear,
)
from nanokv.layers import native_elementwise, native_linear
from nanokv.layers.int8_weights import Int8Embedding
from nanokv.layers.linear import Linear
from nanokv.layers.norm import RMSNorm
from nanokv.layers.rotary import RotaryEmbedding
from nanokv.utils import head_dim_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinearBiases:
    """Which projections carry a bias: q/k/v, o, and the MLP's gate/up/down. Each architecture
    reads its own config flags, as its Hugging Face class does (`biases`)."""

    qkv: bool = False
    o: bool = False
    mlp: bool = False


class LlamaAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, qk_norm: bool, biases: LinearBiases,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        ranks = 1 if tp is None else tp.size
        self.num_heads = cfg.num_attention_heads // ranks  # this rank's heads
        self.num_kv_heads = cfg.num_key_value_heads // ranks
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = column_linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                      biases.qkv, tp)
        self.o_proj = row_linear(self.q_size, cfg.hidden_size, biases.o, tp)
        self.rotary = rotary
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.layer_index = 0  # this layer's index in the KV cache (set by the model)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                step: StepAttention) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [T, hidden] -> ([T, hidden], the post-RoPE queries at `step.capture_rows`)."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # q / k norm (Qwen3) and RoPE; k_pre, before RoPE, is what a store with pre-RoPE keys
        # quantizes
        q, _ = self.rotary.norm_rope(positions, q, self.q_norm)
        k, k_pre = self.rotary.norm_rope(positions, k, self.k_norm, keep_pre=True)
        captured = q[step.capture_rows] if step.capture_rows is not None else None  # [Tc, Hq, D]
        o = step.backend.forward(self.layer_index, q, k, v, k_pre, step.metadata, self.scale)
        return self.o_proj(o.reshape(num_tokens, self.q_size)), captured  # [T, hidden]


# a gate's activation by its Hugging Face name (transformers' ACT2FN: gelu_pytorch_tanh is
# PyTorch's tanh approximation)
ACTIVATIONS = {"silu": F.silu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaMLP(nn.Module):
    def __init__(self, cfg, bias: bool, tp: TensorParallel | None = None,
                 intermediate_size: int | None = None, reduce: bool = True) -> None:
        """intermediate_size: the whole MLP's width (cfg.intermediate_size unless given: an
        expert's); reduce False: under tensor parallelism the output stays this rank's partial
        sum (a mixture of experts sums its experts first, then reduces once)."""
        super().__init__()
        self.act = self.activation(cfg)
        width = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate = width // (1 if tp is None else tp.size)
        self.gate_up_proj = column_linear(cfg.hidden_size, 2 * self.intermediate, bias, tp)
        self.down_proj = row_linear(self.intermediate, cfg.hidden_size, bias, tp, reduce)
        self.native = False  # SiLU-and-multiply in C on float32 CPU (use_native_elementwise)

    @staticmethod
    def activation(cfg) -> str:
        """The gate's activation: `hidden_act` (Gemma's configs name it `hidden_activation`)."""
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {act!r} is not supported; supported: "
                             f"{sorted(ACTIVATIONS)}")
        return act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.native and self.act == "silu" and native_elementwise.fits_gate_up(gate_up):
            return self.down_proj(native_elementwise.silu_mul(gate_up))  # one pass, in C
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, qk_norm: bool, biases: LinearBiases,
                 mlp: nn.Module, tp: TensorParallel | None = None) -> None:
        """mlp: the layer's feed-forward block (a `LlamaMLP`, or a mixture of experts)."""
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, qk_norm, biases, tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, step: StepAttention):
        """x: the previous layer's MLP output [T, hidden] (the embeddings for the first layer,
        with residual None); residual: the stream before it. Returns this layer's (MLP output,
        residual stream, captured queries): the residual add is fused into the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attn, captured = self.self_attn(h, positions, step)
        h, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(h), residual, captured


class LlamaForCausalLM(nn.Module):
    """Llama; the subclasses differ in their biases, q/k norms and sliding windows."""

    qk_norm = False
    # checkpoint tensors the loader skips by prefix (a multimodal checkpoint's vision tower)
    ignored_tensors: tuple[str, ...] = ()
    # checkpoint name -> (our name, shard index) for the packed projections
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, max_positions: int, tp: TensorParallel | None = None) -> None:
        """tp: this rank's place in a tensor-parallel group (None: the whole model here)."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        # the attention backend applies it (`AttentionBackend.soft_cap`); None: none
        self.logits_soft_cap = self.attention_soft_cap(cfg)
        biases = self.biases(cfg)
        self.rotary = self.make_rotary(cfg, max_positions)
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None
                             else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        self.layers = nn.ModuleList(self.make_layer(cfg, index, biases, tp)
                                    for index in range(cfg.num_hidden_layers))
        for index, layer in enumerate(self.layers):
            layer.self_attn.layer_index = index
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = (Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if tp is None
                        else ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp))

    def make_rotary(self, cfg, max_positions: int) -> RotaryEmbedding:
        """The model's RoPE (`rotary`: what a store of pre-RoPE keys rotates them with)."""
        return RotaryEmbedding(cfg, head_dim_of(cfg), max_positions)

    def make_layer(self, cfg, layer: int, biases: LinearBiases,
                   tp: TensorParallel | None) -> nn.Module:
        """Decoder layer `layer` (Gemma 3: its own kind, with its kind's RoPE)."""
        return LlamaDecoderLayer(cfg, self.rotary, self.qk_norm, biases,
                                 self.make_mlp(cfg, layer, biases, tp), tp)

    @classmethod
    def make_mlp(cls, cfg, layer: int, biases: LinearBiases,
                 tp: TensorParallel | None) -> nn.Module:
        """Layer `layer`'s feed-forward block: a dense MLP here (mixtures of experts:
        nanokv/models/moe.py)."""
        return LlamaMLP(cfg, biases.mlp, tp)

    @staticmethod
    def biases(cfg) -> LinearBiases:
        """Hugging Face's Llama: `attention_bias` on q/k/v and o, `mlp_bias` on the MLP."""
        attention = bool(getattr(cfg, "attention_bias", False))
        return LinearBiases(attention, attention, bool(getattr(cfg, "mlp_bias", False)))

    @staticmethod
    def attention_soft_cap(cfg) -> float | None:
        """The attention logit soft-cap c (scores c * tanh(scores / c) before the softmax:
        Gemma 2's attn_logit_softcapping); None here."""
        return None

    @classmethod
    def layer_windows(cls, cfg, max_positions: int) -> tuple[int | None, ...]:
        """Each layer's sliding window (`KVLayout.sliding_windows`), () when every layer attends
        over the whole context, as it does when the window covers max_positions. Llama: refused
        when `sliding_window` is set and shorter (Hugging Face's Llama forward ignores it, but
        its generate then keeps a sliding-window cache: no one attention to match)."""
        window = getattr(cfg, "sliding_window", None)
        if window is not None and window < max_positions:
            raise ValueError(f"sliding_window {window} of {cls.__name__} is not supported (Hugging "
                             f"Face's Llama attends over the whole context in its forward and "
                             f"over a sliding window in generate); set max_model_len <= {window}")
        return ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention
                ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """input_ids, positions: [T] -> hidden states [T, hidden], and per layer the queries
        KV policies asked for (`step.capture_rows`; None when none were asked)."""
        x, residual = self.embed(input_ids), None  # [T, hidden]
        captured = []
        for layer in self.layers:
            x, residual, q_rows = layer(x, residual, positions, step)
            captured.append(q_rows)
        x, _ = self.norm(x, residual)
        return x, (captured if step.capture_rows is not None else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, hidden]."""
        return self.embed_tokens(input_ids)

    def rotaries(self) -> list[RotaryEmbedding]:
        """The model's RoPE tables: one here (Gemma 3: one per kind of layer)."""
        return [m for m in self.modules() if isinstance(m, RotaryEmbedding)]

    def loaded(self) -> None:
        """Called once the checkpoint's tensors are in, before the weights are tied: what an
        architecture makes of them (Gemma 3 folds its norms' 1 + w); nothing here."""

    def tie_weights(self) -> None:
        """Tied embeddings: the LM head shares the embedding matrix (after loading; an int8
        embedding already reads the LM head's codes)."""
        if self.tie_word_embeddings and not self.int8_embedding():
            self.lm_head.weight = self.embed_tokens.weight

    def pack_linear_weights(self) -> None:
        """Switch every linear layer to its CPU fast path: oneDNN's packed weight or, for float32
        weights where it is faster, the panel kernel's column panels (`native_linear`). Which of
        the two is measured once per weight shape (the LM head on its own rows: a decode step's
        largest weight) and logged; each layer keeps one copy. A tied LM head keeps the plain
        matrix too: the embedding lookup uses it. Tensor-parallel layers take oneDNN."""
        chosen: dict[tuple, bool] = {}  # (is the head, out, in) -> panels kept
        t0 = time.perf_counter()
        for module in self.modules():
            if not isinstance(module, Linear) or module.scale is not None:
                continue  # int8 layers keep their codes' panels (`quantize_int8`)
            keep_plain = module is self.lm_head and self.tie_word_embeddings
            is_head, plain = module is self.lm_head, type(module) is Linear
            shape = (is_head, module.out_features, module.in_features)
            # a shape already measured: only the copy it chose is made
            if not (plain and chosen.get(shape) and module.pack_panels()):
                module.pack()
                if (plain and shape not in chosen and module.packed is not None
                        and module.pack_panels()):
                    rows = native_linear.HEAD_ROWS if is_head else native_linear.LAYER_ROWS
                    chosen[shape] = module.keep_faster_path(rows)
            if not keep_plain:
                module.free_plain()
        if chosen:
            logger.info("linear layers on CPU, measured in %.1f s: %s", time.perf_counter() - t0,
                        "; ".join(f"{'LM head ' if head else ''}{n} x {k}: "
                                  f"{'column panels' if panels else 'oneDNN'}"
                                  for (head, n, k), panels in chosen.items()))

    def int8_layers(self) -> list[Linear]:
        """The linear layers weight-only int8 quantizes: all but those marked `keep_float` (a
        MoE router: its top-k choices follow small differences)."""
        return [m for m in self.modules() if isinstance(m, Linear) and not m.keep_float]

    def quantize_int8(self) -> int:
        """Weight-only int8 for each of `int8_layers` not quantized yet (`load_model` quantizes
        each as it is loaded): int8 codes in column panels with a scale per output row
        (`Linear.quantize_int8`); then the input embedding, a scale per token's row
        (`Int8Embedding`: a tied one reads the LM head's codes). Returns how many linear
        layers hold int8 weights."""
        layers = self.int8_layers()
        for module in layers:
            if module.scale is None:
                module.quantize_int8()
        self.quantize_embedding_int8()
        return len(layers)

    def int8_embedding(self) -> bool:
        """Whether the input embedding reads int8 codes (`quantize_embedding_int8`)."""
        embed = self.embed_tokens
        return isinstance(embed, Int8Embedding) or getattr(embed, "int8", None) is not None

    def quantize_embedding_int8(self) -> None:
        """The input embedding as int8 codes, a scale per token's row (`Int8Embedding`); a tied
        one is the LM head's, quantized now from the embedding matrix. The float matrix is
        freed. `load_model` calls it as soon as the embedding is loaded (idempotent)."""
        if self.int8_embedding():
            return
        head = self.lm_head
        if self.tie_word_embeddings:
            head.weight = self.embed_tokens.weight  # the tie, made here
            if head.scale is None:
                head.quantize_int8()
            table = Int8Embedding(head.panels, head.scale)
        else:
            table = Int8Embedding.of(self.embed_tokens.weight)
        if isinstance(self.embed_tokens, VocabParallelEmbedding):
            self.embed_tokens.use_int8(table)  # this rank's rows (the LM head's, if tied)
        else:
            self.embed_tokens = table

    def use_native_elementwise(self) -> bool:
        """Route the norms, RoPE and SiLU-and-multiply through the fused C kernels
        (`native_elementwise`) where they apply: float32 weights on CPU, the library built.
        Returns whether they are in use; the PyTorch ops stay each call's reference path."""
        weight = self.norm.weight
        if not (weight.device.type == "cpu" and weight.dtype == torch.float32
                and native_elementwise.elementwise_available()):
            return False
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, LlamaMLP)):
                module.native = True
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] float32; None on tensor-parallel ranks other than 0 (the
        logits are gathered on rank 0)."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()  # [N, vocab]

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.layers]

    @staticmethod
    def text_config(cfg):
        """The config the decoder is built from: the checkpoint's (a multimodal one's text part:
        Gemma 3's `text_config`)."""
        return cfg

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Our parameter name -> the checkpoint's (`model.` prefix for the decoder)."""
        return name if name.startswith("lm_head") else "model." + name


def _active_windows(windows: list[int | None], max_positions: int) -> tuple[int | None, ...]:
    """Per layer, the window where one is shorter than max_positions; () when none is."""
    for w in windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 or null, got {w!r}")
    active = tuple(w if w is not None and w < max_positions else None for w in windows)
    return active if any(w is not None for w in active) else ()


def _windows_of_layer_types(cls, cfg, max_positions: int) -> tuple[int | None, ...]:
    """Qwen2 / Qwen3: a sliding window on the layers `layer_types` marks "sliding_attention"
    (their configs derive it from use_sliding_window and max_window_layers)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # a config object that did not derive them
        first = getattr(cfg, "max_window_layers", 0)
        types = ["sliding_attention" if getattr(cfg, "use_sliding_window", False)
                 and i >= first else "full_attention" for i in range(cfg.num_hidden_layers)]
    return _active_windows([window if t == "sliding_attention" else None for t in types],
                           max_positions)


class MistralForCausalLM(LlamaForCausalLM):
    """No biases (Hugging Face's Mistral ignores attention_bias and mlp_bias); `sliding_window`
    on every layer."""

    @staticmethod
    def biases(cfg) -> LinearBiases:
        return LinearBiases()

    @classmethod
    def layer_windows(cls, cfg, max_positions: int) -> tuple[int | None, ...]:
        window = getattr(cfg, "sliding_window", None)
        return _active_windows([window] * cfg.num_hidden_layers, max_positions)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """A bias on q/k/v always, none on o or the MLP."""

    @staticmethod
    def biases(cfg) -> LinearBiases:
        return LinearBiases(qkv=True)

    layer_windows = classmethod(_windows_of_layer_types)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """q/k norms; `attention_bias` on q/k/v and o, no MLP bias."""

    qk_norm = True

    @staticmethod
    def biases(cfg) -> LinearBiases:
        attention = bool(getattr(cfg, "attention_bias", False))
        return LinearBiases(attention, attention, False)

    layer_windows = classmethod(_windows_of_layer_types)
