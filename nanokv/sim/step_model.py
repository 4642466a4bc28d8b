"""How long one engine step takes, from what the scheduler put in it.

A step is described by `StepFeatures` (plain numbers taken from a `SchedulerOutput`); a
`StepModel` turns them into seconds. Two kinds:

  * `LinearStepModel`: seconds = c . features, fitted (non-negative least squares) to steps
    this engine timed on this machine (`nanokv bench --step-model-out FILE` writes one);
  * `RooflineStepModel`: from a device's memory bandwidth and FLOP/s and a model's shape:
    max(bytes moved / bandwidth, FLOPs / peak) + a fixed and a per-sequence overhead. Bytes moved:
    the weights once per step plus the K/V every token attends to (bytes per token from the KV
    cache kind's spec); FLOPs: 2 x parameters per token plus the attention products.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from nanokv.models.moe_shape import moe_shape


@dataclass(frozen=True)
class StepFeatures:
    num_tokens: int = 0  # tokens computed (prefill chunks + decodes)
    num_seqs: int = 0  # requests in the step
    num_decodes: int = 0
    decode_context: int = 0  # KV slots read by the decodes (their cache lengths + 1)
    prefill_pairs: int = 0  # query x key pairs of the prefill chunks (causal within the chunk)
    prefill_context: int = 0  # earlier KV slots the prefill chunks read (their start slots)

    @classmethod
    def of(cls, scheduled) -> StepFeatures:
        """From a SchedulerOutput's `scheduled` items (num_tokens, start_slot, is_decode)."""
        tokens = seqs = decodes = ctx = pairs = pctx = 0
        for s in scheduled:
            n, start = s.num_tokens, s.start_slot
            tokens += n
            seqs += 1
            if s.is_decode:  # each row over the slots up to its own (one row but for drafts
                decodes += 1  # or a short chunk's decode rows)
                ctx += n * start + n * (n + 1) // 2
            else:
                pairs += n * start + n * (n + 1) // 2
                pctx += start
        return cls(tokens, seqs, decodes, ctx, pairs, pctx)

    @property
    def num_prefills(self) -> int:
        """Prefill chunks in the step (each has its own attention call and prefix lookup)."""
        return self.num_seqs - self.num_decodes

    def vector(self) -> list[float]:
        return [1.0, self.num_tokens, self.num_seqs, self.decode_context, self.prefill_pairs,
                self.num_prefills]


FEATURE_NAMES = ("step", "token", "seq", "decode_context", "prefill_pair", "prefill_seq")


class StepModel:
    name = "abstract"

    def step_time(self, f: StepFeatures) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


@dataclass
class LinearStepModel(StepModel):
    """seconds = step + token * num_tokens + seq * num_seqs + decode_context * ctx
    + prefill_pair * pairs + prefill_seq * num_prefills (all coefficients >= 0).

    `prefill_seq` is what a prefill chunk costs beyond a decode (its own attention call, the
    prefix lookup, the last-token gather): without it the fitted per-step cost absorbs it and
    steps with a short chunk beside the decodes come out 15-30% short on this CPU."""

    step: float = 0.0
    token: float = 0.0
    seq: float = 0.0
    decode_context: float = 0.0
    prefill_pair: float = 0.0
    source: str = ""  # what it was fitted to
    prefill_seq: float = 0.0  # after `source`: models saved before it load as they were
    name = "fitted"

    def step_time(self, f: StepFeatures) -> float:
        return (self.step + self.token * f.num_tokens + self.seq * f.num_seqs
                + self.decode_context * f.decode_context + self.prefill_pair * f.prefill_pairs
                + self.prefill_seq * f.num_prefills)

    def scaled(self, k: float, source: str) -> LinearStepModel:
        """Every coefficient times `k`."""
        return replace(self, source=source,
                       **{name: getattr(self, name) * k for name in FEATURE_NAMES})

    def describe(self) -> str:
        return (f"fitted ({self.source}): {self.step * 1e3:.3f} ms/step + "
                f"{self.token * 1e6:.2f} us/token + {self.seq * 1e6:.2f} us/seq + "
                f"{self.prefill_seq * 1e6:.2f} us/prefill chunk + "
                f"{self.decode_context * 1e9:.3f} ns/decode slot + "
                f"{self.prefill_pair * 1e12:.3f} ps/prefill pair")

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps({"kind": "linear", **d}, indent=1)

    @classmethod
    def load(cls, path: str) -> LinearStepModel:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except ValueError as e:  # not JSON, or not UTF-8
            raise ValueError(f"{path} is not a fitted step model: {e}") from None
        if not isinstance(d, dict) or d.pop("kind", None) != "linear":
            raise ValueError(f"{path} is not a fitted step model (kind 'linear')")
        return cls(**d)

    @classmethod
    def fit(cls, samples: list[tuple[StepFeatures, float]], source: str = "",
            relative: bool = False) -> LinearStepModel:
        """Non-negative least squares over (features, seconds) samples. Unweighted by default:
        with the per-step term kept, the fitted times of the samples add up to the measured
        total, which is what throughput and queueing depend on (on a shared machine the
        relative-error fit follows the fast steps and predicts a fraction of the busy time).
        `relative`: weight by 1 / seconds (short steps count as much as long ones)."""
        if len(samples) < len(FEATURE_NAMES):
            raise ValueError(f"need at least {len(FEATURE_NAMES)} timed steps to fit, got "
                             f"{len(samples)}")
        x = np.array([f.vector() for f, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        w = 1.0 / np.maximum(y, 1e-6) if relative else np.ones_like(y)
        coef = dict(zip(FEATURE_NAMES, _nnls(x * w[:, None], y * w).tolist()))
        return cls(**coef, source=source)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| with x >= 0 by dropping negative coefficients until none is left
    (columns scaled first; enough for a handful of well-separated features)."""
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    a = a / scale
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return x / scale


# ---- roofline ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bandwidth: float  # bytes/s (datasheet)
    flops: float  # dense bf16 FLOP/s (datasheet, no sparsity)
    memory_bytes: float  # device memory
    bandwidth_efficiency: float = 0.8  # reachable fraction of the bandwidth
    flops_efficiency: float = 0.55  # reachable fraction of the FLOP/s in prefill GEMMs
    step_overhead_s: float = 1e-3  # scheduling, launch, sampling per step
    seq_overhead_s: float = 5e-6  # per request in the step (metadata, sampling)


DEVICES = {
    "h200": DeviceSpec("h200", 4.8e12, 989e12, 141e9),
    "h100": DeviceSpec("h100", 3.35e12, 989e12, 80e9),
    "a100": DeviceSpec("a100", 2.039e12, 312e12, 80e9),
    "l40s": DeviceSpec("l40s", 0.864e12, 362e12, 48e9),
    # this repository's 2-core EPYC: ~33 GB/s of weights read per decode step (README) and
    # oneDNN float32 GEMMs of a few hundred GFLOP/s; a rough stand-in for a fitted model
    "cpu": DeviceSpec("cpu", 33e9, 3e11, 16e9, 1.0, 1.0, 2e-3, 2e-5),
}


# the config fields a ModelShape reads (its own and the experts' of `moe_shape`)
CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
                 "max_position_embeddings", "model_type", "num_experts", "num_local_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    # a mixture of experts (`nanokv.models.moe_shape`): its sparse layers hold num_experts
    # experts of expert_width (and a shared one of shared_width); each token runs top_k
    sparse_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_width: int = 0
    shared_width: int = 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        try:
            heads = cfg["num_attention_heads"]
            moe = moe_shape(cfg)
            experts = {} if moe is None else dict(
                sparse_layers=sum(moe.sparse_layers), num_experts=moe.num_experts,
                top_k=moe.top_k, expert_width=moe.expert_width, shared_width=moe.shared_width)
            return cls(cfg["num_hidden_layers"], cfg["hidden_size"], heads,
                       cfg.get("num_key_value_heads", heads),
                       cfg.get("head_dim") or cfg["hidden_size"] // heads,
                       cfg["intermediate_size"], cfg["vocab_size"],
                       bool(cfg.get("tie_word_embeddings", False)),
                       cfg.get("max_position_embeddings", 8192), **experts)
        except KeyError as e:
            raise ValueError(f"the model config lacks {e.args[0]!r}") from None

    @classmethod
    def load(cls, model_dir: str) -> ModelShape:
        """The shape of a config directory (a multimodal one's `text_config`: the decoder the
        engine runs), with the fields its file leaves at their defaults filled in as
        transformers fills them (transformers 5 saves only what differs from
        them: a Qwen3-MoE config.json may hold no num_experts); the file alone where
        transformers cannot read it (an architecture it does not know)."""
        path = f"{model_dir}/config.json"
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e}") from e
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_dir)
        except Exception:  # noqa: BLE001 - transformers raises many types for configs it lacks
            return cls.from_hf_config(raw.get("text_config", raw))
        if "text_config" in raw:  # a multimodal checkpoint (Gemma 3): its text decoder
            config, raw = config.text_config, raw["text_config"]
        full = {key: getattr(config, key) for key in CONFIG_FIELDS if hasattr(config, key)}
        return cls.from_hf_config({**full, **raw})

    @property
    def num_params(self) -> int:
        """Parameters (embeddings and lm_head once each unless tied; norms ignored)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        dense = 3 * h * self.intermediate_size
        sparse = (self.num_experts * self._expert_params + 3 * h * self.shared_width
                  + h * (self.num_experts + (1 if self.shared_width else 0)))  # + routers
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (self.num_layers * attn + (self.num_layers - self.sparse_layers) * dense
                + self.sparse_layers * sparse + emb)

    @property
    def _expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_width

    @property
    def matmul_params(self) -> int:
        """Parameters each token multiplies (the input embedding is a lookup; of each sparse
        layer's experts, its top_k)."""
        idle = self.sparse_layers * (self.num_experts - self.top_k) * self._expert_params
        return self.num_params - idle - self.vocab_size * self.hidden_size * (
            0 if self.tie_word_embeddings else 1)

    def params_read(self, num_tokens: int) -> float:
        """Parameters a step of num_tokens tokens reads: all but the experts none of its
        tokens picks (expected, each token's top_k drawn uniformly)."""
        if not self.sparse_layers:
            return self.num_params
        untouched = (1 - self.top_k / self.num_experts) ** num_tokens
        return (self.num_params - self.sparse_layers * self.num_experts * untouched
                * self._expert_params)


@dataclass
class RooflineStepModel(StepModel):
    device: DeviceSpec
    model: ModelShape
    kv_bytes_per_token: float  # every layer's K and V of one token, as the KV cache stores it
    weight_bytes_per_param: float = 2.0  # bf16 weights
    name = "roofline"

    @property
    def weight_bytes(self) -> float:
        return self.model.num_params * self.weight_bytes_per_param

    def step_time(self, f: StepFeatures) -> float:
        m, dev = self.model, self.device
        # K/V read once per step (flash attention streams them): each decode its context, each
        # prefill chunk its earlier slots; every new token's K/V written once
        kv = f.decode_context + f.prefill_context + f.num_tokens
        weights = m.params_read(f.num_tokens) * self.weight_bytes_per_param
        moved = weights + self.kv_bytes_per_token * kv
        attn_flops = 4 * m.num_layers * m.num_heads * m.head_dim * (f.decode_context
                                                                     + f.prefill_pairs)
        flops = 2 * m.matmul_params * f.num_tokens + attn_flops
        t = max(moved / (dev.memory_bandwidth * dev.bandwidth_efficiency),
                flops / (dev.flops * dev.flops_efficiency))
        return t + dev.step_overhead_s + dev.seq_overhead_s * f.num_seqs

    def describe(self) -> str:
        d = self.device
        return (f"roofline {d.name}: {d.memory_bandwidth / 1e12:.2f} TB/s x "
                f"{d.bandwidth_efficiency}, {d.flops / 1e12:.0f} TFLOP/s x {d.flops_efficiency}, "
                f"weights {self.weight_bytes / 2**30:.1f} GiB, KV {self.kv_bytes_per_token:.0f} "
                f"B/token, overhead {d.step_overhead_s * 1e3:.1f} ms/step")

    def to_json(self) -> str:
        return json.dumps({"kind": "roofline", "device": asdict(self.device),
                           "model": asdict(self.model),
                           "kv_bytes_per_token": self.kv_bytes_per_token}, indent=1)


# ---- measuring this engine --------------------------------------------------------------------

class StepRecorder:
    """Times every `engine.step()` and keeps (StepFeatures, seconds) samples; attach to an
    `LLMEngine` before running it (wraps its scheduler's `schedule` on the instance)."""

    def __init__(self, engine) -> None:
        self.samples: list[tuple[StepFeatures, float]] = []
        self._engine = engine
        self._pending: StepFeatures | None = None
        self._t0 = 0.0
        schedule, step = engine.scheduler.schedule, engine.step

        def timed_schedule():
            out = schedule()
            self._pending = StepFeatures.of(out.scheduled) if not out.is_empty else None
            return out

        def timed_step():
            t0 = time.perf_counter()
            result = step()
            if self._pending is not None:
                self.samples.append((self._pending, time.perf_counter() - t0))
                self._pending = None
            return result

        engine.scheduler.schedule = timed_schedule
        engine.step = timed_step

    def fit(self, source: str = "") -> LinearStepModel:
        return LinearStepModel.fit(self.samples, source)
