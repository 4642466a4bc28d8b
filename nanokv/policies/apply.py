"""Applying a policy to one request's paged cache across all layers: the calls the engine makes.

`compress_request`  gather each layer's K/V -> window attention (if needed) -> select -> compact
                    (= `plan_compression` + `apply_compression`, split so the engine can make
                    shared blocks private in between). Used once after prefill, and for
                    decode_mode "reselect" when `policy.should_evict_on_decode(num_slots, budget)`.
`decode_block_to_evict`  PagedEviction's per-step check: every layer's block scores -> one block.
Neither touches the block manager; the caller frees blocks and updates the request's accounting
(see each docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanokv.policies.base import KVPolicy, LayerKV
from nanokv.policies.compaction import (
    compact_blocks,
    compact_slots,
    flat_slots,
    gather_request_kv,
    window_attention,
)
from nanokv.utils import cdiv


@dataclass
class CompressionPlan:
    """What `plan_compression` chose for one request; `apply_compression` writes it."""

    kept: list[torch.Tensor]  # per layer: [C_l] or [Hkv, C_l] kept slot indices
    num_slots_before: int
    num_slots: int  # slots the request holds after compaction (max over layers)
    num_blocks: int  # leading blocks of the table still in use: free table[num_blocks:]
    layer_num_slots: list[int]  # per layer C_l (differ only under per-layer budgets)
    first_changed_block: int  # table blocks before it keep their content (and prefix hashes)

    @property
    def num_evicted(self) -> int:
        return self.num_slots_before - self.num_slots

    def unread_tail(self, table_len: int, block_size: int) -> list[int]:
        """Block-table indexes past the kept blocks (`num_blocks`, freed after the compaction)
        whose slots hold no kept token in any layer or head: their content is not read."""
        read = set()
        for kept in self.kept:  # [C_l] or [Hkv, C_l] slot indexes
            read.update(torch.unique(kept // block_size).tolist())
        return [j for j in range(self.num_blocks, table_len) if j not in read]


def plan_compression(policy: KVPolicy, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     block_table: list[int], num_slots: int, *, budget: int | None = None,
                     q_windows: Sequence[torch.Tensor] | None = None, scale: float = 1.0,
                     soft_cap: float | None = None, positions: torch.Tensor | None = None,
                     layer_scores: Sequence[torch.Tensor] | None = None,
                     allow_ragged_layers: bool = False) -> CompressionPlan:
    """Select the kept slots of one request in every layer; nothing is written.

    layers: per layer (k_cache, v_cache) `[num_blocks, B, Hkv, D]` (the pool's layer views);
    budget: None = `policy.layer_budgets(num_slots, L)` (after prefill), or the request's fixed C
    (decode reselect); q_windows: per layer the last W queries `[W, Hq, D]` after RoPE, W =
    min(policy.observation_window or num_slots, num_slots), required when policy.needs_attention;
    scale, soft_cap: the attention scale and logit soft-cap (None: none); positions:
    `[num_slots]` RoPE positions (optional);
    layer_scores: per layer `[Hkv, num_slots]`, required when policy.needs_reconstruction
    (such a policy may then set the layers' budgets from them: `scored_layer_budgets`).
    Per-layer budgets (PyramidKV) leave layers with different lengths: layer l then holds only
    slots [0, layer_num_slots[l]) of the shared table, so this raises unless
    allow_ragged_layers=True (the engine then gives each layer its own table of layer slices,
    `nanokv.cache.layer_slices`, and frees the blocks no layer needs).
    """
    num_layers = len(layers)
    if budget is not None:
        budgets = [min(budget, num_slots)] * num_layers
    elif policy.needs_reconstruction and layer_scores is not None:
        budgets = policy.scored_layer_budgets(layer_scores, num_slots)  # may follow the scores
    else:
        budgets = policy.layer_budgets(num_slots, num_layers)
    if len(set(budgets)) > 1 and not allow_ragged_layers:
        raise ValueError(f"policy {policy.name!r} gives layers different budgets {budgets}; the "
                         f"engine needs per-layer slot masks (allow_ragged_layers=True)")
    if policy.needs_attention and (q_windows is None or len(q_windows) != num_layers):
        raise ValueError(f"policy {policy.name!r} needs the last queries of every layer "
                         f"(q_windows, {num_layers} tensors [W, Hq, D])")
    if policy.needs_reconstruction and (layer_scores is None or len(layer_scores) != num_layers):
        raise ValueError(f"policy {policy.name!r} needs the reconstruction scores of every layer "
                         f"(layer_scores, {num_layers} tensors [Hkv, n])")
    kept_per_layer = []
    first_changed = num_slots
    for layer, (k_cache, v_cache) in enumerate(layers):  # one layer at a time (see LayerReads)
        # [n, Hkv, D]; only read, before anything is written
        keys, values = gather_request_kv(k_cache, v_cache, block_table, num_slots, copy=False)
        attn = (window_attention(q_windows[layer], keys, scale, soft_cap)  # [Hq, W, n]
                if policy.needs_attention else None)
        scores = layer_scores[layer] if policy.needs_reconstruction else None
        kept = policy.select(LayerKV(keys, values, positions, attn, scores), budgets[layer])
        moved = kept != torch.arange(kept.shape[-1], device=kept.device)  # [..., C]
        if bool(moved.any()):
            first_changed = min(first_changed, int(torch.nonzero(moved)[:, -1].min()))
        kept_per_layer.append(kept)
    counts = [k.shape[-1] for k in kept_per_layer]
    new_slots = max(counts)
    bs = k_cache.shape[1]  # the block size (of the last layer read: reading one again copies it)
    # a block keeps its content only if every layer keeps all of its slots unmoved
    return CompressionPlan(kept_per_layer, num_slots, new_slots, cdiv(new_slots, bs), counts,
                           min(first_changed, min(counts)) // bs)


def apply_compression(plan: CompressionPlan, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      block_table: list[int], slot_positions: torch.Tensor | None = None) -> None:
    """Write the plan: compact every layer. slot_positions `[num_blocks, B]` (the pool's) is
    compacted along when every layer kept the same shared slots; otherwise its kept region from
    the first changed block on is set to -1 (positions then differ per layer or head; the engine
    does not read them after prefill).

    Blocks from `plan.first_changed_block` to `plan.num_blocks` are overwritten: they must not be
    shared with another request (ref_cnt 1; copy-on-write or no prefix caching, see the report).
    """
    for (k_cache, v_cache), kept in zip(layers, plan.kept, strict=True):
        compact_blocks(k_cache, v_cache, block_table, plan.num_slots_before, kept)
    if slot_positions is not None:
        first = plan.kept[0]
        if first.dim() == 1 and all(torch.equal(k, first) for k in plan.kept[1:]):
            compact_slots(slot_positions, block_table, plan.num_slots_before, first)
        else:  # from the first changed block on: the blocks before it (maybe shared) keep
            start = plan.first_changed_block * slot_positions.shape[1]  # their positions
            flat = flat_slots(block_table, plan.num_slots, slot_positions.shape[1],
                              slot_positions.device)
            slot_positions.view(-1)[flat[start:]] = -1


def compress_request(policy: KVPolicy, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     block_table: list[int], num_slots: int, *,
                     slot_positions: torch.Tensor | None = None, **plan_options) -> CompressionPlan:
    """`plan_compression` then `apply_compression` (see both). The caller then frees
    `block_table[plan.num_blocks:]` (`free_blocks_at`; those blocks keep valid content and their
    prefix hashes), adds `plan.num_evicted` to `request.num_evicted_tokens`, and calls
    `mark_content_changed(request, from_block=plan.first_changed_block)`."""
    positions = None
    if slot_positions is not None:
        flat = flat_slots(block_table, num_slots, slot_positions.shape[1], slot_positions.device)
        positions = slot_positions.view(-1)[flat].long()  # [n]
    plan = plan_compression(policy, layers, block_table, num_slots, positions=positions,
                            **plan_options)
    apply_compression(plan, layers, block_table, slot_positions)
    return plan


def decode_block_to_evict(policy: KVPolicy, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                          block_table: list[int], num_slots: int, budget: int) -> int | None:
    """After a decode step's K/V write: the block-table index to free now, or None.

    Cheap when nothing is due (no gather unless `should_evict_on_decode`). The caller frees it
    (`free_blocks_at(request, [index])`, which also stops prefix caching for the request) and adds
    B to `request.num_evicted_tokens`. The policy must have decode_mode "evict_block"
    (PagedEviction). A block's scores never change once it is full: the engine's policy runner
    keeps them per request and reads only new blocks; this helper (the reference) recomputes
    them all.
    """
    if policy.decode_mode != "evict_block":
        raise ValueError(f"policy {policy.name!r} does not evict blocks while decoding")
    if not policy.should_evict_on_decode(num_slots, budget):
        return None
    if not policy.needs_block_scores:  # a positional choice (StreamingLLM's block slide)
        return policy.block_to_evict(None, num_slots, budget)
    scores = []
    for k_cache, v_cache in layers:
        keys, values = gather_request_kv(k_cache, v_cache, block_table, num_slots, copy=False)
        scores.append(policy.block_scores(LayerKV(keys, values)))  # [nb]
    return policy.block_to_evict(torch.stack(scores), num_slots, budget)  # [L, nb] in
