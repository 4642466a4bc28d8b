"""The engine's LoRA options, checked (EngineConfig and LoRAManager)."""

from __future__ import annotations

from nanokv.validation import check_int


def check_lora_options(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> None:
    check_int("max_loras", max_loras, 1)
    check_int("max_lora_rank", max_lora_rank, 1)
    if max_cpu_loras is not None:
        check_int("max_cpu_loras", max_cpu_loras, 1)
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras "
                             f"({max_loras})")
