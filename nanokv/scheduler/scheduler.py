"""Continuous batching with chunked prefill and recompute preemption (vLLM v1 style).

Each step spends one token budget: running requests first (decodes and unfinished prefill
chunks), then waiting ones in arrival order. When the pool runs out of blocks the newest running
request is preempted: its blocks are freed and it will be recomputed from scratch. A running
request whose KV-policy step waits for blocks (`policy_wait`) has them kept free, newer requests
preempted for them.

Under the `priority` scheduling policy (vLLM's) the waiting queue is ordered by (priority,
arrival time), lower first, preempted requests included, and the victim of a preemption is the
running request with the largest (priority, arrival time), even one already scheduled this step
(its tokens go back to the budget). A waiting request never preempts a running one.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

import numpy as np

from nanokv.bad_words import completing_tokens
from nanokv.cache.block_manager import BlockManager
from nanokv.cache.layout import sliced_request_blocks, window_request_blocks, window_start
from nanokv.config import SCHEDULING_POLICIES
from nanokv.request import Request, RequestStatus
from nanokv.scheduler.output import (PENDING_DRAFT, RowConstraints, RunnerOutput,
                                     ScheduledRequest, SchedulerOutput, SchedulerStats)
from nanokv.spec.config import SpeculativeConfig
from nanokv.spec.ngram import NgramIndex
from nanokv.spec.stats import SpecDecodeStats


# the longest prefill chunk after a cached past that attends as decode rows: up to it the decode
# kernels, which read the past once a row, beat the prefill path's gather and attention call
# (benchmarks/bench_decode_rows.py, Qwen3-0.6B shape, 8 requests: 0.29-0.71x its step time at 2
# rows, 0.82-0.94x at 8, 0.98-1.10x at 12, 1.06-1.28x at 16; docs/results/engine/decode_rows.md)
DECODE_ROW_CHUNK = 8


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, scheduling_policy: str = "fcfs",
                 speculative: SpeculativeConfig | None = None,
                 drafts_before_block_end: bool = False, max_loras: int = 0,
                 sliding_window: int | None = None,
                 layer_windows: tuple[int | None, ...] | None = None) -> None:
        """drafts_before_block_end: speculative drafts never take a block's last slot (a KV
        cache that quantizes a block when that slot is written: `KVCache.quantizes_full_blocks`);
        only a known token fills a block; and a chunk that writes one goes by the prefill path,
        not as decode rows (`_as_decode_rows`). max_loras: the most distinct LoRA adapters
        running at once (a waiting request of another adapter waits, those behind it may go
        first, as in vLLM). sliding_window: the window every layer attends over
        (`KVLayout.common_window`): after each step a request's blocks wholly behind its next
        token's window are freed (vLLM's sliding-window manager). layer_windows: each layer's
        window (None: the whole context) of a model whose layers mix the two, on a KV cache with
        per-layer tables: a request that runs short of blocks gives its windowed layers'
        passed slices to its other layers' new tokens (`BlockManager.slice_for_windows`), as
        vLLM's hybrid KV cache manager keeps only a window's blocks for such layers; None:
        every layer keeps every block."""
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, "
                             f"got {scheduling_policy!r}")
        self.by_priority = scheduling_policy == "priority"
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0  # tokens of every step's batch (prefill chunks + decodes)
        self.num_recomputed_tokens = 0  # computed tokens thrown away by preemption
        self.speculative = speculative  # n-gram drafts for decoding requests (None: off)
        self.drafts_before_block_end = drafts_before_block_end
        self.max_loras = max_loras
        self.sliding_window = sliding_window
        # the most blocks a request holds at once under the window (None: its whole context)
        self.window_blocks = None if sliding_window is None else window_request_blocks(
            sliding_window, block_manager.block_size, max_num_batched_tokens)
        self.layer_windows = layer_windows
        self.spec_stats = SpecDecodeStats(speculative.num_speculative_tokens) \
            if speculative is not None else None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {request.num_tokens} tokens; max_model_len "
                             f"{self.max_model_len} allows at most {self.max_model_len - 1}")
        # the most slots it can ever hold (the last sampled token is never computed): a request
        # that outgrows the whole pool would preempt itself forever and block the waiting queue
        longest = min(request.num_prompt_tokens + request.params.max_tokens, self.max_model_len)
        blocks = self.block_manager.blocks_for(longest - 1)
        if self.window_blocks is not None:
            blocks = min(blocks, self.window_blocks)
        if self._may_slice(request):
            blocks = min(blocks, self._sliced_blocks(longest - 1))
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"request needs up to {blocks} KV blocks (prompt + max_tokens, "
                             f"capped at max_model_len) but the pool has only "
                             f"{self.block_manager.num_blocks}")
        self.requests[request.request_id] = request
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_rank)
        else:
            self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its blocks. Unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus, drop_cache: bool = False) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.final_kv_blocks = len(request.block_table)
        request.final_kv_slots = request.num_cached_slots
        if request.layer_slices is not None:  # layers hold different lengths: their mean
            lengths = request.layer_slices.lengths(request.num_computed_tokens)
            request.final_kv_slots = round(sum(lengths) / len(lengths))
        self.block_manager.free(request, drop_cache=drop_cache)
        request.grammar = None  # its matcher's memory
        request.status = status
        request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        bm = self.block_manager

        reserved = 0  # free blocks kept for the waiting policy steps of requests scheduled
        kept: dict[str, int] = {}  # those blocks by request (priority policy: given back if it
        # is preempted after being scheduled)
        to_copy: set[int] = set()  # the blocks those steps will copy if still shared then
        # speculative decoding: draft tokens per request at this batch size (running requests)
        k = self.speculative.tokens_for_batch(len(self.running)) if self.speculative else 0
        if self.layer_windows is not None:
            self._slice_to_admit()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request, request.num_computed_tokens, budget)
            drafts, bitmasks = self._drafts(request, num_new, budget, reserved, k)
            while not drafts and not bm.allocate_slots(request, num_new, keep_free=reserved):
                # windowed layers' passed slices: its own take the tokens, or a later
                # request's (not scheduled yet this step) free blocks for it
                if self._slice(request) or self._slice_newest(first=i + 1):
                    continue
                v = self._victim_index()
                victim = self.running.pop(v)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                if v < i:  # scheduled earlier this step (priority policy only): unschedule it
                    i -= 1
                    budget += scheduled.pop(v).num_tokens  # scheduled[k] is running[k], k < i
                    reserved -= kept.pop(victim.request_id)
            if request in preempted:
                break
            held = self._reserve_for_policy(request, i, preempted, reserved)
            reserved += held
            if self.by_priority:  # given back if a later victim is this request
                kept[request.request_id] = held
            to_copy.update(request.block_table[j] for j in bm.wait_private(request))
            scheduled.append(self._scheduled(request, num_new, drafts, bitmasks))
            budget -= num_new + len(drafts)
            i += 1

        adapters = self._running_adapters()
        index = 0  # the waiting request tried: those before it wait for an adapter slot
        while (index < len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs and not preempted):
            request = self.waiting[index]
            if self._waits_for_adapter(request, adapters):
                index += 1
                continue
            hits = self._hits(request)
            hit_tokens = len(hits) * bm.block_size
            if request.num_tokens - hit_tokens > budget and not self.enable_chunked_prefill:
                break
            # the whole known sequence must fit, as vLLM's `scheduler_reserve_full_isl`: a first
            # chunk that fits, of a prompt that does not, would be preempted a step later
            # a hit on a block a waiting compaction would otherwise own alone costs it a copy
            copies = sum(1 for b in hits if b.ref_cnt == 1 and b.block_id in to_copy)
            if self._blocks_to_start(request, hits) + copies > bm.num_free_blocks - reserved:
                break
            num_new = self._chunk(request, hit_tokens, budget)
            if not bm.allocate_slots(request, num_new, hits, keep_free=reserved + copies,
                                     skip=self._blocks_behind(hit_tokens)):
                break
            reserved += copies
            del self.waiting[index]
            if request.lora_int_id:
                adapters.add(request.lora_int_id)
            request.num_computed_tokens = hit_tokens
            if request.num_cached_tokens < 0:  # first admission: count prefix-cache stats
                request.num_cached_tokens = hit_tokens
                if bm.enable_prefix_caching:  # else nothing was looked up (vLLM's count)
                    bm.stats.prefix_cache_queries += request.num_prompt_tokens
                    bm.stats.prefix_cache_hits += hit_tokens
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        # decodes first, then prefill chunks; within each, a LoRA adapter's rows side by side
        # (one slice per adapter for its projections; the order stays without LoRA)
        scheduled.sort(key=lambda s: (not s.is_decode, s.lora_int_id))
        self.num_scheduled_tokens += sum(s.num_tokens for s in scheduled)
        return SchedulerOutput(scheduled, [r.request_id for r in preempted])

    def _drafts(self, request: Request, num_new: int, budget: int, reserved: int,
                k: int) -> tuple[list[int], np.ndarray | None]:
        """Speculative decoding: the drafts a decoding request verifies this step (n-grams, or
        a draft model's: k placeholders, `fill_drafts` before the forward pass), with
        their slots (and its token's) allocated, and a structured request's bitmask of each
        sampling row (`RequestGrammar.draft_rows`: the drafts its grammar refuses are cut);
        ([], None) when it drafts none (the caller allocates its one token as any other,
        preempting if it must: drafts never preempt). Up to k (the step's, by batch size), no
        more than the budget, max_tokens and max_model_len leave room for; none for a request
        with a KV policy."""
        if k == 0 or num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return [], None
        params = request.params
        if request.kv_policy is not None or request.layer_slices is not None:
            return [], None
        spec = self.speculative
        k = min(k, budget - 1,
                params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens)
        if self.drafts_before_block_end:  # the drafts' slots stop before their block's last
            bs = self.block_manager.block_size
            k = min(k, bs - 1 - (request.num_cached_slots + 1) % bs)
        if k < 1:
            return [], None
        bitmasks = None
        if spec.method == "draft_model":  # placeholders until `fill_drafts`
            drafts = [PENDING_DRAFT] * k
        else:
            if request.ngram_index is None:
                request.ngram_index = NgramIndex()
            request.ngram_index.sync(request.prompt_token_ids, request.output_token_ids)
            drafts = request.ngram_index.propose(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                                 k)
            if drafts and request.grammar is not None:
                drafts, bitmasks = request.grammar.draft_rows(drafts)
        if not drafts or not self.block_manager.allocate_slots(request, 1 + len(drafts),
                                                               keep_free=reserved):
            return [], None if bitmasks is None else bitmasks[:1]
        return drafts, bitmasks

    def draft_constraints(self, request_id: str, drafts: list[int]) -> RowConstraints | None:
        """What a draft model's next draft for a request may be: its sampling row after
        `drafts` (its grammar's bitmask after them, the bans of min_tokens and bad words);
        None when its grammar refuses or ends at one of `drafts` (no later draft is kept)."""
        request = self.requests[request_id]
        bitmask = None
        if request.grammar is not None:
            kept, masks = request.grammar.draft_rows(drafts)
            if len(kept) < len(drafts):
                return None
            bitmask = None if masks is None else masks[-1]
        banned = self._banned(request, drafts)
        return RowConstraints(bitmask, banned[-1] if banned else ())

    def fill_drafts(self, s: ScheduledRequest, drafts: list[int]) -> None:
        """A draft model's drafts for a step whose k draft slots `_drafts` allocated with
        placeholders, and the sampling rows that depend on their tokens: a structured request's
        drafts cut before the first its grammar refuses, with each row's bitmask; the bans of
        bad words after the drafts before each row. Slots of drafts cut stay allocated and
        unused this step (written again later, as a rejected draft's)."""
        request = self.requests[s.request_id]
        if request.grammar is not None:
            drafts, bitmasks = request.grammar.draft_rows(drafts)
            if bitmasks is not None:
                s.allowed_token_bitmask = bitmasks
        own = s.num_tokens - len(s.draft_token_ids)
        s.token_ids = s.token_ids[:own] + drafts
        s.draft_token_ids = list(drafts)
        s.banned_token_ids = self._banned(request, drafts)

    def _reserve_for_policy(self, request: Request, index: int, preempted: list[Request],
                            reserved: int) -> int:
        """Keep free the blocks the request's waiting policy step needs (`policy_wait`: a
        compaction's copy-on-write, a scoring pass's scratch) beyond the `reserved` ones,
        preempting running requests newer than it (never itself: it would come back to the same
        wait) while they are short (a copy's block shared with a preempted request is its own
        then); none for scratch blocks the pool cannot hold beside the request's own blocks.
        Returns the blocks kept: all it needs, or what is free."""
        bm = self.block_manager
        wanted = bm.blocks_wanted(request)
        if wanted and request.policy_wait.scratch > bm.num_blocks - len(request.block_table):
            return 0  # scratch the pool cannot hold beside it: preempting others would not help
        while wanted > bm.num_free_blocks - reserved and len(self.running) > index + 1:
            victim = self.running.pop(self._victim_index(index + 1))
            self._preempt(victim)
            preempted.append(victim)
            wanted = bm.blocks_wanted(request)  # a block it shared with the victim may be its own
        return max(0, min(wanted, bm.num_free_blocks - reserved))

    def _victim_index(self, first: int = 0) -> int:
        """Where in `running[first:]` the request to preempt is: the newest (fcfs), or the one
        with the largest (priority, arrival time) (priority)."""
        if not self.by_priority:
            return len(self.running) - 1
        return max(range(first, len(self.running)), key=lambda k: _rank(self.running[k]))

    def _hits(self, request: Request) -> list:
        """The prefix-cache blocks a waiting request would take (`_hit_limit` applied)."""
        bm = self.block_manager
        hits, hit_tokens = bm.get_computed_blocks(request)
        limit = self._hit_limit(request)
        if limit is not None and hit_tokens > limit:
            hits = hits[:limit // bm.block_size]
        return hits

    def _blocks_to_start(self, request: Request, hits: list, extra_tokens: int = 0) -> int:
        """Free blocks a waiting request takes to hold its whole known sequence (prompt, and
        the outputs of a preempted one) and `extra_tokens` more: new blocks after its hits, and
        the hits that sit in the free queue."""
        bm = self.block_manager
        hit_tokens = len(hits) * bm.block_size
        held = hits[self._blocks_behind(hit_tokens):]  # a window's: none behind it
        in_free_queue = sum(1 for b in held if b.ref_cnt == 0)
        new_tokens = request.num_tokens - hit_tokens + extra_tokens
        need = bm.num_new_blocks_needed(request, new_tokens, len(held))
        if self.window_blocks is not None:  # the window frees what it leaves as it goes
            need = min(need, max(0, self.window_blocks - len(held)))
        if self._may_slice(request):  # its windowed layers give back what they pass
            need = min(need, max(0, self._sliced_blocks(request.num_tokens + extra_tokens)
                                 - len(held)))
        return need + in_free_queue

    def _may_slice(self, request: Request) -> bool:
        """Whether the request's windowed layers may give back their passed slices (a model
        whose layers mix windows and full attention, on a cache with per-layer tables, and no
        KV policy of its own)."""
        return (self.layer_windows is not None and request.kv_policy is None
                and request.layer_slices is None)

    def _sliced_blocks(self, num_slots: int, step_tokens: int | None = None) -> int:
        """The most blocks a request of `num_slots` slots holds once sliced, with steps of up
        to `step_tokens` tokens (default: the step's budget)."""
        return sliced_request_blocks(num_slots, self.layer_windows,
                                     self.block_manager.block_size,
                                     step_tokens or self.max_num_batched_tokens)

    def _slice_gain(self, request: Request) -> int:
        """About how many blocks slicing a running request frees now: what it holds less what
        it holds sliced for its next chunk (a token, or the rest of its prompt)."""
        step = min(request.num_tokens - request.num_computed_tokens, self.max_num_batched_tokens)
        return len(request.block_table) - self._sliced_blocks(request.num_cached_slots + step,
                                                               step)

    def _slice_newest(self, first: int) -> bool:
        """Slice the newest request of running[first:] (not scheduled yet this step) whose
        slicing frees blocks; False when none does."""
        return any(self._may_slice(r) and self._slice_gain(r) > 0 and self._slice(r)
                   for r in reversed(self.running[first:]))

    def _slice_to_admit(self) -> None:
        """Before a step: when the first waiting request cannot be admitted for lack of free
        blocks and slicing running requests (newest first) would free enough, slice them (as
        vLLM's hybrid manager keeps only the windows of windowed layers, more requests run)."""
        wanted = self.blocks_to_admit() - self.block_manager.num_free_blocks
        if wanted <= 0:
            return
        gains = [(r, self._slice_gain(r)) for r in reversed(self.running) if self._may_slice(r)]
        if sum(max(0, g) for _, g in gains) < wanted:
            return
        for r, gain in gains:
            if gain > 0 and self._slice(r):
                wanted -= gain
                if wanted <= 0:
                    return

    def _slice(self, request: Request) -> bool:
        """Slice a running request (`BlockManager.slice_for_windows`) once its windowed layers
        have passed a block of its slots; False when it cannot be."""
        if not self._may_slice(request) or request.num_cached_slots == 0:
            return False
        bs = self.block_manager.block_size
        passed = min(window_start(request.num_cached_slots + 1, w)
                     for w in self.layer_windows if w is not None)
        if passed < bs:
            return False
        self.block_manager.slice_for_windows(request, self.layer_windows)
        return True

    def policy_order(self, out: SchedulerOutput) -> list[Request]:
        """The step's running requests in the order their KV-policy steps run: those waiting
        for blocks first, then the rest, each in the running order (oldest first), the order
        `schedule` kept blocks for them in."""
        ids = {s.request_id for s in out.scheduled}
        return sorted((r for r in self.running if r.request_id in ids),
                      key=lambda r: r.policy_wait is None)

    def blocks_to_admit(self) -> int:
        """Free blocks the first waiting request (that the LoRA adapter limit lets in) needs to
        be admitted and compute its whole prompt (and one more token) without preempting
        anyone, prefix hits counted, beside those kept for running requests' waiting policy
        steps; 0 when nothing waits or the batch is full."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return 0
        adapters = self._running_adapters()
        request = next((r for r in self.waiting if not self._waits_for_adapter(r, adapters)),
                       None)
        if request is None:
            return 0
        kept = sum(self.block_manager.blocks_wanted(r) for r in self.running)
        return self._blocks_to_start(request, self._hits(request), extra_tokens=1) + kept

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters of the running requests."""
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _waits_for_adapter(self, request: Request, adapters: set[int]) -> bool:
        """Admitting the request would run one LoRA adapter more than max_loras at once."""
        return (bool(request.lora_int_id) and request.lora_int_id not in adapters
                and len(adapters) >= self.max_loras)

    @staticmethod
    def _hit_limit(request: Request) -> int | None:
        """Most prefix-cache tokens a request may take: a KV policy compresses at its point
        (compress_after, else the prompt's end) a plain prefix it computed up to there, when the
        chunk that reaches the point ends (so hits stop short of it), and one that reads window
        attention must compute the window's queries itself."""
        if request.compress_point is None:
            return None
        limit = request.compress_point - 1
        if request.query_capture_from is not None:
            limit = min(limit, request.query_capture_from)
        return limit

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """Tokens to compute this step from `start` on: the rest of the known tokens, within
        the budget, and never across the request's compression point. After it, a policy that
        evicts while decoding (each time the newest block fills) sees a recompute's outputs a
        block at a time, so it evicts as it did while they were decoded."""
        n = min(request.num_tokens - start, budget)
        stop = request.compress_point
        if stop is not None and not request.compressed and start < stop:
            n = min(n, stop - start)
        if request.compressed and request.kv_budget is not None \
                and request.kv_policy.decode_mode != "none":
            bs = self.block_manager.block_size
            n = min(n, bs - request.num_cached_slots % bs)
        return n

    def _scheduled(self, request: Request, num_new: int, drafts: list[int] | None = None,
                   bitmasks: np.ndarray | None = None) -> ScheduledRequest:
        """bitmasks: a structured request's rows' masks where `_drafts` made them."""
        start = request.num_computed_tokens
        drafts = drafts or []
        sample = start + num_new == request.num_tokens
        layer_tables = layer_start_slots = None
        if request.layer_slices is not None:
            layer_tables = [list(t) for t in request.layer_slices.tables]
            layer_start_slots = request.layer_slices.lengths(start)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_range(start, start + num_new) + drafts,
            start_position=start,
            start_slot=request.num_cached_slots,
            block_table=list(request.block_table),
            sample=sample,
            params=request.params,
            output_index=request.num_output_tokens,
            capture_from=(request.query_capture_from if not request.compressed
                          else start if request.capture_decode_queries else None),
            layer_tables=layer_tables,
            layer_start_slots=layer_start_slots,
            history=((request.prompt_token_ids, request.output_token_ids)
                     if request.params.has_penalties and sample else None),
            banned_token_ids=self._banned(request, drafts) if sample else [],
            allowed_token_bitmask=(
                bitmasks if bitmasks is not None
                else request.grammar.allowed_bitmask()[None]
                if request.grammar is not None and sample and not request.grammar.waiting
                else None),
            prompt_logprob_targets=(self._prompt_logprob_targets(request, start, num_new)
                                    if request.params.prompt_logprobs is not None else None),
            draft_token_ids=list(drafts),
            decode_rows=not drafts and self._as_decode_rows(request, num_new),
            lora_int_id=request.lora_int_id,
        )

    def _as_decode_rows(self, request: Request, num_new: int) -> bool:
        """Whether a prefill chunk of num_new tokens attends as decode rows (each row over the
        slots up to its own, as it would decoding alone: the same outputs as the prefill path,
        through the decode kernels): a short chunk (at most DECODE_ROW_CHUNK tokens) after a
        cached past, such as a prefix-cache hit's last partial block (n > 1 samples, beam
        search, a conversation's next turn); not for a request with a KV policy or per-layer
        tables (their prefill passes keep what they score), nor, in a cache that quantizes a
        block when its last slot is written, a chunk that writes one (its earlier rows would
        read that block quantized: the prefill path reads it staged)."""
        if not 1 < num_new <= DECODE_ROW_CHUNK or request.num_cached_slots == 0 \
                or request.kv_policy is not None or request.layer_slices is not None \
                or request.params.prompt_logprobs is not None \
                or request.params.return_prompt_logits:
            return False
        bs = self.block_manager.block_size
        return not self.drafts_before_block_end or request.num_cached_slots % bs + num_new < bs

    @staticmethod
    def _prompt_logprob_targets(request: Request, start: int, num_new: int) -> list[int] | None:
        """The prompt tokens the chunk's rows predict that are not scored yet: none once the
        prompt is (a recompute after preemption), nor for its last position (its distribution
        is the first output token's)."""
        end = min(start + num_new, request.num_prompt_tokens - 1)
        if start != len(request.prompt_logprobs) - 1 or start >= end:
            return None
        return request.prompt_token_ids[start + 1:end + 1]

    @staticmethod
    def _banned(request: Request, drafts: list[int]) -> list[tuple[int, ...]]:
        """What each sampling row's token may not be (row j: the token after drafts[:j]), []
        when no row bans any: before min_tokens outputs, the tokens that would stop the request
        (EOS unless ignore_eos, and stop_token_ids); and the tokens that would complete one of
        its bad words."""
        params, n = request.params, request.num_output_tokens
        bad_words = request.bad_words_token_ids
        if n >= params.min_tokens and not bad_words:
            return []
        stop = (*(() if params.ignore_eos else request.eos_token_ids), *params.stop_token_ids)
        # the outputs' tail a bad word can end with, then the drafts
        tail = request.output_token_ids[-max(map(len, bad_words)):] if bad_words else []
        rows = []
        for j in range(1 + len(drafts)):
            banned = stop if n + j < params.min_tokens else ()
            if bad_words:
                banned += completing_tokens(bad_words, tail + drafts[:j])
            rows.append(tuple(dict.fromkeys(banned)))
        return rows

    def _preempt(self, request: Request) -> None:
        self.num_recomputed_tokens += request.num_computed_tokens
        bm = self.block_manager
        # blocks registered for tokens whose K/V is not all written are no prefix for a later
        # hit: those a step allocated for its tokens when the priority policy preempts the
        # request after scheduling it; a draft model's lagging slot (`nanokv.spec.draft_model`)
        written = request.num_cached_slots
        if request.draft_kv_end is not None:  # no KV policy: its positions are its slots
            written = min(written, request.draft_kv_end)
        bm.mark_content_changed(request, written // bm.block_size)
        request.draft_kv_end = None
        bm.free(request, reason="preemption")
        request.num_computed_tokens = 0
        request.num_evicted_tokens = 0
        request.compressed = False  # the recomputed cache is compressed again
        request.policy_wait = None
        request.kv_budget = None
        request.captured_queries = []
        request.block_scores = {}
        if request.num_output_tokens == 0:  # incomplete prompt logits: recomputed from scratch
            request.prompt_logits = []
            request.prompt_logprobs = [None]
        request.prefix_cacheable = True
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:  # back in its (priority, arrival) place, as vLLM's priority queue
            bisect.insort(self.waiting, request, key=_rank)
        else:
            self.waiting.appendleft(request)

    def update_from_output(self, output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens; finish those that stop on a
        token rule (EOS, stop token, max_tokens, max_model_len). Returns the requests that
        received a new token."""
        now = time.monotonic()
        progressed = []
        for s in output.scheduled:
            request = self.requests.get(s.request_id)
            if request is None:  # aborted meanwhile
                continue
            request.num_computed_tokens += s.num_tokens
            if s.request_id in runner_output.prompt_logits:
                request.prompt_logits.append(runner_output.prompt_logits[s.request_id])
            if s.request_id in runner_output.prompt_logprobs:
                request.prompt_logprobs += runner_output.prompt_logprobs[s.request_id]
            if not s.sample:
                continue
            tokens = self._verified(request, s, runner_output)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            progressed.append(request)
            for j, token in enumerate(tokens):
                request.output_token_ids.append(token)
                status = self._check_token_stop(request, token)
                if request.grammar is not None:
                    status = self._advance_grammar(request, token, status)
                if status is not None:
                    # the accepted drafts after the stop are not outputs, nor computed
                    request.num_computed_tokens -= len(tokens) - 1 - j
                    self.finish(request, status)
                    break
        if self.sliding_window is not None:
            for s in output.scheduled:
                request = self.requests.get(s.request_id)
                if request is not None:  # running on (a finished one left `requests`)
                    self._free_behind_window(request)
        if self.layer_windows is not None:
            for s in output.scheduled:
                request = self.requests.get(s.request_id)
                if (request is not None and request.layer_slices is not None
                        and request.layer_slices.windows is not None):
                    self.block_manager.recycle_window_slices(request)
        return progressed

    def _blocks_behind(self, slot: int) -> int:
        """Blocks wholly before the window of the token at `slot` (it sees slots
        [slot + 1 - W, slot]): no query of it or after it reaches them; 0 without a window."""
        return window_start(slot + 1, self.sliding_window) // self.block_manager.block_size

    def _free_behind_window(self, request: Request) -> None:
        """Free the request's blocks behind its next token's window."""
        behind = self._blocks_behind(request.num_cached_slots)
        if behind:
            self.block_manager.free_leading_blocks(request, behind)

    def _verified(self, request: Request, s: ScheduledRequest,
                  runner_output: RunnerOutput) -> list[int]:
        """The step's new tokens: the sampled one; with drafts, the drafts the samples agree
        with, one by one, then the sample after the last of them (the token decoding alone
        would give next). A rejected draft's slot is not computed: it is written again."""
        first = runner_output.sampled_token_ids[s.request_id]
        drafts = s.draft_token_ids
        if not drafts:
            return [first]
        samples = [first, *runner_output.draft_samples[s.request_id]]
        accepted = 0
        while accepted < len(drafts) and samples[accepted] == drafts[accepted]:
            accepted += 1
        request.num_computed_tokens -= len(drafts) - accepted
        self.spec_stats.record(len(drafts), accepted)
        return samples[:accepted + 1]

    @staticmethod
    def _advance_grammar(request: Request, token: int,
                         status: RequestStatus | None) -> RequestStatus | None:
        """Feed a structured request's sampled token to its grammar: a request whose grammar
        ended (on one of its stop tokens: EOS, stop_token_ids) stops; one whose token the
        grammar refuses (it allowed no token at all: min_tokens banned the stop token it
        needed) is aborted with the reason."""
        if not request.grammar.accept(token):
            request.error = (f"the structured-output grammar refused token {token}: no token "
                             f"was allowed (min_tokens bans the stop token that ends it?)")
            return RequestStatus.FINISHED_ABORTED
        if request.grammar.is_terminated and status in (None, RequestStatus.FINISHED_LENGTH):
            request.stop_reason = token if token in request.params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        return status

    def _check_token_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        n = request.num_output_tokens
        if n >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage, num_preemptions=self.num_preemptions,
            num_scheduled_tokens=self.num_scheduled_tokens,
            prefix_cache_queries=bm.stats.prefix_cache_queries,
            prefix_cache_hits=bm.stats.prefix_cache_hits,
            evicted_blocks=dict(bm.stats.evicted_blocks),
            spec_decode=self.spec_stats.copy() if self.spec_stats is not None else None,
            max_loras=self.max_loras,  # the adapters' names only with LoRA on (every turn)
            running_lora_adapters=_adapter_names(self.running) if self.max_loras else (),
            waiting_lora_adapters=_adapter_names(self.waiting) if self.max_loras else ())

    def check_invariants(self) -> None:
        live = [r for r in self.running] + [r for r in self.waiting if r.block_table]
        self.block_manager.check_invariants(live)
        for request in self.waiting:
            if request.block_table:
                raise RuntimeError(f"waiting {request} holds blocks")
        for request in self.running:
            need = self.block_manager.blocks_for(request.num_cached_slots)
            if request.layer_slices is not None:
                ls = request.layer_slices
                need = ls.blocks_needed(ls.lengths(request.num_computed_tokens))
            if len(request.block_table) < need:
                raise RuntimeError(f"{request} holds fewer blocks than its cached slots need")


def _rank(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority value first, then earlier arrival."""
    return request.priority, request.metrics.arrival_time


def _adapter_names(requests) -> tuple[str, ...]:
    """The LoRA adapters' names of `requests`, sorted, each once."""
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_int_id}))
