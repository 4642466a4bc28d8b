"""Engine configuration: every user-settable option, validated; unknown options rejected."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields

from nanokv.layers.int8_weights import QUANTIZATIONS
from nanokv.lora.options import check_lora_options
from nanokv.spec.config import SpeculativeConfig
from nanokv.validation import check_bool, check_choice, check_fraction, check_int

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LINEAR_BACKENDS = ("auto", "onednn", "torch")
SCHEDULING_POLICIES = ("fcfs", "priority")
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
    if not math.isfinite(n) or n <= 0:
        raise ValueError(f"memory size must be finite and > 0 (bytes), got {value!r}")
    return int(n)


def check_block_size(what: str, value) -> None:
    """`what` an integer in [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE] (the block sizes the engine runs),
    else a ValueError."""
    if (isinstance(value, bool) or not isinstance(value, int)
            or not MIN_BLOCK_SIZE <= value <= MAX_BLOCK_SIZE):
        raise ValueError(f"{what} an integer in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                         f"got {value!r}")


def auto_block_size(max_model_len: int, window: int | None = None) -> int:
    """Larger blocks for longer contexts: the block table (and each step's per-block work) stays
    short, while a short context does not waste most of a large last block. 128 tokens below 2k,
    256 up to 32k, 512 up to 100k, 1024 beyond. With a sliding window on every layer
    (`KVLayout.common_window`) a request holds about the window's blocks however long it runs:
    the window's length decides instead (a 512-token window in 256-token blocks spans 768
    slots, in 128-token blocks 640)."""
    context = max_model_len if window is None else min(max_model_len, window)
    if context < 2048:
        return 128
    if context <= 32 * 1024:
        return 256
    if context <= 100 * 1024:
        return 512
    return 1024


def _opt(default, help: str, **cli):
    """A config field with its CLI help (and argparse settings): the CLI is generated from these
    (`nanokv.cli.add_engine_args`), so each default and description is written once."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """Options of `LLM(model, **options)` and of the CLI (`--max-num-seqs` = `max_num_seqs`)."""

    model: str
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model's)")
    skip_tokenizer_init: bool = _opt(
        False, "load no tokenizer; prompts must be token ids, outputs carry no text")
    dtype: str = _opt("auto", "compute dtype; auto = the checkpoint's where the device has "
                              "native support, else float32", choices=DTYPES)
    device: str = _opt("auto", "auto: cuda when available, else cpu", choices=DEVICES)
    max_model_len: int | None = _opt(
        None, "longest prompt + output in tokens (default: the model's, fit to the pool)",
        type=int)
    block_size: int | str = _opt(
        "auto", "tokens per KV block, 16..1024, or auto (128 below 2k context, 256 up to 32k, "
                "512 above, 1024 above 100k; with a sliding window on every layer, by the "
                "window's length)", type="block_size")
    kv_cache_memory: int | str | None = _opt(
        None, "KV pool size: bytes or with a unit, e.g. 4GiB, 512MiB")
    kv_cache_memory_fraction: float = _opt(
        0.9, "without kv_cache_memory: fraction of the memory left after weights and "
             "activations (on CPU at most 4 GiB); the pool is capped at what max_num_seqs "
             "full-length requests need")
    num_kv_blocks: int | None = _opt(
        None, "exact KV pool size in blocks (overrides the memory budget)", type=int)
    max_num_seqs: int = _opt(64, "requests running at once")
    max_num_batched_tokens: int = _opt(4096, "token budget of one step (prefill chunks + "
                                             "decodes)")
    scheduling_policy: str = _opt(
        "fcfs", "fcfs: waiting requests in arrival order, the newest running one preempted; "
                "priority: by each request's priority (lower first), then arrival, the running "
                "request with the largest (priority, arrival) preempted",
        choices=SCHEDULING_POLICIES)
    enable_prefix_caching: bool = _opt(True, "share full blocks of identical prefixes",
                                       false_flag="--no-prefix-caching")
    enable_chunked_prefill: bool = _opt(
        True, "split long prompts over steps (without it a prompt must fit one step)",
        false_flag="--no-chunked-prefill")
    disable_hybrid_kv_cache_manager: bool = _opt(
        False, "a model whose layers mix sliding-window and full attention (Gemma 3): every "
               "layer keeps every block of a request. By default (as vLLM's hybrid KV cache "
               "manager), on the float KV pool, a request that runs short of blocks hands its "
               "windowed layers' slices behind their windows to its full layers' new tokens "
               "(per-layer block tables): it holds about a window per windowed layer instead "
               "of its whole context, and its blocks from then on are not prefix-cached")
    seed: int = _opt(0, "engine seed (unseeded sampling)")
    num_threads: int | None = _opt(None, "torch CPU threads (default: torch's choice)",
                                   type=int)
    linear_backend: str = _opt(
        "auto", "the dense layers' CPU path. auto: oneDNN-packed weights or the panel "
                "kernel's column panels (whichever is faster per weight shape, measured at "
                "load) and the fused C norm / RoPE / SiLU-and-multiply kernels on CPU (fast "
                "path), torch F.linear elsewhere; torch: the reference path (PyTorch ops only)",
        choices=LINEAR_BACKENDS)
    quantization: str | None = _opt(
        None, "weight quantization: int8 (weight-only, one scale per output row, every linear "
              "layer but a MoE router; CPU, float32 activations) or unset: the checkpoint's "
              "weights in dtype", choices=QUANTIZATIONS)
    attention_backend: str = _opt(
        "auto", "attention implementation, chosen once at start-up. auto: the fastest that "
                "applies (on CPU with a float32 pool the C decode kernel, built on first use "
                "with $CC and cached in $NANOKV_CACHE_DIR or ~/.cache/nanokv), logged with the "
                "reason; on CUDA the Triton kernels (float, int8, fp8 caches; decode over "
                "kvquant / kivi codes); native: the C "
                "kernel or an error; triton: the Triton kernels (CUDA; on CPU only in Triton's "
                "interpreter, TRITON_INTERPRET=1); torch: the PyTorch reference path",
        choices="attention_backends")
    kv_policy: str | None = _opt(
        None, "KV policy (streaming, h2o, snapkv, pyramidkv, knorm, paged_eviction, kvcrush, "
              "kvzip; 'full' or unset: the full cache)")
    kv_budget: int | None = _opt(None, "tokens a request keeps under the policy", type=int)
    kv_compression_ratio: float | None = _opt(
        None, "or: fraction of a request's tokens removed, in [0, 1)", type=float)
    kv_policy_options: dict | None = _opt(
        None, "the policy's options as JSON, e.g. '{\"window\": 32}'", type="json")
    kv_cache_dtype: str = _opt(
        "auto", "KV cache storage: auto (the float pool, compute dtype), int8 / fp8 "
                "(= fp8_e4m3) / fp8_e5m2 (one scale per token and head), kvquant (2-4 bit "
                "KVQuant: per-channel pre-RoPE keys, outliers, sinks), kivi (2/4-bit KIVI: "
                "per-channel keys, per-token values, the newest block in full precision)",
        choices="kv_cache_dtypes")
    kv_quant_bits: int | None = _opt(
        None, "code width of kvquant (2, 3, 4; default: the calibration's decision, else 4) "
              "or kivi (2, 4; default 2)", type=int)
    kv_quant_config: str | None = _opt(
        None, "kvquant calibration JSON written by `nanokv calibrate` (codebooks, key outlier "
              "thresholds, per-layer widths)", metavar="FILE")
    enforce_eager: bool = _opt(
        False, "run every step eagerly: no CUDA graphs for decode steps (on CUDA, decode-only "
               "steps replay a graph captured per batch-size bucket at start-up when the "
               "attention backend supports it and tensor parallelism is off; CPU runs are "
               "always eager)")
    tensor_parallel_size: int = _opt(
        1, "processes the model is split over (heads, MLP, vocabulary and KV heads), started by "
           "the engine: gloo on CPU, one GPU each (NCCL) on CUDA; the model's KV heads must "
           "divide by it")
    speculative_config: dict | None = _opt(
        None, "speculative decoding, vLLM's form (JSON on the CLI): {\"method\": \"ngram\", "
              "\"num_speculative_tokens\": k (1-16), \"prompt_lookup_max\": n, "
              "\"prompt_lookup_min\": m (default 5, or each other), optionally "
              "\"num_speculative_tokens_per_batch_size\": [[first, last, k], ...] (k by "
              "the running batch size, vLLM's)}: each decoding request "
              "drafts up to k tokens a step from the first occurrence of the longest "
              "n-gram ending its tokens (m <= n), verified in one forward pass; or "
              "{\"model\": DIR, \"num_speculative_tokens\": k} (method \"draft_model\"): "
              "a smaller checkpoint with the model's vocabulary, KV heads and head size drafts "
              "k tokens greedily (its layers held in the same KV pool; float, int8 or fp8 "
              "caches, one process); the output is "
              "the one decoding alone gives (greedy, and seeded sampling token for token). "
              "Not with KV policies; structured outputs, bad_words and min_tokens constrain "
              "every draft row (a draft model's drafts are its greedy tokens under those "
              "constraints)", type="json")
    enable_lora: bool = _opt(
        False, "serve LoRA adapters (PEFT directories: adapter_config.json, "
               "adapter_model.safetensors) per request, as vLLM: LLM.generate(..., "
               "lora_request=LoRARequest(name, id, path)), the server's --lora-modules; "
               "adapters of the q/k/v, o, gate/up and down projections; one process (no "
               "tensor parallelism)")
    max_loras: int = _opt(1, "with enable_lora: distinct LoRA adapters running at once (a "
                             "request of another adapter waits)")
    max_lora_rank: int = _opt(16, "with enable_lora: the largest adapter rank r accepted (each "
                                  "adapter slot is this wide)")
    max_cpu_loras: int | None = _opt(
        None, "with enable_lora: adapters kept in memory once read, least recently used "
              "dropped first (default and at least: max_loras)", type=int)

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
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("device", self.device, DEVICES)
        check_choice("linear_backend", self.linear_backend, LINEAR_BACKENDS)
        if self.quantization is not None:
            check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if not isinstance(self.attention_backend, str):
            raise ValueError(f"attention_backend must be a backend name, "
                             f"got {self.attention_backend!r}")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2)
        if self.block_size != "auto":
            check_block_size("block_size must be 'auto' or", self.block_size)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        check_fraction("kv_cache_memory_fraction", self.kv_cache_memory_fraction)
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "skip_tokenizer_init",
                     "enforce_eager", "enable_lora", "disable_hybrid_kv_cache_manager"):
            check_bool(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) \
                or not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) (torch.manual_seed's "
                             f"range), got {self.seed!r}")
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads, 1)
        if self.kv_policy in (None, "full") and (self.kv_budget is not None
                                                 or self.kv_policy_options
                                                 or self.kv_compression_ratio is not None):
            raise ValueError(f"kv_budget, kv_compression_ratio and kv_policy_options need "
                             f"kv_policy (a policy name), got kv_policy={self.kv_policy!r} "
                             f"(the full cache)")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str)
                                           or not self.tokenizer.strip()):
            raise ValueError(f"tokenizer must be the path of a tokenizer directory (default: "
                             f"the model's), got {self.tokenizer!r}")
        if self.kv_policy is not None and (not isinstance(self.kv_policy, str)
                                           or not self.kv_policy):
            raise ValueError(f"kv_policy must be a policy name, got {self.kv_policy!r}")
        if self.kv_budget is not None:
            check_int("kv_budget (tokens a request keeps)", self.kv_budget, 1)
        if self.kv_compression_ratio is not None:
            check_fraction("kv_compression_ratio", self.kv_compression_ratio, low_open=False,
                           high_open=True, meaning=" (the fraction of tokens removed)")
        if self.kv_policy_options is not None and not isinstance(self.kv_policy_options, dict):
            raise ValueError(f"kv_policy_options must be a dict, got {self.kv_policy_options!r}")
        if not isinstance(self.kv_cache_dtype, str):
            raise ValueError(f"kv_cache_dtype must be a string, got {self.kv_cache_dtype!r}")
        if self.kv_quant_bits is not None:
            check_int("kv_quant_bits", self.kv_quant_bits, 1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.kv_quant_config is not None and (not isinstance(self.kv_quant_config, str)
                                                 or not self.kv_quant_config):
            raise ValueError(f"kv_quant_config must be the path of a calibration file, "
                             f"got {self.kv_quant_config!r}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        check_lora_options(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        # which kv_cache_dtype exists, which options it reads and which policies it serves are
        # checked where the KV cache and the policy meet (nanokv/engine/assembly.py)

    def resolve(self, model_max_len: int) -> None:
        """Fill the 'auto' values that depend on the model (the one place they are resolved)."""
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_max_len}")
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.block_size == "auto":
            self.block_size = auto_block_size(self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so every prompt fits one step")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else \
            SpeculativeConfig.from_dict(self.speculative_config)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
