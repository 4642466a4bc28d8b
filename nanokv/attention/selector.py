"""The attention backends, in order of preference, and the one choice made at start-up.

`select_backend(requested, kv_cache, device, soft_cap)`: with "auto" the first backend that can
serve the cache on the device and apply the model's attention logit soft-cap if it has one (a
backend made for it but unusable here, e.g. the C kernel without a compiler, is logged with the
reason); with a name, that backend or a ValueError saying why not.
Adding a backend is one file with its class plus one line in `_BACKENDS`.
"""

from __future__ import annotations

import importlib
import logging

import torch

from nanokv.attention.backend import AttentionBackend

logger = logging.getLogger("nanokv")

_BACKENDS = (  # preference order
    "nanokv.attention.triton_paged:TritonPagedBackend",
    "nanokv.attention.triton_quantized:TritonQuantizedBackend",
    "nanokv.attention.native_cpu:NativeCPUBackend",
    "nanokv.attention.torch_paged:TorchPagedBackend",
    "nanokv.attention.native_quantized:NativeQuantizedBackend",
    "nanokv.attention.quantized:QuantizedTorchBackend",
)


def backend_classes() -> list[type[AttentionBackend]]:
    out = []
    for path in _BACKENDS:
        module, name = path.split(":")
        out.append(getattr(importlib.import_module(module), name))
    return out


def backend_names() -> list[str]:
    return ["auto"] + sorted({cls.name for cls in backend_classes()})


def select_backend(requested: str, kv_cache, device: torch.device,
                   soft_cap: float | None = None) -> tuple[type[AttentionBackend], str]:
    """The backend class and why it was chosen (for the start-up log). soft_cap: the model's
    attention logit soft-cap (None: none); only a backend that applies it is chosen."""
    skipped: list[str] = []
    reasons: list[str] = []
    for cls in backend_classes():
        if requested not in ("auto", cls.name):
            continue
        if requested == "auto" and cls.auto_devices is not None \
                and device.type not in cls.auto_devices:
            continue
        why = cls.why_not(kv_cache, device)
        if why is None and soft_cap is not None and not cls.supports_soft_cap:
            why = (f"it applies no attention logit soft-cap (the model's is {soft_cap})", True)
        if why is None:
            if requested != "auto":
                return cls, f"attention_backend {requested!r}"
            if skipped:
                return cls, "auto; " + "; ".join(skipped)
            return cls, "auto: the first that applies"
        reason, structural = why
        if reason not in reasons:  # two backends of one name may say the same
            reasons.append(reason)
        if not structural:
            skipped.append(f"{cls.name} not used: {reason}")
            if requested == "auto":
                logger.warning("attention backend %s not used (%s); falling back to the next "
                               "(decode attention: PyTorch path)", cls.name, reason)
    raise ValueError(f"attention_backend {requested!r} cannot be used: {'; '.join(reasons)}; "
                     f"use 'auto' or 'torch'")
