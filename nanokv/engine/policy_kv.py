"""Where KV policies read and rewrite a request's cache: the float pool or a quantized store.

Both give the policy the same view: per layer `(k, v)` as `[num_blocks, B, Hkv, D]` with keys
after RoPE, and a block table into it, so `plan_compression` and the block scorers run unchanged.

* `FloatPoolKV`: the pool's own layer views and the request's block table; compaction moves
  slots in place (`apply_compression`).
* `QuantizedStoreKV`: the request's blocks dequantized into dense copies (keys rotated to their
  slot's position), table `0..n-1`; compaction RE-WRITES the kept tokens through the store
  (`plan_write` + `write`), from the first changed block on, so every block is quantized again
  with its new content's statistics (a second rounding of those tokens). A store that keeps keys
  before RoPE records one position per slot, shared by all layers and heads, but a slot may now
  hold different tokens per layer (and per head): the slot gets the position of layer 0 / head
  0's token, p, and each stored key is the kept post-RoPE key rotated back by p, so reading it
  (rotation by p) gives exactly the kept key. For a slot whose token is the same everywhere this
  is the plain pre-RoPE key.
"""

from __future__ import annotations

import torch

from nanokv.cache.kv_pool import KVPool
from nanokv.layers.rotary import RotaryEmbedding, apply_rotary
from nanokv.policies.apply import CompressionPlan, apply_compression
from nanokv.policies.compaction import flat_slots, gather_request_kv
from nanokv.quant.attention import rope_from_rotary
from nanokv.quant.store import QuantizedKVStore
from nanokv.request import Request


class FloatPoolKV:
    rewrites_from_copies = False  # compaction reads the pool itself: free the tail after it

    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool
        self.layers = [kv_pool.layer(i) for i in range(kv_pool.layout.num_layers)]

    def views(self, request: Request) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list]:
        return self.layers, request.block_table

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.kv_pool.copy_blocks(pairs)

    def apply(self, request: Request, plan: CompressionPlan, layers, table) -> None:
        apply_compression(plan, layers, table, self.kv_pool.slot_positions)


class QuantizedStoreKV:
    rewrites_from_copies = True  # the kept tokens are in dense copies: free the tail first

    def __init__(self, store: QuantizedKVStore, rotary: RotaryEmbedding) -> None:
        self.store = store
        self.rotary = rotary
        self.rope = rope_from_rotary(rotary) if store.pre_rope_keys else None
        self._positions: tuple[str, torch.Tensor] = ("", torch.empty(0))

    def views(self, request: Request) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list]:
        nb = -(-request.num_cached_slots // self.store.block_size)
        ids = torch.tensor(request.block_table[:nb], dtype=torch.long, device=self.store.device)
        layers = [self.store.read_blocks(layer, ids, self.rope)  # each [nb, B, Hkv, D]
                  for layer in range(self.store.layout.num_layers)]
        # each slot's recorded position, for `apply` (the table may shrink before it runs)
        self._positions = (request.request_id, self.store.slot_positions[ids].reshape(-1).long())
        return layers, list(range(nb))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.store.copy_blocks(pairs)

    def unrotate(self, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Inverse of the model's RoPE: k [n, Hkv, D] rotated by positions [n] -> pre-RoPE.
        The tables may carry an attention scaling s (cos = s cos t): divide by s^2 too."""
        cos = self.rotary.cos[positions].unsqueeze(1).to(k.dtype)  # [n, 1, rot_dim]
        sin = self.rotary.sin[positions].unsqueeze(1).to(k.dtype)
        norm = cos * cos + sin * sin  # s^2
        return apply_rotary(k, cos / norm, -sin / norm, self.rotary.rot_dim)

    def apply(self, request: Request, plan: CompressionPlan, layers, table) -> None:
        if len(set(plan.layer_num_slots)) > 1:
            raise ValueError("per-layer budgets need the float KV pool (kv_cache_dtype 'auto')")
        store, bs = self.store, self.store.block_size
        n_before, n = plan.num_slots_before, plan.num_slots
        start = plan.first_changed_block * bs
        if start >= n:
            return
        owner, old_pos = self._positions  # [nb * B] as recorded when `views` read them
        if owner != request.request_id:
            raise RuntimeError("apply() must follow views() of the same request")
        kept_keys, kept_values, slot_pos = [], [], None
        for (k_blocks, v_blocks), kept in zip(layers, plan.kept):
            keys, values = gather_request_kv(k_blocks, v_blocks, table, n_before)  # [n, Hkv, D]
            if kept.dim() == 1:
                ks, vs, pos = keys[kept], values[kept], old_pos[kept]  # [C, Hkv, D], [C]
            else:  # per KV head: [Hkv, C]
                heads = torch.arange(kept.shape[0], device=kept.device)[:, None]  # [Hkv, 1]
                ks = keys[kept, heads].transpose(0, 1)  # [Hkv, C, D] -> [C, Hkv, D]
                vs = values[kept, heads].transpose(0, 1)
                pos = old_pos[kept[0]]  # head 0's tokens: [C]
            if slot_pos is None:
                slot_pos = pos
            kept_keys.append(ks)
            kept_values.append(vs)
        new_slots = flat_slots(request.block_table, n, bs, store.device)[start:]  # [n - start]
        write = store.plan_write(new_slots.tolist(), slot_pos[start:].tolist())
        for layer, (ks, vs) in enumerate(zip(kept_keys, kept_values)):
            ks = ks[start:]
            if store.pre_rope_keys:
                ks = self.unrotate(slot_pos[start:], ks)
            store.write(layer, write, ks.contiguous(), vs[start:].contiguous())
