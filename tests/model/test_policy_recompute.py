"""A KV policy's decisions do not depend on what shares the engine: a request compresses at its
point whatever its prefix-cache hits, one preempted and recomputed evicts as it did while it
decoded (and ends with the tokens it gets alone), and a policy failure on a step that samples
nothing still ends the request with its error. Oracle: the same request alone on a cold engine.
The shipped model: a trained one, whose greedy tokens are not near ties."""

import os

import pytest

from nanokv.config import EngineConfig
from nanokv.engine.llm_engine import LLMEngine
from nanokv.engine.policy_runner import PolicyRunner
from nanokv.policies.base import PolicyConfig
from nanokv.sampling_params import SamplingParams

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "models", "nanokv-tiny")
GREEDY = dict(temperature=0, ignore_eos=True)
OPTIONS = dict(block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)


def engine(**options) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(SHIPPED, **{**OPTIONS, **options}))


def prompt_of(n: int, mul: int, mod: int) -> list[int]:
    return [(i * mul) % mod + 5 for i in range(n)]


def run(eng: LLMEngine, *requests) -> None:
    for request in requests:
        eng.add_prepared(request)
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_invariants()


def first_compression(eng: LLMEngine, request) -> list:
    """Records (tokens computed, tokens evicted) when `request` is first compressed."""
    seen, compress = [], eng.policies.compress

    def recording(r):
        compress(r)
        if r is request and r.compressed and not seen:
            seen.append((r.num_computed_tokens, r.num_evicted_tokens))
    eng.policies.compress = recording
    return seen


@pytest.mark.parametrize("compress_after", [32, 48])  # a hit of 32 or 48 prompt tokens ends on it
def test_prefix_hits_ending_on_the_compression_point_do_not_skip_it(compress_after):
    prompt = prompt_of(64, 37, 900)
    results = []
    for warm in (False, True):
        eng = engine(num_kv_blocks=64)
        if warm:  # a plain request caches every full block of the prompt
            run(eng, eng.make_request(prompt, SamplingParams(max_tokens=1, **GREEDY)))
        request = eng.make_request(prompt, SamplingParams(max_tokens=6, **GREEDY),
                                   kv_policy=PolicyConfig("knorm", budget=16),
                                   compress_after=compress_after)
        point = first_compression(eng, request)
        run(eng, request)
        results.append((point, request.output_token_ids))
        if warm:
            assert request.num_cached_tokens == compress_after - 16  # hits stop short of it
    assert results[0][0] == [(compress_after, compress_after - 16)]
    assert results[1] == results[0]


@pytest.mark.parametrize("name,options", [("paged_eviction", {}),
                                          ("streaming", {"slide": "block"}), ("h2o", {})])
def test_a_recompute_evicts_as_its_decode_did(name, options):
    """B's growth preempts A once; A comes back, is compressed at its prompt's end again, and
    re-prefills its outputs a block at a time, evicting at each block as its decode did: its
    cache stays within [budget, budget + B - 1] and its tokens equal A alone."""
    policy = PolicyConfig(name, budget=32, options=options)
    a_prompt, b_prompt = prompt_of(64, 7, 300), prompt_of(100, 13, 500)
    a_params = SamplingParams(max_tokens=180, **GREEDY)
    outcomes = []
    for crowded in (False, True):
        eng = engine(num_kv_blocks=17 if crowded else 200,
                     enable_prefix_caching=False)
        if crowded:
            eng.add_prepared(eng.make_request(b_prompt, SamplingParams(max_tokens=150,
                                                                       **GREEDY)))
            eng.step()
        a = eng.make_request(a_prompt, a_params, kv_policy=policy)
        eng.add_prepared(a)
        most = 0
        while eng.has_unfinished_requests():
            eng.step()
            if a.compressed and not a.is_finished:
                most = max(most, a.num_cached_slots)
        eng.check_invariants()
        outcomes.append((a.num_preemptions, most, a.output_token_ids))
    (alone_preempted, alone_most, alone_tokens), (preempted, most, tokens) = outcomes
    assert alone_preempted == 0 and preempted >= 1
    assert alone_most <= 32 + 15 and most <= 32 + 15
    assert tokens == alone_tokens


def test_a_policy_failure_on_a_step_that_samples_nothing_ends_the_request(monkeypatch):
    compress = PolicyRunner.compress

    def failing(self, request):
        if request.request_id == "bad":
            raise ValueError("simulated policy failure")
        return compress(self, request)
    monkeypatch.setattr(PolicyRunner, "compress", failing)
    eng = engine(num_kv_blocks=64)
    params = SamplingParams(max_tokens=4, **GREEDY)
    prompt = prompt_of(64, 37, 900)
    # compress_after inside the prompt: the compaction runs after a chunk that samples nothing
    eng.add_prepared(eng.make_request(prompt, params, request_id="bad",
                                      kv_policy=PolicyConfig("snapkv", budget=40),
                                      compress_after=32))
    eng.add_prepared(eng.make_request(prompt[::-1], params, request_id="good"))
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = (out.finish_reason, out.error)
    assert finished["good"] == ("length", None)
    assert finished["bad"][0] == "abort" and "simulated policy failure" in finished["bad"][1]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
