"""The mixture-of-experts part of a Hugging Face config, read the way its model class reads it.

    Qwen2-MoE / Qwen3-MoE   num_experts, num_experts_per_tok, moe_intermediate_size,
                            norm_topk_prob, decoder_sparse_step, mlp_only_layers (those layers,
                            and the ones the step skips, keep a dense MLP of intermediate_size);
                            Qwen2-MoE adds a shared expert (shared_expert_intermediate_size)
    Mixtral (model_type     num_local_experts, num_experts_per_tok; every layer sparse, each
    "mixtral")              expert of intermediate_size, the top-k weights renormalized

Plain config objects and config.json dicts both work (the simulator reads the dict; no torch
here). A config without experts gives None.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int  # experts per token
    expert_width: int  # each routed expert's intermediate size
    shared_width: int  # the shared expert's intermediate size (0: none)
    normalize: bool  # the top-k weights renormalized to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP

    @property
    def dense_layers(self) -> int:
        return len(self.sparse_layers) - sum(self.sparse_layers)


def _get(cfg, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def moe_shape(cfg) -> MoEShape | None:
    """The experts of a config (an object or a config.json dict); None for a dense model.
    Raises ValueError on values the model classes cannot build."""
    mixtral = _get(cfg, "model_type") == "mixtral"
    experts = _get(cfg, "num_local_experts") if mixtral else _get(cfg, "num_experts")
    if not experts:
        return None
    layers = _get(cfg, "num_hidden_layers")
    top_k = _get(cfg, "num_experts_per_tok")
    for name, value in (("num_experts", experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok {top_k} is more than the {experts} experts")
    if mixtral:
        return MoEShape(experts, top_k, _get(cfg, "intermediate_size"), 0, True,
                        (True,) * layers)
    step = _get(cfg, "decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be an integer >= 1, got {step!r}")
    dense = set(_get(cfg, "mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return MoEShape(experts, top_k, _get(cfg, "moe_intermediate_size"),
                    _get(cfg, "shared_expert_intermediate_size") or 0,
                    bool(_get(cfg, "norm_topk_prob", False)), sparse)


def mlp_widths(cfg) -> list[int]:
    """The intermediate sizes of the model's MLPs (dense, routed expert, shared expert): what
    tensor parallelism splits."""
    moe = moe_shape(cfg)
    if moe is None:
        return [_get(cfg, "intermediate_size")]
    widths = [moe.expert_width] if any(moe.sparse_layers) else []
    if moe.dense_layers:
        widths.append(_get(cfg, "intermediate_size"))
    if moe.shared_width:
        widths.append(moe.shared_width)
    return widths


def mlp_token_width(cfg) -> int:
    """The widest intermediate activation one token makes in an MLP: a dense layer's
    intermediate_size, or a sparse layer's top_k experts and shared expert together."""
    moe = moe_shape(cfg)
    if moe is None:
        return _get(cfg, "intermediate_size")
    sparse = moe.top_k * moe.expert_width + moe.shared_width
    return max(sparse, _get(cfg, "intermediate_size") if moe.dense_layers else 0)
