"""The KV-policy contract, the policy registry and `PolicyConfig`.

A KV policy decides which of a request's cached tokens stay in the paged cache. Policies are pure:
they see dense tensors and return indices; the engine gathers, calls, compacts and frees blocks
(see `compaction.py` and the hook points in each class's docstring).

What a policy sees, per layer (`LayerKV`):
  keys, values   [n, Hkv, D]  the request's cached slots 0..n-1 gathered from its blocks, in slot
                              (logical) order; keys are stored AFTER RoPE
  positions      [n] int64    the RoPE position of each slot (differs from the slot after eviction)
  attention      [Hq, W, n]   only when `needs_attention`: softmax probabilities of the last W
                              queries (slots n-W..n-1) over all n slots, causal (query w sees slots
                              <= n - W + w), rows summing to 1; `window_attention` computes it
  scores         [Hkv, n]     only when `needs_reconstruction`: per-slot importance from the
                              engine's extra forward pass over the cache (KVzip)

What it returns, per layer: kept SLOT indices (not positions), int64, strictly ascending, either
shared by all KV heads `[C]` or per KV head `[Hkv, C]` (the same count C for every head). Without
a per-layer budget C == the budget; block-granular selections may keep fewer (whole blocks only).
Every layer of a request keeps the same count, except under per-layer budgets (`layer_budgets`).

Block-wise policies (`granularity == "block"`) can also name whole blocks of the block table to
free in place (`blocks_to_free`): block j of the table holds slots j*B .. j*B + B - 1. The block
table is shared by all layers, so such decisions take every layer's block scores at once.

Budgets: `budget` (tokens per sequence and layer) OR `compression_ratio` (the fraction of the cached
tokens to REMOVE, kvpress's convention: 0.75 keeps a quarter, n tokens keep floor(n (1 - r)),
`kept_by_ratio`). `resolve_budget(n)` turns either
into C for a sequence of n cached tokens; it never returns less than the policy's `min_budget`
(unless n itself is smaller) nor more than n. A request whose prompt is shorter than C is not cut
at its compression point: during decode it grows to C (`decode_budget`), then the policy evicts.
"""

from __future__ import annotations

import abc
import inspect
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

import torch

from nanokv.validation import check_fraction, check_int

GRANULARITIES = ("token", "block")
DECODE_MODES = ("none", "reselect", "evict_block")


@dataclass(frozen=True)
class LayerKV:
    """One layer's view of one request's cache, dense. See the module docstring for shapes."""

    keys: torch.Tensor  # [n, Hkv, D]
    values: torch.Tensor  # [n, Hkv, D]
    positions: torch.Tensor | None = None  # [n] int64; None: slot i holds position i
    attention: torch.Tensor | None = None  # [Hq, W, n] window probabilities
    scores: torch.Tensor | None = None  # [Hkv, n] reconstruction scores (KVzip)

    def __post_init__(self) -> None:
        if self.keys.dim() != 3 or self.values.shape != self.keys.shape:
            raise ValueError(f"keys and values must both be [n, Hkv, D], got "
                             f"{tuple(self.keys.shape)} and {tuple(self.values.shape)}")
        n = self.keys.shape[0]
        if self.positions is not None and tuple(self.positions.shape) != (n,):
            raise ValueError(f"positions must be [{n}], got {tuple(self.positions.shape)}")
        if self.attention is not None:
            a = self.attention
            if a.dim() != 3 or a.shape[2] != n or a.shape[1] > n or a.shape[1] < 1:
                raise ValueError(f"attention must be [Hq, W, {n}] with 1 <= W <= {n}, got "
                                 f"{tuple(a.shape)}")
            if a.shape[0] % self.num_kv_heads:
                raise ValueError(f"attention has {a.shape[0]} query heads, not a multiple of the "
                                 f"{self.num_kv_heads} KV heads")
        if self.scores is not None and tuple(self.scores.shape) != (self.num_kv_heads, n):
            raise ValueError(f"scores must be [{self.num_kv_heads}, {n}], got "
                             f"{tuple(self.scores.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]


class KVPolicy(abc.ABC):
    """Base of every KV policy. Subclasses implement `_select` and declare their class attributes.

    Class attributes (the engine reads them):
      name             registry name
      needs_attention  True: the runner must pass `LayerKV.attention` for the last
                       `observation_window` queries (None = all prompt queries)
      granularity      "token" (select + compact) or "block" (may free whole blocks in place)
      decode_mode      what to do while decoding, checked after each step's K/V write:
                       "none"        nothing (the policy runs once, after prefill)
                       "reselect"    when `should_evict_on_decode`: select again with the same
                                     budget and compact (costs one compaction per B steps)
                       "evict_block" when `should_evict_on_decode`: free `blocks_to_free(...)`
                                     (its `block_scores` must score each block from that
                                     block's tokens alone: the engine scores a full block once)
      per_layer_budgets  layers may get different budgets (PyramidKV)
      needs_reconstruction  True: the runner runs the policy's extra forward pass over the cache
                       (`chunks`) and passes `LayerKV.scores` (KVzip)
      pool_pressure    without a budget, evicts blocks across requests under pool pressure
    Constructor keywords are the policy's options; `make_policy` rejects unknown ones.
    """

    name: ClassVar[str] = ""
    needs_attention: ClassVar[bool] = False
    granularity: ClassVar[str] = "token"
    decode_mode: ClassVar[str] = "none"
    allows_no_budget: ClassVar[bool] = False  # True: without budget or ratio it keeps everything
    # True: `layer_budgets` may give layers different budgets (the engine then needs per-layer
    # block tables, which only the float KV pool has)
    per_layer_budgets: ClassVar[bool] = False
    # True: frees blocks across running requests when the pool fills (`pool_evictions`, the
    # pool-pressure mode of a policy run without a budget)
    pool_pressure: ClassVar[bool] = False
    # decode_mode "evict_block": the runner passes every layer's block scores to `block_to_evict`
    # (False: it passes None; the choice is positional)
    needs_block_scores: ClassVar[bool] = True
    # True: the engine scores the cache with an extra forward pass (`chunks(...)`, KVzip) and
    # passes the scores as `LayerKV.scores`
    needs_reconstruction: ClassVar[bool] = False

    def __init__(self, *, budget: int | None = None, compression_ratio: float | None = None,
                 block_size: int | None = None) -> None:
        if budget is not None and compression_ratio is not None:
            raise ValueError("give either budget (tokens) or compression_ratio (fraction "
                             "removed), not both")
        if budget is None and compression_ratio is None and not self.allows_no_budget:
            raise ValueError(f"policy {self.name!r} needs budget (tokens kept) or "
                             f"compression_ratio (fraction removed, in [0, 1))")
        if budget is not None:
            check_int("budget", budget, 1)
        if compression_ratio is not None:
            _check_ratio(compression_ratio)
        if block_size is not None:
            check_int("block_size", block_size, 1)
        self.budget = budget
        self.compression_ratio = compression_ratio
        self.block_size = block_size

    def _check_budget_option(self) -> None:
        """Subclasses call this at the end of __init__, once `min_budget` can be computed."""
        if self.budget is not None and self.budget < self.min_budget:
            raise ValueError(f"budget {self.budget} is below the {self.min_budget} tokens policy "
                             f"{self.name!r} always keeps with these options; allowed: budget >= "
                             f"{self.min_budget}")

    # ---- what the runner must provide ----------------------------------------------------------
    @property
    def observation_window(self) -> int | None:
        """Queries the runner captures per layer for `attention` (0: none; None: all prompt)."""
        return 0

    @property
    def min_budget(self) -> int:
        """The fewest tokens this policy can keep (its protected sinks/windows)."""
        return 1

    # ---- budgets -------------------------------------------------------------------------------
    def resolve_budget(self, num_tokens: int) -> int:
        """C for a sequence of `num_tokens` cached tokens (see the module docstring)."""
        return min(self.decode_budget(num_tokens), num_tokens)

    def decode_budget(self, num_tokens: int) -> int:
        """The cache length decode keeps a request compressed at `num_tokens` tokens within:
        C before the cap at `num_tokens`. A sequence shorter than C is not cut; it grows to C
        before the policy evicts (it is never held below the budget asked for, nor below
        `min_budget`)."""
        if self.budget is not None:
            return self.budget
        if self.compression_ratio is not None:
            return max(kept_by_ratio(num_tokens, self.compression_ratio), self.min_budget)
        return num_tokens

    def layer_budgets(self, num_tokens: int, num_layers: int) -> list[int]:
        """Budget of each layer: the same C everywhere unless PyramidKV says otherwise."""
        check_int("num_layers", num_layers, 1)
        return [self.resolve_budget(num_tokens)] * num_layers

    # ---- selection -----------------------------------------------------------------------------
    def select(self, kv: LayerKV, budget: int) -> torch.Tensor:
        """Kept slot indices of one layer: `[C]` or `[Hkv, C]`, ascending (module docstring).

        With `budget >= n` every slot is kept (`[n]`)."""
        check_int("budget", budget, 1)
        n = kv.num_tokens
        if budget >= n:
            return torch.arange(n, device=kv.keys.device)
        if self.needs_attention and kv.attention is None:
            raise ValueError(f"policy {self.name!r} needs the window attention (LayerKV.attention)")
        if budget < self.min_budget:
            raise ValueError(f"budget {budget} is below the {self.min_budget} tokens policy "
                             f"{self.name!r} always keeps; allowed: budget >= {self.min_budget}")
        return self._select(kv, budget)

    @abc.abstractmethod
    def _select(self, kv: LayerKV, budget: int) -> torch.Tensor:
        """`select` for min_budget <= budget < n (inputs already checked)."""

    # ---- decode --------------------------------------------------------------------------------
    def should_evict_on_decode(self, num_slots: int, budget: int) -> bool:
        """True right after the newest block filled (num_slots % B == 0) when losing one block
        would still leave >= budget slots. For a budget that is a multiple of B this is exactly
        "the newest block filled and the sequence holds more than C tokens", and the cache length
        stays within [C, C + B - 1] between steps; for other budgets within
        [C, B * ceil(C / B) + B - 1]."""
        if self.decode_mode == "none" or self.block_size is None:
            return False
        bs = self.block_size
        return num_slots > 0 and num_slots % bs == 0 and num_slots - bs >= budget

    def blocks_to_free(self, block_scores: torch.Tensor, num_slots: int,
                       budget: int) -> list[int]:
        """Block-table indices to free in place (block policies); token policies free none."""
        return []

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({opts})"


# ---- registry ----------------------------------------------------------------------------------
_REGISTRY: dict[str, type[KVPolicy]] = {}
_ENGINE_KEYWORDS = {"budget", "compression_ratio", "block_size"}


def register_policy(name: str):
    """Class decorator: make a KVPolicy subclass available to `make_policy(name, ...)`."""

    def deco(cls: type[KVPolicy]) -> type[KVPolicy]:
        if not (isinstance(cls, type) and issubclass(cls, KVPolicy)):
            raise TypeError(f"{cls!r} is not a KVPolicy subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"a policy named {name!r} is already registered "
                             f"({_REGISTRY[name].__name__})")
        if cls.granularity not in GRANULARITIES or cls.decode_mode not in DECODE_MODES:
            raise ValueError(f"{cls.__name__}: granularity must be one of {GRANULARITIES} and "
                             f"decode_mode one of {DECODE_MODES}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtin() -> None:
    import nanokv.policies  # noqa: F401  (importing the package registers the built-in policies)


def available_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[KVPolicy]:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV policy {name!r}; available: {['full', *sorted(_REGISTRY)]} "
                         f"('full' or None: the whole cache, no policy)")
    return _REGISTRY[name]


def policy_options(name: str) -> list[str]:
    """The keyword options policy `name` accepts (budget, compression_ratio, block_size incl.)."""
    sig = inspect.signature(policy_class(name).__init__)
    return sorted(p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY)


def make_policy(name: str, **options: Any) -> KVPolicy:
    """Build a registered policy; unknown names and options raise ValueError listing what exists."""
    cls = policy_class(name)
    allowed = policy_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for KV policy {name!r}; allowed: {allowed}")
    return cls(**options)


@dataclass(frozen=True)
class PolicyConfig:
    """Which policy, how much to keep, and the policy's own options.

    budget: tokens kept per sequence (and layer), or compression_ratio: fraction of the tokens
    removed, in [0, 1). `options` are the policy's keywords (see `policy_options(name)`).
    The engine adds its block size: `config.build(block_size=engine_block_size)`.
    """

    name: str
    budget: int | None = None
    compression_ratio: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        allowed = set(policy_options(self.name)) - _ENGINE_KEYWORDS  # raises for an unknown name
        reserved = sorted(_ENGINE_KEYWORDS & set(self.options))
        if reserved:
            raise ValueError(f"{reserved} are PolicyConfig fields or engine settings, not options")
        unknown = sorted(set(self.options) - allowed)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for KV policy {self.name!r}; "
                             f"allowed: {sorted(allowed)}")
        if self.budget is not None and self.compression_ratio is not None:
            raise ValueError("give either budget (tokens) or compression_ratio (fraction "
                             "removed), not both")
        if self.budget is not None:
            check_int("budget", self.budget, 1)
        if self.compression_ratio is not None:
            _check_ratio(self.compression_ratio)
        # option values are checked by `build`, once the engine's block size is known

    def build(self, block_size: int | None = None) -> KVPolicy:
        kwargs = dict(self.options, budget=self.budget, compression_ratio=self.compression_ratio)
        if block_size is not None:
            kwargs["block_size"] = block_size
        return make_policy(self.name, **kwargs)


def kept_by_ratio(num_tokens: int, ratio: float) -> int:
    """Tokens kept when the fraction `ratio` of num_tokens is removed: floor(n (1 - r)), in exact
    decimal arithmetic (r as written: 0.29 is 29/100), so n = 100 at r = 0.29 keeps 71. kvpress
    keeps int(n * (1 - r)), the same rounding in floats, which can come out one lower (n = 90 at
    0.3: 62, where this keeps 63)."""
    return math.floor(num_tokens * (1 - Fraction(repr(float(ratio)))))


def _check_ratio(ratio: Any) -> None:
    check_fraction("compression_ratio", ratio, low_open=False, high_open=True,
                   meaning=" (the fraction of tokens removed)")


def validate_kept(kept: torch.Tensor, num_tokens: int, num_kv_heads: int) -> int:
    """Check a selection against the contract; returns C. Raises ValueError when it breaks it."""
    if kept.dtype != torch.int64 or kept.dim() not in (1, 2):
        raise ValueError(f"kept must be int64 [C] or [Hkv, C], got {kept.dtype} "
                         f"{tuple(kept.shape)}")
    rows = kept.unsqueeze(0) if kept.dim() == 1 else kept
    if kept.dim() == 2 and rows.shape[0] != num_kv_heads:
        raise ValueError(f"per-head kept has {rows.shape[0]} rows for {num_kv_heads} KV heads")
    if rows.numel() and (rows.min() < 0 or rows.max() >= num_tokens):
        raise ValueError(f"kept indices must lie in [0, {num_tokens})")
    if rows.shape[1] > 1 and not bool((rows[:, 1:] > rows[:, :-1]).all()):
        raise ValueError("kept indices must be strictly ascending")
    return rows.shape[1]
