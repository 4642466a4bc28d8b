"""KV policies modelled by what they do to the blocks, not by their scores.

  * `compress` (ratio r): when a request's prompt is computed its cache is cut to
    floor(n (1 - r)) tokens (`kept_by_ratio`; token-level selection, as SnapKV/H2O: the kept
    blocks are rewritten, so they are made private and leave the prefix cache; the tail blocks
    are freed);
  * `relieve_pressure` (PagedEviction's pool-pressure mode, eviction ratio e): while usage >
    1 - e, whole middle blocks (never block 0 nor the newest) of the running requests that
    finished their prompt are freed, largest requests first (the real policy picks them by
    ||V||/||K||; the count is the same, which blocks is not).
"""

from __future__ import annotations

from nanokv.cache.block_manager import BlockManager
from nanokv.policies.base import kept_by_ratio
from nanokv.request import PolicyBlockWait, Request
from nanokv.utils import cdiv


def compress(bm: BlockManager, request: Request, ratio: float) -> bool:
    """Cut a request's cache by `ratio`; False if copy-on-write lacked blocks (retried at the
    next step, the scheduler keeping the copies' blocks free meanwhile, as in the engine)."""
    slots = request.num_cached_slots
    keep = kept_by_ratio(slots, ratio)
    request.policy_wait = None
    if keep >= slots:
        return True
    nb = cdiv(keep, bm.block_size)
    if bm.make_private(request, range(nb)) is None:
        request.policy_wait = PolicyBlockWait(private=range(nb))
        return False
    tail = list(range(nb, len(request.block_table)))
    if tail:
        bm.free_blocks_at(request, tail)
    bm.mark_content_changed(request, from_block=0)
    request.num_evicted_tokens += slots - keep
    return True


def pressure_limit(bm: BlockManager, ratio: float) -> int:
    """Blocks in use above which pool-pressure eviction starts."""
    return int((1 - ratio) * bm.num_blocks + 1e-9)


def relieve_pressure(bm: BlockManager, running: list[Request], ratio: float) -> None:
    excess = bm.num_used_blocks - pressure_limit(bm, ratio)
    if excess <= 0:
        return
    cands = sorted((r for r in running
                    if r.num_computed_tokens >= r.num_prompt_tokens and len(r.block_table) > 2),
                   key=lambda r: -len(r.block_table))
    for r in cands:
        if excess <= 0:
            break
        take = min(excess, len(r.block_table) - 2)
        bm.free_blocks_at(r, list(range(1, 1 + take)))
        r.num_evicted_tokens += bm.block_size * take
        excess -= take
