"""The simulator against the real engine on a tiny model: the same requests added before the same
steps give the same scheduling decisions, step shapes, hit tokens and preemptions."""

from __future__ import annotations

import random

import pytest

from nanokv import LLM
from nanokv.sampling_params import SamplingParams
from nanokv.sim.simulator import SimConfig, Simulator
from nanokv.sim.step_log import fit_step_log, read_step_log, turn_times
from nanokv.sim.step_model import LinearStepModel
from nanokv.sim.trace import TraceWriter, read_trace

ENGINE = dict(block_size=16, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=48,
              max_model_len=256)


def _workload(vocab: int, seed: int) -> dict[int, list[tuple[list[int], int]]]:
    """{loop turn: [(prompt, max_tokens)]}: three shared system prompts, fresh user parts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 64, 23)]
    adds: dict[int, list[tuple[list[int], int]]] = {}
    turn = 0
    for _ in range(14):
        prompt = rng.choice(systems) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        adds.setdefault(turn, []).append((prompt, rng.randint(1, 50)))
        turn += rng.choice((0, 0, 1, 3, 8))
    return adds


def _serve(engine, adds, writer):
    """The server's loop (nanokv/server/async_engine.py) with the trace hooks, single-threaded;
    returns the engine's decisions per step and the requests by id."""
    decisions = []
    writer.attach(engine)
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if not out.is_empty:
            decisions.append(([(s.request_id, s.num_tokens) for s in out.scheduled],
                              list(out.preempted_request_ids)))
        return out

    engine.scheduler.schedule = recording_schedule
    requests = {}
    turn, last = 0, max(adds)
    while turn <= last or engine.has_unfinished_requests():
        writer.begin_turn()
        for prompt, max_tokens in adds.get(turn, []):
            r = engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                           ignore_eos=True))
            engine.add_prepared(r)
            writer.admitted(r)
            requests[r.request_id] = r
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    writer.record(requests[out.request_id], "test")
        writer.end_turn(engine.has_unfinished_requests())
        turn += 1
    return decisions, requests


@pytest.mark.parametrize("seed", [0, 1])
def test_recorded_admission_replays_the_engine(tiny_llama, tmp_path, seed):
    llm = LLM(tiny_llama, **ENGINE)
    engine = llm.engine
    trace, steps = str(tmp_path / "t.jsonl"), str(tmp_path / "s.jsonl")
    writer = TraceWriter(trace, steps_path=steps)
    decisions, requests = _serve(engine, _workload(engine.hf_config.vocab_size, seed), writer)
    writer.close()
    records, log = read_trace(trace), read_step_log(steps)
    assert len(records) == len(requests) and len(log) == len(decisions)
    assert engine.scheduler.num_preemptions > 0  # the pool is small enough to preempt
    assert sum(r.cached for r in records) > 0
    # sim ids are admission orders; the engine's map to them through the trace
    order = {rid: str(i) for i, rid in enumerate(requests)}
    want = [([(order[rid], n) for rid, n in sched], [order[p] for p in pre])
            for sched, pre in decisions]
    cfg = dict(block_size=16, num_blocks=ENGINE["num_kv_blocks"], max_num_seqs=4,
               max_num_batched_tokens=48, max_model_len=256, admission="recorded")
    for ff in (False, True):
        sim = Simulator(records, SimConfig(**cfg, fast_forward=ff, check_invariants=not ff),
                        LinearStepModel(step=1e-3), record_decisions=True)
        res = sim.run()
        assert sim.decisions == want
        assert sim.features == [e.features for e in log]
        assert res.preemptions == engine.scheduler.num_preemptions
        assert res.peak_running == max(e.running for e in log)
        assert sorted((r.arrival, r.cached) for r in res.requests) == sorted(
            (r.t, r.cached) for r in records)
    # the served run's own turn times replay its timing; a model fitted to them is positive
    times = turn_times(log)
    res = Simulator(records, SimConfig(**cfg), LinearStepModel(), step_times=times).run()
    assert res.num_steps == len(log)
    fitted = fit_step_log(log)
    assert fitted.step_time(log[0].features) > 0


def test_a_sliding_window_is_replayed_as_the_engine_runs_it(tmp_path):
    """A Mistral model with a window on every layer: the engine frees each request's blocks
    behind its window after every step; the replay (recorded admission) makes the same
    decisions, step shapes, hits and preemptions with the same window (fast-forward off by
    itself: those decode steps free blocks)."""
    from tiny_models import build_tiny_model

    model = build_tiny_model(str(tmp_path / "mistral"), "mistral", tokenizer=False,
                             sliding_window=20, max_position_embeddings=256)
    engine = LLM(model, skip_tokenizer_init=True, **ENGINE).engine
    assert engine.scheduler.sliding_window == 20
    trace, steps = str(tmp_path / "t.jsonl"), str(tmp_path / "s.jsonl")
    writer = TraceWriter(trace, steps_path=steps)
    decisions, requests = _serve(engine, _workload(engine.hf_config.vocab_size, 2), writer)
    writer.close()
    records, log = read_trace(trace), read_step_log(steps)
    assert any(r.num_evicted_tokens for r in requests.values())  # blocks freed behind windows
    cfg = dict(block_size=16, num_blocks=ENGINE["num_kv_blocks"], max_num_seqs=4,
               max_num_batched_tokens=48, max_model_len=256, admission="recorded")
    res = _replays_as_served(engine, decisions, requests, records, log, cfg,
                             dict(sliding_window=20))
    peak = max(r.peak_blocks for r in res.requests)
    assert peak == max(r.peak_blocks for r in requests.values())


def _replays_as_served(engine, decisions, requests, records, log, cfg: dict, windows: dict):
    """The replay of a served run (recorded admission) with the model's `windows` (SimConfig
    fields) makes the engine's decisions, step shapes, preemptions and hits; without them,
    others (whole requests held). Returns the replay's result."""
    order = {rid: str(i) for i, rid in enumerate(requests)}
    want = [([(order[rid], n) for rid, n in sched], [order[p] for p in pre])
            for sched, pre in decisions]
    sim = Simulator(records, SimConfig(**cfg, **windows, check_invariants=True),
                    LinearStepModel(step=1e-3), record_decisions=True)
    res = sim.run()
    assert sim.decisions == want
    assert sim.features == [e.features for e in log]
    assert res.preemptions == engine.scheduler.num_preemptions
    assert sorted((r.arrival, r.cached) for r in res.requests) == sorted(
        (r.t, r.cached) for r in records)
    plain = Simulator(records, SimConfig(**cfg), LinearStepModel(step=1e-3),
                      record_decisions=True)
    plain.run()
    assert plain.decisions != want
    return res


def test_a_hybrid_model_is_replayed_as_the_engine_runs_it(tmp_path):
    """A Gemma 3 model whose windowed layers sit beside a full one: the engine slices requests
    (the hybrid KV cache manager, `layer_windows`); the replay with the same layer windows
    makes the same decisions, step shapes and hits; with every layer keeping every block it
    makes others."""
    from tiny_models import build_tiny_model

    model = build_tiny_model(str(tmp_path / "gemma3"), "gemma3", tokenizer=False, seed=3,
                             num_hidden_layers=3, sliding_window=20, max_position_embeddings=256,
                             layer_types=["sliding_attention", "full_attention",
                                          "sliding_attention"])
    engine = LLM(model, skip_tokenizer_init=True, **{**ENGINE, "num_kv_blocks": 12}).engine
    windows = engine.scheduler.layer_windows
    assert windows == (20, None, 20)
    sliced = []
    original = engine.block_manager.slice_for_windows
    engine.block_manager.slice_for_windows = lambda r, w: (sliced.append(r.request_id),
                                                           original(r, w))
    trace, steps = str(tmp_path / "t.jsonl"), str(tmp_path / "s.jsonl")
    writer = TraceWriter(trace, steps_path=steps)
    decisions, requests = _serve(engine, _workload(engine.hf_config.vocab_size, 2), writer)
    writer.close()
    assert sliced
    records, log = read_trace(trace), read_step_log(steps)
    cfg = dict(block_size=16, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=48,
               max_model_len=256, admission="recorded")
    _replays_as_served(engine, decisions, requests, records, log, cfg,
                       dict(layer_windows=windows))
    with pytest.raises(ValueError, match="layer_windows must mix"):
        SimConfig(**cfg, layer_windows=(20, 20, 20))


def test_recorded_admission_needs_the_step_fields():
    from nanokv.sim.trace import TraceRecord

    rec = TraceRecord(t=0.0, prompt_len=20, output_len=2, hashes=["ab" * 8])
    with pytest.raises(ValueError, match="step and order"):
        Simulator([rec], SimConfig(block_size=16, num_blocks=8, admission="recorded"),
                  LinearStepModel())
    with pytest.raises(ValueError, match="admission"):
        SimConfig(block_size=16, num_blocks=8, admission="later")


def test_simulate_cli_fits_the_step_log(tiny_llama, tmp_path, capsys):
    import json

    from nanokv.cli import main

    engine = LLM(tiny_llama, **ENGINE).engine
    trace, steps = str(tmp_path / "t.jsonl"), str(tmp_path / "s.jsonl")
    writer = TraceWriter(trace, steps_path=steps)
    _serve(engine, _workload(engine.hf_config.vocab_size, 2), writer)
    writer.close()
    records = read_trace(trace)
    rc = main(["simulate", "--trace", trace, "--step-log", steps, "--admission", "recorded",
               "--model-config", tiny_llama, "--kv-memory", "4MiB", "--num-kv-blocks", "16",
               "--block-size", "16",
               "--kv-cache-dtype", "auto", "--compute-dtype", "float32",
               "--max-num-seqs-sim", "4", "--max-num-batched-tokens", "48",
               "--max-model-len", "256"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_requests"] == len(records) and out["num_blocks"] == 16
    assert out["preemptions"] == engine.scheduler.num_preemptions
    assert out["prefix_hit_rate"] == pytest.approx(
        sum(r.cached for r in records) / sum(r.prompt_len for r in records))
    assert out["step_model"].startswith(f"fitted (step log {steps}")
