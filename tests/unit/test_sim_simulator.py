"""The simulator against hand-computed hit rates, the unmodified scheduler, its own slow path,
and the block manager's invariants."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from nanokv.cache.block_manager import BlockManager
from nanokv.metrics.stats import percentile
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import RunnerOutput
from nanokv.scheduler.scheduler import Scheduler
from nanokv.sim.simulator import SimConfig, Simulator
from nanokv.sim.step_model import LinearStepModel
from nanokv.sim.synthetic import WorkloadShape, generate
from nanokv.sim.trace import BlockHasher, TraceRecord, replay_token_ids

STEP = LinearStepModel(step=1e-3, token=1e-5)


def _rec(t, prompt, out_len, cls="c", key=b"k"):
    out = [10_000 + int(t * 1000) * 100 + i for i in range(out_len)]
    return TraceRecord(t=t, prompt_len=len(prompt), output_len=out_len,
                       hashes=BlockHasher(16, key).chain(prompt + out), cls=cls)


@pytest.mark.parametrize("block_size,hit", [(16, 64), (32, 64), (48, 48), (64, 64)])
def test_hit_rate_by_hand(block_size, hit):
    shared = list(range(1, 65))  # 64 tokens
    recs = [_rec(0.0, shared, 5, "a"),
            _rec(100.0, shared + list(range(500, 520)), 5, "b"),  # 84 tokens, arrives later
            _rec(200.0, list(range(900, 950)), 5, "a")]
    res = Simulator(recs, SimConfig(block_size=block_size, num_blocks=64),
                    STEP).run()
    assert res.prefix_hit_rate == pytest.approx(hit / (64 + 84 + 50))
    assert res.hit_rate_by_class == {"a": 0.0, "b": pytest.approx(hit / 84)}
    assert res.preemptions == 0 and res.num_requests == 3


def test_salts_separate_tenants():
    shared = list(range(1, 65))
    a = _rec(0.0, shared, 3)
    b = _rec(50.0, shared + [7], 3)
    b.salt = "other"
    res = Simulator([a, b], SimConfig(block_size=16, num_blocks=64), STEP).run()
    assert res.prefix_hit_rate == 0.0


def _vanilla(records, cfg: SimConfig):
    """The unmodified Scheduler with a plain runner, everything added at once in trace order."""
    bm = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    sched = Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                      sliding_window=cfg.sliding_window)
    tokens = {}
    for i, rec in enumerate(records):
        toks = replay_token_ids(rec, i)
        tokens[str(i)] = toks
        sched.add_request(Request(str(i), toks[:rec.prompt_len],
                                  SamplingParams(max_tokens=max(1, rec.output_len),
                                                 ignore_eos=True), cache_salt=rec.salt))
    decisions = []
    while sched.has_unfinished:
        out = sched.schedule()
        decisions.append(([(s.request_id, s.num_tokens) for s in out.scheduled],
                          list(out.preempted_request_ids)))
        sampled = {s.request_id: tokens[s.request_id][sched.requests[s.request_id].num_tokens]
                   for s in out.scheduled if s.sample}
        sched.update_from_output(out, RunnerOutput(sampled))
        sched.check_invariants()
    return decisions, sched.num_preemptions, bm.stats


def _pressure_trace(n=24, seed=0):
    shape = WorkloadShape(system_prompts=3, system_len=(40, 120), user_len=(5, 60),
                          output_len=(1, 70), max_model_len=512)
    recs = generate("chat", n, rate=1e6, seed=seed, shape=shape)
    for r in recs:
        r.t = 0.0  # one burst: the arrival order is the only order
    return recs


@pytest.mark.parametrize("window", [None, 24])  # a sliding window on every layer: 24 tokens
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_decisions_as_the_unmodified_scheduler(seed, window):
    recs = _pressure_trace(seed=seed)
    cfg = SimConfig(block_size=16, num_blocks=30, max_num_seqs=6, max_num_batched_tokens=96,
                    max_model_len=512, sliding_window=window)
    want, preemptions, stats = _vanilla(recs, cfg)
    assert preemptions > 0 or window  # the pool is small enough to preempt whole requests
    features = []
    for ff in (False, True):
        sim = Simulator(recs, SimConfig(**{**cfg.__dict__, "fast_forward": ff}), STEP,
                        record_decisions=True)
        res = sim.run()
        assert sim.decisions == want
        assert res.preemptions == preemptions
        assert sim.bm.stats.prefix_cache_hits == stats.prefix_cache_hits
        assert res.evicted_blocks == dict(stats.evicted_blocks)
        features.append(sim.features)
    assert features[0] == features[1]  # the step shapes too


def test_fast_forward_is_exact_with_arrivals_over_time():
    recs = generate("sessions", 150, rate=40.0, seed=4,
                    shape=WorkloadShape(system_len=(64, 256), user_len=(8, 64),
                                        output_len=(8, 96), think_time_s=0.5,
                                        max_model_len=2048))
    from nanokv.sim.server_overhead import ServerOverhead

    cfg = dict(block_size=32, num_blocks=200, max_num_seqs=8, max_model_len=2048)
    for overhead in (None, ServerOverhead(1e-3, 2e-3, 1e-3, 5e-4, 1e-4, 3e-3)):
        slow = Simulator(recs, SimConfig(**cfg, fast_forward=False), STEP,
                         record_decisions=True, overhead=overhead)
        fast = Simulator(recs, SimConfig(**cfg), STEP, record_decisions=True,
                         overhead=overhead)
        a, b = slow.run(), fast.run()
        assert slow.decisions == fast.decisions
        assert a.summary() | {"wall_s": 0} == b.summary() | {"wall_s": 0} or (
            a.prefix_hit_rate == b.prefix_hit_rate and a.ttft_s == pytest.approx(b.ttft_s)
            and a.tpot_s == pytest.approx(b.tpot_s) and a.preemptions == b.preemptions)


@pytest.mark.parametrize("policy", [{}, {"compression_ratio": 0.5}, {"eviction_ratio": 0.3}])
def test_invariants_hold_and_every_request_finishes(policy):
    recs = _pressure_trace(n=30, seed=5)
    rng = random.Random(0)
    for r in recs:
        r.t = rng.uniform(0, 0.05)
    recs.sort(key=lambda r: r.t)
    cfg = SimConfig(block_size=16, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=128,
                    max_model_len=512, check_invariants=True, **policy)
    res = Simulator(recs, cfg, STEP).run()
    assert res.num_requests == len(recs)
    assert sorted(r.output_len for r in res.requests) == sorted(max(1, r.output_len)
                                                                 for r in recs)
    if "compression_ratio" in policy:
        assert res.evicted_blocks.get("policy", 0) > 0
    if "eviction_ratio" in policy:
        assert res.evicted_blocks.get("policy", 0) > 0


def test_rejects_block_sizes_the_trace_cannot_resolve():
    with pytest.raises(ValueError, match="multiple"):
        Simulator([_rec(0.0, list(range(40)), 2)], SimConfig(block_size=24, num_blocks=8), STEP)


def test_latency_by_hand():
    """One request alone: a 20-token prefill step, then 3 decode steps (4 outputs)."""
    rec = _rec(0.0, list(range(1, 21)), 4)
    model = LinearStepModel(step=0.1, token=0.01)
    res = Simulator([rec], SimConfig(block_size=16, num_blocks=8), model).run()
    (r,) = res.requests
    assert r.ttft == pytest.approx(0.1 + 0.2)
    assert r.tpot == pytest.approx(0.11)
    assert res.output_tok_s == pytest.approx(4 / (0.3 + 3 * 0.11))


def test_capacity_by_hand():
    """A burst of 40 distinct requests, 4 at a time, 10 outputs each, 10 ms a step: each wave of
    4 takes 10 steps, so 40 req/s and 400 output tok/s while requests wait (the last wave runs
    with nobody waiting and is not counted)."""
    recs = [_rec(0.0, [1000 * (i + 1) + j for j in range(16)], 10) for i in range(40)]
    for ff in (False, True):
        res = Simulator(recs, SimConfig(block_size=16, num_blocks=64, max_num_seqs=4,
                                        fast_forward=ff),
                        LinearStepModel(step=0.01)).run()
        assert res.saturated_s == pytest.approx(9 * 10 * 0.01)
        assert res.capacity_req_s == pytest.approx(40.0)
        assert res.capacity_tok_s == pytest.approx(400.0)
    alone = Simulator(recs[:1], SimConfig(block_size=16, num_blocks=64), STEP).run()
    assert alone.saturated_s == 0 and alone.capacity_req_s is None


def test_load_profile_scales_step_times_by_window():
    from nanokv.sim.step_log import StepLogEntry, load_profile
    from nanokv.sim.step_model import StepFeatures

    model = LinearStepModel(step=0.1)
    f = StepFeatures(1, 1, 1, 10, 0, 0)
    # 0-1 s: steps take 0.2 s (2x the model), 1-2 s: 0.1 s, then idle, 3-4 s: 0.3 s
    log = [StepLogEntry(k, t, d, k < 6, f, 1, 0) for k, (t, d) in enumerate(
        [(0.0, 0.2), (0.2, 0.2), (0.4, 0.2), (0.6, 0.2), (0.8, 0.2), (1.0, 0.1), (1.1, 0.1)])]
    log.append(StepLogEntry(7, 3.0, 0.3, False, f, 1, 0))
    prof = load_profile(log, model, window=1.0)
    assert prof.factors == pytest.approx((2.0, 1.0, 1.0, 3.0))
    assert [prof.factor(t) for t in (-5, 3.5, 99)] == pytest.approx([2.0, 3.0, 3.0])
    rec = _rec(0.0, list(range(1, 21)), 4)  # 4 steps of 0.1 s x 2 (all in the first second)
    res = Simulator([rec], SimConfig(block_size=16, num_blocks=8), model,
                    load_profile=prof).run()
    assert res.requests[0].finish == pytest.approx(0.8)


def test_client_abort_by_hand():
    """Arrival admission, 0.1 s per step. A (20-token prompt, max_tokens 50) is aborted at
    0.25 s: the turn at 0.3 s aborts it after 3 tokens (steps at 0-0.1-0.2-0.3) and frees its
    blocks, so B, which needs the whole pool, runs from 0.3 s instead of waiting for A's 50
    tokens. C's abort time comes after it finished: it is not aborted."""
    model = LinearStepModel(step=0.1)
    a = _rec(0.0, list(range(1, 21)), 3)
    a.abort_t, a.max_tokens = 0.25, 50
    b = _rec(0.05, list(range(100, 180)), 2)  # 80 + 2 tokens: 6 blocks of 16
    c = _rec(5.0, list(range(300, 310)), 2)
    c.abort_t, c.max_tokens = 9.0, 2
    cfg = SimConfig(block_size=16, num_blocks=6, max_num_seqs=4, check_invariants=True)
    for ff in (False, True):
        res = Simulator([a, b, c], replace(cfg, fast_forward=ff, check_invariants=not ff),
                        model).run()
        ra, rb, rc = sorted(res.requests, key=lambda r: r.arrival)
        assert res.num_aborted == 1 and ra.aborted and not rb.aborted and not rc.aborted
        assert ra.output_len == 3 and ra.finish == pytest.approx(0.3)
        assert ra.ttft == pytest.approx(0.1) and ra.tpot is None and ra.e2e is None
        assert rb.first_token == pytest.approx(0.4) and rb.finish == pytest.approx(0.5)
        assert rc.output_len == 2 and rc.finish == pytest.approx(5.2)
        assert res.e2e_s["p50"] == pytest.approx(percentile([0.45, 0.2], 50))
        assert res.preemptions == 0
    # without the abort A holds 2 of the 6 blocks until its 50th token: B waits 5 s for it
    plain = Simulator([replace(a, abort_t=None, max_tokens=None, output_len=50,
                               hashes=a.hashes), b, c], cfg, model).run()
    assert sorted(plain.requests, key=lambda r: r.arrival)[1].first_token > 4.9


def test_abort_fields_are_checked():
    with pytest.raises(ValueError, match="before it arrived"):
        TraceRecord(t=1.0, prompt_len=4, output_len=0, hashes=[], abort_t=0.5, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        TraceRecord(t=1.0, prompt_len=4, output_len=5, hashes=[], abort_t=2.0, max_tokens=4)
    rec = TraceRecord(t=0.0, prompt_len=20, output_len=2, hashes=["ab" * 8], step=0, order=0,
                      abort_t=1.0, max_tokens=8)
    with pytest.raises(ValueError, match="abort_step"):
        Simulator([rec], SimConfig(block_size=16, num_blocks=8, admission="recorded"), STEP)
    again = TraceRecord.from_json(rec.to_json())
    assert again == rec and again.aborted


def test_server_overhead_fit_and_replay_by_hand():
    """Turns generated from known costs: the fit recovers them (the oracle is the generator)
    from CPU times, while other processes stretch every wall time by up to 2x at random.
    The engine thread's CPU time is the step model's; a request's HTTP work (1.5 ms) falls in
    the turn during which it arrives, inside the step's wall time. Replayed alone, a request's
    first token comes after the turn's pre part (1 ms + 2 ms for the request added; it arrived
    while the server idled: no HTTP work in a turn) and the step; the post part (0.5 ms +
    0.1 ms/seq, + 3 ms when a request ends) delays the next turn, not the stamps. A second
    request arriving while the first runs adds its 1.5 ms after the stamps of the turn that
    adds it."""
    from nanokv.sim.server_overhead import ServerOverhead, fit_server_overhead
    from nanokv.sim.step_log import StepLogEntry, fit_engine_step
    from nanokv.sim.step_model import StepFeatures

    truth = ServerOverhead(pre_s=1e-3, pre_added_s=2e-3, arrival_s=1.5e-3, post_s=5e-4,
                           post_seq_s=1e-4, post_ended_s=3e-3)
    engine = LinearStepModel(step=4e-3, token=1e-4, seq=2e-4)
    rng = random.Random(0)
    added = [rng.choice((0, 0, 1, 2)) for _ in range(201)]
    log, t, used = [], 0.0, 0.0
    for k in range(200):
        seqs, ended = rng.randint(1, 8), rng.choice((0, 0, 1))
        f = StepFeatures(seqs + rng.randint(0, 60), seqs, seqs, 0, 0, 0)
        cpu = engine.step_time(f)
        step = cpu + truth.arrival_s * added[k + 1]  # the event loop's share of the core
        pre = truth.pre_s + truth.pre_added_s * added[k]
        turn = pre + step + truth.post(seqs, ended)  # the server's CPU time in the turn
        theft = 1 + rng.random()  # other processes stretch the wall time, not the CPU time
        log.append(StepLogEntry(k, t, turn * theft, True, f, seqs, 0, added[k], ended,
                                pre * theft, step * theft, cpu, used, used + turn))
        t += turn * theft
        used += turn
    model = fit_engine_step(log)
    assert (model.step, model.token, model.seq) == pytest.approx((4e-3, 1e-4, 2e-4))
    fitted = fit_server_overhead(log, model)
    for name in ("pre_added_s", "arrival_s", "post_seq_s", "post_ended_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-9)
    # the per-turn time is split before / after the stamps by the measured (wall) `pre`
    assert fitted.pre_s + fitted.post_s == pytest.approx(truth.pre_s + truth.post_s)
    assert truth.pre_s <= fitted.pre_s <= 2 * truth.pre_s
    rec = _rec(0.0, list(range(1, 21)), 3)  # a 20-token prefill, then 2 decodes
    res = Simulator([rec], SimConfig(block_size=16, num_blocks=8), engine,
                    overhead=truth).run()
    (r,) = res.requests
    prefill, decode = engine.step_time(StepFeatures(20, 1)), engine.step_time(StepFeatures(1, 1))
    assert r.ttft == pytest.approx(3e-3 + prefill)
    between = 6e-4 + 1e-3 + decode  # post of one turn, pre of the next (nothing added), step
    assert r.finish == pytest.approx(3e-3 + prefill + 2 * between)
    assert res.duration_s == pytest.approx(r.finish)
    late = _rec(0.001, list(range(500, 520)), 1)  # arrives during the first prefill
    both = Simulator([rec, late], SimConfig(block_size=16, num_blocks=8), engine,
                     overhead=truth).run()
    a, b = sorted(both.requests, key=lambda x: x.arrival)
    prefill2 = engine.step_time(StepFeatures(21, 2))  # its prefill beside the first's decode
    assert b.first_token == pytest.approx(3e-3 + prefill + 6e-4 + 3e-3 + prefill2)
    after = 3e-3 + prefill + 6e-4 + 3e-3 + prefill2 + 7e-4 + 1.5e-3 + 3e-3  # its turn's post
    assert a.finish == pytest.approx(after + 1e-3 + decode)


def test_measured_load_profile_is_wall_over_cpu_time():
    """Without a model the profile is each window's turn wall time over the server's CPU time
    in those turns: 0-1 s the turns took twice their CPU time, 1-2 s their CPU time."""
    from nanokv.sim.step_log import StepLogEntry, load_profile
    from nanokv.sim.step_model import StepFeatures

    f = StepFeatures(1, 1, 1, 10, 0, 0)
    log, t, cpu = [], 0.0, 0.0
    for k, (wall, used) in enumerate([(0.2, 0.1)] * 5 + [(0.1, 0.1)] * 10):
        log.append(StepLogEntry(k, t, wall, True, f, 1, 0, proc_cpu0=cpu, proc_cpu1=cpu + used))
        t, cpu = t + wall, cpu + used
    assert load_profile(log, window=1.0).factors == pytest.approx((2.0, 1.0))
    with pytest.raises(ValueError, match="CPU time"):
        load_profile([StepLogEntry(0, 0.0, 0.1, False, f, 1, 0)])


def test_server_overhead_is_measured_beside_the_engines_cpu_time_not_left_over_by_a_model():
    """With the process's CPU time per turn and the engine thread's CPU time per step in the log,
    the overhead is the difference, whatever the engine model: a model 10x off (or one that
    leaves negative remainders, clipped before) changes nothing. A new request's cost is split
    before / after the stamps by the measured `pre`: here 0.5 ms before, 1.5 ms after."""
    from nanokv.sim.server_overhead import ServerOverhead, fit_server_overhead
    from nanokv.sim.step_log import StepLogEntry
    from nanokv.sim.step_model import StepFeatures

    truth = ServerOverhead(pre_s=1e-4, pre_added_s=5e-4, arrival_s=1e-3, post_s=4e-4,
                           post_seq_s=5e-5, post_ended_s=6e-4, post_added_s=1.5e-3)
    rng = random.Random(1)
    added = [rng.choice((0, 0, 1, 3)) for _ in range(301)]
    log, t = [], 0.0
    for k in range(300):
        seqs, ended = rng.randint(1, 8), rng.choice((0, 0, 1))
        f = StepFeatures(seqs + rng.randint(0, 200), seqs, seqs, 0, 0, 0)
        cpu = 2e-3 + 1e-5 * f.num_tokens * rng.uniform(0.5, 1.5)  # noisy: no model fits it
        pre = truth.pre(added[k])
        arrived = added[k + 1] if k < 299 else 0  # the last turn has no next turn to add them
        turn = pre + cpu + truth.post(seqs, ended, arrived, added[k])
        log.append(StepLogEntry(k, t, turn, True, f, seqs, 0, added[k], ended, pre, cpu, cpu,
                                t, t + turn))
        t += turn
    for model in (LinearStepModel(step=2e-2), LinearStepModel()):
        fitted = fit_server_overhead(log, model)
        for name in ("arrival_s", "post_seq_s", "post_ended_s", "pre_added_s", "post_added_s"):
            assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6,
                                                          abs=1e-9), name
        assert fitted.pre_s + fitted.post_s == pytest.approx(truth.pre_s + truth.post_s)
    # a log without CPU times falls back to the turn's wall time minus the model
    wall = [StepLogEntry(e.step, e.t, e.dur, e.busy, e.features, e.running, 0, e.added,
                         e.finished, e.pre, e.step_dur) for e in log]
    assert fit_server_overhead(wall, LinearStepModel(step=2e-2)).post_s == 0.0
