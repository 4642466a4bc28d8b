"""Runs the KV policies (nanokv/policies) on the engine's paged cache.

When a request's compression point is computed (its whole prompt, or `compress_after` tokens),
its cache is compressed to the policy's budget: kept tokens are written densely to the front
of its block table and the tail blocks go back to the pool at once. During decode a block-wise
policy (PagedEviction) frees one whole block each time the newest block fills and the request
holds more than its budget; a policy that re-selects (StreamingLLM, H2O with the attention of
the queries since its last selection) compresses again then. A policy that declares
`pool_pressure` (PagedEviction) and runs without a budget frees, when pool usage passes
1 - eviction_ratio, the least important blocks across running requests before anyone has to be
preempted (and recomputed whole).

The policy chooses (a `CompressionPlan`, on the KV cache's `policy_view`); the block manager and
the KV cache apply it: copy-on-write of shared blocks (into free blocks, else into blocks of the
request's tail that hold no kept token), `apply_plan`, freeing the blocks no longer needed. A
compaction whose copies (or a scoring pass whose scratch blocks) find the pool short changes
nothing and records what it waits for (`request.policy_wait`); the scheduler keeps those
blocks free at the next step, when it is tried again first. Per-layer budgets (PyramidKV) leave
layers with different lengths: the block manager then gives the request per-layer tables of layer
slices (`pack_layer_slices`) and the KV cache moves the slices.

Kept tokens keep their original RoPE rotation; the next token's position stays the request's
logical length (`num_computed_tokens`), its slot the cache length (`num_cached_slots`).

A policy that scores the cache with an extra forward pass (`needs_reconstruction`: KVzip) gets
it at its compression point, between two steps: each chunk of the pass (at most one step's token
budget) runs through `ModelRunner.score_forward` over the request's blocks, its own K/V in
scratch blocks taken from the pool and freed right after; the request's cache is only read.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanokv.cache.block_manager import BlockManager
from nanokv.cache.kv_cache import KVCache, KVView, raise_reconstruction_unsupported
from nanokv.policies.apply import plan_compression
from nanokv.policies.base import KVPolicy, LayerKV, PolicyConfig
from nanokv.policies.compaction import gather_request_kv
from nanokv.policies.kvzip import chunk_scores
from nanokv.request import PolicyBlockWait, Request
from nanokv.sampling_params import SamplingParams
from nanokv.utils import cdiv

_SCRATCH_PARAMS = SamplingParams(temperature=0, max_tokens=1)


@dataclass
class PolicyStats:
    compressions: int = 0
    compress_seconds: float = 0.0  # compressions at the compression point (scoring included)
    seconds: float = 0.0  # all policy work: compressions, decode evictions, pool pressure
    decode_evicted_blocks: int = 0
    pressure_evicted_blocks: int = 0
    reconstruction_tokens: int = 0  # tokens of extra scoring passes (KVzip), all chunks
    reconstruction_seconds: float = 0.0  # their forward passes and scoring


@dataclass
class ScoringPass:
    """What the runner needs for policies with an extra forward pass (KVzip)."""

    forward: Callable  # ModelRunner.score_forward
    encode: Callable[[str], list[int]] | None  # text -> ids without special tokens; None: none
    max_tokens: int  # the step budget: no chunk of the pass is larger


class PolicyRunner:
    def __init__(self, default: PolicyConfig | None, block_manager: BlockManager,
                 kv_cache: KVCache, attention_scale: float,
                 scoring: ScoringPass | None = None, soft_cap: float | None = None) -> None:
        """attention_scale, soft_cap: the model's (its scores as its attention computes them:
        what the policies' attention probabilities are made with)."""
        self.block_manager = block_manager
        self.scoring = scoring
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.scale = attention_scale
        self.soft_cap = soft_cap
        self.num_layers = kv_cache.layout.num_layers
        self.default_config = default
        self.default = self.build(default) if default is not None else None
        self.stats = PolicyStats()

    def build(self, config: PolicyConfig) -> KVPolicy:
        if not isinstance(config, PolicyConfig):
            raise ValueError(f"kv_policy must be a PolicyConfig (e.g. PolicyConfig('snapkv', "
                             f"budget=256)) or None, got {type(config).__name__} {config!r}")
        policy = config.build(block_size=self.block_size)
        self.kv_cache.check_policy(policy)
        if policy.needs_reconstruction:
            if self.scoring is None:  # no scoring pass across tensor-parallel ranks
                raise_reconstruction_unsupported(policy.name)
            if self.scoring.encode is None:
                raise ValueError(f"kv_policy {policy.name!r} needs a tokenizer for its repeat "
                                 f"prompt (not skip_tokenizer_init)")
            # raises now, not mid-step, when a chunk cannot fit the step budget
            policy.chunks([0], self.scoring.encode, self.scoring.max_tokens)
        return policy

    # ---- per request ---------------------------------------------------------------------------
    def attach(self, request: Request, override: PolicyConfig | None = None) -> None:
        policy = self.build(override) if override is not None else self.default
        request.kv_policy = policy
        if policy is None or not policy.needs_attention:
            return
        point = request.compress_point
        window = policy.observation_window
        request.query_capture_from = 0 if window is None else max(0, point - window)
        request.capture_decode_queries = (policy.decode_mode == "reselect"
                                          and policy.needs_attention)

    def collect(self, captured: dict, requests: dict[str, Request]) -> None:
        for request_id, per_layer in captured.items():
            request = requests.get(request_id)
            if request is not None:
                request.captured_queries.append(per_layer)

    def after_step(self, requests: list[Request]) -> list[tuple[Request, Exception]]:
        """Apply each scheduled request's policy once its step's K/V are written, in the order
        given (`Scheduler.policy_order`: the steps that waited for blocks first). A request
        whose policy raises is returned with its error (its cache may be half compacted: the
        engine aborts it); the others go on."""
        t0 = time.perf_counter()
        failures = []
        for request in requests:
            policy = request.kv_policy
            if policy is None or request.is_finished:
                continue
            try:
                if not request.compressed:
                    if request.num_computed_tokens >= request.compress_point:
                        self.compress(request)
                elif request.kv_budget is not None:
                    self._decode_evict(request, policy)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                failures.append((request, e))
        self.stats.seconds += time.perf_counter() - t0
        return failures

    def compress(self, request: Request) -> None:
        """Cut the request's cache to its budget (once, at its compression point)."""
        policy = request.kv_policy
        if policy.budget is None and policy.compression_ratio is None:
            request.compressed = True  # pool-pressure mode: keep everything until pressure
            request.kv_budget = None
            return
        t0 = time.perf_counter()
        budget = policy.resolve_budget(request.num_cached_slots)
        q_windows = None
        if policy.needs_attention:
            # the last W queries: when a compaction had to wait (copy-on-write found no free
            # block), the steps since captured more rows than the window
            window = min(policy.observation_window or request.num_cached_slots,
                         request.num_cached_slots)
            q_windows = [torch.cat([step[layer] for step in request.captured_queries])[-window:]
                         for layer in range(self.num_layers)]  # each [W, Hq, D]
        layer_scores = None
        if policy.needs_reconstruction and budget < request.num_cached_slots:
            layer_scores = self._reconstruction_scores(request, policy)
            if layer_scores is None:  # no scratch blocks now: the next step tries again
                self.stats.compress_seconds += time.perf_counter() - t0
                return
        if self._compact(request, policy, budget, q_windows, layer_scores=layer_scores):
            request.compressed = True
            # decode keeps the cache within the budget asked for, not within a shorter prompt
            request.kv_budget = max(budget, policy.decode_budget(request.num_cached_slots))
            request.captured_queries = []
            self.stats.compressions += 1
        self.stats.compress_seconds += time.perf_counter() - t0

    def _compact(self, request: Request, policy: KVPolicy, budget: int, q_windows,
                 layer_scores=None) -> bool:
        """Compact to `budget` slots; False (nothing changed) when copy-on-write lacks blocks:
        the next step tries again."""
        bm, kv = self.block_manager, self.kv_cache
        num_slots = request.num_cached_slots
        wait, request.policy_wait = request.policy_wait, None  # set again if it must wait
        if budget >= num_slots:
            return True
        ragged = request.layer_slices is None and policy.per_layer_budgets
        view = kv.policy_view(request)
        plan = plan_compression(policy, view.layers, view.block_table, num_slots,
                                budget=None if ragged else budget, q_windows=q_windows,
                                scale=self.scale, soft_cap=self.soft_cap,
                                layer_scores=layer_scores,
                                allow_ragged_layers=ragged)
        if plan.num_evicted == 0:
            return True
        # blocks about to be rewritten must be this request's alone (copy-on-write): free
        # blocks, or once those run short the blocks of its tail that hold no kept token
        rewritten = range(plan.first_changed_block, plan.num_blocks)
        copies, spare = bm.make_private(request, rewritten), []
        if copies is None and request.layer_slices is None:  # (else slot s is not in table[s // B])
            spare = bm.held_alone(request, plan.unread_tail(len(request.block_table),
                                                            self.block_size))
            copies = bm.make_private(request, rewritten, spare)
        if copies is None:  # the scheduler keeps the copies' blocks free for the next try
            request.policy_wait = dataclasses.replace(wait or PolicyBlockWait(),
                                                      private=rewritten, spare=len(spare))
            return False
        kv.copy_blocks(copies)
        kv.apply_plan(request, plan, view)  # reads kept tokens from any block of the view
        request.block_scores = {}  # blocks from first_changed_block on hold other tokens now
        tail = list(range(plan.num_blocks, len(request.block_table)))
        if tail:  # untouched: their prefix hashes stay
            bm.free_blocks_at(request, tail)
        bm.mark_content_changed(request, from_block=plan.first_changed_block)
        request.num_evicted_tokens += plan.num_evicted
        if len(set(plan.layer_num_slots)) > 1:
            kv.copy_slices(bm.pack_layer_slices(request, plan.layer_num_slots))
        return True

    def _reconstruction_scores(self, request: Request, policy: KVPolicy
                               ) -> list[torch.Tensor] | None:
        """Per layer [Hkv, n]: the policy's scores of the request's n cached slots from its extra
        forward pass (KVzip's reconstruction), chunk by chunk. None when the pool has no scratch
        blocks for a chunk now."""
        t0 = time.perf_counter()
        n = request.num_cached_slots
        if request.num_evicted_tokens:
            raise RuntimeError("the reconstruction pass runs before anything is evicted")
        chunks = policy.chunks(request.token_ids_range(0, n), self.scoring.encode,
                               self.scoring.max_tokens)
        view = self.kv_cache.policy_view(request)
        keys = [gather_request_kv(k, v, view.block_table, n)[0]  # each [n, Hkv, D]
                for k, v in view.layers]
        scores = [torch.zeros(k.shape[1], n, device=k.device) for k in keys]  # each [Hkv, n]
        bs, bm = self.block_size, self.block_manager

        def seen_by(chunk) -> int:  # the context slots a chunk sees
            return n if policy.context == "full" else chunk.end

        def scratch_slots(chunk) -> int:  # the partial block it sees, then its own tokens
            return seen_by(chunk) % bs + len(chunk.token_ids)

        for chunk in chunks:
            # the chunk sees slots [0, seen) and sits right after them (slot = position: nothing
            # was evicted yet); its K/V go to scratch blocks, the partial block copied first
            seen = seen_by(chunk)
            full = seen // bs
            scratch = Request(f"{request.request_id}#scoring", [0], _SCRATCH_PARAMS)
            scratch.prefix_cacheable = False
            if not bm.allocate_slots(scratch, scratch_slots(chunk)):
                # tried again after one more decode step: one more context slot, and the
                # largest chunk may see one more slot and hold one more token then
                request.policy_wait = dataclasses.replace(
                    request.policy_wait or PolicyBlockWait(),
                    scratch=max(bm.blocks_for(scratch_slots(c) + 2) for c in chunks))
                return None
            try:
                if seen % bs:
                    self.kv_cache.copy_blocks([(request.block_table[full],
                                                scratch.block_table[0])])
                q, chunk_keys = self.scoring.forward(chunk.token_ids, seen, seen,
                                                     request.block_table[:full]
                                                     + scratch.block_table,
                                                     request.lora_int_id)
            finally:
                bm.free(scratch)
            for layer in range(self.num_layers):
                scores[layer][:, chunk.start:chunk.end] = chunk_scores(
                    q[layer], keys[layer], chunk_keys[layer], chunk.start, chunk.end,
                    policy.n_sink, self.scale, soft_cap=self.soft_cap)
            self.stats.reconstruction_tokens += len(chunk.token_ids)
        self.stats.reconstruction_seconds += time.perf_counter() - t0
        return scores

    def _decode_evict(self, request: Request, policy: KVPolicy) -> None:
        if request.layer_slices is not None:  # per-layer budgets (PyramidKV): prefill only
            return
        num_slots = request.num_cached_slots
        if policy.decode_mode == "evict_block":
            # a block each time the newest fills (the scheduler ends a recompute's chunks on
            # block fills too); more if a chunk crossed fills: back within the budget at once
            while policy.should_evict_on_decode(num_slots, request.kv_budget):
                scores = (self._block_scores(request, self.kv_cache.policy_view(request))
                          if policy.needs_block_scores else None)
                index = policy.block_to_evict(scores, num_slots, request.kv_budget)
                if index is None:
                    break
                self._free_blocks(request, [index])
                request.num_evicted_tokens += self.block_size
                self.stats.decode_evicted_blocks += 1
                num_slots = request.num_cached_slots
        elif policy.decode_mode == "reselect" and self._reselect_due(request):
            q_windows = None
            if policy.needs_attention:  # the queries since the last selection (of slots n-W..)
                if not request.captured_queries:
                    return
                q_windows = [torch.cat([step[layer] for step in request.captured_queries])
                             for layer in range(self.num_layers)]  # each [W, Hq, D]
            if self._compact(request, policy, request.kv_budget, q_windows):
                request.captured_queries = []

    def _reselect_due(self, request: Request) -> bool:
        """A re-selecting policy's cache past the most it holds between selections, B ceil(C / B)
        + B - 1 slots: true first when the newest block fills past it (where
        `should_evict_on_decode` is), and at every step after until a selection succeeds (one
        whose copy-on-write found no free block is tried again at the next step, not a block
        later)."""
        bs = self.block_size
        return request.num_cached_slots > bs * cdiv(request.kv_budget, bs) + bs - 1

    # ---- block-wise policies: scores of whole blocks --------------------------------------------
    def _block_scores(self, request: Request, view: KVView) -> torch.Tensor:
        """[L, nb] the policy's `block_scores` of each of the request's blocks in every layer.
        A block-wise policy scores a block from its own tokens, and a full block's content stays
        as it is until a compaction or a preemption (which clear `request.block_scores`): each
        full block is read and scored once, then its scores are kept by block id. The partial
        newest block is scored afresh."""
        n, bs = request.num_cached_slots, self.block_size
        nb, full = cdiv(n, bs), n // bs
        ids = request.block_table[:nb]
        kept = request.block_scores
        fresh = [i for i in range(nb) if i >= full or ids[i] not in kept]  # partial one last
        new = {}  # block-table index -> [L]
        if fresh:
            num_tokens = n - (nb - len(fresh)) * bs  # the blocks not read are full
            per_layer = []
            for layer in range(self.num_layers):
                k, v = view.blocks(layer, fresh)  # each [m, B, Hkv, D]
                keys = k.flatten(0, 1)[:num_tokens]  # [m * B - unwritten slots, Hkv, D]
                values = v.flatten(0, 1)[:num_tokens]
                per_layer.append(request.kv_policy.block_scores(LayerKV(keys, values)))  # [m]
            new = dict(zip(fresh, torch.stack(per_layer).unbind(1)))  # [L, m] -> m x [L]
            kept.update({ids[i]: s for i, s in new.items() if i < full})
        return torch.stack([new[i] if i in new else kept[ids[i]] for i in range(nb)], dim=1)

    def _free_blocks(self, request: Request, indices: list[int]) -> None:
        """Free the blocks at these block-table indexes (their kept scores go with them)."""
        for i in indices:
            request.block_scores.pop(request.block_table[i], None)
        self.block_manager.free_blocks_at(request, indices)

    # ---- pool pressure -------------------------------------------------------------------------
    @staticmethod
    def pressure_candidates(running: list[Request]) -> list[Request]:
        """The running requests whose blocks pool pressure may evict."""
        return [r for r in running if r.kv_policy is not None and r.compressed
                and r.kv_budget is None and r.kv_policy.pool_pressure]

    def relieve_pressure(self, running: list[Request],
                         blocks_to_admit: Callable[[], int] | None = None) -> int:
        """Pool-pressure mode: free the least important blocks across running requests while
        usage is above 1 - eviction_ratio, or until the blocks the first waiting request needs
        are free (`blocks_to_admit()`, asked only when there are candidates; only when they can
        free that many). Returns the number of blocks freed."""
        bm = self.block_manager
        candidates = self.pressure_candidates(running)
        if not candidates:
            return 0
        policy = candidates[0].kv_policy
        blocks_to_admit = blocks_to_admit() if blocks_to_admit is not None else 0
        evictable = sum(max(0, len(r.block_table) - 2) for r in candidates)  # not 0, not newest
        if bm.num_free_blocks >= blocks_to_admit or bm.num_free_blocks + evictable < \
                blocks_to_admit:
            blocks_to_admit = 0  # admission is not blocked, or eviction cannot unblock it
        if bm.usage <= 1 - policy.eviction_ratio and not blocks_to_admit:
            return 0
        t0 = time.perf_counter()
        scores = [self._block_scores(r, self.kv_cache.policy_view(r))  # each [L, nb]
                  for r in candidates]
        freed = 0
        for request, indices in zip(candidates, policy.pool_evictions(
                scores, bm.num_used_blocks, bm.num_blocks, blocks_to_admit)):
            if indices:
                self._free_blocks(request, list(indices))
                request.num_evicted_tokens += self.block_size * len(indices)
                freed += len(indices)
        self.stats.pressure_evicted_blocks += freed
        self.stats.seconds += time.perf_counter() - t0
        return freed
