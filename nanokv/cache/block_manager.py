"""Block manager: allocation, ref counting, prefix caching and freeing of KV blocks.

Vocabulary follows vLLM: `get_computed_blocks` finds prefix-cache hits, `allocate_slots` makes a
request's block table cover the tokens it is about to compute, `free` returns its blocks.

One block per hash is registered in the prefix cache (vLLM registers every copy). A copy arises
when a request computes a block whose content is already cached: a prompt that ends on a block
boundary recomputes its last block (the last token is never a hit), and two requests can compute
the same block in different steps. The copy never takes a second place in the LRU order, and a
hit never pulls a free copy out of the queue while another is held. What the one registered
block must not lose, the copies give back:
  - a held copy (`copy_of`) takes over the hash when the registered block is evicted or
    rewritten, so content a request holds stays a hit;
  - a copy freed after its registered twin takes over the hash, so the content's place in the
    LRU order is its latest use, and the twin (nothing to serve now) is reused first.

A hit compares content, not only hashes: each cached content has an id (`content_id`), and a
block's identity is its tokens, its index and its parent's content id, so a chain of hits is
the same whole prefix even where 64-bit hashes collide. A block whose hash another content holds
is not cached (nor are the blocks after it).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nanokv.cache.block import FreeBlockQueue, KVCacheBlock
from nanokv.cache.hashing import ROOT_HASH, hash_block, request_extra_keys
from nanokv.cache.layer_slices import LayerSlices
from nanokv.request import Request
from nanokv.utils import cdiv

ROOT_CONTENT = 0  # the content id of the empty prefix


@dataclass
class BlockManagerStats:
    """Counters the metrics exporter reads; lifetimes are drained by it."""

    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of those, tokens served from cache
    evicted_blocks: Counter = field(default_factory=Counter)  # reason -> blocks
    evicted_block_lifetimes: list[float] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_keys: tuple = (),
                 on_block_freed: Callable[[list[int]], None] | None = None,
                 on_slices_moved: Callable[[list[tuple[int, int]]], None] | None = None
                 ) -> None:
        """on_block_freed(block_ids): called when blocks' ref counts reach 0 (the KV cache's
        `release`: a quantized store drops what their partial content holds; full cached blocks
        stay readable). on_slices_moved(pairs): copy layer slices (source, destination flat
        slice ids) now, before the next forward pass (the KV cache's `copy_slices`): a sliced
        request's packing (`recycle_window_slices`)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_keys = tuple(extra_keys)  # engine-wide (KV dtype, policy ...)
        self.on_block_freed = on_block_freed
        self.on_slices_moved = on_slices_moved
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> block
        self.copies: dict[int, list[KVCacheBlock]] = {}  # block hash -> held copies, oldest first
        self._content_ids = itertools.count(ROOT_CONTENT + 1)
        self.birth = [0.0] * num_blocks  # allocation time of each block
        self.stats = BlockManagerStats()

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_slots: int) -> int:
        return cdiv(num_slots, self.block_size)

    def request_extra_keys(self, request: Request) -> tuple:
        return request_extra_keys(self.extra_keys, request.cache_salt, request.lora_int_id)

    # ---- prefix cache --------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached full blocks matching the request's tokens.

        Capped so the last token is always computed (its logits are needed). Returns the blocks
        and the number of tokens they hold. Nothing is touched; `allocate_slots` takes them.
        """
        if (not self.enable_prefix_caching or request.num_computed_tokens > 0
                or request.params.return_prompt_logits
                or request.params.prompt_logprobs is not None):
            return [], 0
        bs = self.block_size
        extra = self.request_extra_keys(request)
        hits: list[KVCacheBlock] = []
        parent, parent_content = ROOT_HASH, ROOT_CONTENT
        for i in range((request.num_tokens - 1) // bs):
            tokens = tuple(request.token_ids_range(i * bs, (i + 1) * bs))
            h = hash_block(parent, tokens, extra)
            block = self.cached.get(h)
            # compare content on every hit: a hash collision must never serve wrong K/V (the
            # parent's content id: the whole prefix before it; the depth i: a block whose hash
            # equals its parent's would otherwise match again)
            if (block is None or block.token_ids != tokens
                    or block.extra_keys != (parent_content, i, extra)):
                break
            hits.append(block)
            parent, parent_content = h, block.content_id
        return hits, len(hits) * bs

    # ---- allocation ----------------------------------------------------------------------------
    def num_new_blocks_needed(self, request: Request, num_new_tokens: int,
                              num_hit_blocks: int = 0) -> int:
        ls = request.layer_slices
        if ls is not None:  # per-layer tables (layers hold different lengths)
            wanted = ls.slices_wanted(ls.lengths(request.num_computed_tokens + num_new_tokens))
            if wanted == 0:  # most steps: every layer's last slice has room
                return 0
            free = len(ls.free_slices(request.block_table, self._pinned(request)))
            return cdiv(max(0, wanted - free), ls.num_layers)
        slots = request.num_cached_slots + num_hit_blocks * self.block_size + num_new_tokens
        return max(0, self.blocks_for(slots) - len(request.block_table) - num_hit_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None,
                       keep_free: int = 0, skip: int = 0) -> bool:
        """Grow the block table to hold `num_new_tokens` more slots (after any prefix hits).

        Returns False, changing nothing, when the pool cannot supply the blocks and still keep
        `keep_free` blocks free (those the scheduler holds for other requests' policy steps).
        `skip`: the first hits lie behind the request's sliding window: they count as computed
        (their tokens in `num_evicted_tokens`, as `free_leading_blocks` leaves them) but are
        not taken.
        """
        computed_blocks = computed_blocks or []
        if computed_blocks and request.block_table:
            raise RuntimeError("prefix hits can only be taken by a request without blocks")
        behind, computed_blocks = computed_blocks[:skip], computed_blocks[skip:]
        need = self.num_new_blocks_needed(request, num_new_tokens, len(computed_blocks))
        # hits that sit in the free queue stop being free once taken
        hits_in_queue = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.num_free_blocks - hits_in_queue - keep_free:
            return False

        now = time.monotonic()
        for block in behind:  # their hashes chain the request's later blocks
            request.block_hashes.append(block.block_hash)
            request.block_content_ids.append(block.content_id)
        request.num_evicted_tokens += len(behind) * self.block_size
        for block in computed_blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            request.block_table.append(block.block_id)
            request.block_hashes.append(block.block_hash)
            request.block_content_ids.append(block.content_id)
        for _ in range(need):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # reusing a cached block evicts its content
                self._uncache(block, now, reason="prefix_lru")
            block.ref_cnt = 1
            self.birth[block.block_id] = now
            request.block_table.append(block.block_id)
        request.peak_blocks = max(request.peak_blocks, len(request.block_table))
        ls = request.layer_slices
        lengths = None if ls is None else ls.lengths(request.num_computed_tokens + num_new_tokens)
        if ls is not None and ls.slices_wanted(lengths):  # (most decode steps: none wanted)
            taken = ls.reserve(request.block_table, lengths, self._pinned(request))
            # a cached block whose free slice now takes other tokens serves no hit any more
            for block_id in {ls.slice_block(s) for s in taken}:
                self._content_changed(self.blocks[block_id], now)
            if ls.windows is not None:
                self._release_idle(request)  # a new block the others' free slices spared

        hit_tokens = (len(behind) + len(computed_blocks)) * self.block_size
        # known tokens only: speculative draft tokens past them are hashed once accepted
        self._cache_full_blocks(request, min(request.num_tokens, request.num_computed_tokens
                                             + hit_tokens + num_new_tokens))
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once `num_tokens` tokens are computed."""
        if not self.enable_prefix_caching or not request.prefix_cacheable:
            return
        bs = self.block_size
        extra = self.request_extra_keys(request)
        for i in range(len(request.block_hashes), num_tokens // bs):
            parent = request.block_hashes[i - 1] if i > 0 else ROOT_HASH
            parent_content = request.block_content_ids[i - 1] if i > 0 else ROOT_CONTENT
            tokens = tuple(request.token_ids_range(i * bs, (i + 1) * bs))
            h = hash_block(parent, tokens, extra)
            request.block_hashes.append(h)
            identity = (parent_content, i, extra)
            twin = self.cached.get(h)
            other = twin is not None and (twin.token_ids, twin.extra_keys) != (tokens, identity)
            if other and parent_content is not None and self._orphan(twin, tokens, identity,
                                                                     parent):
                self._drop_orphan(twin)
                twin, other = None, False
            if parent_content is None or other:
                request.block_content_ids.append(None)  # its prefix is not cached, or its
                continue  # hash is another content's (a collision): never a hit
            # a sliding window's freed blocks left the table's front (free_leading_blocks);
            # they were registered before they went
            block = self.blocks[request.block_table[i - request.num_evicted_tokens // bs]]
            block.token_ids, block.extra_keys = tokens, identity
            if twin is None:
                block.content_id = next(self._content_ids)
                self._register(block, h)
            elif twin.ref_cnt > 0:  # held: it stays the registered block, this one its copy
                block.content_id, block.copy_of = twin.content_id, h
                self.copies.setdefault(h, []).append(block)
            else:  # a free twin hands its hash to this fresher copy: the LRU order sees reuse
                block.content_id = twin.content_id
                self._hand_over(twin, block, h)
            request.block_content_ids.append(block.content_id)

    def _orphan(self, twin: KVCacheBlock, tokens: tuple, identity: tuple, parent: int) -> bool:
        """Whether `twin`, registered under the hash of a block with these tokens and identity
        whose parent is hash `parent`, is the same block of an older copy of the prefix, which
        no hit can reach now: a policy's compaction or eviction freed its parent, whose content
        went (its id with it) while the twin stayed registered."""
        if twin.token_ids != tokens or twin.extra_keys[1:] != identity[1:]:
            return False  # other tokens (a collision)
        cached_parent = self.cached.get(parent)
        return cached_parent is None or cached_parent.content_id != twin.extra_keys[0]

    def _drop_orphan(self, twin: KVCacheBlock) -> None:
        """Unregister an unreachable block and its copies (as unreachable); a free one is
        reused first."""
        for copy in self.copies.pop(twin.block_hash, []):
            copy.reset_hash()
        self._forget(twin)

    def _register(self, block: KVCacheBlock, h: int) -> None:
        """Make `block` (its token_ids, extra_keys and content_id set) the cached block of h."""
        block.block_hash, block.copy_of = h, None
        self.cached[h] = block

    def _forget(self, block: KVCacheBlock) -> None:
        """Unregister `block` (no copy takes over); free, it holds nothing to serve now, so it
        moves to the front of the free queue."""
        del self.cached[block.block_hash]
        block.reset_hash()
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)

    def _hand_over(self, twin: KVCacheBlock, block: KVCacheBlock, h: int) -> None:
        """The free registered `twin` of hash h gives it to `block`, a fresher copy."""
        self._forget(twin)
        self._register(block, h)

    def _drop_copy(self, block: KVCacheBlock) -> int:
        """Take `block` off its hash's copies (its identity stays); returns the hash."""
        h, block.copy_of = block.copy_of, None
        copies = self.copies[h]
        copies.remove(block)
        if not copies:
            del self.copies[h]
        return h

    def _uncache(self, block: KVCacheBlock, now: float, reason: str | None) -> None:
        """Unregister `block` (evicted by `reason`, or None: not an eviction); a held copy of
        its content, if any, becomes the cached block."""
        h = block.block_hash
        if self.cached.get(h) is block:
            del self.cached[h]
        block.reset_hash()
        if reason is not None:
            self.stats.evicted_blocks[reason] += 1
            self.stats.evicted_block_lifetimes.append(now - self.birth[block.block_id])
        copies = self.copies.get(h)
        if copies and h not in self.cached:
            copy = copies[0]  # its identity was set when it was made
            self._drop_copy(copy)
            self._register(copy, h)

    # ---- freeing -------------------------------------------------------------------------------
    def free(self, request: Request, reason: str | None = None, drop_cache: bool = False) -> None:
        """Release all of a request's blocks, tail first.

        Unhashed blocks go to the front of the free queue (reused first), cached ones to the back
        (least recently used first). `reason` (e.g. "preemption") counts as evicted, with their
        lifetimes, the blocks whose content this loses: those freed without a cached hash. A
        block another request still holds keeps its content, and so does a cached one until it
        is reused (counted then, as "prefix_lru"). `drop_cache` unregisters their hashes (their
        content may be garbage, e.g. after a failed step).
        """
        now = time.monotonic()
        freed = [block_id for block_id in reversed(request.block_table)
                 if self._release(self.blocks[block_id], now, drop_cache)]
        self._notify_freed(freed)
        if reason is not None:
            lost = [b for b in freed if self.blocks[b].block_hash is None]
            self.stats.evicted_blocks[reason] += len(lost)
            self.stats.evicted_block_lifetimes.extend(now - self.birth[b] for b in lost)
        request.block_table = []
        request.layer_slices = None
        request.block_hashes = []
        request.block_content_ids = []

    def free_blocks_at(self, request: Request, indices: list[int], reason: str = "policy") -> None:
        """Remove the blocks at `indices` of the request's block table (a KV policy's eviction).

        The caller updates the request's token accounting; the request's cached content no longer
        matches its token blocks, so it stops registering prefix-cache blocks.
        """
        drop = set(indices)
        if not drop:
            return
        if max(drop) >= len(request.block_table) or min(drop) < 0:
            raise ValueError(f"block indices {sorted(drop)} outside the request's table "
                             f"of {len(request.block_table)} blocks")
        if request.layer_slices is not None:
            dropped = {request.block_table[i] for i in drop}
            busy = [s for t in request.layer_slices.tables for s in t
                    if request.layer_slices.slice_block(s) in dropped]
            if busy:
                raise ValueError(f"blocks {sorted(dropped)} still hold layer slices {busy}: "
                                 f"move them first")
        now = time.monotonic()
        freed = []
        for i in sorted(drop, reverse=True):
            block = self.blocks[request.block_table[i]]
            if self._release(block, now, drop_cache=False):
                freed.append(block.block_id)
            self.stats.evicted_blocks[reason] += 1
            self.stats.evicted_block_lifetimes.append(now - self.birth[block.block_id])
        self._notify_freed(freed)
        request.block_table = [b for i, b in enumerate(request.block_table) if i not in drop]
        request.prefix_cacheable = False
        request.block_hashes = request.block_hashes[:min(drop)]
        request.block_content_ids = request.block_content_ids[:min(drop)]

    def free_leading_blocks(self, request: Request, num_blocks: int) -> None:
        """Free the first `num_blocks` of the request's table: slots its sliding window has
        left, which no later query sees (their slots then leave the table from the front, and
        `num_evicted_tokens` counts them). Not an eviction (nothing a query needs is lost), so
        not counted as one; the request's full blocks stay registered for prefix caching, the
        freed ones cached until reused, and it goes on registering those it fills (its block
        hashes count token blocks from its first)."""
        if not 0 < num_blocks <= len(request.block_table):
            raise ValueError(f"cannot free the first {num_blocks} of the request's "
                             f"{len(request.block_table)} blocks")
        # register its computed full blocks first (accepted speculative tokens are hashed at
        # the next allocation otherwise): the freed ones must be among them
        self._cache_full_blocks(request, min(request.num_tokens, request.num_computed_tokens))
        now = time.monotonic()
        freed = [block_id for block_id in request.block_table[:num_blocks]
                 if self._release(self.blocks[block_id], now, drop_cache=False)]
        self._notify_freed(freed)
        del request.block_table[:num_blocks]
        request.num_evicted_tokens += num_blocks * self.block_size

    def make_private(self, request: Request, indices: range | list[int],
                     spare: Sequence[int] = ()) -> list[tuple[int, int]] | None:
        """Copy-on-write: give the request its own copy of every shared block at `indices`
        before a policy rewrites them. The copies take free blocks, and once those run short
        the request's own blocks at `spare` (indexes outside `indices` of blocks it alone
        holds, `held_alone`, whose content the caller discards and frees right after: a
        compaction's unread tail): such a block trades places with the shared one, which then
        leaves with the tail. Returns (source, destination) block ids for the caller to copy in
        the KV pool, or None, changing nothing, when both are short."""
        table = request.block_table
        shared = self._shared(request, indices)
        from_queue = min(len(shared), self.num_free_blocks)
        if len(shared) > from_queue + len(spare):
            return None
        now = time.monotonic()
        copies = []
        for n, i in enumerate(shared):
            old = self.blocks[table[i]]
            if n < from_queue:
                new = self.free_queue.popleft()
                if new.block_hash is not None:
                    self._uncache(new, now, reason="prefix_lru")
                new.ref_cnt = 1
                old.ref_cnt -= 1  # still held by the other request(s): never reaches zero here
            else:  # ref counts unchanged: the request holds both, the old one at the spare index
                j = spare[n - from_queue]
                new = self.blocks[table[j]]
                table[j] = old.block_id
            self.birth[new.block_id] = now
            table[i] = new.block_id
            copies.append((old.block_id, new.block_id))
        return copies

    def _shared(self, request: Request, indices: range | list[int]) -> list[int]:
        """The indexes among `indices` whose block another request holds too, ascending."""
        return sorted(i for i in set(indices)
                      if self.blocks[request.block_table[i]].ref_cnt > 1)

    def held_alone(self, request: Request, indices: range | list[int]) -> list[int]:
        """The indexes among `indices` whose block no other request holds, ascending."""
        return sorted(set(indices) - set(self._shared(request, indices)))

    def wait_private(self, request: Request) -> range:
        """The block-table indexes the request's waiting KV-policy step (`policy_wait`) will make
        private, within its table (empty when nothing waits)."""
        wait = request.policy_wait
        if wait is None:
            return range(0)
        return range(wait.private.start, min(wait.private.stop, len(request.block_table)))

    def blocks_wanted(self, request: Request) -> int:
        """Free blocks the request's waiting KV-policy step needs now (`policy_wait`): a copy
        of each block to make private that is still shared beyond its spare blocks, or its
        scratch blocks (given back before the copies are taken), whichever is more."""
        wait = request.policy_wait
        if wait is None:
            return 0
        copies = len(self._shared(request, self.wait_private(request))) - wait.spare
        return max(copies, wait.scratch, 0)

    def pack_layer_slices(self, request: Request, counts: list[int]) -> list[tuple[int, int]]:
        """A policy left the request's layers with different lengths (`counts`, per layer): give
        each layer its own table of layer slices (`nanokv.cache.layer_slices`), move slices out
        of the tail blocks into the unused slices of the front ones, so the request holds
        ceil(sum_l ceil(C_l / B) / L) blocks instead of ceil(max_l C_l / B), and free the rest.
        Returns the (source, destination) slice moves for the KV cache to copy now (the freed
        blocks keep their content until the pool hands them out again). The moved-into blocks
        must be the request's own (the policy runner made them private first)."""
        bs, n_pool, n_layers = self.block_size, self.num_blocks, len(counts)
        table = request.block_table
        per_layer = [cdiv(c, bs) for c in counts]
        keep = cdiv(sum(per_layer), n_layers)
        tables = [[layer * n_pool + table[j] for j in range(nb)]
                  for layer, nb in enumerate(per_layer)]
        free = [layer * n_pool + table[j] for j in range(keep)
                for layer in range(n_layers) if j >= per_layer[layer]]
        moves = []
        for layer, nb in enumerate(per_layer):
            for j in range(keep, nb):
                moves.append((tables[layer][j], free[len(moves)]))
                tables[layer][j] = moves[-1][1]
        request.layer_slices = LayerSlices(tables, counts, request.num_computed_tokens, bs,
                                           n_pool)
        if keep < len(table):
            self.free_blocks_at(request, list(range(keep, len(table))))
        return moves

    # ---- windows of some layers (nanokv.cache.layer_slices) -------------------------------------
    def slice_for_windows(self, request: Request, windows: Sequence[int | None]) -> None:
        """Give each layer of the request its own table of layer slices (every layer its own
        row of the blocks it holds), so that its windowed layers (`windows[l]` not None) drop
        the slices their windows have passed and its full-attention layers' new tokens take
        them (`recycle_window_slices`, now and after each step). Its blocks stay registered for
        prefix caching until one of their slices takes other tokens; those it fills from now
        on are not registered (their slices no longer follow the token blocks)."""
        if request.layer_slices is not None:
            raise RuntimeError(f"{request} already has per-layer tables")
        n, bs, n_pool = request.num_cached_slots, self.block_size, self.num_blocks
        held = request.block_table[:cdiv(n, bs)]
        tables = [[layer * n_pool + b for b in held] for layer in range(len(windows))]
        request.layer_slices = LayerSlices(tables, [n] * len(windows),
                                           request.num_computed_tokens, bs, n_pool, windows)
        request.prefix_cacheable = False
        request.layer_slices.drop_passed(n)
        self._pack(request)

    def recycle_window_slices(self, request: Request) -> None:
        """Drop the slices the request's windowed layers no longer read (before its next
        token's window) from their tables, pack the rest into as few blocks as hold them when
        that frees a block (`_pack`: the moved slices copied through `on_slices_moved`), and
        free its blocks no layer uses any more (not an eviction: no query needs what they
        hold; a cached one stays a hit until reused)."""
        if request.layer_slices.drop_passed(request.num_cached_slots):
            self._pack(request)

    def _pack(self, request: Request) -> None:
        """Move the request's slices out of its emptiest blocks (`LayerSlices.pack`), copy
        them, and free the blocks no layer uses."""
        if self.on_slices_moved is None:
            raise RuntimeError("packing moves slices: the block manager needs on_slices_moved "
                               "(the KV cache's copy_slices), or their data would stay behind")
        moves = request.layer_slices.pack(request.block_table, self._pinned(request))
        if moves:
            now = time.monotonic()
            for block_id in {request.layer_slices.slice_block(d) for _, d in moves}:
                self._content_changed(self.blocks[block_id], now)  # its free slices rewritten
            self.on_slices_moved(moves)
        self._release_idle(request)

    def _release_idle(self, request: Request) -> None:
        """Free the blocks of a request with per-layer tables that no layer uses."""
        used = request.layer_slices.used_blocks()
        idle = [b for b in request.block_table if b not in used]
        if not idle:
            return
        now = time.monotonic()
        self._notify_freed([b for b in idle if self._release(self.blocks[b], now, False)])
        request.block_table = [b for b in request.block_table if b in used]

    def _pinned(self, request: Request) -> set[int]:
        """The request's blocks another request holds too (their slices are not its to
        overwrite)."""
        return {b for b in request.block_table if self.blocks[b].ref_cnt > 1}

    def _content_changed(self, block: KVCacheBlock, now: float) -> None:
        """The request holding `block` alone rewrites it: unregister it (or drop it from its
        hash's copies)."""
        if block.block_hash is not None:
            self._uncache(block, now, reason=None)
        elif block.copy_of is not None:
            self._drop_copy(block)
            block.reset_hash()

    def mark_content_changed(self, request: Request, from_block: int = 0) -> None:
        """A policy rewrote the request's blocks from `from_block` on: never serve them as a
        plain prefix again."""
        now = time.monotonic()
        for block_id in request.block_table[from_block:]:
            block = self.blocks[block_id]
            if block.ref_cnt != 1:  # shared: copied before it is rewritten (make_private)
                continue
            self._content_changed(block, now)
        # its block hashes count token blocks from the first (free_leading_blocks)
        first = from_block + (request.num_evicted_tokens // self.block_size
                              if request.prefix_cacheable else 0)
        request.prefix_cacheable = False
        request.block_hashes = request.block_hashes[:first]
        request.block_content_ids = request.block_content_ids[:first]

    def _release(self, block: KVCacheBlock, now: float, drop_cache: bool) -> bool:
        """Drop one reference; True when the block became free."""
        if block.ref_cnt <= 0:
            raise RuntimeError(f"double free of {block}")
        block.ref_cnt -= 1
        if block.ref_cnt > 0:
            return False
        if block.copy_of is not None:
            h = self._drop_copy(block)
            twin = self.cached[h]
            if twin.ref_cnt == 0 and not drop_cache:  # freed after its twin: the later use
                self._hand_over(twin, block, h)
            else:
                block.reset_hash()
        if drop_cache and block.block_hash is not None:
            self._uncache(block, now, reason=None)
        if block.block_hash is None:
            self.free_queue.appendleft(block)
        else:
            self.free_queue.append(block)
        return True

    def _notify_freed(self, block_ids: list[int]) -> None:
        if block_ids and self.on_block_freed is not None:
            self.on_block_freed(block_ids)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds. Returns how many were dropped."""
        dropped = [b for b in self.cached.values() if b.ref_cnt == 0]
        for block in dropped:
            self._uncache(block, time.monotonic(), reason=None)
        return len(dropped)

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self, live_requests: list[Request]) -> None:
        """Raise RuntimeError if the block accounting is inconsistent with the live requests."""
        refs = Counter()
        for request in live_requests:
            if len(set(request.block_table)) != len(request.block_table):
                raise RuntimeError(f"{request} holds a block twice: {request.block_table}")
            refs.update(request.block_table)
            if request.layer_slices is not None:
                request.layer_slices.check(request.block_table, request.num_computed_tokens)
        queued = list(self.free_queue)
        if len(queued) != self.free_queue.num_free_blocks:
            raise RuntimeError("free queue length disagrees with its counter")
        if len(set(id(b) for b in queued)) != len(queued):
            raise RuntimeError("a block appears twice in the free queue")
        for block in self.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise RuntimeError(f"{block} has ref_cnt {block.ref_cnt} but "
                                   f"{refs.get(block.block_id, 0)} live references")
            if (block.ref_cnt == 0) != self.free_queue.contains(block):
                raise RuntimeError(f"{block} free-queue membership disagrees with its ref count")
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                raise RuntimeError(f"{block} has a hash but is not the cached block for it")
            twin = None if block.copy_of is None else self.cached.get(block.copy_of)
            if block.copy_of is not None and (
                    block.block_hash is not None or block.ref_cnt == 0
                    or block not in self.copies.get(block.copy_of, ()) or twin in (None, block)
                    or (twin.token_ids, twin.extra_keys, twin.content_id)
                    != (block.token_ids, block.extra_keys, block.content_id)):
                raise RuntimeError(f"{block} is not a held copy of the registered block of "
                                   f"its hash")
        for h, block in self.cached.items():
            if block.block_hash != h:
                raise RuntimeError(f"cache entry {h} points at {block}")
        for h, copies in self.copies.items():
            if not copies or any(b.copy_of != h for b in copies):
                raise RuntimeError(f"copies of hash {h} disagree with their blocks: {copies}")
        if self.num_free_blocks + sum(1 for b in self.blocks if b.ref_cnt > 0) != self.num_blocks:
            raise RuntimeError("free + used blocks != total blocks")
