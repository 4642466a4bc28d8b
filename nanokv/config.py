"""Engine configuration: every user-settable option, validated; unknown options rejected."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LINEAR_BACKENDS = ("auto", "onednn", "torch")
ATTENTION_BACKENDS = ("auto", "native", "torch")
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 1024

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int (bytes) or a string such as '4GiB', '512MiB', '2.5GB', '1073741824'."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory size {value!r} not understood: use bytes or a number with "
                             f"one of the units B, KB, MB, GB, KiB, MiB, GiB (e.g. '4GiB')")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n <= 0:
        raise ValueError(f"memory size must be > 0, got {value!r}")
    return int(n)


def auto_block_size(max_model_len: int) -> int:
    """The user's table: 128 below 2k, 256 up to 32k, 512 above 32k, 1024 above 100k."""
    if max_model_len < 2048:
        return 128
    if max_model_len <= 32 * 1024:
        return 256
    if max_model_len <= 100 * 1024:
        return 512
    return 1024


@dataclass
class EngineConfig:
    """Options of `LLM(model, **options)` and of the CLI (`--max-num-seqs` = `max_num_seqs`)."""

    model: str
    tokenizer: str | None = None  # defaults to the model directory
    skip_tokenizer_init: bool = False  # token-id prompts only; outputs carry no text
    dtype: str = "auto"  # auto: the checkpoint's dtype where the device computes it natively
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings (fit to pool)
    block_size: int | str = "auto"  # tokens per KV block, 16..1024, or 'auto' (user's table)
    kv_cache_memory: int | str | None = None  # KV pool bytes ('4GiB'); default: fraction below
    kv_cache_memory_fraction: float = 0.9  # of memory left after weights and activations
    num_kv_blocks: int | None = None  # exact pool size in blocks (overrides the memory budget)
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 4096  # tokens per step (prefill chunks + decodes)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; default: torch's choice
    linear_backend: str = "auto"  # auto: oneDNN-packed weights on CPU, torch F.linear elsewhere
    attention_backend: str = "auto"  # auto: C decode kernel on CPU when it builds, else torch
    kv_policy: str | None = None  # KV policy name (nanokv.policies registry); None: full cache
    kv_budget: int | None = None  # tokens a request keeps under the policy
    kv_compression_ratio: float | None = None  # or: fraction of the tokens removed, in [0, 1)
    kv_policy_options: dict | None = None  # the policy's own options
    kv_cache_dtype: str = "auto"  # auto (the float pool), int8, fp8[_e4m3|_e5m2], kvquant
    kv_quant_bits: int | None = None  # kvquant code width 2 / 3 / 4 (default: the file's, or 4)
    kv_quant_config: str | None = None  # calibration JSON of `nanokv calibrate` (kvquant)

    @classmethod
    def from_kwargs(cls, model: str, **options) -> "EngineConfig":
        allowed = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; allowed options: {sorted(allowed)}")
        return cls(model=model, **options)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a local directory path, got {self.model!r}")
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("linear_backend", self.linear_backend, LINEAR_BACKENDS)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.max_model_len is not None:
            _int_at_least("max_model_len", self.max_model_len, 2)
        if self.block_size != "auto":
            if (not isinstance(self.block_size, int) or isinstance(self.block_size, bool)
                    or not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE):
                raise ValueError(f"block_size must be 'auto' or an integer in "
                                 f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {self.block_size!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        if not isinstance(self.kv_cache_memory_fraction, (int, float)) or not (
                0 < self.kv_cache_memory_fraction <= 1):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], "
                             f"got {self.kv_cache_memory_fraction!r}")
        if self.num_kv_blocks is not None:
            _int_at_least("num_kv_blocks", self.num_kv_blocks, 1)
        _int_at_least("max_num_seqs", self.max_num_seqs, 1)
        _int_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "skip_tokenizer_init"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.num_threads is not None:
            _int_at_least("num_threads", self.num_threads, 1)
        if self.kv_policy is None and (self.kv_budget is not None or self.kv_policy_options
                                       or self.kv_compression_ratio is not None):
            raise ValueError("kv_budget, kv_compression_ratio and kv_policy_options need "
                             "kv_policy (a policy name)")
        if self.kv_policy_options is not None and not isinstance(self.kv_policy_options, dict):
            raise ValueError(f"kv_policy_options must be a dict, got {self.kv_policy_options!r}")
        self._validate_kv_quant()

    def _validate_kv_quant(self) -> None:
        from nanokv.quant.kvquant import KVQUANT_BITS
        from nanokv.quant.registry import KV_CACHE_DTYPES

        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_dtype != "kvquant":
            for name in ("kv_quant_bits", "kv_quant_config"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to kv_cache_dtype 'kvquant' only, got "
                                     f"kv_cache_dtype {self.kv_cache_dtype!r}")
        if self.kv_quant_bits is not None and (
                isinstance(self.kv_quant_bits, bool) or self.kv_quant_bits not in KVQUANT_BITS):
            raise ValueError(f"kv_quant_bits must be one of {list(KVQUANT_BITS)}, "
                             f"got {self.kv_quant_bits!r}")
        if self.kv_quant_config is not None and (not isinstance(self.kv_quant_config, str)
                                                 or not self.kv_quant_config):
            raise ValueError(f"kv_quant_config must be the path of a calibration file, "
                             f"got {self.kv_quant_config!r}")
        policy = self.policy_config()
        if self.kv_cache_dtype != "auto" and policy is not None:  # before the model loads
            policy.build(block_size=MIN_BLOCK_SIZE).check_store(self.kv_cache_dtype)

    def policy_config(self):
        """The engine's default KV policy as a validated PolicyConfig (None: full cache)."""
        if self.kv_policy is None or self.kv_policy == "full":
            return None
        from nanokv.policies.base import PolicyConfig

        return PolicyConfig(self.kv_policy, budget=self.kv_budget,
                            compression_ratio=self.kv_compression_ratio,
                            options=dict(self.kv_policy_options or {}))

    def resolve(self, model_max_len: int) -> None:
        """Fill the 'auto' values that depend on the model."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.block_size == "auto":
            self.block_size = auto_block_size(self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so every prompt fits one step")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _int_at_least(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
