"""Where the engine's parts meet, in the order the engine is built:

    resolve_parts   config + model config -> which KV cache kind with which settings, the default
                    policy, the attention backend name: every compatibility check, before any
                    weight is loaded
    plan_kv_cache   the kind's spec against the memory budget -> KVCachePlan (plain data)
    build_kv_cache  the plan, the allocated KV cache and the attention backend chosen for it
                    (the one choice; the plan reserves decode scratch only for a backend that
                    dequantizes the blocks it reads)
    startup_report  what the engine logs at start-up

`LLMEngine.__init__` calls these and builds the parts from their results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from nanokv.attention.backend import AttentionBackend
from nanokv.attention.selector import backend_names, select_backend
from nanokv.cache.kv_cache import KVCache, KVCacheOptions, KVCacheSpec, check_policy_support
from nanokv.cache.layout import KVLayout, common_window, sliced_request_blocks
from nanokv.cache.registry import KV_CACHE_DTYPES, kv_cache_class, kv_cache_settings
from nanokv.config import EngineConfig, auto_block_size
from nanokv.distributed.support import check_tensor_parallel
from nanokv.engine.kv_cache_plan import (
    KVBudget,
    KVCachePlan,
    budget_blocks,
    estimate_activation_bytes,
    kv_budget,
)
from nanokv.models.registry import model_class
from nanokv.worker.loader import load_hf_config
from nanokv.worker.profiler import measure_activation_bytes
from nanokv.policies.base import PolicyConfig, policy_class
from nanokv.spec.config import SpeculativeConfig
from nanokv.utils import head_dim_of

logger = logging.getLogger("nanokv")


@dataclass(frozen=True)
class EngineParts:
    """What the config resolved to, before anything is loaded."""

    kv_cache_class: type[KVCache]
    kv_cache_settings: dict
    default_policy: PolicyConfig | None
    max_model_len_given: bool  # False: it may be lowered to what the pool holds
    draft_layers: int = 0  # a draft model's layers, held in the pool after the model's
    # per layer, its sliding window (`KVLayout.sliding_windows`; () when none is active)
    sliding_windows: tuple[int | None, ...] = ()


def engine_policy(config: EngineConfig) -> PolicyConfig | None:
    """The engine's default KV policy as a validated PolicyConfig (None: full cache)."""
    if config.kv_policy is None or config.kv_policy == "full":
        return None
    return PolicyConfig(config.kv_policy, budget=config.kv_budget,
                        compression_ratio=config.kv_compression_ratio,
                        options=dict(config.kv_policy_options or {}))


def resolve_parts(config: EngineConfig, hf_config, architecture: str) -> EngineParts:
    """Resolve the config's 'auto' values against the model (block_size, max_model_len: this is
    the one place) and check every part against the others; raises ValueError before anything
    is loaded."""
    given = config.max_model_len is not None
    auto_block = config.block_size == "auto"
    config.resolve(int(hf_config.max_position_embeddings))
    windows = model_class(architecture).layer_windows(hf_config, config.max_model_len)
    soft_cap = model_class(architecture).attention_soft_cap(hf_config)
    window = common_window(windows, hf_config.num_hidden_layers)
    if auto_block and window is not None:  # a request holds about its window's blocks
        config.block_size = auto_block_size(config.max_model_len, window)
    check_tensor_parallel(config, hf_config)
    if config.enable_lora and config.tensor_parallel_size != 1:
        raise ValueError(f"enable_lora runs with tensor_parallel_size 1 only (the adapters are "
                         f"not sharded), got {config.tensor_parallel_size}")
    names = backend_names()
    if config.attention_backend not in names:
        raise ValueError(f"attention_backend must be one of {names}, "
                         f"got {config.attention_backend!r}")
    spec = config.speculative
    draft_layers = 0
    if spec is not None and spec.method == "draft_model":
        draft_layers = check_draft_model(config, hf_config, spec.model, soft_cap)
    # dtype is not known before loading; the settings do not depend on it
    layout = KVLayout(hf_config.num_hidden_layers + draft_layers, hf_config.num_key_value_heads,
                      head_dim_of(hf_config), config.block_size, torch.float32)
    kv_class, settings = kv_cache_settings(
        KVCacheOptions(config.kv_cache_dtype, config.max_num_seqs, config.kv_quant_bits,
                       config.kv_quant_config), layout)
    if windows:
        check_sliding_windows(config, windows)
    if soft_cap is not None:
        check_soft_cap(config, soft_cap)
    policy = engine_policy(config)
    if policy is not None:
        built = policy.build(block_size=config.block_size)  # validates the option values
        check_policy_support(kv_class, built)
    elif config.kv_policy is not None and config.kv_policy != "full":
        policy_class(config.kv_policy)
    if spec is not None:
        check_speculation(config, spec, kv_class, policy)
    return EngineParts(kv_class, settings, policy, given, draft_layers, windows)


def check_sliding_windows(config: EngineConfig, windows: tuple[int | None, ...]) -> None:
    """A model whose layers attend over sliding windows runs on any KV cache (every backend
    reads a window's slots only), without a KV policy (its evictions would move the window's
    slots) and without a draft model (whose layers share the pool's slots)."""
    window = min(w for w in windows if w is not None)
    if config.kv_policy is not None and config.kv_policy != "full":
        raise ValueError(f"this model attends over a sliding window ({window} tokens) on some "
                         f"layers: it runs without a KV policy (its own window frees the blocks "
                         f"behind it), got kv_policy {config.kv_policy!r}")
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        raise ValueError(f"this model attends over a sliding window ({window} tokens) on some "
                         f"layers: speculative decoding with a draft model is not supported "
                         f"with it; use method \"ngram\"")


def check_soft_cap(config: EngineConfig, soft_cap: float) -> None:
    """A model whose attention soft-caps its scores (Gemma 2) runs on the float pool
    (kv_cache_dtype "auto"), whose backends apply the cap (torch, native, triton:
    `AttentionBackend.supports_soft_cap`); the quantized stores' kernels take none."""
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"this model soft-caps its attention scores (attn_logit_softcapping "
                         f"{soft_cap}), which the attention kernels of kv_cache_dtype "
                         f"{config.kv_cache_dtype!r} do not apply: it runs with kv_cache_dtype "
                         f"'auto' (the float KV pool)")


def check_draft_model(config: EngineConfig, hf_config, path: str,
                      soft_cap: float | None = None) -> int:
    """A draft model's checkpoint against the model's, before either is loaded: its layers
    share the model's KV pool (the same KV heads and head size) and attention backend (the same
    attention soft-cap, `soft_cap` the model's), its token ids are the model's (the same
    vocabulary size), it covers max_model_len, it runs in this process. Returns its layer
    count."""
    name = "speculative_config model"
    if config.tensor_parallel_size != 1:
        raise ValueError(f"a draft model ({name}) runs with tensor_parallel_size 1 only, got "
                         f"{config.tensor_parallel_size}; use method \"ngram\" under tensor "
                         f"parallelism")
    try:
        draft, arch = load_hf_config(path)
        model_class(arch)
    except ValueError as e:
        raise ValueError(f"{name} {path!r}: {e}") from None
    shape = (draft.num_key_value_heads, head_dim_of(draft))
    target = (hf_config.num_key_value_heads, head_dim_of(hf_config))
    if shape != target:
        raise ValueError(f"{name} {path!r} has {shape[0]} KV heads of {shape[1]} channels, the "
                         f"model {target[0]} of {target[1]}: a draft model's layers share the "
                         f"model's KV pool, so both must match")
    if draft.vocab_size != hf_config.vocab_size:
        raise ValueError(f"{name} {path!r} has a vocabulary of {draft.vocab_size} tokens, the "
                         f"model {hf_config.vocab_size}: a draft model must share the model's "
                         f"token ids")
    draft_cap = model_class(arch).attention_soft_cap(draft)
    if draft_cap != soft_cap:
        raise ValueError(f"{name} {path!r} soft-caps its attention scores at {draft_cap}, the "
                         f"model at {soft_cap} (attn_logit_softcapping; None: none): a draft "
                         f"model's layers run through the model's attention backend, so both "
                         f"must match")
    if model_class(arch).layer_windows(draft, config.max_model_len):
        raise ValueError(f"{name} {path!r} attends over a sliding window within max_model_len "
                         f"{config.max_model_len}: a draft model must attend over the whole "
                         f"context")
    if draft.max_position_embeddings < config.max_model_len:
        raise ValueError(f"{name} {path!r} covers {draft.max_position_embeddings} positions "
                         f"(max_position_embeddings), less than max_model_len "
                         f"{config.max_model_len}; lower max_model_len")
    return int(draft.num_hidden_layers)


def check_speculation(config: EngineConfig, spec: SpeculativeConfig, kv_class: type[KVCache],
                      policy: PolicyConfig | None) -> None:
    """Speculative decoding writes draft tokens' K/V that a rejection leaves behind, to be
    written over: a cache kind that allows it (`KVCache.supports_speculation`: slots that stand
    alone, or partial blocks staged until they fill), no KV policy (its scores and evictions
    would see the drafts)."""
    if not kv_class.supports_speculation:
        allowed = [d for d in KV_CACHE_DTYPES if kv_cache_class(d).supports_speculation]
        raise ValueError(f"speculative_config needs a KV cache whose slots a rejected draft "
                         f"token leaves can be written again: kv_cache_dtype one of {allowed}, "
                         f"got {config.kv_cache_dtype!r}")
    if spec.method == "draft_model" and kv_class.quantizes_full_blocks:
        allowed = [d for d in KV_CACHE_DTYPES if kv_cache_class(d).supports_speculation
                   and not kv_cache_class(d).quantizes_full_blocks]
        raise ValueError(f"a draft model's layers share the KV cache, whose block statistics "
                         f"and staging are the model's: kv_cache_dtype one of {allowed} with a "
                         f"draft model, got {config.kv_cache_dtype!r}")
    if policy is not None:
        raise ValueError(f"speculative_config does not go with a KV policy (kv_policy "
                         f"{config.kv_policy!r}: its scores and evictions would see draft "
                         f"tokens); leave one of them unset")


def scaled_spec(spec: KVCacheSpec, copies: int) -> KVCacheSpec:
    """The cost of `copies` caches of one spec together (tensor-parallel ranks that share one
    memory budget: each holds the same blocks for its share of the KV heads)."""
    return KVCacheSpec(spec.kv_cache_dtype, spec.bytes_per_block * copies,
                       spec.fixed_bytes * copies, spec.scratch_bytes_per_block * copies)


def measure_kv_budget(config: EngineConfig, model, hf_config, device: torch.device,
                      dtype: torch.dtype) -> KVBudget | None:
    """The KV cache's byte budget (once: free memory drops when the cache is allocated); None
    when num_kv_blocks gives the block count."""
    if config.num_kv_blocks is not None:
        return None
    activation = measure_activation_bytes(model, config.max_num_batched_tokens, device)
    if activation is None:
        activation = (estimate_activation_bytes(hf_config, config.max_num_batched_tokens,
                                                config.max_num_seqs, dtype), "estimated")
    budget = kv_budget(device=device, kv_cache_memory=config.kv_cache_memory,
                       fraction=config.kv_cache_memory_fraction, activation_bytes=activation[0])
    return replace(budget, source=f"{budget.source}; peak activations "
                                  f"{activation[0] / 2**20:.0f} MiB, {activation[1]}")


def plan_kv_cache(config: EngineConfig, spec: KVCacheSpec, layout: KVLayout,
                  budget: KVBudget | None, max_model_len_given: bool,
                  reserve_scratch: bool,
                  layer_windows: tuple[int | None, ...] | None = None) -> KVCachePlan:
    """Blocks from num_kv_blocks or the budget (decode scratch reserved per block when
    `reserve_scratch`: see `budget_blocks`); max_model_len lowered to the pool when it was not
    given (a ValueError when it was and one request cannot fit: with a sliding window on every
    layer, the window and a step's tokens; with `layer_windows` (`hybrid_layer_windows`), the
    full layers' context and the windowed layers' windows: `KVLayout.max_request_blocks`)."""
    bs = config.block_size
    blocks_per_seq = layout.max_request_blocks(config.max_model_len,
                                               config.max_num_batched_tokens, layer_windows)
    if budget is None:
        num_blocks, source = config.num_kv_blocks, "num_kv_blocks"
    else:
        num_blocks, source = budget_blocks(spec, budget, reserve_scratch=reserve_scratch,
                                           max_useful_blocks=config.max_num_seqs * blocks_per_seq)
    max_model_len = config.max_model_len
    if num_blocks < blocks_per_seq:
        fit = num_blocks * bs
        if layer_windows is not None:  # the longest context whose slices the pool holds
            fit = bs * _most_blocks(lambda x: sliced_request_blocks(
                x * bs, layer_windows, bs, config.max_num_batched_tokens) <= num_blocks,
                num_blocks * layout.num_layers)
        if max_model_len_given:
            raise ValueError(f"the KV pool ({num_blocks} blocks = {fit} tokens) cannot hold "
                             f"one request of max_model_len {max_model_len} ({blocks_per_seq} "
                             f"blocks at once); lower max_model_len or raise kv_cache_memory")
        logger.warning("max_model_len lowered from %d to %d to fit the KV pool", max_model_len,
                       fit)
        max_model_len = fit
        blocks_per_seq = min(blocks_per_seq, layout.max_request_blocks(
            fit, config.max_num_batched_tokens, layer_windows))
    return KVCachePlan(spec, num_blocks, bs, max_model_len, source, blocks_per_seq)


def _most_blocks(fits: Callable[[int], bool], high: int) -> int:
    """The largest x in [1, high] with fits(x), fits monotonic (true up to some x, fits(1))."""
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def hybrid_layer_windows(config: EngineConfig, layout: KVLayout, kv_cache
                         ) -> tuple[int | None, ...] | None:
    """Each layer's window when windowed layers give back what their windows pass (the
    scheduler's `layer_windows`): a model whose layers mix windows and full attention, on a KV
    cache with per-layer tables (the float pool), unless disable_hybrid_kv_cache_manager; else
    None (every layer keeps every block)."""
    if config.disable_hybrid_kv_cache_manager or not kv_cache.supports_layer_slices:
        return None
    return layout.mixed_windows


def build_kv_cache(config: EngineConfig, spec: KVCacheSpec, layout: KVLayout,
                   budget: KVBudget | None,
                   max_model_len_given: bool, create: Callable[[int], KVCache],
                   device: torch.device, layer_windows: tuple[int | None, ...] | None = None,
                   soft_cap: float | None = None
                   ) -> tuple[KVCachePlan, KVCache, type[AttentionBackend], str]:
    """Plan the pool, allocate it (`create(num_blocks)`) and choose the attention backend: the
    one place it is chosen. The plan first gives the decode scratch's bytes to blocks (a backend
    that reads the codes in place needs none); when the chosen backend dequantizes the blocks it
    reads and that changes the block count, the cache is planned and allocated again, with the
    scratch reserved (the choice stays: same kind, same settings, same device)."""
    plan = plan_kv_cache(config, spec, layout, budget, max_model_len_given,
                         reserve_scratch=False, layer_windows=layer_windows)
    kv_cache = create(plan.num_blocks)
    backend_class, why = select_backend(config.attention_backend, kv_cache, device, soft_cap)
    if backend_class.dequantizes_blocks:
        reserved = plan_kv_cache(config, spec, layout, budget, max_model_len_given,
                                 reserve_scratch=True, layer_windows=layer_windows)
        if reserved.num_blocks != plan.num_blocks:
            del kv_cache  # freed before the smaller one is allocated
            plan, kv_cache = reserved, create(reserved.num_blocks)
    return plan, kv_cache, backend_class, why


def startup_report(config: EngineConfig, model, device: torch.device, dtype_note: str,
                   plan: KVCachePlan, kv_cache: KVCache, backend, backend_why: str) -> list[str]:
    """The start-up log: model and dtype, the pool (blocks, tokens, MiB, bytes per token), a
    quantized cache's bytes by category, concurrency at max_model_len, the attention backend."""
    slots = plan.num_slots
    per_token = kv_cache.nbytes / slots
    lines = [
        f"model {config.model} ({type(model).__name__}) on {device}, {dtype_note}",
        f"KV cache: {plan.num_blocks} blocks x {plan.block_size} tokens = {slots} tokens, "
        f"{kv_cache.nbytes / 2**20:.1f} MiB ({plan.source}); {per_token / 1024:.1f} KiB per "
        f"token",
    ]
    breakdown = kv_cache.memory_breakdown()
    if breakdown:
        layout = kv_cache.layout
        float_per_token = layout.bytes_per_block / layout.block_size
        parts = ", ".join(f"{name} {n / slots:.1f}" for name, n in breakdown.items() if n)
        lines.append(f"KV cache dtype {kv_cache.kv_cache_dtype}: {per_token:.1f} bytes per token "
                     f"held ({parts}), {per_token / float_per_token:.3f}x the "
                     f"{str(layout.dtype).removeprefix('torch.')} pool's {float_per_token:.0f}")
    lines.append(f"max concurrency at max_model_len {plan.max_model_len}: "
                 f"{plan.max_concurrency:.2f} requests")
    cap = ("" if backend.soft_cap is None
           else f"; scores soft-capped at {backend.soft_cap:g} (attn_logit_softcapping)")
    lines.append(f"attention backend: {backend.name} ({backend.description}; {backend_why})"
                 f"{cap}")
    windows = kv_cache.layout.sliding_windows
    if windows:
        sizes = sorted({w for w in windows if w is not None})
        freed = ("a request's blocks behind it are freed after each step"
                 if kv_cache.layout.common_window is not None
                 else "the other layers attend over the whole context; a request short of "
                      "blocks gives the windowed layers' passed slices to their new tokens "
                      "(hybrid KV cache manager)"
                 if hybrid_layer_windows(config, kv_cache.layout, kv_cache) is not None
                 else "the other layers attend over the whole context: every block is kept")
        lines.append(f"sliding-window attention: {'/'.join(map(str, sizes))} tokens on "
                     f"{sum(w is not None for w in windows)} of {len(windows)} layers; {freed}")
    spec = config.speculative
    if spec is not None:
        by_batch = "" if spec.per_batch_size is None else " (by batch size: " + ", ".join(
            f"{first}-{last}: {min(k, spec.num_speculative_tokens)}"
            for first, last, k in spec.per_batch_size) + ")"
        source = (f"from n-grams of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens"
                  if spec.method == "ngram" else f"from the draft model {spec.model}")
        lines.append(f"speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} "
                     f"draft tokens a step{by_batch} {source}")
    return lines
