"""Replay a trace through the engine's own BlockManager and Scheduler, without a model.

The loop is the server's (`nanokv/server/async_engine.py`): requests that arrived are added,
then one step is scheduled; a `StepClock` says how long the step takes and a virtual clock
advances by that much. The "runner" returns each request's next token from its replayed token
ids (`replay_token_ids`), so every block the real engine would cache, share or evict is cached,
shared or evicted here by the same code. Outputs end at the trace's output length (the requests
are replayed with `max_tokens` = that length and `ignore_eos`). KV policies are modelled by
what they do to the blocks (`nanokv/sim/policy_effects.py`).

Admission. `admission="arrival"` (what `nanokv advise` predicts with): a request joins the
first loop turn that starts at or after its arrival, as in the server; which turn that is
depends on the modelled step times, so batches, frees, LRU reuse and therefore hits and
preemptions can differ slightly from a real run whose steps took other times.
`admission="recorded"` replays a served trace's own step boundaries (the `step` / `order` its
server wrote, `nanokv/sim/step_log.py`): each request is added right before the step the server
added it before, in the same order, so every scheduling decision, hit and preemption is the
server's (the clock waits for a request's arrival if the modelled steps ran ahead of it).
`step_times` (step index -> seconds, from the step log) replaces the model in that mode.

Client aborts. A request the trace records as aborted runs towards its own `max_tokens` and is
aborted (its blocks freed, as `Scheduler.abort` does in the server) before the step the server
aborted it before (recorded admission: so it has produced exactly the recorded tokens), or at
the first loop turn at or after its recorded abort time (arrival admission: the client's
patience; a request the replay finishes earlier is not aborted). Aborted requests count in the
hit rate and the output tokens, and in TTFT if they got a first token, but not in TPOT nor E2E
(their end is the client's, not the server's).

Where a replay can still differ from the real run with recorded admission: none of the
scheduling (requests the server never added are not in the trace: they never touched the block
manager); the step times, which come from the model.
"""

from __future__ import annotations

import math
import time

from nanokv.cache.block_manager import BlockManager
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import RunnerOutput
from nanokv.sim.fast_forward import fast_forward
from nanokv.sim.policy_effects import compress, relieve_pressure
from nanokv.sim.replay_scheduler import SimScheduler
from nanokv.sim.server_overhead import ServerOverhead
from nanokv.sim.sim_config import SimConfig
from nanokv.sim.sim_result import RequestResult, RunTally, SimResult
from nanokv.sim.step_clock import StepClock
from nanokv.sim.step_model import StepFeatures, StepModel
from nanokv.sim.trace import TraceRecord, replay_token_ids

__all__ = ["RequestResult", "SimConfig", "SimResult", "Simulator"]


class Simulator:
    def __init__(self, records: list[TraceRecord], config: SimConfig, step_model: StepModel,
                 record_decisions: bool = False,
                 step_times: dict[int, float] | None = None, load_profile=None,
                 overhead: ServerOverhead | None = None) -> None:
        """step_times: a served run's turn times by step (recorded admission only);
        load_profile: a `nanokv.sim.step_log.LoadProfile` scaling the model's step times by the
        machine's measured slowdown at the simulated time (validation on a shared machine);
        overhead: the server's time outside the engine step, fitted from a step log (the
        model is then the engine step's alone)."""
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
        self.config = config
        self.step_model = step_model
        # (a sliced request's packing moves slices: no data here to copy)
        self.bm = BlockManager(config.num_blocks, bs, config.enable_prefix_caching,
                               on_slices_moved=lambda pairs: None)
        self.scheduler = SimScheduler(self.bm, config.max_num_seqs,
                                      config.max_num_batched_tokens, config.max_model_len,
                                      config.enable_chunked_prefill,
                                      sliding_window=config.sliding_window,
                                      layer_windows=config.layer_windows)
        # per step: ([(request id, tokens)], [preempted ids]) for tests against the engine
        self.decisions: list[tuple[list[tuple[str, int]], list[str]]] | None = (
            [] if record_decisions else None)
        self.features: list[StepFeatures] | None = [] if record_decisions else None
        self.first_step = self.records[0].step if recorded else 0  # served run's step index
        for r in self.records:
            if r.aborted and recorded and r.abort_step is None:
                raise ValueError("admission='recorded' needs each aborted request's abort_step "
                                 "(nanokv serve --trace-file writes it)")
        # (when, request index) of the client aborts: the served step (recorded) or the time
        self.aborts = sorted((r.abort_step if recorded else r.abort_t, i)
                             for i, r in enumerate(self.records) if r.aborted)
        self.clock = StepClock(step_model, step_times, load_profile, self.first_step, overhead)

    def _log_step(self, decisions: list[tuple[str, int]], features: StepFeatures,
                  preempted: list[str] | None = None) -> None:
        self.decisions.append((decisions, preempted or []))
        self.features.append(features)

    @staticmethod
    def _request_result(rec: TraceRecord, r: Request, first_token: float | None, now: float,
                        aborted: bool) -> RequestResult:
        return RequestResult(rec.cls, rec.t, r.num_prompt_tokens, r.num_output_tokens,
                             max(0, r.num_cached_tokens), first_token, now, r.peak_blocks,
                             r.num_preemptions, aborted)

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        cfg, sched, bm = self.config, self.scheduler, self.bm
        records = self.records
        tokens: dict[str, list[int]] = {}
        meta: dict[str, TraceRecord] = {}
        first_token: dict[str, float] = {}
        compressed: set[str] = set()
        tally = RunTally()
        steps = added = ended = 0  # requests added and ended in the turn (server overhead)
        idled = True  # the server was idle before this turn: its arrivals cost no busy turn
        now, i, n = records[0].t, 0, len(records)
        aborts, a = self.aborts, 0
        recorded = cfg.admission == "recorded"
        log = self._log_step if self.decisions is not None else None
        while i < n or sched.has_unfinished:
            while i < n and (records[i].step <= self.first_step + steps if recorded
                             else records[i].t <= now):
                rec = records[i]
                if recorded:
                    now = max(now, rec.t)
                rid = str(i)
                toks = replay_token_ids(rec, i)
                limit = rec.max_tokens if rec.aborted and rec.max_tokens else rec.output_len
                request = Request(rid, toks[:rec.prompt_len],
                                  SamplingParams(max_tokens=max(1, limit), ignore_eos=True),
                                  cache_salt=rec.salt, arrival_time=rec.t)
                try:
                    sched.add_request(request)
                except ValueError:
                    tally.rejected += 1
                else:
                    tokens[rid] = toks
                    meta[rid] = rec
                    added += 1
                i += 1
            while a < len(aborts) and (aborts[a][0] <= self.first_step + steps if recorded
                                       else aborts[a][0] <= now):
                rid = str(aborts[a][1])
                a += 1
                request = sched.abort(rid) if rid in meta else None  # else finished first
                if request is not None:
                    ended += 1
                    tokens.pop(rid)
                    compressed.discard(rid)
                    tally.done.append(self._request_result(
                        meta.pop(rid), request, first_token.pop(rid, None), now, True))
            if not sched.has_unfinished:
                ended = 0  # the server idles: a last abort's work costs no turn
                idled = True
                if i < n:
                    now = max(now, records[i].t)
                    if recorded:  # the server idled: its next step is that request's
                        steps = records[i].step - self.first_step
                continue
            if cfg.eviction_ratio is not None:
                relieve_pressure(bm, sched.running, cfg.eviction_ratio)
            out = sched.schedule()
            if out.is_empty:  # nothing fits and nothing runs: cannot happen after add_request
                raise RuntimeError("the scheduler made no progress with requests waiting")
            features = StepFeatures.of(out.scheduled)
            stamp_dt, post_dt = self.clock.turn(features, steps, now, added,
                                                0 if idled else added)
            idled = False
            steps += 1
            if self.decisions is not None:
                self._log_step([(s.request_id, s.num_tokens) for s in out.scheduled], features,
                               list(out.preempted_request_ids))
            nrun, usage = len(sched.running), bm.usage
            turn_start = now
            now += stamp_dt  # the outputs' time
            requests = sched.requests
            sampled = {}
            for s in out.scheduled:
                if s.sample:
                    r = requests[s.request_id]
                    t = tokens[s.request_id]
                    sampled[s.request_id] = t[r.num_tokens] if r.num_tokens < len(t) else 0
            stepped = sched.policy_order(out)  # the engine's order for policy steps
            saturated = bool(sched.waiting)
            progressed = sched.update_from_output(out, RunnerOutput(sampled))
            for r in progressed:
                first_token.setdefault(r.request_id, now)
                if r.is_finished:
                    ended += 1
                    rec = meta.pop(r.request_id)
                    del tokens[r.request_id]
                    compressed.discard(r.request_id)
                    tally.done.append(self._request_result(
                        rec, r, first_token.pop(r.request_id), now, False))
            post_dt += self.clock.ended(ended, turn_start)
            now += post_dt
            tally.steps(nrun, usage, stamp_dt + post_dt, saturated, len(sampled))
            added = ended = 0
            if cfg.compression_ratio is not None:
                for r in stepped:
                    if (not r.is_finished and r.request_id not in compressed
                            and r.num_computed_tokens >= r.num_prompt_tokens):
                        if compress(bm, r, cfg.compression_ratio):
                            compressed.add(r.request_id)
            for r in sched.waiting:  # preempted: compressed again after its recompute
                compressed.discard(r.request_id)
            if cfg.check_invariants:
                sched.check_invariants()
            if (cfg.fast_forward and not cfg.check_invariants and not out.preempted_request_ids
                    and len(out.scheduled) == len(sched.running)
                    and all(s.is_decode and s.num_tokens == 1 for s in out.scheduled)
                    and (cfg.compression_ratio is None
                         or all(r.request_id in compressed for r in sched.running))
                    and (cfg.eviction_ratio is None
                         or bm.usage <= 1 - cfg.eviction_ratio)):
                next_abort = aborts[a][0] if a < len(aborts) else math.inf
                if recorded:  # until the next step a request is added or aborted before
                    served = self.first_step + steps
                    k, elapsed = fast_forward(
                        sched, self.clock, tokens, now, math.inf, steps,
                        records[i].step - served if i < n else math.inf, cfg.eviction_ratio,
                        log, max_abort_steps=next_abort - served)
                else:
                    k, elapsed = fast_forward(
                        sched, self.clock, tokens, now, records[i].t if i < n else math.inf,
                        steps, math.inf, cfg.eviction_ratio, log, next_abort=next_abort,
                        arrivals_take_time=self.clock.overhead is not None)
                steps += k
                # running is full when anyone waits: every fast-forwarded step is saturated
                nrun = len(sched.running)
                tally.steps(nrun, bm.usage, elapsed, bool(sched.waiting), k * nrun, peaks=False)
                now += elapsed
            if len(bm.stats.evicted_block_lifetimes) > 4096:
                bm.stats.evicted_block_lifetimes.clear()
        described = self.step_model.describe()
        if self.clock.overhead is not None:
            described += f"; {self.clock.overhead.describe()}"
        return tally.result(cfg, described, steps, records[0].t,
                            sched.num_preemptions, sched.num_recomputed_tokens,
                            dict(bm.stats.evicted_blocks), time.perf_counter() - wall0)
