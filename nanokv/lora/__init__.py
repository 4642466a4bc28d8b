"""LoRA adapters served next to the base model (vLLM's `enable_lora`, `LoRARequest`).

    request.py  LoRARequest: which adapter a request runs with (name, id, PEFT directory)
    adapter.py  a PEFT checkpoint read and checked against the model: per (layer, projection)
                its A [r, in] and scaled B [out, r]
    layers.py   LoRALinear: a projection plus each step's adapters, over slices of rows
    manager.py  LoRAManager: the adapters loaded (an LRU of max_cpu_loras), the max_loras slots
                the step's adapters are copied into, each step's slices of rows by slot
"""

from nanokv.lora.request import LoRARequest

__all__ = ["LoRARequest"]
