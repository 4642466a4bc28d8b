"""Short prefill chunks after a cached past attended as decode rows (`Scheduler._as_decode_rows`)
give the outputs the prefill path gives (the oracle: the same engine with the rows turned off),
for every KV store; they are taken only where the rule allows (short chunks after a cached past,
no KV policy, no chunk that writes a block's last slot in a cache that quantizes full blocks)."""

from __future__ import annotations

import random

import pytest

import nanokv.scheduler.scheduler as scheduler_module
from nanokv import LLM, SamplingParams
from schedule_spy import record_decode_rows
from tiny_models import VOCAB
from triton_device import triton_ready

BS = 16
STORES = [dict(), dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8_e4m3"),
          dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
          dict(kv_cache_dtype="kivi", kv_quant_bits=2)]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 30) for _ in range(n)]


def run(model, prompts, params, rows_limit, monkeypatch, **options):
    """The outputs, and every scheduled chunk that went as decode rows (with the engine's
    cache), with rows of up to `rows_limit` tokens (0: none)."""
    monkeypatch.setattr(scheduler_module, "DECODE_ROW_CHUNK", rows_limit)
    options = {"skip_tokenizer_init": True, **options}
    llm = LLM(model, block_size=BS, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=44, **options)
    routed = record_decode_rows(llm.engine, monkeypatch)
    first = params[0] if isinstance(params, list) else params
    llm.generate(prompts[:1], first, use_tqdm=False)  # its blocks serve the others' prefix
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, routed, llm


@pytest.mark.parametrize("kv", STORES, ids=lambda kv: kv.get("kv_cache_dtype", "float32")
                         + str(kv.get("kv_quant_bits", "")))
def test_decode_rows_equal_the_prefill_path(tiny_model, kv, monkeypatch):
    shared = tokens(37, 0)  # 2 full blocks and 5 tokens
    # own tails of 1 to 13 tokens after the 32 cached slots, cut by the step budget of 44
    # tokens (decodes included) anywhere: short chunks from every slot of a block, some across
    # its end
    prompts = [shared] + [shared + tokens(n, i + 1) for i, n in enumerate((1, 2, 5, 9, 13))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, n=2)
    want, none, _ = run(tiny_model, prompts, params, 0, monkeypatch, **kv)
    got, routed, llm = run(tiny_model, prompts, params, 8, monkeypatch, **kv)
    assert not none and routed
    for chunk in routed:
        assert 1 < chunk.num_tokens <= 8 and chunk.start_slot > 0
        if llm.engine.kv_cache.quantizes_full_blocks:  # no block filled by its rows
            assert chunk.start_slot % BS + chunk.num_tokens < BS
    if kv.get("kv_cache_dtype") in (None, "int8", "fp8_e4m3"):  # per-token stores: any chunk
        assert any(c.start_slot % BS + c.num_tokens >= BS for c in routed)
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs):
            assert a.token_ids == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs):
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
                assert abs(x.logprob - y.logprob) < 1e-3


def test_no_decode_rows_under_a_kv_policy(tiny_llama, monkeypatch):
    shared = tokens(37, 0)
    prompts = [shared] + [shared + tokens(3, i + 1) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    _, routed, _ = run(tiny_llama, prompts, params, 8, monkeypatch, kv_policy="streaming",
                       kv_budget=200)
    assert routed == []
    _, routed, _ = run(tiny_llama, prompts, params, 8, monkeypatch)
    assert len(routed) == 4  # the same prompts without the policy: each one's tail after the
    # 32 cached slots as decode rows


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kv", STORES[:2] + STORES[3:], ids=lambda kv: kv.get(
    "kv_cache_dtype", "float32"))
def test_decode_rows_through_the_backends_cuda_takes(tiny_llama, backend, kv, monkeypatch):
    """The Triton kernels (in Triton's interpreter here) and the PyTorch backends: each over
    the rows' decode entries, against itself without them."""
    if backend == "triton" and not triton_ready():
        pytest.skip("the Triton backends run on CPU only under TRITON_INTERPRET=1 with triton")
    shared = tokens(37, 0)
    prompts = [shared] + [shared + tokens(n, i + 1) for i, n in enumerate((2, 9))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    options = dict(attention_backend=backend, **kv)
    want, _, _ = run(tiny_llama, prompts, params, 0, monkeypatch, **options)
    got, routed, llm = run(tiny_llama, prompts, params, 8, monkeypatch, **options)
    assert llm.engine.attention_backend.name == backend and routed
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_sampling_rules_at_a_decode_row_chunks_last_row(tiny_llama, monkeypatch):
    """The chunk's last row samples with the request's rules as the prefill path's does: a
    grammar's mask, penalties over the history, min_tokens' bans, a seeded draw."""
    from nanokv import StructuredOutputsParams

    shared = tokens(37, 0)
    prompts = [shared] + [shared + tokens(n, i + 1) for i, n in enumerate((1, 2, 3))]
    params = [SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(regex="[a-e ]{3,8}")),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.8,
                             presence_penalty=0.7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, min_tokens=3),
              SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True)]
    options = dict(skip_tokenizer_init=False)
    want, _, _ = run(tiny_llama, prompts, params, 0, monkeypatch, **options)
    got, routed, _ = run(tiny_llama, prompts, params, 8, monkeypatch, **options)
    assert len(routed) == 4  # every prompt's tail after the 32 cached slots
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
