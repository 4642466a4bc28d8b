"""PagedEviction (arXiv 2509.04377): block-wise eviction for a paged cache, no attention needed.

Token score (option `score`, higher = more important), with norms averaged over the KV heads
first (the reference code makes one decision per layer):
  value_key_ratio (default)  mean_h ||V_h|| / mean_h ||K_h||
  inv_key_norm               1 / mean_h ||K_h||
  value_norm                 mean_h ||V_h||
  key_plus_value             mean_h ||K_h|| + mean_h ||V_h||
Block score: mean (default) or sum of its tokens' scores (option `block_reduce`).

Prefill (`select`): keep block 0 (the first B slots) and the newest `num_recent` slots (default
B), then the highest-scoring middle slots so that exactly C remain, in original order; the runner
compacts them (`compact_blocks`).
Decode (`block_to_evict`): after each step's write, when the newest block just filled and losing
one block still leaves >= C slots (for C a multiple of B: "more than C tokens"), free the block
with the lowest score, never block 0 nor the newest block. The block table is shared by all
layers: the engine passes every layer's block scores `[L, nb]`, combined by `layer_reduce`.

Pool-pressure mode (`pool_evictions`, for a policy run without a budget): when pool usage >
1 - eviction_ratio, free blocks of several requests until usage <= 1 - eviction_ratio, so the
least important blocks across the batch go before any request has to be preempted (and
recomputed whole). The same when a waiting request's prompt is larger than the free blocks
(`min_free_blocks`): without that, a prompt larger than the headroom left by eviction_ratio
would never be admitted while the running requests hold the rest. Importance is normalised
(`normalize`): "request_minmax" (default) maps each request's evictable block scores to [0, 1]
(a request whose evictable blocks all score the same gets 0), "pool_max" divides by the largest
evictable block score in the pool. Blocks are taken in ascending normalised importance, those below
`importance_threshold` first; with sweep_below_threshold=True every block below the threshold goes
once pressure triggers, even past the target. Block 0 and each request's newest block never go.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanokv.policies.base import KVPolicy, LayerKV, register_policy
from nanokv.policies.scoring import edge_mask, select_with_protected
from nanokv.utils import cdiv
from nanokv.validation import check_choice, check_int

SCORES = ("value_key_ratio", "inv_key_norm", "value_norm", "key_plus_value")
BLOCK_REDUCES = ("mean", "sum")
LAYER_REDUCES = ("normalized_mean", "mean")
NORMALIZATIONS = ("request_minmax", "pool_max")
_EPS = 1e-6


def token_scores(keys: torch.Tensor, values: torch.Tensor, score: str = "value_key_ratio"
                 ) -> torch.Tensor:
    """keys, values [n, Hkv, D] -> [n] token importance (see the module docstring)."""
    check_choice("score", score, SCORES)
    k = keys.float().norm(dim=-1).mean(-1)  # [n]
    v = values.float().norm(dim=-1).mean(-1)  # [n]
    if score == "value_key_ratio":
        return v / k.clamp_min(_EPS)
    if score == "inv_key_norm":
        return 1.0 / k.clamp_min(_EPS)
    if score == "value_norm":
        return v
    return k + v


def block_scores_from_tokens(scores: torch.Tensor, block_size: int,
                             reduce: str = "mean") -> torch.Tensor:
    """[n] token scores -> [ceil(n / B)] block scores; the last block may be partial."""
    check_choice("block_reduce", reduce, BLOCK_REDUCES)
    n = scores.shape[0]
    nb = cdiv(n, block_size)
    padded = scores.new_zeros(nb * block_size)
    padded[:n] = scores
    sums = padded.view(nb, block_size).sum(1)  # [nb]
    if reduce == "sum":
        return sums
    counts = torch.full((nb,), float(block_size), device=scores.device)
    counts[-1] = n - (nb - 1) * block_size
    return sums / counts


def select_pool_evictions(block_scores: Sequence[torch.Tensor], num_used_blocks: int,
                          num_total_blocks: int, eviction_ratio: float = 0.2,
                          importance_threshold: float = 0.1, normalize: str = "request_minmax",
                          sweep_below_threshold: bool = False,
                          min_free_blocks: int = 0) -> list[list[int]]:
    """Blocks to free under pool pressure, per request (ascending block-table indices).

    block_scores[r]: request r's block scores `[nb_r]` (layers already combined), its newest block
    last. Does nothing unless num_used_blocks / num_total_blocks > 1 - eviction_ratio or fewer
    than `min_free_blocks` are free (a waiting request needs them to be admitted); then frees
    until used <= (1 - eviction_ratio) * total and at least min_free_blocks are free (or no
    candidate is left). See the module docstring.
    """
    check_choice("normalize", normalize, NORMALIZATIONS)
    limit = min(int((1 - eviction_ratio) * num_total_blocks + 1e-9),
                num_total_blocks - min_free_blocks)
    result: list[list[int]] = [[] for _ in block_scores]
    if num_used_blocks <= limit:
        return result
    # candidates: (importance, request, block), never block 0 nor the newest block
    cands: list[tuple[float, int, int]] = []
    raw = [s.float().cpu() for s in block_scores]
    pool_max = max((float(s[1:-1].max()) for s in raw if s.numel() > 2), default=0.0)
    for r, s in enumerate(raw):
        middle = s[1:-1]  # [nb - 2]
        if middle.numel() == 0:
            continue
        if normalize == "request_minmax":
            lo, hi = float(middle.min()), float(middle.max())
            imp = (middle - lo) / (hi - lo) if hi > lo else torch.zeros_like(middle)
        else:
            imp = middle / pool_max if pool_max > 0 else torch.zeros_like(middle)
        cands += [(float(v), r, j + 1) for j, v in enumerate(imp)]
    cands.sort(key=lambda c: (c[0] >= importance_threshold, c[0], c[1], c[2]))
    used = num_used_blocks
    for importance, r, j in cands:
        below = importance < importance_threshold
        if used <= limit and not (sweep_below_threshold and below):
            break
        result[r].append(j)
        used -= 1
    return [sorted(blocks) for blocks in result]


@register_policy("paged_eviction")
class PagedEviction(KVPolicy):
    """Options: score, block_reduce, num_recent (None = B), layer_reduce, and for the pool mode
    eviction_ratio (0.2), importance_threshold (0.1), normalize, sweep_below_threshold. Needs the
    engine's block_size. Without budget and compression_ratio there is no per-sequence budget
    (prefill keeps everything, decode never evicts): pool-pressure mode only."""

    granularity = "block"
    decode_mode = "evict_block"
    allows_no_budget = True
    pool_pressure = True

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 score: str = "value_key_ratio", block_reduce: str = "mean",
                 num_recent: int | None = None, layer_reduce: str = "normalized_mean",
                 eviction_ratio: float = 0.2, importance_threshold: float = 0.1,
                 normalize: str = "request_minmax", sweep_below_threshold: bool = False) -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size)
        if block_size is None:
            raise ValueError("paged_eviction needs the engine's block_size")
        check_choice("score", score, SCORES)
        check_choice("block_reduce", block_reduce, BLOCK_REDUCES)
        check_choice("layer_reduce", layer_reduce, LAYER_REDUCES)
        check_choice("normalize", normalize, NORMALIZATIONS)
        if num_recent is not None:
            check_int("num_recent", num_recent, 0)
        for name, value in (("eviction_ratio", eviction_ratio),
                            ("importance_threshold", importance_threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if not isinstance(sweep_below_threshold, bool):
            raise ValueError(f"sweep_below_threshold must be True or False, "
                             f"got {sweep_below_threshold!r}")
        self.score = score
        self.block_reduce = block_reduce
        self.num_recent = block_size if num_recent is None else num_recent
        self.layer_reduce = layer_reduce
        self.eviction_ratio = eviction_ratio
        self.importance_threshold = importance_threshold
        self.normalize = normalize
        self.sweep_below_threshold = sweep_below_threshold
        self._check_budget_option()

    @property
    def min_budget(self) -> int:
        # block 0 plus at least one more slot: with C <= B only block 0 and the newest block
        # exist when the newest fills, neither may go, and the cache would outgrow C + B - 1
        return self.block_size + max(self.num_recent, 1)

    # ---- scores --------------------------------------------------------------------------------
    def token_scores(self, kv: LayerKV) -> torch.Tensor:
        return token_scores(kv.keys, kv.values, self.score)  # [n]

    def block_scores(self, kv: LayerKV) -> torch.Tensor:
        """[ceil(n / B)] block scores of one layer (block j = slots j*B .. j*B + B - 1)."""
        return block_scores_from_tokens(self.token_scores(kv), self.block_size,
                                        self.block_reduce)

    def combine_layers(self, block_scores: torch.Tensor) -> torch.Tensor:
        """[L, nb] -> [nb]; "normalized_mean" divides each layer by its mean block score first so
        that no layer dominates by scale. [nb] passes through."""
        if block_scores.dim() == 1:
            return block_scores
        if self.layer_reduce == "normalized_mean":
            block_scores = block_scores / block_scores.mean(1, keepdim=True).clamp_min(_EPS)
        return block_scores.mean(0)

    # ---- prefill -------------------------------------------------------------------------------
    def _select(self, kv: LayerKV, budget: int) -> torch.Tensor:
        protected = edge_mask(kv.num_tokens, self.block_size, self.num_recent, kv.keys.device)
        return select_with_protected(self.token_scores(kv), budget, protected)  # [C]

    # ---- decode --------------------------------------------------------------------------------
    def block_to_evict(self, block_scores: torch.Tensor, num_slots: int,
                       budget: int) -> int | None:
        """Index (in the block table) of the block to free now, or None.

        block_scores: [nb] or [L, nb] for the request's ceil(num_slots / B) blocks; budget: the
        request's C (fixed at prefill). Never block 0 nor the newest block; ties: the older block.
        """
        if not self.should_evict_on_decode(num_slots, budget):
            return None
        scores = self.combine_layers(block_scores)
        nb = cdiv(num_slots, self.block_size)
        if scores.shape[0] != nb:
            raise ValueError(f"{scores.shape[0]} block scores for {num_slots} slots "
                             f"({nb} blocks of {self.block_size})")
        if nb < 3:
            return None
        middle = scores[1:-1]  # [nb - 2]
        return 1 + int(torch.nonzero(middle == middle.min())[0])

    def blocks_to_free(self, block_scores: torch.Tensor, num_slots: int,
                       budget: int) -> list[int]:
        block = self.block_to_evict(block_scores, num_slots, budget)
        return [] if block is None else [block]

    # ---- pool pressure -------------------------------------------------------------------------
    def pool_evictions(self, block_scores: Sequence[torch.Tensor], num_used_blocks: int,
                       num_total_blocks: int, min_free_blocks: int = 0) -> list[list[int]]:
        """`select_pool_evictions` with this policy's options; `[L, nb]` entries are combined."""
        combined = [self.combine_layers(s) for s in block_scores]
        return select_pool_evictions(combined, num_used_blocks, num_total_blocks,
                                     self.eviction_ratio, self.importance_threshold,
                                     self.normalize, self.sweep_below_threshold,
                                     min_free_blocks)
