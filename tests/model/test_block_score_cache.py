"""Block-wise policies (PagedEviction) keep each full block's scores once computed
(`request.block_scores`, by block id): at every decode eviction and pool-pressure round the
scores the engine uses equal scores computed from scratch over every block (the reference:
`gather_request_kv` then `block_scores`, layer by layer), over the float pool and a quantized
store, with blocks freed and re-used, preemption and prefix hits on the way."""

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.engine.policy_runner import PolicyRunner
from nanokv.policies.base import LayerKV
from nanokv.policies.compaction import gather_request_kv
from policy_oracles import prompt_of


def check_against_scratch(monkeypatch) -> list[int]:
    """Wrap `PolicyRunner._block_scores`: each call's result must equal the from-scratch scores.
    Returns, per call, how many full blocks' scores were already kept before it."""
    reused = []
    real = PolicyRunner._block_scores

    def checked(self, request, view):
        before = sum(1 for b in request.block_table if b in request.block_scores)
        got = real(self, request, view)
        n = request.num_cached_slots
        ref = torch.stack([request.kv_policy.block_scores(
            LayerKV(*gather_request_kv(k, v, view.block_table, n))) for k, v in view.layers])
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        reused.append(before)
        return got

    monkeypatch.setattr(PolicyRunner, "_block_scores", checked)
    return reused


STORES = [("auto", {}), ("kvquant", {"kv_quant_bits": 4})]


@pytest.mark.parametrize("dtype,store_options", STORES)
def test_decode_evictions_use_kept_scores(tiny_qwen3, monkeypatch, dtype, store_options):
    reused = check_against_scratch(monkeypatch)
    prompts = [prompt_of(70 + 10 * i, 30 + i) for i in range(3)]
    prompts.append(prompts[0][:64] + prompt_of(20, 40))  # a prefix hit on 4 shared blocks
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=16, max_model_len=256,
              kv_cache_dtype=dtype, kv_policy="paged_eviction", kv_budget=48, **store_options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert all(len(o.token_ids) == 90 for o in outs)
    assert engine.policies.stats.decode_evicted_blocks >= 3 * len(prompts)
    assert len(reused) >= engine.policies.stats.decode_evicted_blocks
    assert sum(r > 0 for r in reused) >= len(reused) // 2  # most rounds reuse kept scores
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("dtype,store_options", STORES)
def test_pool_pressure_uses_kept_scores(tiny_qwen3, monkeypatch, dtype, store_options):
    reused = check_against_scratch(monkeypatch)
    prompts = [prompt_of(60, seed=10 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=16, max_model_len=256,
              num_kv_blocks=30, kv_cache_dtype=dtype, kv_policy="paged_eviction",
              kv_policy_options={"eviction_ratio": 0.2, "importance_threshold": 0.1},
              **store_options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert all(len(o.token_ids) == 60 for o in outs)
    assert engine.policies.stats.pressure_evicted_blocks > 0
    assert sum(r > 0 for r in reused) > 0
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_clears_kept_scores(tiny_qwen3, monkeypatch):
    """Pool-pressure mode (no compaction ever) in a pool too small for every request: preempted
    requests come back on re-used block ids with other content, and their scores are computed
    again."""
    reused = check_against_scratch(monkeypatch)
    prompts = [prompt_of(30, seed=50 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=16, max_model_len=256,
              num_kv_blocks=16, kv_policy="paged_eviction",
              kv_policy_options={"eviction_ratio": 0.2, "importance_threshold": 0.1})
    engine = llm.engine
    preempt, held = engine.scheduler._preempt, []

    def spy(request):  # the preempted request's kept scores are gone with its blocks
        held.append(len(request.block_scores))
        preempt(request)
        assert request.block_scores == {}

    monkeypatch.setattr(engine.scheduler, "_preempt", spy)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == 120 for o in outs)
    assert engine.scheduler.num_preemptions > 0 and max(held) > 0
    assert engine.policies.stats.pressure_evicted_blocks > 0 and max(reused) > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_compaction_clears_kept_scores(tiny_qwen3, monkeypatch):
    """A compaction re-writes blocks in place (same ids, other tokens): scores kept before it
    are dropped."""
    reused = check_against_scratch(monkeypatch)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=16, max_model_len=256,
              kv_policy="paged_eviction", kv_budget=48)
    engine = llm.engine
    rid = engine.add_request(prompt_of(90, 7), SamplingParams(temperature=0, max_tokens=80,
                                                              ignore_eos=True))
    request = engine.scheduler.requests[rid]
    while engine.policies.stats.decode_evicted_blocks < 2:
        engine.step()
    assert request.block_scores  # full blocks' scores kept
    runner = engine.policies
    assert runner._compact(request, request.kv_policy, 32, None)  # compact to 2 blocks
    assert request.num_cached_slots == 32
    runner._block_scores(request, engine.kv_cache.policy_view(request))  # checked vs scratch
    assert reused[-1] == 0
