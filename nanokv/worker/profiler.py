"""Measure the peak activation memory of one forward pass (before the KV pool exists).

CUDA: torch's peak-allocation counter. CPU: the process's peak resident set (VmHWM), reset
through /proc/self/clear_refs first. On CPU the run uses at most `cpu_tokens` tokens (a full
4k-token step of a 0.6B model takes tens of seconds there) and the result is scaled linearly to
the step's token budget. The run doubles as a warm-up of the kernels.
"""

from __future__ import annotations

import torch

from nanokv.attention.common import StepAttention
from nanokv.attention.no_cache import NoCacheBackend
from nanokv.worker.cpu_memory import proc_status_kib


@torch.inference_mode()
def _forward(model, num_tokens: int, device: torch.device) -> None:
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    # positions only index the RoPE tables here: wrap them into the table's range
    pos = torch.arange(num_tokens, device=device) % model.rotary.max_positions
    hidden, _ = model(ids, pos, StepAttention(NoCacheBackend(device, model.logits_soft_cap), None))
    model.compute_logits(hidden[-1:])


def measure_activation_bytes(model, num_tokens: int, device: torch.device,
                             cpu_tokens: int = 256) -> tuple[int, str] | None:
    """Peak bytes of one forward of `num_tokens` tokens, and how it was found; None when it
    cannot be measured here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _forward(model, num_tokens, device)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, "measured"
    n = min(num_tokens, cpu_tokens)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
        base = proc_status_kib("VmRSS")
        _forward(model, n, device)
        peak = (proc_status_kib("VmHWM") - base) * 1024
    except (OSError, RuntimeError):
        return None
    return int(peak * num_tokens / n), f"measured on {n} tokens, scaled to {num_tokens}"
