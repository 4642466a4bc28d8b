"""Replay a trace through the engine's own BlockManager and Scheduler, without a model.

The loop is the server's (`nanokv/server/async_engine.py`): requests that arrived are added,
then one step is scheduled; a `StepModel` says how long the step takes and a virtual clock
advances by that much. The "runner" returns each request's next token from its replayed token
ids (`replay_token_ids`), so every block the real engine would cache, share or evict is cached,
shared or evicted here by the same code. Outputs end at the trace's output length (the requests
are replayed with `max_tokens` = that length and `ignore_eos`).

KV policies are modelled by what they do to the blocks, not by their scores:
  * `compression_ratio` r: when a request's prompt is computed its cache is cut to
    n - floor(r n) tokens (token-level selection, as SnapKV/H2O: the kept blocks are rewritten,
    so they are made private and leave the prefix cache; the tail blocks are freed);
  * `eviction_ratio` e (PagedEviction's pool-pressure mode): while usage > 1 - e, whole middle
    blocks (never block 0 nor the newest) of the running requests that finished their prompt are
    freed, largest requests first (the real policy picks them by ||V||/||K||; the count is the
    same, which blocks is not).

Admission. `admission="arrival"` (what `nanokv advise` predicts with): a request joins the
first loop turn that starts at or after its arrival, as in the server; which turn that is
depends on the modelled step times, so batches, frees, LRU reuse and therefore hits and
preemptions can differ slightly from a real run whose steps took other times.
`admission="recorded"` replays a served trace's own step boundaries (the `step` / `order` its
server wrote, `nanokv/sim/step_log.py`): each request is added right before the step the server
added it before, in the same order, so every scheduling decision, hit and preemption is the
server's (the clock waits for a request's arrival if the modelled steps ran ahead of it).
`step_times` (step index -> seconds, from the step log) replaces the model in that mode.

Where a replay can still differ from the real run: requests aborted by clients (replayed to
their recorded length), requests not in the trace (aborted before they were added), and the
step times, which come from the model.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

from nanokv.cache.block_manager import BlockManager
from nanokv.metrics.stats import percentile
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import RunnerOutput
from nanokv.scheduler.scheduler import Scheduler
from nanokv.sim.step_model import StepFeatures, StepModel
from nanokv.sim.trace import TraceRecord, replay_token_ids
from nanokv.utils import cdiv


@dataclass(frozen=True)
class SimConfig:
    block_size: int
    num_blocks: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    bytes_per_block: int = 0  # the KV cache kind's spec (KV bytes per request)
    compression_ratio: float | None = None
    eviction_ratio: float | None = None
    window_s: float = 60.0  # hit rate over time: buckets of arrivals this long
    check_invariants: bool = False  # run scheduler.check_invariants() after every step (slow)
    fast_forward: bool = True  # batch runs of pure decode steps that change no block (exact)
    admission: str = "arrival"  # or "recorded": at the served run's own step boundaries

    def __post_init__(self) -> None:
        if self.admission not in ("arrival", "recorded"):
            raise ValueError(f"admission must be 'arrival' or 'recorded', got "
                             f"{self.admission!r}")
        for name in ("compression_ratio", "eviction_ratio"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < 1:
                raise ValueError(f"{name} must be in [0, 1), got {v}")


class _Scheduled:
    """The part of a ScheduledRequest the simulator and the step model read (the real one also
    copies token ids and block tables for the model runner, which no one reads here)."""

    __slots__ = ("request_id", "num_tokens", "start_slot", "sample", "is_decode")

    def __init__(self, request_id: str, num_tokens: int, start_slot: int, sample: bool):
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.start_slot = start_slot
        self.sample = sample
        self.is_decode = num_tokens == 1 and start_slot > 0


class SimScheduler(Scheduler):
    """The engine's Scheduler; only the step's hand-over to the runner is lighter."""

    def _scheduled(self, request: Request, num_new: int) -> _Scheduled:
        start = request.num_computed_tokens
        return _Scheduled(request.request_id, num_new, request.num_cached_slots,
                          start + num_new == request.num_tokens)


@dataclass
class RequestResult:
    cls: str
    arrival: float
    prompt_len: int
    output_len: int
    cached: int
    first_token: float | None
    finish: float
    peak_blocks: int
    preemptions: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.output_len < 2:
            return None
        return (self.finish - self.first_token) / (self.output_len - 1)


@dataclass
class SimResult:
    config: SimConfig
    step_model: str
    num_requests: int
    num_rejected: int
    num_steps: int
    duration_s: float  # first arrival to last finish, simulated
    wall_s: float  # how long the simulation took
    prefix_hit_rate: float
    hit_rate_by_class: dict[str, float]
    hit_rate_over_time: list[tuple[float, float]]  # (window start, hit rate of its arrivals)
    peak_running: int
    mean_running: float  # time-weighted
    peak_kv_usage: float
    mean_kv_usage: float
    preemptions: int
    recomputed_tokens: int
    evicted_blocks: dict[str, int]
    kv_bytes_per_request: dict[str, float]  # mean, p50, p90 of the peak bytes held
    ttft_s: dict[str, float | None]  # p50, p90, p99
    tpot_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    output_tok_s: float
    total_tok_s: float
    requests_per_s: float
    # while requests wait (the batch is full: max_num_seqs or the KV pool), what is served:
    # the configuration's capacity, if the run was saturated long enough to measure it
    saturated_s: float = 0.0
    capacity_req_s: float | None = None
    capacity_tok_s: float | None = None
    requests: list[RequestResult] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "num_requests", "num_rejected", "num_steps", "duration_s", "wall_s",
            "prefix_hit_rate", "hit_rate_by_class", "peak_running", "mean_running",
            "peak_kv_usage", "mean_kv_usage", "preemptions", "recomputed_tokens",
            "evicted_blocks", "kv_bytes_per_request", "ttft_s", "tpot_s", "e2e_s",
            "output_tok_s", "total_tok_s", "requests_per_s", "saturated_s", "capacity_req_s",
            "capacity_tok_s")}
        d["step_model"] = self.step_model
        return d


def _pcts(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


class Simulator:
    def __init__(self, records: list[TraceRecord], config: SimConfig, step_model: StepModel,
                 record_decisions: bool = False,
                 step_times: dict[int, float] | None = None, load_profile=None) -> None:
        """step_times: a served run's turn times by step (recorded admission only);
        load_profile: a `nanokv.sim.step_log.LoadProfile` scaling the model's step times by the
        machine's measured slowdown at the simulated time (validation on a shared machine)."""
        if not records:
            raise ValueError("the trace is empty")
        recorded = config.admission == "recorded"
        if recorded and any(r.step is None or r.order is None for r in records):
            raise ValueError("admission='recorded' needs a trace with each request's step and "
                             "order (nanokv serve --trace-file writes them)")
        if step_times is not None and not recorded:
            raise ValueError("step_times are a served run's, by step: they need "
                             "admission='recorded'")
        bs = config.block_size
        for r in records:
            if bs % r.hash_block_size:
                raise ValueError(f"block size {bs} is not a multiple of the trace's hash block "
                                 f"size {r.hash_block_size}: the trace cannot say which blocks "
                                 f"of that size are shared")
        self.records = sorted(records, key=(lambda r: (r.step, r.order)) if recorded
                              else (lambda r: r.t))
        self.step_times = step_times
        self.load_profile = load_profile
        self.config = config
        self.step_model = step_model
        self.bm = BlockManager(config.num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = SimScheduler(self.bm, config.max_num_seqs,
                                      config.max_num_batched_tokens, config.max_model_len,
                                      config.enable_chunked_prefill)
        # per step: ([(request id, tokens)], [preempted ids]) for tests against the engine
        self.decisions: list[tuple[list[tuple[str, int]], list[str]]] | None = (
            [] if record_decisions else None)
        self.features: list[StepFeatures] | None = [] if record_decisions else None
        self.first_step = self.records[0].step if recorded else 0  # served run's step index

    def _step_time(self, f: StepFeatures, step: int, now: float) -> float:
        if self.step_times is not None:
            try:
                return self.step_times[self.first_step + step]
            except KeyError:
                raise ValueError(f"the step log has no step {self.first_step + step}: the "
                                 f"replay left the served run's steps") from None
        if self.load_profile is not None:
            return self.step_model.step_time(f) * self.load_profile.factor(now)
        return self.step_model.step_time(f)

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        cfg, sched = self.config, self.scheduler
        records = self.records
        tokens: dict[str, list[int]] = {}
        meta: dict[str, tuple[TraceRecord, float]] = {}
        first_token: dict[str, float] = {}
        compressed: set[str] = set()
        done: list[RequestResult] = []
        rejected = steps = 0
        now, i, n = records[0].t, 0, len(records)
        recorded = cfg.admission == "recorded"
        running_area = usage_area = 0.0
        peak_running, peak_usage = 0, 0.0
        sat = [0.0, 0]  # seconds with requests waiting, tokens sampled in them
        while i < n or sched.has_unfinished:
            while i < n and (records[i].step <= self.first_step + steps if recorded
                             else records[i].t <= now):
                rec = records[i]
                if recorded:
                    now = max(now, rec.t)
                rid = str(i)
                toks = replay_token_ids(rec, i)
                request = Request(rid, toks[:rec.prompt_len],
                                  SamplingParams(max_tokens=max(1, rec.output_len),
                                                 ignore_eos=True),
                                  cache_salt=rec.salt, arrival_time=rec.t)
                try:
                    sched.add_request(request)
                except ValueError:
                    rejected += 1
                else:
                    tokens[rid] = toks
                    meta[rid] = (rec, rec.t)
                i += 1
            if not sched.has_unfinished:
                if i < n:
                    now = max(now, records[i].t)
                    if recorded:  # the server idled: its next step is that request's
                        steps = records[i].step - self.first_step
                continue
            if cfg.eviction_ratio is not None:
                self._relieve_pressure(cfg.eviction_ratio)
            out = sched.schedule()
            if out.is_empty:  # nothing fits and nothing runs: cannot happen after add_request
                raise RuntimeError("the scheduler made no progress with requests waiting")
            features = StepFeatures.of(out.scheduled)
            dt = self._step_time(features, steps, now)
            steps += 1
            if self.decisions is not None:
                self.decisions.append(([(s.request_id, s.num_tokens) for s in out.scheduled],
                                       list(out.preempted_request_ids)))
                self.features.append(features)
            nrun = len(sched.running)
            usage = self.bm.usage
            running_area += nrun * dt
            usage_area += usage * dt
            peak_running = max(peak_running, nrun)
            peak_usage = max(peak_usage, usage)
            now += dt
            requests = sched.requests
            sampled = {}
            for s in out.scheduled:
                if s.sample:
                    r = requests[s.request_id]
                    t = tokens[s.request_id]
                    sampled[s.request_id] = t[r.num_tokens] if r.num_tokens < len(t) else 0
            stepped = [requests[s.request_id] for s in out.scheduled]
            saturated = bool(sched.waiting)
            progressed = sched.update_from_output(out, RunnerOutput(sampled))
            if saturated:
                sat[0] += dt
                sat[1] += len(sampled)
            for r in progressed:
                first_token.setdefault(r.request_id, now)
                if r.is_finished:
                    rec, arrival = meta.pop(r.request_id)
                    del tokens[r.request_id]
                    compressed.discard(r.request_id)
                    done.append(RequestResult(
                        rec.cls, arrival, r.num_prompt_tokens, r.num_output_tokens,
                        max(0, r.num_cached_tokens), first_token.pop(r.request_id), now,
                        r.peak_blocks, r.num_preemptions))
            if cfg.compression_ratio is not None:
                for r in stepped:
                    if (not r.is_finished and r.request_id not in compressed
                            and r.num_computed_tokens >= r.num_prompt_tokens):
                        if self._compress(r, cfg.compression_ratio):
                            compressed.add(r.request_id)
            for r in sched.waiting:  # preempted: compressed again after its recompute
                compressed.discard(r.request_id)
            if cfg.check_invariants:
                sched.check_invariants()
            if (cfg.fast_forward and not cfg.check_invariants and not out.preempted_request_ids
                    and len(out.scheduled) == len(sched.running)
                    and all(s.is_decode for s in out.scheduled)
                    and (cfg.compression_ratio is None
                         or all(r.request_id in compressed for r in sched.running))
                    and (cfg.eviction_ratio is None
                         or self.bm.usage <= 1 - cfg.eviction_ratio)):
                if recorded:
                    limit = (records[i].step - self.first_step - steps) if i < n else math.inf
                    k, elapsed = self._fast_forward(tokens, now, math.inf, steps, limit)
                else:
                    k, elapsed = self._fast_forward(
                        tokens, now, records[i].t if i < n else math.inf, steps)
                steps += k
                nrun = len(sched.running)
                if sched.waiting:  # running is full: every fast-forwarded step is saturated
                    sat[0] += elapsed
                    sat[1] += k * nrun
                running_area += nrun * elapsed
                usage_area += self.bm.usage * elapsed
                now += elapsed
            if len(self.bm.stats.evicted_block_lifetimes) > 4096:
                self.bm.stats.evicted_block_lifetimes.clear()
        return self._result(done, rejected, steps, records[0].t, running_area, usage_area,
                            peak_running, peak_usage, time.perf_counter() - wall0, sat)

    def _fast_forward(self, tokens: dict[str, list[int]], now: float, next_arrival: float,
                      steps: int, max_steps: float = math.inf) -> tuple[int, float]:
        """After a step of decodes only (every running request, nobody preempted) with no
        admission possible (nobody waiting, or max_num_seqs running), the next steps are the
        same decodes until a request finishes, a request arrives (unless max_num_seqs run:
        it only queues), or the blocks they need run
        short (preemption) or cross the pool-pressure limit (recorded admission: until the step a
        request is added before, `max_steps` from now). Apply those steps at once: each
        request's tokens are appended and `allocate_slots` gives it the blocks of all of them
        in one call (the same blocks taken from the free queue and the same prefix-cache
        entries registered, only in another order between requests). Returns (steps, seconds).
        """
        sched, bm, cfg = self.scheduler, self.bm, self.config
        bs = bm.block_size
        running = sched.running
        if not running or (sched.waiting and len(running) < sched.max_num_seqs):
            return 0, 0.0
        k = min(min(r.params.max_tokens - r.num_output_tokens - 1,
                    sched.max_model_len - r.num_tokens - 1) for r in running)
        if k <= 0:
            return 0, 0.0
        spare = bm.num_free_blocks
        if cfg.eviction_ratio is not None:
            spare = min(spare, int((1 - cfg.eviction_ratio) * bm.num_blocks + 1e-9)
                        - bm.num_used_blocks)
        new_blocks = [0] * (k + 1)  # new_blocks[j]: blocks first needed by step j
        ctx = 0
        for r in running:
            cs = r.num_cached_slots
            ctx += cs + 1
            for j in range(len(r.block_table) * bs - cs + 1, k + 1, bs):
                new_blocks[j] += 1
        nrun = len(running)
        if nrun >= sched.max_num_seqs:  # arrivals only queue: no admission is attempted
            next_arrival = max_steps = math.inf
        k = int(min(k, max_steps))
        elapsed, j, need = 0.0, 0, 0
        while j < k and now + elapsed < next_arrival:
            if need + new_blocks[j + 1] > spare:
                break
            need += new_blocks[j + 1]
            f = StepFeatures(nrun, nrun, nrun, ctx + j * nrun, 0, 0)
            elapsed += self._step_time(f, steps + j, now + elapsed)
            j += 1
            if self.decisions is not None:
                self.decisions.append(([(r.request_id, 1) for r in running], []))
                self.features.append(f)
        if j == 0:
            return 0, 0.0
        for r in running:
            t = tokens[r.request_id]
            n = r.num_tokens
            r.output_token_ids.extend(t[n:n + j])  # first: the blocks filled are hashed
            if not bm.allocate_slots(r, j):
                raise RuntimeError(f"fast-forward: {r} lacks blocks it was counted to have")
            r.num_computed_tokens += j
        return j, elapsed

    # ---- KV policies, by their effect on blocks --------------------------------------------
    def _compress(self, request: Request, ratio: float) -> bool:
        bm = self.bm
        slots = request.num_cached_slots
        keep = slots - math.floor(slots * ratio)
        if keep >= slots:
            return True
        nb = cdiv(keep, bm.block_size)
        if bm.make_private(request, range(nb)) is None:  # copy-on-write lacks blocks: retry
            return False
        tail = list(range(nb, len(request.block_table)))
        if tail:
            bm.free_blocks_at(request, tail)
        bm.mark_content_changed(request, from_block=0)
        request.num_evicted_tokens += slots - keep
        return True

    def _relieve_pressure(self, ratio: float) -> None:
        bm = self.bm
        limit = int((1 - ratio) * bm.num_blocks + 1e-9)
        excess = bm.num_used_blocks - limit
        if excess <= 0:
            return
        cands = sorted((r for r in self.scheduler.running
                        if r.num_computed_tokens >= r.num_prompt_tokens
                        and len(r.block_table) > 2),
                       key=lambda r: -len(r.block_table))
        for r in cands:
            if excess <= 0:
                break
            take = min(excess, len(r.block_table) - 2)
            indices = list(range(1, 1 + take))
            bm.free_blocks_at(r, indices)
            r.num_evicted_tokens += bm.block_size * take
            excess -= take

    # ---- summary ---------------------------------------------------------------------------
    def _result(self, done, rejected, steps, t0, running_area, usage_area, peak_running,
                peak_usage, wall, sat) -> SimResult:
        cfg = self.config
        end = max((r.finish for r in done), default=t0)
        duration = max(end - t0, 1e-12)
        queries = sum(r.prompt_len for r in done)
        hits = sum(r.cached for r in done)
        by_cls: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        by_win: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for r in done:
            by_cls[r.cls][0] += r.cached
            by_cls[r.cls][1] += r.prompt_len
            w = by_win[int((r.arrival - t0) // cfg.window_s)]
            w[0] += r.cached
            w[1] += r.prompt_len
        kv = [r.peak_blocks * cfg.bytes_per_block for r in done]
        out_tokens = sum(r.output_len for r in done)
        return SimResult(
            config=cfg, step_model=self.step_model.describe(), num_requests=len(done),
            num_rejected=rejected, num_steps=steps, duration_s=duration, wall_s=wall,
            prefix_hit_rate=hits / queries if queries else math.nan,
            hit_rate_by_class={c: h / q for c, (h, q) in sorted(by_cls.items()) if q},
            hit_rate_over_time=[(t0 + k * cfg.window_s, h / q)
                                for k, (h, q) in sorted(by_win.items()) if q],
            peak_running=peak_running, mean_running=running_area / duration,
            peak_kv_usage=peak_usage, mean_kv_usage=usage_area / duration,
            preemptions=self.scheduler.num_preemptions,
            recomputed_tokens=self.scheduler.num_recomputed_tokens,
            evicted_blocks=dict(self.bm.stats.evicted_blocks),
            kv_bytes_per_request={"mean": sum(kv) / len(kv) if kv else 0.0,
                                  "p50": percentile(kv, 50) or 0.0,
                                  "p90": percentile(kv, 90) or 0.0},
            ttft_s=_pcts([r.ttft for r in done if r.ttft is not None]),
            tpot_s=_pcts([r.tpot for r in done if r.tpot is not None]),
            e2e_s=_pcts([r.finish - r.arrival for r in done]),
            output_tok_s=out_tokens / duration,
            total_tok_s=(out_tokens + queries) / duration,
            requests_per_s=len(done) / duration, saturated_s=sat[0],
            # requests/s from the token rate: counting the requests that finish while others
            # wait would miss the batch's fill-up, a larger share for a larger batch
            capacity_req_s=(sat[1] / sat[0] / (out_tokens / len(done))
                            if sat[0] > 0 and out_tokens else None),
            capacity_tok_s=sat[1] / sat[0] if sat[0] > 0 else None, requests=done)
