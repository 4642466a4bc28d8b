"""A PEFT LoRA checkpoint, read and checked against the model before any request uses it.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, ...) and
`adapter_model.safetensors` with, per adapted projection, `lora_A.weight` [r, in] and
`lora_B.weight` [out, r] under the module's name
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`). A projection's output
becomes W x + scaling * B (A x), scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA),
which is what PEFT's `LoraLayer` computes at inference (dropout off). Here the scaling is folded
into B once: an adapter is its `AdapterWeights`.
"""

from __future__ import annotations

import json
import math
import os
import re
import torch
from safetensors.torch import load_file

# the projections an adapter may target, by their Hugging Face names
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(" + "|".join(PROJECTIONS) + r")\.lora_([AB])\.weight")
# config keys whose non-default values change what the adapter computes, and are not supported
_UNSUPPORTED = {
    "use_dora": (False, "DoRA (use_dora)"),
    "bias": ("none", "trained biases (bias)"),
    "lora_bias": (False, "trained biases (lora_bias)"),
    "fan_in_fan_out": (False, "fan_in_fan_out weights (Conv1D models)"),
}


# an adapter's weights on the host: per (layer, projection) (A [r, in], scaling * B [out, r]),
# float32
AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: str) -> dict:
    """The directory's adapter_config.json, checked for what nanokv computes."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is not a directory (a PEFT adapter directory "
                         f"holds adapter_config.json and adapter_model.safetensors)")
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json must be an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r} is a {config['peft_type']} adapter; only LORA "
                         f"adapters are supported")
    for key, (default, what) in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None):
            raise ValueError(f"LoRA adapter {path!r} uses {what} = {value!r}, which is not "
                             f"supported (allowed: {default!r})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r} sets {key} ({config[key]!r}); adapters "
                             f"with {key} are not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"LoRA adapter {path!r}: adapter_config.json's {key} must be a "
                             f"number > 0, got {value!r}")
    return config


def load_adapter(path: str, shapes: list[dict[str, tuple[int, int]]],
                 max_lora_rank: int) -> AdapterWeights:
    """Read and check a PEFT adapter: its rank at most max_lora_rank, each tensor a projection
    that its layer takes (`shapes[layer]`: projection -> (in, out) features) with both A and B
    of the adapter's rank and the projection's shape. Raises ValueError saying what is wrong."""
    num_layers = len(shapes)
    config = read_adapter_config(path)
    rank = config["r"]
    if not isinstance(rank, int) or rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, more than max_lora_rank "
                         f"{max_lora_rank}; raise max_lora_rank")
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        other = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors{other}")
    tensors = load_file(file)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            unknown.append(key)
            continue
        layer, projection, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r}: {key} is for layer {layer}, the model has "
                             f"{num_layers}")
        parts.setdefault((layer, projection), {})[which] = tensor
    if unknown:
        raise ValueError(f"LoRA adapter {path!r} holds tensors nanokv cannot apply: "
                         f"{unknown[:3]}{' ...' if len(unknown) > 3 else ''}; supported: "
                         f"lora_A / lora_B of the decoder layers' {list(PROJECTIONS)}")
    if not parts:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    weights = {}
    for (layer, projection), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {projection} has lora_"
                             f"{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if projection not in shapes[layer]:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {projection} cannot take an "
                             f"adapter (a mixture of experts' MLP takes none); this layer's "
                             f"projections: {sorted(shapes[layer])}")
        fan_in, fan_out = shapes[layer][projection]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {projection} has lora_A "
                             f"{list(a.shape)} and lora_B {list(b.shape)}; the model needs "
                             f"[{rank}, {fan_in}] and [{fan_out}, {rank}] (rank r={rank})")
        weights[(layer, projection)] = (a.float(), b.float() * scaling)
    return weights
