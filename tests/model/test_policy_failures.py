"""A KV policy that raises on one request: that request is aborted (its blocks freed, its output
finished with the error), the others finish exactly as they would alone, and the engine keeps
serving. At the prompt's compaction, at a decode eviction, and in pool pressure."""

import pytest

from nanokv import LLM, SamplingParams
from nanokv.engine.policy_runner import PolicyRunner
from nanokv.policies.base import PolicyConfig
from test_policies_engine import prompt_of

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BAD = "bad request"


def assert_all_free(engine):
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def fail_for(monkeypatch, method, request_id=BAD):
    """PolicyRunner.`method` raises for `request_id`'s request (the first argument after self
    that is a request, or any of a list of them)."""
    original = getattr(PolicyRunner, method)

    def wrapped(self, *args, **kwargs):
        first = args[0]
        requests = first if isinstance(first, list) else [first]
        if any(getattr(r, "request_id", None) == request_id for r in requests):
            raise ValueError(f"simulated failure in {method}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PolicyRunner, method, wrapped)


def run(llm, prompts, policy, bad_index=None):
    engine = llm.engine
    requests = [engine.make_request(p, PARAMS, kv_policy=policy,
                                    request_id=BAD if i == bad_index else f"r{i}")
                for i, p in enumerate(prompts)]
    return llm.generate_requests(requests, use_tqdm=False)


@pytest.mark.parametrize("method,policy", [
    ("compress", PolicyConfig("snapkv", budget=40)),  # the prompt's compaction
    ("_decode_evict", PolicyConfig("paged_eviction", budget=40)),  # a decode eviction
])
def test_a_failing_request_is_aborted_and_the_others_finish(tiny_llama, monkeypatch, method,
                                                             policy):
    prompts = [prompt_of(70, seed=i) for i in range(3)]
    llm = LLM(tiny_llama, block_size=16, max_model_len=256)
    expected = run(llm, prompts, policy)  # nothing fails
    assert all(len(o.token_ids) == 24 and o.error is None for o in expected)
    fail_for(monkeypatch, method)
    outs = run(llm, prompts, policy, bad_index=1)
    bad = outs[1]
    assert bad.finished and bad.finish_reason == "abort"
    assert "simulated failure" in bad.error and "ValueError" in bad.error
    for i in (0, 2):
        assert outs[i].error is None and outs[i].token_ids == expected[i].token_ids
    assert_all_free(llm.engine)
    monkeypatch.undo()
    again = run(llm, prompts[:1], policy)  # the engine keeps serving
    assert again[0].token_ids == expected[0].token_ids
    assert_all_free(llm.engine)


def test_a_failing_pool_pressure_round_aborts_its_candidates(tiny_llama, monkeypatch):
    """Pool pressure scores the candidates together: a failure aborts them; a request without a
    pool-pressure policy finishes."""
    prompts = [prompt_of(60, seed=20 + i) for i in range(5)]
    pressure = PolicyConfig("paged_eviction", options={"eviction_ratio": 0.2,
                                                       "importance_threshold": 0.1})
    llm = LLM(tiny_llama, block_size=16, max_model_len=256, num_kv_blocks=30)
    engine = llm.engine
    calls = []

    def boom(self, request, view):
        calls.append(request.request_id)
        raise ValueError("simulated failure in pool pressure")

    monkeypatch.setattr(PolicyRunner, "_block_scores", boom)
    plain = engine.make_request(prompt_of(40, seed=30), PARAMS, request_id="plain")
    requests = [engine.make_request(p, PARAMS, kv_policy=pressure, request_id=f"p{i}")
                for i, p in enumerate(prompts)] + [plain]
    outs = llm.generate_requests(requests, use_tqdm=False)
    assert calls  # pressure was reached
    aborted = [o for o in outs if o.finish_reason == "abort"]
    assert aborted and all("pool pressure" in o.error for o in aborted)
    assert {o.request_id for o in aborted} <= {f"p{i}" for i in range(5)}
    assert outs[-1].error is None and len(outs[-1].token_ids) == 24
    assert_all_free(engine)
