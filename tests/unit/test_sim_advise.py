"""Step models (fit recovers known coefficients, roofline magnitudes) and `nanokv advise`."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from nanokv.cli import main
from nanokv.sim.advise import AdviseSettings, Candidate, evaluate, kv_cost, line, sweep
from nanokv.sim.step_model import (DEVICES, LinearStepModel, ModelShape, RooflineStepModel,
                                   StepFeatures)
from nanokv.sim.synthetic import WorkloadShape, generate

LLAMA3_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192}


def test_fit_recovers_coefficients():
    true = LinearStepModel(step=2e-3, token=3e-5, seq=1e-4, decode_context=2e-8,
                           prefill_pair=1e-9, prefill_seq=4e-4)
    rng = random.Random(0)
    samples = []
    for _ in range(200):
        seqs = rng.randint(1, 16)
        f = StepFeatures(rng.randint(1, 500), seqs, rng.randint(0, seqs),
                         rng.randint(0, 20000), rng.randint(0, 200000))
        samples.append((f, true.step_time(f)))
    fit = LinearStepModel.fit(samples)
    for name in ("step", "token", "seq", "decode_context", "prefill_pair", "prefill_seq"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=1e-3)
    # a prefill chunk costs prefill_seq more than a decode of the same token count
    decode, chunk = StepFeatures(1, 1, 1, 100, 0), StepFeatures(1, 1, 0, 0, 1)
    assert true.step_time(chunk) - true.step_time(decode) == pytest.approx(
        4e-4 + 1e-9 - 100 * 2e-8)


def test_step_model_files_saved_before_prefill_seq_still_load(tmp_path):
    import json

    path = tmp_path / "old.json"
    path.write_text(json.dumps({"kind": "linear", "step": 1e-3, "token": 2e-5, "seq": 0.0,
                                "decode_context": 0.0, "prefill_pair": 0.0, "source": "old"}))
    old = LinearStepModel.load(str(path))
    assert old.prefill_seq == 0.0 and old.step_time(StepFeatures(10, 1, 0)) == pytest.approx(
        1e-3 + 2e-4)
    again = tmp_path / "again.json"
    again.write_text(LinearStepModel(step=1e-3, prefill_seq=5e-4, source="new").to_json())
    assert LinearStepModel.load(str(again)).prefill_seq == 5e-4


def test_roofline_llama3_8b_on_h200():
    model = ModelShape.from_hf_config(LLAMA3_8B)
    assert model.num_params == pytest.approx(8.03e9, rel=0.01)
    per_block, fixed = kv_cost(model, "auto", 16, 256)
    assert per_block / 16 == 131072 + 4  # 2 x 32 layers x 8 heads x 128 x 2 bytes + position
    step = RooflineStepModel(DEVICES["h200"], model, per_block / 16)
    one = step.step_time(StepFeatures(1, 1, 1, 1000, 0))
    # a lone decode reads the 16 GB of weights at 80% of 4.8 TB/s: about 4 ms, plus overhead
    assert 0.004 < one < 0.006
    prefill = step.step_time(StepFeatures(8192, 1, 0, 0, 8192 * 8193 // 2))
    assert prefill > 0.2  # compute-bound: 2 x 8e9 x 8192 FLOPs at 55% of 989 TFLOP/s
    fp8, _ = kv_cost(model, "fp8", 16, 256)
    assert fp8 < per_block * 0.6


def test_int8_weights_are_read_at_a_byte_a_parameter():
    """`quantization="int8"` (the engine's option): the roofline reads a quarter of float32's
    weight bytes, so a lone decode on the CPU roofline (weights-bound) takes about a quarter
    of the time less the step overhead; int8 computes in float32 only."""
    import torch

    model = ModelShape.from_hf_config(LLAMA3_8B)
    recs = generate("chat", 10, rate=0.001, seed=0,  # one request at a time
                    shape=WorkloadShape(output_len=(32, 64), max_model_len=2048))
    common = dict(model=model, kv_memory=2 * 2**30, device=DEVICES["cpu"], max_model_len=2048,
                  compute_dtype=torch.float32)
    tpot = {}
    for quantization in (None, "int8"):
        s = AdviseSettings(quantization=quantization, **common)
        assert s.weight_bytes_per_param == (1.0 if quantization else 4)
        tpot[quantization] = evaluate(recs, s, Candidate(16, "auto", 64)).result.tpot_s["p50"]
    cpu = DEVICES["cpu"]
    weights_s = model.num_params * 4 / cpu.memory_bandwidth  # a float32 step's weight reads
    assert tpot[None] == pytest.approx(weights_s, rel=0.05)
    assert tpot["int8"] == pytest.approx(weights_s / 4, rel=0.1)
    with pytest.raises(ValueError, match=r"computes in float32 .* must be float32, got "
                                         r"bfloat16"):
        AdviseSettings(model=model, kv_memory=2**30, quantization="int8")
    with pytest.raises(ValueError, match=r"quantization must be one of \['int8'\] or None, "
                                         r"got 'int4'"):
        AdviseSettings(quantization="int4", **common)


def test_simulate_cli_takes_int8_weights(tmp_path, capsys):
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ["simulate", "--workload", "chat", "--num-requests", "10", "--rate", "0.001",
            "--model-config", str(cfg), "--kv-memory", "2GiB", "--device", "cpu",
            "--max-model-len", "2048"]
    tpot = {}
    for extra in ([], ["--quantization", "int8"], ["--compute-dtype", "float32"]):
        assert main(args + extra) == 0
        tpot[tuple(extra)] = json.loads(capsys.readouterr().out)["tpot_s"]["p50"]
    # int8 (float32 compute) against bfloat16 and float32 weights: half and a quarter
    assert tpot[("--quantization", "int8")] < 0.6 * tpot[()]
    assert tpot[("--quantization", "int8")] < 0.3 * tpot[("--compute-dtype", "float32")]
    assert main(args + ["--quantization", "int8", "--compute-dtype", "bfloat16"]) != 0
    assert "compute dtype must be float32, got bfloat16" in capsys.readouterr().err


def test_sweep_ranks_and_prefers_small_blocks_for_shared_prefixes():
    shape = WorkloadShape(system_prompts=4, system_len=(200, 600), user_len=(20, 100),
                          output_len=(20, 80), max_model_len=4096)
    recs = generate("chat", 150, rate=20.0, seed=0, shape=shape)
    s = AdviseSettings(model=ModelShape.from_hf_config(LLAMA3_8B), kv_memory=2 * 2**30,
                       device=DEVICES["h200"], max_model_len=4096, block_sizes=(16, 64, 256),
                       kv_dtypes=("auto", "fp8"), max_num_seqs=(32, 64), compressions=(0.5,),
                       eviction_ratios=(), default_max_num_seqs=64)
    outcomes = sweep(recs, s)
    assert len(outcomes) >= 6
    hits = {o.candidate.block_size: o.result.prefix_hit_rate for o in outcomes
            if o.candidate.kv_dtype == "auto" and o.candidate.policy == "full"
            and o.candidate.max_num_seqs == 64}
    assert hits[16] >= hits[64] >= hits[256]
    fp8 = evaluate(recs, s, Candidate(64, "fp8", 64))
    auto = evaluate(recs, s, Candidate(64, "auto", 64))
    assert fp8.num_blocks > 1.8 * auto.num_blocks
    # a progress line shows what the table shows: '-' where a figure is missing, never nan
    assert auto.capacity_req_s is None and "nan" not in line(auto)
    assert " capacity       - req/s " in line(auto)
    measured = replace(fp8, saturated=replace(fp8.result, capacity_req_s=12.5))
    assert " capacity   12.50 req/s " in line(measured)


def test_advise_cli(tmp_path, capsys):
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(LLAMA3_8B))
    out = tmp_path / "out"
    rc = main(["advise", "--workload", "chat", "--num-requests", "60", "--rate", "20",
               "--model-config", str(cfg), "--kv-memory", "4GiB", "--block-sizes", "16,256",
               "--kv-dtypes", "auto", "--max-num-seqs", "64", "--compressions", "",
               "--eviction-ratios", "", "--rates", "5,40", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Recommendation" in text and "| rank |" in text and "bound by" in text
    assert (out / "block_size.png").stat().st_size > 0
    assert json.loads((out / "advise.json").read_text())["outcomes"]


def test_advise_ranks_by_capacity_below_saturation():
    """At 2 req/s both max_num_seqs serve the whole load; with a step time that does not grow
    with the batch, 32 sequences serve about 4x what 8 do, and rank first."""
    from nanokv.sim.advise import compress_arrivals

    shape = WorkloadShape(system_prompts=2, system_len=(64, 128), user_len=(8, 32),
                          output_len=(16, 48), max_model_len=1024)
    recs = generate("chat", 200, rate=2.0, seed=0, shape=shape)
    fast = compress_arrivals(recs, 8.0)
    assert [r.hashes for r in fast] == [r.hashes for r in recs]
    assert fast[-1].t - fast[0].t == pytest.approx((recs[-1].t - recs[0].t) / 8)
    recs[5].abort_t, recs[5].max_tokens = recs[5].t + 3.0, 64  # a client's patience: 3 s
    aborted = compress_arrivals(recs, 8.0)[5]
    assert aborted.abort_t - aborted.t == pytest.approx(3.0) and aborted.t < recs[5].t
    recs[5].abort_t = recs[5].max_tokens = None
    s = AdviseSettings(model=ModelShape.from_hf_config(LLAMA3_8B), kv_memory=8 * 2**30,
                       fitted=LinearStepModel(step=0.01), max_model_len=1024,
                       block_sizes=(16,), kv_dtypes=("auto",), max_num_seqs=(8, 32),
                       compressions=(), eviction_ratios=(), default_max_num_seqs=8)
    outcomes = sweep(recs, s)
    by_seqs = {o.candidate.max_num_seqs: o for o in outcomes}
    assert by_seqs[8].result.requests_per_s == pytest.approx(
        by_seqs[32].result.requests_per_s, rel=0.05)  # the offered load: no difference
    assert outcomes[0].candidate.max_num_seqs == 32
    assert by_seqs[32].capacity_req_s > 3 * by_seqs[8].capacity_req_s
    for o in outcomes:
        assert o.saturated.saturated_s >= 0.5 * o.saturated.duration_s


def test_recommended_prefers_the_full_cache_unless_a_policy_adds_10_percent():
    """`recommended` (what the report recommends, and what `advise --rates` simulates): a KV
    policy that adds under 10% capacity over the best full cache gives way to that one."""
    from types import SimpleNamespace

    import nanokv.sim.advise as adv

    def outcome(policy, capacity):
        return SimpleNamespace(candidate=SimpleNamespace(policy=policy), capacity_req_s=capacity)

    small_gain = [outcome("compress 4x", 10.5), outcome("full", 10.0)]
    pick, caveat = adv.recommended(small_gain)
    assert pick is small_gain[1] and "only 5% capacity" in caveat
    big_gain = [outcome("compress 4x", 13.0), outcome("full", 10.0)]
    pick, caveat = adv.recommended(big_gain)
    assert pick is big_gain[0] and "+30% capacity" in caveat
    only_full = [outcome("full", 3.0)]
    assert adv.recommended(only_full) == (only_full[0], "")


def test_a_window_on_every_layer_is_replayed_as_the_engine_runs_it(tmp_path):
    """A Mistral checkpoint's window (every layer) read as the engine reads it: the replay frees
    the blocks behind each request's window after every step, so a request holds at most
    cdiv(W - 1 + T, B) + 1 blocks (the full-attention replay of the same trace holds a whole
    request's) and more run at once; no KV policy is swept or simulated. A hybrid Qwen2 (layer
    0 over the whole context), a window no shorter than max_model_len and a config without one
    give no window."""
    from tiny_models import build_tiny_model

    from nanokv.sim.advise import model_window
    from nanokv.sim.simulator import SimConfig

    mistral = build_tiny_model(str(tmp_path / "mistral"), "mistral", tokenizer=False,
                               sliding_window=64, max_position_embeddings=2048)
    hybrid = build_tiny_model(str(tmp_path / "qwen2"), "qwen2", tokenizer=False,
                              use_sliding_window=True, sliding_window=64, max_window_layers=1,
                              max_position_embeddings=2048)
    assert model_window(mistral, 1024) == 64
    assert model_window(mistral, 64) is None  # the window covers max_model_len: no window
    assert model_window(hybrid, 1024) is None
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert model_window(str(plain), 1024) is None
    recs, base = _chat_on_160_blocks()
    windowed = replace(base, sliding_window=64)
    full = evaluate(recs, base, Candidate(16, "auto", 32)).result
    slid = evaluate(recs, windowed, Candidate(16, "auto", 32)).result
    cap = -(-(64 - 1 + 256) // 16) + 1
    assert max(r.peak_blocks for r in slid.requests) <= cap
    assert max(r.peak_blocks for r in full.requests) > 2 * cap
    assert slid.peak_running > full.peak_running
    assert len(slid.requests) == len(full.requests) == len(recs)
    outcomes = sweep(recs, windowed)
    assert {o.candidate.policy for o in outcomes} == {"full"}  # no policy with a window
    assert {o.candidate.policy for o in sweep(recs, base)} != {"full"}
    with pytest.raises(ValueError, match="without a KV policy"):
        SimConfig(block_size=16, num_blocks=8, sliding_window=64, compression_ratio=0.5)
    with pytest.raises(ValueError, match="sliding_window must be an integer >= 1"):
        replace(base, sliding_window=0)


def test_windows_beside_full_layers_are_replayed_with_the_hybrid_manager(tmp_path):
    """A Gemma 3 checkpoint's windowed layers beside full ones read as the engine reads them;
    the float pool's replay slices requests (fewer blocks each, more served than keeping every
    block), the
    quantized candidates keep every block, and no KV policy is swept."""
    from tiny_models import build_tiny_model

    from nanokv.sim.advise import model_layer_windows

    gemma = build_tiny_model(str(tmp_path / "gemma3"), "gemma3", tokenizer=False,
                             num_hidden_layers=4, sliding_window=64,
                             max_position_embeddings=2048)
    assert model_layer_windows(gemma, 1024) == (64, None, 64, None)
    assert model_layer_windows(gemma, 64) is None  # the window covers max_model_len
    mistral = build_tiny_model(str(tmp_path / "mistral"), "mistral", tokenizer=False,
                               sliding_window=64, max_position_embeddings=2048)
    assert model_layer_windows(mistral, 1024) is None  # a window on every layer
    recs, base = _chat_on_160_blocks()
    windows = (64, 64, 64, None) * 8  # Llama 3 8B's 32 layers, one in four full
    hybrid = replace(base, layer_windows=windows)
    full = evaluate(recs, base, Candidate(16, "auto", 32)).result
    sliced = evaluate(recs, hybrid, Candidate(16, "auto", 32)).result
    assert max(r.peak_blocks for r in sliced.requests) < max(r.peak_blocks for r in full.requests)
    assert sliced.capacity_req_s > 1.2 * full.capacity_req_s
    quantized = evaluate(recs, replace(hybrid, kv_dtypes=("int8",)), Candidate(16, "int8", 32))
    plain = evaluate(recs, replace(base, kv_dtypes=("int8",)), Candidate(16, "int8", 32))
    assert quantized.result.peak_running == plain.result.peak_running
    assert {o.candidate.policy for o in sweep(recs, hybrid)} == {"full"}


def test_a_soft_capped_model_is_advised_the_float_pool_only(tmp_path):
    """Gemma 2 soft-caps its attention scores, which only the float pool's attention applies
    (the engine refuses the quantized caches for it): the advisor sweeps "auto" only."""
    from tiny_models import build_tiny_model

    from nanokv.sim.advise import engine_kv_dtypes

    gemma2 = build_tiny_model(str(tmp_path / "gemma2"), "gemma2", tokenizer=False)
    kept, why = engine_kv_dtypes(gemma2, ("auto", "fp8", "kvquant"))
    assert kept == ("auto",) and "fp8,kvquant left out" in why
    with pytest.raises(ValueError, match="--kv-dtypes must include auto, got int8"):
        engine_kv_dtypes(gemma2, ("int8",))
    llama = build_tiny_model(str(tmp_path / "llama"), "llama", tokenizer=False)
    assert engine_kv_dtypes(llama, ("auto", "fp8")) == (("auto", "fp8"), None)


def _chat_on_160_blocks():
    """A chat trace (two system prompts, 1k max_model_len) and settings that replay it on 160
    blocks of 16 with Llama 3 8B's shape."""
    shape = WorkloadShape(system_prompts=2, system_len=(400, 600), user_len=(50, 200),
                          output_len=(100, 200), max_model_len=1024)
    recs = generate("chat", 40, rate=50.0, seed=1, shape=shape)
    base = AdviseSettings(model=ModelShape.from_hf_config(LLAMA3_8B), kv_memory=0,
                          num_blocks=160, fitted=LinearStepModel(step=0.01), max_model_len=1024,
                          max_num_batched_tokens=256, block_sizes=(16,), kv_dtypes=("auto",),
                          max_num_seqs=(), compressions=(0.5,), eviction_ratios=(0.2,),
                          default_max_num_seqs=32)
    return recs, base
