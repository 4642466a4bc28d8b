"""KVCrush (arXiv 2503.00022): a wrapper that spends part of the budget on representatives of the
tokens an importance scorer would drop, chosen by head-behaviour signatures.

With budget C and kvcrush_ratio r: C_rep = floor(r C) representatives, C_imp = C - C_rep chosen by
the base scorer (any `ScoredPolicy`: snapkv, pyramidkv, h2o, knorm), which also keeps its protected
slots (sinks `n_sink`, its window / recent part) inside C_imp. r = 0 is exactly the base scorer.

Token variant, over the MIDDLE slots M (not protected by the base):
  1. bits[h, t] = 1 if t is among the top floor(|M| / 2) of M by head h's score (ties to the
     older slot): each token gets an H-bit signature. H = query heads (signature_heads="query",
     the base's per-query-head scores before GQA averaging) or KV heads ("kv").
  2. anchor a: "random" (H bits from a torch generator seeded with `seed`), "mean" (1 where the
     mean of the bits over M is > 0.5), "alternate" (0101...). Distance d_t = Hamming(bits_t, a).
  3. the middle slots the base did NOT keep, sorted by d (stable: ties in slot order); take C_rep
     of them at positions i * floor(m / C_rep), i < C_rep (OpenVINO's even spacing).
  4. keep important + representatives, ascending. Per-head bases do 3 for each KV head.
Block variant (block_granular=True, shared across heads, needs block_size): whole blocks of B
slots (block j = slots j*B ..); the last (maybe partial) block and every block holding a protected
slot are kept. K = (C - p) // B + 1 blocks fit the budget (p = size of the last block),
K_rep = floor(r K); block importance = mean of the base's (head-averaged) token scores; block
signature: "majority" (bit h = 1 if more than half of the block's tokens have bit h) or
"token_bits" (OpenVINO: B bits, bit s = 1 if the block's token s is in the top half of the middle
tokens by head-averaged score). The selection keeps K blocks = (K - 1) B + p <= C slots.
A budget must hold, for every prompt length, the newest block and the blocks of the protected
slots inside the K - K_rep important blocks (`min_budget` is the smallest that does; a budget
from compression_ratio is raised to the next one that does).
"""

from __future__ import annotations

import math

import torch

from nanokv.policies.base import KVPolicy, LayerKV, make_policy, register_policy
from nanokv.policies.scoring import ScoredPolicy, select_with_protected, top_k_indices
from nanokv.utils import cdiv
from nanokv.validation import check_choice

ANCHORS = ("random", "mean", "alternate")
SIGNATURE_HEADS = ("query", "kv")
BLOCK_SIGNATURES = ("majority", "token_bits")


def top_half_bits(scores: torch.Tensor) -> torch.Tensor:
    """[H, m] scores -> [H, m] bool: True for each row's top floor(m / 2) (ties to lower index)."""
    h, m = scores.shape
    bits = torch.zeros(h, m, dtype=torch.bool, device=scores.device)
    if m >= 2:
        bits.scatter_(1, top_k_indices(scores, m // 2), True)
    return bits


def make_anchor(bits: torch.Tensor, mode: str, seed: int) -> torch.Tensor:
    """[H, m] signatures (one column per token or block) -> [H] bool anchor."""
    num_bits = bits.shape[0]
    if mode == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, 2, (num_bits,), generator=gen).bool().to(bits.device)
    if mode == "mean":
        return bits.float().mean(1) > 0.5
    return torch.arange(num_bits, device=bits.device) % 2 == 1  # alternate: 0101...


def hamming_to_anchor(bits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """[H, m] and [H] -> [m] int64 Hamming distances."""
    return (bits != anchor[:, None]).sum(0)


def pick_representatives(candidates: torch.Tensor, distances: torch.Tensor,
                         count: int) -> torch.Tensor:
    """`count` candidates evenly spaced along their stable sort by distance. Both [m]."""
    if count == 0:
        return candidates[:0]
    if candidates.numel() < count:
        raise ValueError(f"{count} representatives wanted from {candidates.numel()} candidates")
    order = torch.sort(distances, stable=True).indices  # [m]
    step = candidates.numel() // count
    return candidates[order[torch.arange(count, device=candidates.device) * step]]


@register_policy("kvcrush")
class KVCrush(KVPolicy):
    """Options: base (a scored policy name, default "snapkv"), base_options (dict),
    kvcrush_ratio r in [0, 1) (default 0.25), anchor ("random" | "mean" | "alternate"), seed,
    signature_heads ("query" | "kv"), block_granular (False), block_signature ("majority" |
    "token_bits"). Budget or compression_ratio is the knob; compare at equal budgets."""

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 base: str = "snapkv", base_options: dict | None = None,
                 kvcrush_ratio: float = 0.25, anchor: str = "random", seed: int = 0,
                 signature_heads: str = "query", block_granular: bool = False,
                 block_signature: str = "majority") -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size)
        if isinstance(kvcrush_ratio, bool) or not isinstance(kvcrush_ratio, (int, float)) \
                or not 0 <= kvcrush_ratio < 1:
            raise ValueError(f"kvcrush_ratio must be in [0, 1), got {kvcrush_ratio!r}")
        check_choice("anchor", anchor, ANCHORS)
        check_choice("signature_heads", signature_heads, SIGNATURE_HEADS)
        check_choice("block_signature", block_signature, BLOCK_SIGNATURES)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not isinstance(block_granular, bool):
            raise ValueError(f"block_granular must be True or False, got {block_granular!r}")
        if block_granular and block_size is None:
            raise ValueError("kvcrush with block_granular=True needs the engine's block_size")
        if base_options is not None and not isinstance(base_options, dict):
            raise ValueError(f"base_options must be a dict of the base policy's options, got "
                             f"{base_options!r}")
        base_options = dict(base_options or {})
        shared = sorted({"budget", "compression_ratio", "block_size"} & set(base_options))
        if shared:
            raise ValueError(f"base_options cannot set {shared}: kvcrush passes its own budget, "
                             f"compression_ratio and block_size to the base")
        if base == "kvcrush":
            raise ValueError("kvcrush cannot wrap itself; base must be a scored policy")
        if block_granular:
            if base_options.get("per_head", False):
                raise ValueError("block_granular kvcrush selects blocks shared by all heads: "
                                 "per_head=True is not allowed in base_options")
            base_options["per_head"] = False
        try:
            self.base = make_policy(base, budget=budget, compression_ratio=compression_ratio,
                                    block_size=block_size, **base_options)
        except ValueError as e:
            raise ValueError(f"kvcrush's base policy {base!r}: {e}") from None
        if not isinstance(self.base, ScoredPolicy):
            raise ValueError(f"kvcrush needs a scored base policy (snapkv, pyramidkv, h2o, knorm), "
                             f"got {base!r}")
        self.needs_attention = self.base.needs_attention
        self.kvcrush_ratio = kvcrush_ratio
        self.anchor = anchor
        self.seed = seed
        self.signature_heads = signature_heads
        self.block_granular = block_granular
        self.block_signature = block_signature
        self._block_min_budget = self._smallest_block_budget() if block_granular else None
        if block_granular and budget is not None and not self._blocks_fit(budget):
            raise ValueError(
                f"block_granular kvcrush keeps whole blocks of {block_size}: budget {budget} "
                f"cannot hold the newest block and the blocks of the base's protected slots "
                f"within the {1 - kvcrush_ratio:g} share left after the representatives, for "
                f"every prompt length; allowed: a budget that can (the smallest is "
                f"{self._block_min_budget}), or a lower kvcrush_ratio or base window / sinks")
        self._check_budget_option()
        if budget is not None:  # the base's protected slots must fit in the important share
            probe = budget + self.base.min_budget + 1  # any sequence longer than the budget
            protected = int(self.base.protected_mask(probe, budget).sum())
            if protected > budget - math.floor(kvcrush_ratio * budget):
                raise ValueError(f"the base keeps {protected} protected slots but only "
                                 f"{budget - math.floor(kvcrush_ratio * budget)} of budget "
                                 f"{budget} are left after the representatives; lower "
                                 f"kvcrush_ratio or the base's window / recent share")

    @property
    def observation_window(self) -> int | None:
        return self.base.observation_window

    @property
    def min_budget(self) -> int:
        if self._block_min_budget is not None:
            return self._block_min_budget
        return math.ceil(self.base.min_budget / (1 - self.kvcrush_ratio))

    def resolve_budget(self, num_tokens: int) -> int:
        c = super().resolve_budget(num_tokens)
        while self.block_granular and c < num_tokens and not self._blocks_fit(c):
            c += 1  # a ratio's budget, raised to one that holds the protected blocks
        return c

    def _blocks_fit(self, budget: int) -> bool:
        """Can the block variant keep `budget` slots for every prompt length longer than it?
        For each size p of the newest block: K = (budget - p) // B + 1 blocks fit, and the
        newest block plus every block holding a protected slot must be among the K - floor(r K)
        important ones. The base's protected slots are sinks at the start and slots counted
        from the end (`edge_mask`): most blocks at a prompt long enough to keep them apart."""
        bs = self.block_size
        if budget < bs:  # a full newest block
            return False
        full = (2 * cdiv(budget, bs) + 2) * bs  # a prompt of whole blocks, longer than 2 budgets
        protected = torch.nonzero(self.base.protected_mask(full, budget)).squeeze(1).tolist()
        head_blocks = len({q // bs for q in protected if q < full // 2})
        from_end = {full - q for q in protected if q >= full // 2} | {1}  # 1: the newest slot
        span = max(from_end)
        contiguous = len(from_end) == span  # a window of the last `span` slots
        for p in range(1, bs + 1):  # slots in the newest block
            n = full + p
            if contiguous:
                tail_blocks = (n - 1) // bs - (n - span) // bs + 1
            else:
                tail_blocks = len({(n - o) // bs for o in from_end})
            blocks = (budget - p) // bs + 1
            if blocks - math.floor(self.kvcrush_ratio * blocks) < head_blocks + tail_blocks:
                return False
        return True

    def _smallest_block_budget(self) -> int:
        start = max(math.ceil(self.base.min_budget / (1 - self.kvcrush_ratio)), self.block_size)
        for budget in range(start, start + 64 * self.block_size):
            if self._blocks_fit(budget):
                return budget
        raise ValueError(f"block_granular kvcrush: the base's protected slots grow with the "
                         f"budget as fast as the {1 - self.kvcrush_ratio:g} share left after the "
                         f"representatives (blocks of {self.block_size}); lower kvcrush_ratio or "
                         f"the base's recent share")

    def layer_budgets(self, num_tokens: int, num_layers: int) -> list[int]:
        return self.base.layer_budgets(num_tokens, num_layers)

    def select(self, kv: LayerKV, budget: int) -> torch.Tensor:
        """As the base's contract; a layer whose budget (PyramidKV's top layers) cannot hold the
        base's protected slots plus representatives is left to the base alone (r = 0 there)."""
        if self.base.min_budget <= budget < self.min_budget and budget < kv.num_tokens:
            return self.base.select(kv, budget)
        return super().select(kv, budget)

    # ---- signatures ----------------------------------------------------------------------------
    def signature_scores(self, kv: LayerKV) -> torch.Tensor:
        """[H, n]: the per-head scores whose top halves make the signatures."""
        if self.signature_heads == "query":
            return self.base.head_scores(kv)
        return self.base.token_scores(kv)

    def token_signatures(self, kv: LayerKV, middle: torch.Tensor) -> torch.Tensor:
        """[H, m] bool bits of the middle slots `middle` [m]."""
        return top_half_bits(self.signature_scores(kv)[:, middle])

    # ---- selection -----------------------------------------------------------------------------
    def _select(self, kv: LayerKV, budget: int) -> torch.Tensor:
        if self.block_granular:
            return self._select_blocks(kv, budget)
        n = kv.num_tokens
        num_rep = math.floor(self.kvcrush_ratio * budget)
        protected = self.base.protected_mask(n, budget).to(kv.keys.device)  # [n]
        important = select_with_protected(self.base.selection_scores(kv), budget - num_rep,
                                          protected)  # [C_imp] or [Hkv, C_imp]
        if num_rep == 0:
            return important
        middle = torch.nonzero(~protected).squeeze(1)  # [m]
        bits = self.token_signatures(kv, middle)  # [H, m]
        dist = hamming_to_anchor(bits, make_anchor(bits, self.anchor, self.seed))  # [m]
        rows = important if important.dim() == 2 else important.unsqueeze(0)  # [R, C_imp]
        kept = []
        for row in rows:
            dropped = ~torch.isin(middle, row)  # [m]
            reps = pick_representatives(middle[dropped], dist[dropped], num_rep)
            kept.append(torch.sort(torch.cat([row, reps])).values)
        out = torch.stack(kept)  # [R, C]
        return out if important.dim() == 2 else out[0]

    def _select_blocks(self, kv: LayerKV, budget: int) -> torch.Tensor:
        n, bs = kv.num_tokens, self.block_size
        nb = cdiv(n, bs)
        last = n - (nb - 1) * bs  # size of the newest block
        if budget < last:
            raise ValueError(f"budget {budget} cannot hold the newest block ({last} slots)")
        num_blocks = (budget - last) // bs + 1
        num_rep = math.floor(self.kvcrush_ratio * num_blocks)
        block_of = torch.arange(n, device=kv.keys.device) // bs  # [n]
        protected_tok = self.base.protected_mask(n, budget).to(kv.keys.device)  # [n]
        protected = torch.zeros(nb, dtype=torch.bool, device=kv.keys.device)
        protected[block_of[protected_tok]] = True
        protected[-1] = True
        scores = self.base.selection_scores(kv)  # [n]
        block_imp = torch.zeros(nb, device=scores.device).index_add_(0, block_of, scores.float())
        block_imp[:-1] /= bs
        block_imp[-1] /= last
        try:
            important = select_with_protected(block_imp, num_blocks - num_rep, protected)
        except ValueError as err:
            raise ValueError(f"block_granular kvcrush: {err} (in blocks of {bs})") from None
        if num_rep:
            middle_blocks = torch.nonzero(~protected).squeeze(1)  # [mb]
            bits = self.block_signatures(kv, middle_blocks)  # [H', mb]
            dist = hamming_to_anchor(bits, make_anchor(bits, self.anchor, self.seed))  # [mb]
            dropped = ~torch.isin(middle_blocks, important)
            reps = pick_representatives(middle_blocks[dropped], dist[dropped], num_rep)
            important = torch.sort(torch.cat([important, reps])).values
        keep = torch.zeros(nb, dtype=torch.bool, device=kv.keys.device)
        keep[important] = True
        return torch.nonzero(keep[block_of]).squeeze(1)  # [(K - 1) B + last]

    def block_signatures(self, kv: LayerKV, middle_blocks: torch.Tensor) -> torch.Tensor:
        """[H', mb] bool signatures of the (full) middle blocks."""
        bs = self.block_size
        tok = (middle_blocks[:, None] * bs
               + torch.arange(bs, device=middle_blocks.device)).reshape(-1)  # [mb * B]
        mb = middle_blocks.numel()
        if self.block_signature == "majority":
            bits = top_half_bits(self.signature_scores(kv)[:, tok])  # [H, mb * B]
            votes = bits.view(bits.shape[0], mb, bs).float().mean(-1)  # [H, mb]
            return votes > 0.5
        shared = self.base.selection_scores(kv)[tok]  # [mb * B]
        bits = top_half_bits(shared.unsqueeze(0))  # [1, mb * B]
        return bits.view(mb, bs).transpose(0, 1)  # [B, mb]
