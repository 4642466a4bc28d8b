"""Which LoRA adapter a request runs with: vLLM's `LoRARequest(lora_name, lora_int_id,
lora_path)`."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (the server's `model` field); lora_int_id: its id, >= 1,
    unique per adapter for the engine's lifetime (the prefix cache keys blocks by it);
    lora_path: a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the path of a PEFT adapter directory, "
                             f"got {self.lora_path!r}")


def parse_lora_modules(values: list[str]) -> tuple[LoRARequest, ...]:
    """The server's --lora-modules, vLLM's forms: `name=path`, or JSON
    `{"name": ..., "path": ..., "base_model_name": ...}` (base_model_name is accepted and
    not used). Ids 1, 2, ... in order; names must differ."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {value!r} is not JSON ({e})") from None
            unknown = sorted(set(spec) - {"name", "path", "base_model_name"}) \
                if isinstance(spec, dict) else None
            if unknown is None or unknown or "name" not in spec or "path" not in spec:
                raise ValueError(f"--lora-modules {value!r}: a JSON module is an object with "
                                 f"\"name\" and \"path\" (and optionally \"base_model_name\")")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: give name=path or a JSON object "
                                 f"with \"name\" and \"path\"")
        modules.append(LoRARequest(name, len(modules) + 1, path))
    names = [m.lora_name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names must differ; given more than once: {twice}")
    return tuple(modules)
