"""KV policies inside the engine: against masked Hugging Face attention, block invariants,
memory really freed, prefix caching kept correct."""

import random

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.policies.base import PolicyConfig
from tiny_models import VOCAB, hf_greedy, load_hf

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 30) for _ in range(n)]


def masked_hf_greedy(hf, prompt: list[int], kept_prompt: set[int], steps: int) -> list[int]:
    """Greedy decode where generated tokens see only the kept prompt positions (and each
    other); prompt tokens attend causally as usual. RoPE positions are the true positions."""
    tokens = list(prompt)
    n = len(prompt)
    for _ in range(steps):
        total = len(tokens)
        allowed = torch.ones(total, total).tril().bool()
        for q in range(n - 1, total):  # queries after the prefill see kept prompt slots only
            if q >= n:
                for k in range(n):
                    allowed[q, k] = k in kept_prompt
        mask = torch.zeros(1, 1, total, total).masked_fill(~allowed, float("-inf"))
        with torch.no_grad():
            logits = hf(torch.tensor([tokens]), attention_mask=mask).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[n:]


def test_streaming_matches_masked_hf(tiny_llama):
    prompt = prompt_of(60)
    budget, sinks = 24, 4
    llm = LLM(tiny_llama, block_size=16, max_model_len=256, kv_policy="streaming",
              kv_budget=budget, kv_policy_options={"n_sink": sinks})
    out = llm.generate([prompt], GREEDY)[0]
    kept = set(range(sinks)) | set(range(len(prompt) - (budget - sinks), len(prompt)))
    # the prompt's last token is computed with the full cache, so the first output is HF's
    hf = load_hf(tiny_llama)
    expected = masked_hf_greedy(hf, prompt, kept, 10)
    assert out.token_ids == expected
    assert out.token_ids != hf_greedy(hf, prompt, 10)[0]  # eviction really changed attention
    assert out.kv_slots_at_finish == budget + 9  # 10 outputs, the last one never cached
    llm.engine.check_invariants()


@pytest.mark.parametrize("name,options", [
    ("streaming", {}), ("knorm", {}), ("h2o", {}), ("snapkv", {"window": 8}),
    ("paged_eviction", {}), ("kvcrush", {"base": "snapkv", "base_options": {"window": 8}}),
])
def test_budget_above_length_changes_nothing(tiny_qwen3, name, options):
    prompt = prompt_of(50, seed=1)
    expected = hf_greedy(load_hf(tiny_qwen3), prompt, 10)[0]
    llm = LLM(tiny_qwen3, block_size=16, max_model_len=256, kv_policy=name, kv_budget=4000,
              kv_policy_options=options)
    assert llm.generate([prompt], GREEDY)[0].token_ids == expected


@pytest.mark.parametrize("name,options", [
    ("snapkv", {"window": 8}), ("h2o", {}), ("knorm", {}),
    ("kvcrush", {"base": "snapkv", "base_options": {"window": 8}, "kvcrush_ratio": 0.25}),
])
def test_compression_frees_blocks_at_once(tiny_qwen3, name, options):
    llm = LLM(tiny_qwen3, block_size=16, max_model_len=512, kv_policy=name,
              kv_compression_ratio=0.75, kv_policy_options=options)
    engine = llm.engine
    rid = engine.add_request(prompt_of(256, seed=2), SamplingParams(temperature=0, max_tokens=4,
                                                                    ignore_eos=True))
    engine.step()  # the whole prompt in one step, then compression
    request = engine.scheduler.requests[rid]
    assert request.compressed and request.num_cached_slots == 64
    assert len(request.block_table) == 4  # 64 slots in 16-token blocks
    assert engine.block_manager.num_used_blocks == 4
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_paged_eviction_decode_invariants(tiny_llama):
    B, C = 16, 48
    llm = LLM(tiny_llama, block_size=B, max_model_len=512, kv_policy="paged_eviction",
              kv_budget=C)
    engine = llm.engine
    rid = engine.add_request(prompt_of(100, seed=3), SamplingParams(temperature=0,
                                                                    max_tokens=120,
                                                                    ignore_eos=True))
    first_block = None
    seen_eviction = False
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        request = engine.scheduler.requests.get(rid)
        if request is None:
            break
        if first_block is None:
            first_block = request.block_table[0]
            assert request.num_cached_slots == C  # prefill cut to exactly C
        assert request.block_table[0] == first_block  # block 0 survives
        assert C <= request.num_cached_slots <= C + B - 1
        assert len(request.block_table) <= -(-C // B) + 1
        seen_eviction |= request.num_evicted_tokens > 100 - C
    assert seen_eviction
    assert engine.block_manager.stats.evicted_blocks["policy"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_shared_prefix_survives_compression_of_one_sharer(tiny_llama):
    """Copy-on-write: a request that compresses never corrupts blocks another one reads."""
    prefix = prompt_of(64, seed=4)
    plain = prefix + prompt_of(8, seed=5)
    hf = load_hf(tiny_llama)
    expected = hf_greedy(hf, plain, 10)[0]
    llm = LLM(tiny_llama, block_size=16, max_model_len=256)
    engine = llm.engine
    policy = PolicyConfig("knorm", budget=20)
    a = engine.make_request(prefix + prompt_of(8, seed=6), GREEDY, kv_policy=policy)
    b = engine.make_request(plain, GREEDY)
    outs = llm.generate_requests([a, b])
    assert outs[1].num_cached_tokens == 64  # b shared a's prefix blocks in the same step
    assert outs[1].token_ids == expected
    assert outs[0].kv_slots_at_finish == 20 + 9
    # the prefix is still served from cache, intact
    again = llm.generate([plain], GREEDY)[0]
    assert again.num_cached_tokens == 64 and again.token_ids == expected


def test_pool_pressure_mode_evicts_instead_of_preempting(tiny_llama):
    prompts = [prompt_of(60, seed=10 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    base = LLM(tiny_llama, block_size=16, max_model_len=256, num_kv_blocks=30)
    base.generate(prompts, params)
    assert base.engine.scheduler.num_preemptions > 0
    llm = LLM(tiny_llama, block_size=16, max_model_len=256, num_kv_blocks=30,
              kv_policy="paged_eviction",
              kv_policy_options={"eviction_ratio": 0.2, "importance_threshold": 0.1})
    outs = llm.generate(prompts, params)
    engine = llm.engine
    assert all(len(o.token_ids) == 60 for o in outs)
    assert engine.block_manager.stats.evicted_blocks["policy"] > 0
    assert engine.scheduler.num_preemptions < base.engine.scheduler.num_preemptions
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_policy_options_validated(tiny_llama):
    with pytest.raises(ValueError, match="unknown"):
        LLM(tiny_llama, kv_policy="no-such-policy", kv_budget=10)
    with pytest.raises(ValueError, match="need kv_policy"):
        LLM(tiny_llama, kv_budget=10)
    with pytest.raises(ValueError, match="window"):
        LLM(tiny_llama, kv_policy="snapkv", kv_budget=64, kv_policy_options={"window": -1})


@pytest.mark.parametrize("name,options", [("snapkv", {"window": 32}), ("h2o", {})])
def test_prefix_hit_stops_before_the_queries_a_policy_reads(tiny_llama, name, options):
    """A plain request caches a prompt; the same prompt under an attention-reading policy takes
    only the cached blocks before its observation window (it must compute those queries), and
    decodes as it does with prefix caching off."""
    prompt = prompt_of(100, seed=21)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_llama, block_size=16, max_model_len=256)
    llm.generate([prompt], params)  # caches the prompt's full blocks
    engine = llm.engine
    engine.add_prepared(engine.make_request(
        prompt, params, kv_policy=PolicyConfig(name, budget=48, options=options)))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    ref = LLM(tiny_llama, block_size=16, max_model_len=256, enable_prefix_caching=False,
              kv_policy=name, kv_budget=48, kv_policy_options=options).generate([prompt], params)
    window_start = 100 - options.get("window", 100)  # h2o observes every prompt query
    assert outs[0].num_cached_tokens == (window_start // 16) * 16
    assert outs[0].token_ids == ref[0].token_ids
    engine.check_invariants()


def test_delayed_compression_scores_with_the_last_window(tiny_llama, monkeypatch):
    """A compaction that must wait (copy-on-write finds no free block in a full pool) runs a step
    later, when more queries have been captured than the window: it scores with the LAST W
    queries over all cached slots, as the policy contract says, instead of failing."""
    import nanokv.engine.policy_runner as policy_runner

    real = policy_runner.plan_compression
    seen = []

    def spy(policy, layers, table, num_slots, **kw):
        seen.append((num_slots, [q.shape[0] for q in kw["q_windows"]]))
        return real(policy, layers, table, num_slots, **kw)

    monkeypatch.setattr(policy_runner, "plan_compression", spy)
    prefix = prompt_of(37, 0)
    # (a waiting request starts only when its whole prompt fits: these sizes still fill the pool
    # while a compaction needs its copies)
    prompts = [prefix + prompt_of(n, i + 1) for i, n in enumerate((20, 30, 40, 50))]
    llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=16, num_kv_blocks=9,
              max_num_batched_tokens=64, max_model_len=128, kv_policy="snapkv", kv_budget=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert seen and all(rows == [min(32, n)] * len(rows) for n, rows in seen)
    lengths = {len(p) for p in prompts}
    assert any(n not in lengths for n, _ in seen)  # some compaction ran after its prompt's end
    llm.engine.check_invariants()


def _peak_running(llm, prompts, params) -> int:
    engine, peak = llm.engine, 0
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
        engine.check_invariants()
    return peak


def test_pool_pressure_admits_a_prompt_larger_than_the_headroom(tiny_llama):
    """60 blocks of 16, eviction at 80% (12 blocks of headroom), prompts of 16 blocks: the full
    cache runs 3 at once, and so did pool pressure while it only evicted down to 80%. Now it
    frees the least important blocks of the running requests until the waiting prompt fits:
    more run at once, and nobody is preempted."""
    prompts = [prompt_of(250, seed=40 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    opts = dict(block_size=16, max_model_len=512, num_kv_blocks=60, skip_tokenizer_init=True,
                max_num_batched_tokens=512)
    full = LLM(tiny_llama, **opts)
    full_peak = _peak_running(full, prompts, params)
    llm = LLM(tiny_llama, **opts, kv_policy="paged_eviction",
              kv_policy_options={"eviction_ratio": 0.2, "importance_threshold": 0.1})
    peak = _peak_running(llm, prompts, params)
    engine = llm.engine
    assert full_peak == 3
    assert peak > full_peak
    assert engine.scheduler.num_preemptions == 0
    assert engine.block_manager.stats.evicted_blocks["policy"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_blocks_to_admit_counts_prefix_hits(tiny_llama):
    """What the first waiting request needs: its prompt's blocks (and one more token's) less
    the cached prefix it will take, plus the cached blocks it takes out of the free queue."""
    llm = LLM(tiny_llama, block_size=16, max_model_len=256, skip_tokenizer_init=True)
    engine = llm.engine
    prompt = prompt_of(100, seed=5)
    assert engine.scheduler.blocks_to_admit() == 0  # nothing waits
    engine.add_request(prompt, GREEDY)
    assert engine.scheduler.blocks_to_admit() == 7  # ceil(101 / 16)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(prompt + [3, 4], GREEDY)  # 6 full cached blocks, now free, are hits
    assert engine.scheduler.blocks_to_admit() == 1 + 6
