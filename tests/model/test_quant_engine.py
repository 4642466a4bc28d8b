"""The quantized KV cache inside the engine (kv_cache_dtype int8 / fp8 / kvquant): greedy tokens
against the float engine under prefix hits, chunked prefill and preemption; every attention call
against the dequantize-then-dense oracle; pool sizing with the store's real bytes; prefix-cache
separation; bad options; `nanokv calibrate` -> `--kv-quant-config`."""

import json
import logging
import random

import pytest
import torch

import nanokv.engine.llm_engine as llm_engine_module
import nanokv.attention.quantized as quantized_backend_module
from nanokv import LLM, SamplingParams
from nanokv.cache.block_manager import BlockManager
from nanokv.cli import main as cli_main
from nanokv.policies.base import PolicyConfig
from nanokv.quant import QuantizedKVStore, store_memory
from nanokv.quant.attention import reference_quantized_attention
from nanokv.request import Request
from tiny_models import TOKENIZER_TEXT, VOCAB

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 30) for _ in range(n)]


PREFIX = tokens(37, 0)
PROMPTS = [PREFIX + tokens(n, i + 1) for i, n in enumerate((3, 17, 40, 25))]

# roomy pool, small step budget: prompts share a 2-block prefix and are prefilled in chunks
CHUNKED = dict(num_kv_blocks=64, max_num_batched_tokens=24)
# 9 blocks of 16 for 4 requests of up to 77 + 12 tokens: the newest is preempted and recomputed
PREEMPT = dict(num_kv_blocks=9, max_num_batched_tokens=32, max_model_len=128)


def calibration_file(path, model_dir, layer_bits, bits=4, decision="kvquant") -> str:
    """A minimal calibration JSON (uniform grids, per-block outlier thresholds) for `model_dir`."""
    with open(f"{model_dir}/config.json") as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    data = {"format": "nanokv-kv-calibration", "version": 1,
            "model": {"path": model_dir, "num_layers": cfg["num_hidden_layers"],
                      "num_kv_heads": cfg["num_key_value_heads"], "head_dim": head_dim},
            "settings": {"block_size": 16, "outlier_fraction": 0.01, "num_sink_tokens": 1,
                         "per_channel_keys": True, "nuq": False},
            "codebooks": {}, "key_outlier_thresholds": None,
            "perplexity": {"baseline": 5.0, "trials": []},
            "decision": {"kv_cache_dtype": decision,
                         "bits": bits if decision == "kvquant" else None,
                         "layer_bits": layer_bits, "perplexity": 5.0, "delta": 0.0,
                         "reason": "test"}}
    path.write_text(json.dumps(data))
    return str(path)


def run(model_dir, prompts=PROMPTS, params=GREEDY, **options):
    llm = LLM(model_dir, skip_tokenizer_init=True, block_size=16, **options)
    outs = llm.generate(prompts, params)
    return llm.engine, outs


def assert_all_free(engine):
    engine.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    store = engine.kv_cache
    if store is not None and hasattr(store, "num_free_staging_blocks"):  # kvquant staging
        assert store.num_free_staging_blocks == store.num_staging_blocks


# ---- greedy tokens: quantized (near-lossless settings) == float ----------------------------------
@pytest.mark.parametrize("scenario", ["chunked_prefix", "preemption"])
@pytest.mark.parametrize("kv", ["int8", "kvquant8"])
def test_near_lossless_quantized_greedy_equals_float(tiny_model, tmp_path, kv, scenario):
    extra = CHUNKED if scenario == "chunked_prefix" else PREEMPT
    quant = {"kv_cache_dtype": "int8"}
    if kv == "kvquant8":  # kvquant with 8-bit layers (the calibration's mixed-precision fallback)
        quant = {"kv_cache_dtype": "kvquant", "max_num_seqs": 4, "kv_quant_config":
                 calibration_file(tmp_path / "c.json", tiny_model, [8, 8])}
    ref_engine, ref = run(tiny_model, **extra)
    engine, outs = run(tiny_model, **extra, **quant)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # no float K/V tensor: the store holds them, and attention reads the store
    assert isinstance(engine.kv_cache, QuantizedKVStore)
    assert engine.attention_backend.kv_cache is engine.kv_cache
    if scenario == "chunked_prefix":
        assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]  # prefix hits served
    else:
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.num_preemptions == ref_engine.scheduler.num_preemptions
    assert_all_free(engine)


# ---- kvquant 4-bit: every attention call == dequantize-then-dense over the store -----------------
def checking_attention(checked: dict):
    """The PyTorch attention over a store, wrapped to compare every call with the
    dequantize-then-dense reference; counts decodes and prefill chunks with a past in
    `checked`."""
    real = quantized_backend_module.quantized_paged_attention

    def checking(q, k, v, k_store, store, layer, meta, plan, scale, rope, read_past=None,
                 staged_pasts=None):
        out = real(q, k, v, k_store, store, layer, meta, plan, scale, rope, read_past,
                   staged_pasts)
        bs = store.block_size
        for i in range(meta.num_decode_tokens):
            context = int(meta.decode_mask[i].sum())
            table = meta.decode_block_tables[i][:-(-context // bs)]
            ref = reference_quantized_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], store, layer,
                                                table, context - 1, scale, rope)
            torch.testing.assert_close(out[i:i + 1], ref, atol=2e-5, rtol=1e-4)
            checked["decode"] += 1
        for i, seq in enumerate(meta.prefills):
            sl = slice(seq.query_start, seq.query_start + seq.query_len)
            past = seq.context_len - seq.query_len
            # the staged rows of a block the write filled: read before it (by `read_filling`,
            # checked against a read before the step in tests/unit/test_decode_view.py)
            ref = reference_quantized_attention(q[sl], k[sl], v[sl], store, layer,
                                                seq.block_table, past, scale, rope, k_store[sl],
                                                plan.positions[sl], staged_pasts[i])
            torch.testing.assert_close(out[sl], ref, atol=2e-5, rtol=1e-4)
            checked["prefill_past"] += past > 0
        return out

    return checking


def test_kvquant_attention_equals_dequantize_then_dense(tiny_model, monkeypatch):
    checked = {"decode": 0, "prefill_past": 0}
    checking = checking_attention(checked)

    monkeypatch.setattr(quantized_backend_module, "quantized_paged_attention", checking)
    engine, outs = run(tiny_model, kv_cache_dtype="kvquant", kv_quant_bits=4, max_num_seqs=4,
                       attention_backend="torch", **CHUNKED)  # the PyTorch path; the C
    # kernels' own check: tests/unit/test_native_quant_attention.py
    assert engine.kv_cache.pre_rope_keys and engine.kv_cache.config.bits == 4
    assert checked["decode"] > 0 and checked["prefill_past"] > 0
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]
    assert_all_free(engine)


def test_quantized_logits_close_to_float(tiny_model):
    """Teacher-forced: prompt logits with 16-token prefill chunks. Every token attends to the
    earlier ones as the store holds them (decode's view), so only the first token, which sees
    itself alone, is exact.

    Bound: the per-position logit error relative to the logits' spread,
    ||l_q - l|| / ||l - mean(l)||, max over positions. Measured on this prompt: int8 0.014 /
    0.022 (llama / qwen3), kvquant 4-bit 0.11 / 0.17, 2-bit 0.48 / 0.76 (random weights give
    K/V without the outlier structure KVQuant exploits, so they quantize worse than a trained
    model's). 0.25 for 4-bit leaves ~1.5x margin; the exact wiring is checked by the
    dequantize-then-dense test above. The mean error must also shrink with more bits."""
    prompt = tokens(96, 7)
    params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
    opts = dict(num_kv_blocks=16, max_num_batched_tokens=16, max_model_len=128)

    def logits(**kw):
        return run(tiny_model, [prompt], params, **opts, **kw)[1][0].prompt_logits

    ref = logits()
    errors = {}
    for name, kw in (("int8", {"kv_cache_dtype": "int8"}),
                     ("kvquant4", {"kv_cache_dtype": "kvquant", "kv_quant_bits": 4}),
                     ("kvquant2", {"kv_cache_dtype": "kvquant", "kv_quant_bits": 2})):
        got = logits(max_num_seqs=2, **kw)
        torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)  # sees only itself, fresh
        diff = (got - ref)[1:]
        centered = ref[1:] - ref[1:].mean(-1, keepdim=True)
        errors[name] = (float((diff.norm(dim=-1) / centered.norm(dim=-1)).max()),
                        float(diff.abs().mean()))
    assert errors["kvquant4"][0] < 0.25
    assert errors["int8"][0] < 0.05
    assert errors["int8"][1] < errors["kvquant4"][1] < errors["kvquant2"][1]


# ---- pool sizing: bytes per token really drop ----------------------------------------------------
def test_more_blocks_at_a_fixed_budget(tiny_qwen3):
    budget = 2 * 2**20
    opts = dict(kv_cache_memory=budget, max_num_seqs=4, max_model_len=256)
    sizes = {}
    for kv, extra in (("auto", {}), ("int8", {}), ("fp8_e5m2", {}),
                      ("kvquant", {"kv_quant_bits": 4}), ("kvquant", {"kv_quant_bits": 2})):
        llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=16, kv_cache_dtype=kv,
                  **extra, **opts)
        e = llm.engine
        blocks = e.block_manager.num_blocks
        assert e.kv_cache_bytes <= budget
        if kv == "auto":
            assert e.kv_bytes_per_token == e.layout.bytes_per_block / 16  # K/V + position
            sizes[kv] = (blocks, e.kv_bytes_per_block)
            continue
        store = e.kv_cache
        options = {}
        if kv == "kvquant":
            options = {"kvquant_config": store.config, "num_staging_blocks": 4}
        # the engine's figure is every byte the store allocated plus the slot positions ...
        allocated = sum(b.nbytes for b in store.buffers.values()) + store.slot_positions.nbytes
        assert e.kv_cache_bytes == allocated
        # ... which is what store_memory predicts for that pool (positions owned there)
        mem = store_memory(kv, e.layout, blocks, **options)
        assert e.kv_bytes_per_token == pytest.approx(mem.bytes_per_token)
        assert e.kv_bytes_per_token == pytest.approx(allocated / (blocks * 16))
        # sizing: the fixed cost (kvquant staging) first, then whole blocks
        fixed = store_memory(kv, e.layout, 0, **options).total
        assert blocks == (budget - fixed) // e.kv_bytes_per_block
        sizes[f"{kv}{extra.get('kv_quant_bits', '')}"] = (blocks, e.kv_bytes_per_block)
        assert any("bytes per token held" in line for line in e.startup_lines)
        assert_all_free(e)
    float_blocks, float_per_block = sizes["auto"]
    for name in ("int8", "fp8_e5m2", "kvquant4", "kvquant2"):
        blocks, per_block = sizes[name]  # blocks grow by the bytes-per-block ratio
        assert blocks / float_blocks == pytest.approx(float_per_block / per_block, rel=0.02), name
    assert sizes["int8"][0] > 3 * float_blocks  # qwen3 tiny: 516 -> 148 bytes per token
    assert sizes["kvquant2"][0] > sizes["kvquant4"][0] > sizes["int8"][0]


# ---- prefix cache: never across settings ---------------------------------------------------------
def test_prefix_cache_extra_keys_separate_settings(tiny_llama):
    keys = {}
    for kv, extra in (("auto", {}), ("int8", {}), ("fp8", {}), ("fp8_e5m2", {}),
                      ("kvquant", {"kv_quant_bits": 4}), ("kvquant", {"kv_quant_bits": 3})):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=16, num_kv_blocks=8,
                  max_model_len=128, max_num_seqs=2, kv_cache_dtype=kv, **extra)
        keys[(kv, extra.get("kv_quant_bits"))] = llm.engine.block_manager.extra_keys
    assert len(set(keys.values())) == len(keys)
    assert all(k[0] == ("kv_dtype", "torch.float32") for k in keys.values())
    # blocks cached under one setting are never hits under another
    bm = BlockManager(8, 4, extra_keys=keys[("int8", None)])
    a = Request("a", list(range(2, 11)), GREEDY)
    assert bm.allocate_slots(a, 9)
    probe = Request("b", list(range(2, 11)), GREEDY)
    assert bm.get_computed_blocks(probe)[1] == 8  # same setting: two full blocks hit
    for other in keys.values():
        if other != keys[("int8", None)]:
            bm.extra_keys = other
            assert bm.get_computed_blocks(probe) == ([], 0)


# ---- bad options ---------------------------------------------------------------------------------
def test_bad_quant_options_raise_before_anything_is_loaded(tiny_llama, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were validated")

    monkeypatch.setattr(llm_engine_module, "load_model", no_load)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    other_dims = calibration_file(tmp_path / "dims.json", tiny_llama, None)
    data = json.loads(open(other_dims).read())
    data["model"]["head_dim"] = 64
    (tmp_path / "dims.json").write_text(json.dumps(data))
    int8_file = calibration_file(tmp_path / "int8.json", tiny_llama, None, decision="int8")
    cases = [
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of"),
        (dict(kv_cache_dtype="kvquant", kv_quant_bits=5), "kv_quant_bits must be one of"),
        (dict(kv_cache_dtype="kvquant", kv_quant_bits=8), "kv_quant_bits must be one of"),
        (dict(kv_cache_dtype="int8", kv_quant_bits=4), "kvquant' only"),
        (dict(kv_quant_config=str(corrupt)), "kvquant' only"),
        (dict(kv_cache_dtype="kvquant", kv_quant_config=str(tmp_path / "missing.json")),
         "cannot read calibration file"),
        (dict(kv_cache_dtype="kvquant", kv_quant_config=str(corrupt)),
         "cannot read calibration file"),
        (dict(kv_cache_dtype="kvquant", kv_quant_config=other_dims), "calibration is for"),
        (dict(kv_cache_dtype="kvquant", kv_quant_config=int8_file), "chose kv_cache_dtype 'int8'"),
        (dict(kv_cache_dtype="int8", kv_policy="pyramidkv", kv_budget=128),
         "kv_policy 'pyramidkv' gives layers different budgets"),
    ]
    for options, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM(tiny_llama, **options)


def test_per_layer_budgets_rejected_with_a_quantized_cache(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=16, num_kv_blocks=8,
              max_model_len=128, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="float KV pool"):
        llm.engine.make_request([3, 4, 5], GREEDY, kv_policy=PolicyConfig("pyramidkv",
                                                                          budget=128))
    assert not llm.engine.has_unfinished_requests()


# ---- nanokv calibrate -> --kv-quant-config -------------------------------------------------------
def test_calibrate_cli_then_engine_loads_the_file(tiny_llama, tmp_path, capsys, caplog):
    text = tmp_path / "text.txt"
    text.write_text("".join(TOKENIZER_TEXT))
    out = tmp_path / "calib.json"
    rc = cli_main(["calibrate", "--model", tiny_llama, "--text", str(text), "--block-size", "16",
                   "--seq-len", "64", "--num-samples", "2", "--eval-samples", "1",
                   "--eval-seq-len", "64", "--chunk-size", "16", "--bits", "4",
                   "--codebook-bits", "4", "--kmeans-iters", "5", "--max-ppl-increase", "100",
                   "--output", str(out), "--json"])
    assert rc == 0
    decision = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (decision["kv_cache_dtype"], decision["bits"]) == ("kvquant", 4)
    rc = cli_main(["generate", "--model", tiny_llama, "--block-size", "16", "--max-model-len",
                   "128", "--max-num-seqs", "2", "--kv-cache-dtype", "kvquant",
                   "--kv-quant-config", str(out), "--prompt", "def add(a, b):", "--max-tokens",
                   "4", "--ignore-eos", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out.strip().splitlines()[-1])["token_ids"]) == 4
    assert "KV cache dtype kvquant" in captured.err
    # the engine uses the file's codebooks; another block size is allowed with a warning
    with caplog.at_level(logging.WARNING, logger="nanokv"):
        llm = LLM(tiny_llama, block_size=32, max_model_len=128, max_num_seqs=2,
                  kv_cache_dtype="kvquant", kv_quant_config=str(out))
    assert llm.engine.kv_cache.config.nuq
    assert "block_size 16" in caplog.text


def test_kvquant_random_traffic_keeps_blocks_and_staging_consistent(tiny_qwen3):
    """Arrivals sharing prefixes, aborts and preemptions on a 9-block pool: the block manager's
    invariants hold after every step, and at the end every block and staging block is free."""
    rng = random.Random(0)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=16, num_kv_blocks=9,
              max_model_len=128, max_num_batched_tokens=24, max_num_seqs=4,
              kv_cache_dtype="kvquant", kv_quant_bits=3)
    e = llm.engine
    prefixes = [tokens(rng.randrange(10, 40), 100 + i) for i in range(3)]
    live = []
    for _ in range(150):
        if rng.random() < 0.3 and len(live) < 8:
            prompt = rng.choice(prefixes) + tokens(rng.randrange(1, 30), rng.randrange(10**6))
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(20, 60),
                                    ignore_eos=True)
            live.append(e.add_request(prompt, params))
        if live and rng.random() < 0.05:
            e.abort(live.pop(rng.randrange(len(live))))
        for out in e.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        e.check_invariants()
    while e.has_unfinished_requests():
        e.step()
    assert e.scheduler.num_preemptions > 0 and e.block_manager.stats.prefix_cache_hits > 0
    assert_all_free(e)
