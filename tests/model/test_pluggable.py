"""Adding a KV cache kind or an attention backend is one class plus one registry line: both are
plugged in here from the test module, and the engine serves them end to end. And the KIVI store
(added the same way) under prefix hits, preemption and a KV policy."""

import sys

import pytest
import torch

import nanokv.attention.quantized as quantized_backend_module
import nanokv.attention.selector as selector
import nanokv.cache.registry as kv_registry
from nanokv import LLM, SamplingParams
from nanokv.attention.torch_paged import TorchPagedBackend
from nanokv.quant.pertoken_store import Int8KVStore
from test_quant_engine import (CHUNKED, GREEDY, PREEMPT, PROMPTS, assert_all_free,
                               checking_attention, run, tokens)

HERE = sys.modules[__name__].__name__


class MirrorInt8Store(Int8KVStore):
    """A 'new' store: int8 under another name (its own prefix-cache keys)."""

    kv_cache_dtype = "mirror_int8"


class CountingBackend(TorchPagedBackend):
    """A 'new' backend: the PyTorch path, counting its calls."""

    name = "counting"
    description = "counts its calls"
    calls = 0

    def forward(self, *args, **kwargs):
        CountingBackend.calls += 1
        return super().forward(*args, **kwargs)


def test_a_new_kv_cache_kind_is_one_registry_line(tiny_llama, monkeypatch):
    monkeypatch.setitem(kv_registry._KINDS, "mirror_int8", f"{HERE}:MirrorInt8Store")
    monkeypatch.setattr(kv_registry, "KV_CACHE_DTYPES", tuple(kv_registry._KINDS))
    ref_engine, ref = run(tiny_llama, **CHUNKED, kv_cache_dtype="int8")
    engine, outs = run(tiny_llama, **CHUNKED, kv_cache_dtype="mirror_int8")
    assert type(engine.kv_cache) is MirrorInt8Store
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]
    assert ("kv_cache_dtype", "mirror_int8") in engine.block_manager.extra_keys
    # a KV policy works on it through the generic store interface
    engine, outs = run(tiny_llama, **PREEMPT, kv_cache_dtype="mirror_int8",
                       kv_policy="snapkv", kv_budget=32)
    assert all(o.kv_slots_at_finish <= 32 + 16 for o in outs)
    assert_all_free(engine)


def test_a_new_attention_backend_is_one_registry_line(tiny_llama, monkeypatch):
    monkeypatch.setattr(selector, "_BACKENDS", selector._BACKENDS + (f"{HERE}:CountingBackend",))
    CountingBackend.calls = 0
    _, ref = run(tiny_llama, **CHUNKED, attention_backend="torch")
    engine, outs = run(tiny_llama, **CHUNKED, attention_backend="counting")
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert CountingBackend.calls > 0
    assert any("attention backend: counting" in line for line in engine.startup_lines)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(tiny_llama, attention_backend="nonexistent")


# ---- KIVI, registered like any store -------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_attention_equals_dequantize_then_dense(tiny_model, monkeypatch, bits):
    checked = {"decode": 0, "prefill_past": 0}
    checking = checking_attention(checked)
    monkeypatch.setattr(quantized_backend_module, "quantized_paged_attention", checking)
    engine, outs = run(tiny_model, kv_cache_dtype="kivi", kv_quant_bits=bits, max_num_seqs=4,
                       attention_backend="torch", **CHUNKED)  # the PyTorch path; the C
    # kernel's own check: tests/unit/test_native_quant_attention.py
    assert engine.kv_cache.kv_cache_dtype == "kivi" and engine.kv_cache.bits == bits
    assert checked["decode"] > 0 and checked["prefill_past"] > 0
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]
    assert_all_free(engine)
    assert engine.kv_cache.num_free_staging_blocks == engine.kv_cache.num_staging_blocks


def test_kivi_preemption_and_policy_keep_accounting(tiny_qwen3):
    ref_engine, _ = run(tiny_qwen3, **PREEMPT, kv_cache_dtype="kivi", max_num_seqs=4)
    assert ref_engine.scheduler.num_preemptions > 0
    assert_all_free(ref_engine)
    assert ref_engine.kv_cache.num_free_staging_blocks == ref_engine.kv_cache.num_staging_blocks
    engine, outs = run(tiny_qwen3, **PREEMPT, kv_cache_dtype="kivi", max_num_seqs=4,
                       kv_policy="streaming", kv_budget=32)
    assert engine.policies.stats.compressions > 0
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert_all_free(engine)


def test_kivi_logits_close_to_float(tiny_model):
    """Teacher-forced prompt logits over a cache read in 16-token chunks: 4-bit KIVI stays
    close to the float cache and closer than 2-bit; the tokens before the first block fills see
    their block staged (exact)."""
    prompt = tokens(96, 7)
    params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
    opts = dict(num_kv_blocks=16, max_num_batched_tokens=16, max_model_len=128, max_num_seqs=2)

    def logits(**kw):
        return run(tiny_model, [prompt], params, **opts, **kw)[1][0].prompt_logits

    ref = logits()
    centered = ref[15:] - ref[15:].mean(-1, keepdim=True)
    errors = {}
    for bits in (2, 4):
        got = logits(kv_cache_dtype="kivi", kv_quant_bits=bits)
        # before the first block fills, every token sees its K/V staged (exact: equal but for
        # the rounding of another order of sums; a quantized K/V moves them by 1e-3 and more) ...
        torch.testing.assert_close(got[:15], ref[:15], atol=2e-5, rtol=1e-5)
        diff = (got - ref)[15:]  # ... its last slot sees the block's codes, as decode would
        assert float(diff[0].abs().max()) > 0
        errors[bits] = float((diff.norm(dim=-1) / centered.norm(dim=-1)).max())
    assert errors[4] < 0.25
    assert errors[4] < errors[2]


def test_prompts_reach_kivi_from_the_cli(tiny_llama, capsys):
    from nanokv.cli import main

    rc = main(["generate", "--model", tiny_llama, "--block-size", "16", "--max-model-len", "128",
               "--max-num-seqs", "2", "--kv-cache-dtype", "kivi", "--kv-quant-bits", "2",
               "--prompt", "def add(a, b):", "--max-tokens", "4", "--ignore-eos", "--json"])
    assert rc == 0
    assert "KV cache dtype kivi" in capsys.readouterr().err
    assert PROMPTS  # the shared prompts import cleanly


def test_padded_decode_batch_equals_per_request_decode(tiny_llama):
    """The PyTorch backend's CUDA decode (one padded, masked batch over gathered blocks) run on
    CPU: the same greedy tokens as the CPU path (each request over its own blocks), with prefix
    hits, chunked prefill and preemption."""
    for scenario in (CHUNKED, PREEMPT):
        _, ref = run(tiny_llama, **scenario, attention_backend="torch")
        llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=16, attention_backend="torch",
                  **scenario)
        llm.engine.attention_backend.per_request_decode = False  # what CUDA runs
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert_all_free(llm.engine)
