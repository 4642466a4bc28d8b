"""KVzip (Kim et al. 2025, arXiv 2505.23416): query-agnostic compression by context reconstruction.

Each cached token is scored by the attention it receives while the model reconstructs the context
from the cache: a second pass over "repeat the context" + the context itself, chunk by chunk,
attending to the request's cache. A token that no reconstruction query needs is evicted. The
choice does not depend on any question, so the compressed cache serves whatever comes after it.

The reconstruction pass (the engine's part, `nanokv/engine/policy_runner.py`): the context slots
[0, n) are cut into chunks of at most `chunk_size` tokens; chunk [s, e) is fed as
    repeat prompt (+ the last `prev_tail` tokens of the previous chunk) + suffix + context[s:e]
on top of the cache, its own K/V in scratch blocks that are freed right after (the request's
cache is never written). `context="full"` (KVzip, kvpress): the chunk sees the whole cache and
sits at positions n, n + 1, ...; `context="prefix"`: it sees the cache's first e slots and sits at
positions e, e + 1, ... (shorter query-key distances, a cheaper pass).

Score of context slot i in chunk [s, e), per KV head (`chunk_scores`, as KVzip's code and kvpress
0.5.5): the softmax of each chunk query over the keys {sinks [0, min(n_sink, s)), the chunk's
slots [s, e), the chunk's own tokens (causal)}, then the max over the chunk's queries and over the
query heads of the KV head's group. The first `n_sink` slots are always kept.

Budgets: each KV head keeps its top C slots; `per_head=False` keeps one set per layer by the mean
over KV heads. `layer_budgets="scores"` (kvpress's KVzip default, `layerwise=False`) spends the
request's L x C slots across layers by score: the L x Hkv x C best (layer, head, slot) scores of
the whole cache say how many slots each layer gets (C_l = its count / Hkv, then rounded so they
sum to L x C); within a layer every KV head keeps its top C_l (the paged cache holds the same
count for every head of a layer, so the per-head part of kvpress's allocation is not taken). The
engine then gives the request per-layer block tables (PyramidKV's layer slices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.layers.attention import soft_cap_scores
from nanokv.policies.base import LayerKV, register_policy
from nanokv.policies.scoring import ScoredPolicy, edge_mask
from nanokv.validation import check_choice, check_int

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
REPEAT_NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
CONTEXTS = ("full", "prefix")
LAYER_BUDGETS = ("uniform", "scores")


@dataclass(frozen=True)
class ReconstructionChunk:
    """One chunk of the reconstruction pass."""

    start: int  # the context slots [start, end) this chunk reconstructs
    end: int
    token_ids: list[int]  # prompt (+ previous chunk's tail) + suffix + context[start:end]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids) - (self.end - self.start)


def reconstruction_chunks(context_ids: list[int], chunk_size: int, first_prompt: list[int],
                          next_prompt: list[int], suffix: list[int],
                          prev_tail: int = 8) -> list[ReconstructionChunk]:
    """Cut the context into chunks of `chunk_size` and build each chunk's input (module doc)."""
    check_int("chunk_size", chunk_size, 1)
    chunks = []
    for start in range(0, len(context_ids), chunk_size):
        end = min(start + chunk_size, len(context_ids))
        if start == 0:
            head = list(first_prompt)
        else:
            head = list(next_prompt) + list(context_ids[max(0, start - prev_tail):start])
        chunks.append(ReconstructionChunk(start, end, head + list(suffix)
                                          + list(context_ids[start:end])))
    return chunks


def chunk_scores(queries: torch.Tensor, keys: torch.Tensor, chunk_keys: torch.Tensor,
                 start: int, end: int, n_sink: int, scale: float,
                 rows_per_block: int = 1024, soft_cap: float | None = None) -> torch.Tensor:
    """KVzip scores of context slots [start, end) from one chunk's queries.

    queries [T, Hq, D] (post-RoPE, the chunk's tokens), keys [n, Hkv, D] (the cache), chunk_keys
    [T, Hkv, D] (the chunk's own keys) -> [Hkv, end - start]: max over queries and GQA group of the
    softmax over sinks + slots [start, end) + the chunk's own keys (causal). Queries are taken
    `rows_per_block` at a time (the logits of a block stay small).
    """
    t, hq, d = queries.shape
    hkv = keys.shape[1]
    group = hq // hkv
    sink = min(n_sink, start)
    width = end - start
    subset = torch.cat([keys[:sink], keys[start:end], chunk_keys]).float()  # [S, Hkv, D]
    subset_t = subset.permute(1, 2, 0)  # [Hkv, D, S]
    prefix = sink + width  # keys before the chunk's own
    q = (queries.float() * scale).view(t, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, g, T, D]
    best = torch.full((hkv, width), float("-inf"), device=queries.device)
    for r0 in range(0, t, rows_per_block):
        r1 = min(t, r0 + rows_per_block)
        rows = q[:, :, r0:r1].reshape(hkv, group * (r1 - r0), d)  # [Hkv, g * rb, D]
        logits = torch.bmm(rows, subset_t).view(hkv, group, r1 - r0, -1)  # [Hkv, g, rb, S]
        logits = soft_cap_scores(logits, soft_cap)  # the model's scores (Gemma 2)
        # query r sees the chunk's own keys 0..r: mask the later ones
        own = torch.arange(t, device=q.device) > torch.arange(r0, r1, device=q.device)[:, None]
        logits[..., prefix:].masked_fill_(own, float("-inf"))  # own: [rb, T]
        # max_r softmax(x_r)_i = exp(max_r (x_r,i - logsumexp(x_r))): no softmax materialised
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [Hkv, g, rb, 1]
        block = (logits[..., sink:prefix] - lse).amax(dim=(1, 2))  # [Hkv, e - s]
        best = torch.maximum(best, block)
    return best.exp()


@register_policy("kvzip")
class KVzip(ScoredPolicy):
    """Options: chunk_size (context tokens per reconstruction chunk, default 2048; the engine
    caps a chunk at its step budget), context ("full" | "prefix", module doc), n_sink (4),
    window (last slots always kept, default 0), per_head (True), repeat_prompt,
    repeat_next_prompt, suffix ("\\n"), prev_tail (8).

    The engine supplies `LayerKV.scores` [Hkv, n] from its reconstruction pass; the policy ranks.
    """

    needs_reconstruction = True
    per_layer_budgets = True  # with layer_budgets="scores"; "uniform" keeps one count for all

    def __init__(self, *, budget=None, compression_ratio=None, block_size=None,
                 chunk_size: int = 2048, context: str = "full", n_sink: int = 4,
                 window: int = 0, per_head: bool = True, repeat_prompt: str = REPEAT_PROMPT,
                 repeat_next_prompt: str = REPEAT_NEXT_PROMPT, suffix: str = "\n",
                 prev_tail: int = 8, layer_budgets: str = "uniform") -> None:
        super().__init__(budget=budget, compression_ratio=compression_ratio,
                         block_size=block_size, per_head=per_head, n_sink=n_sink)
        check_int("chunk_size", chunk_size, 1)
        check_choice("context", context, CONTEXTS)
        check_choice("layer_budgets", layer_budgets, LAYER_BUDGETS)
        check_int("window", window, 0)
        check_int("prev_tail", prev_tail, 0)
        for name, text in (("repeat_prompt", repeat_prompt),
                           ("repeat_next_prompt", repeat_next_prompt), ("suffix", suffix)):
            if not isinstance(text, str):
                raise ValueError(f"{name} must be a string, got {text!r}")
        self.chunk_size = chunk_size
        self.context = context
        self.window = window
        self.repeat_prompt = repeat_prompt
        self.repeat_next_prompt = repeat_next_prompt
        self.suffix = suffix
        self.prev_tail = prev_tail
        self.layer_budget_mode = layer_budgets
        self._check_budget_option()

    @property
    def min_budget(self) -> int:
        return self.n_sink + self.window + 1

    def chunks(self, context_ids: list[int], encode, max_chunk_tokens: int
               ) -> list[ReconstructionChunk]:
        """The reconstruction chunks of `context_ids`; `encode(text) -> ids` is the engine's
        tokenizer; a chunk's whole input stays within `max_chunk_tokens` (the step budget)."""
        first, nxt, suffix = (encode(self.repeat_prompt), encode(self.repeat_next_prompt),
                              encode(self.suffix))
        overhead = max(len(first), len(nxt) + self.prev_tail) + len(suffix)
        size = min(self.chunk_size, max_chunk_tokens - overhead)
        if size < 1:
            raise ValueError(f"the step budget of {max_chunk_tokens} tokens cannot hold the "
                             f"{overhead} tokens of KVzip's repeat prompt plus one context token")
        return reconstruction_chunks(context_ids, size, first, nxt, suffix, self.prev_tail)

    def scored_layer_budgets(self, scores: list[torch.Tensor], num_tokens: int) -> list[int]:
        """Each layer's budget C_l from the reconstruction scores (per layer [Hkv, n]); uniform
        unless layer_budgets="scores" (module doc). Protected slots count in every layer."""
        c = self.resolve_budget(num_tokens)
        num_layers = len(scores)
        if self.layer_budget_mode == "uniform" or c >= num_tokens:
            return [c] * num_layers
        hkv = scores[0].shape[0]
        protected = self.protected_mask(num_tokens, c).to(scores[0].device)  # [n]
        free = torch.stack([s.float().masked_fill(protected, float("-inf"))
                            for s in scores])  # [L, Hkv, n]
        extra = c - int(protected.sum())  # free slots per layer on average
        k = extra * num_layers * hkv
        top = torch.topk(free.flatten(), k).indices // (hkv * num_tokens)  # layer of each
        share = torch.bincount(top, minlength=num_layers).double() / hkv  # [L] free slots
        share = share.clamp(max=num_tokens - int(protected.sum()))
        base = share.floor().long()
        # largest remainders first, so the layers' free slots sum to L x extra
        left = extra * num_layers - int(base.sum())
        order = torch.argsort(share - base, descending=True, stable=True)
        for layer in order.tolist():
            if left <= 0:
                break
            if base[layer] < num_tokens - int(protected.sum()):
                base[layer] += 1
                left -= 1
        return [int(b) + int(protected.sum()) for b in base]

    def head_scores(self, kv: LayerKV) -> torch.Tensor:
        if kv.scores is None:
            raise ValueError("KVzip needs the reconstruction scores (LayerKV.scores [Hkv, n])")
        return kv.scores  # [Hkv, n]

    def token_scores(self, kv: LayerKV) -> torch.Tensor:
        return self.head_scores(kv)  # already one row per KV head (max over each group)

    def protected_mask(self, n: int, budget: int) -> torch.Tensor:
        return edge_mask(n, self.n_sink, self.window)
