"""H2O in decode: each time the newest block fills, it re-selects with the attention of the
queries since its last selection. Checked against Hugging Face with the cache each layer and KV
head really held at every step, rebuilt from the engine's selections."""

import pytest

from nanokv import LLM, SamplingParams
from policy_oracles import hf_greedy_with_visibility, prompt_of, record_selections
from tiny_models import load_hf

BS = 16


@pytest.mark.parametrize("per_head", [True, False])
def test_h2o_reselects_in_decode_like_hf_with_the_same_caches(tiny_qwen3, monkeypatch, per_head):
    events = record_selections(monkeypatch)
    prompt, steps, budget = prompt_of(60, 3), 40, 32
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=BS, max_model_len=256,
              kv_policy="h2o", kv_budget=budget, kv_policy_options={"per_head": per_head})
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for r in engine.scheduler.running:
            if r.compressed and r.num_output_tokens > 1:
                assert budget <= r.num_cached_slots <= budget + BS - 1
                assert len(r.block_table) <= -(-budget // BS) + 1
        engine.check_invariants()
    assert len(events) >= 3  # after the prompt, then while decoding
    assert [e[0] for e in events[1:]] == sorted(e[0] for e in events[1:])
    hf = load_hf(tiny_qwen3)
    assert out.token_ids == hf_greedy_with_visibility(hf, prompt, events, steps)
    # control: without the decode re-selections HF decodes something else
    assert out.token_ids != hf_greedy_with_visibility(hf, prompt, events[:1], steps)
