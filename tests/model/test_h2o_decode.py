"""H2O in decode: each time the newest block fills, it re-selects with the attention of the
queries since its last selection. Checked against Hugging Face with the cache each layer and KV
head really held at every step, rebuilt from the engine's selections."""

import random

import pytest
import torch

import nanokv.engine.kv_policy as kv_policy_module
from nanokv import LLM, SamplingParams
from tiny_models import VOCAB, load_hf

BS = 16


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 30) for _ in range(n)]


def record_selections(monkeypatch) -> list:
    """(tokens computed when it ran, kept slots per layer) for every compaction."""
    events = []
    real_plan = kv_policy_module.plan_compression
    real_compact = kv_policy_module.PolicyRunner._compact
    current = {}

    def plan_spy(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        current["plan"] = plan
        return plan

    def compact_spy(self, request, policy, budget, q_windows):
        current.clear()
        done = real_compact(self, request, policy, budget, q_windows)
        if done and "plan" in current and current["plan"].num_evicted:
            events.append((request.num_computed_tokens, current["plan"].kept))
        return done

    monkeypatch.setattr(kv_policy_module, "plan_compression", plan_spy)
    monkeypatch.setattr(kv_policy_module.PolicyRunner, "_compact", compact_spy)
    return events


def visibility(total: int, events, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """[L, Hkv, total, total] bool: which positions the query at each position saw, replaying
    the cache: a token's K/V is written, it attends, then selections due at that length apply."""
    seen = torch.zeros(num_layers, num_kv_heads, total, total, dtype=torch.bool)
    cache = [[[] for _ in range(num_kv_heads)] for _ in range(num_layers)]
    due = {}
    for computed, kept in events:
        due.setdefault(computed, []).append(kept)
    for p in range(total):
        for layer in range(num_layers):
            for h in range(num_kv_heads):
                cache[layer][h].append(p)
                seen[layer, h, p, cache[layer][h]] = True
        for kept in due.get(p + 1, []):
            for layer in range(num_layers):
                for h in range(num_kv_heads):
                    idx = kept[layer] if kept[layer].dim() == 1 else kept[layer][h]
                    cache[layer][h] = [cache[layer][h][i] for i in idx.tolist()]
    return seen


def hf_greedy_with_visibility(hf, prompt, events, steps) -> list[int]:
    cfg = hf.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    tokens = list(prompt)
    for _ in range(steps):
        total = len(tokens)
        seen = visibility(total, events, cfg.num_hidden_layers, cfg.num_key_value_heads)
        hooks = []
        for layer, block in enumerate(hf.model.layers):
            allowed = seen[layer].repeat_interleave(group, dim=0)  # [Hq, total, total]
            mask = torch.zeros(1, *allowed.shape).masked_fill(~allowed[None], float("-inf"))

            def pre(module, args, kwargs, mask=mask):
                kwargs["attention_mask"] = mask
                return args, kwargs
            hooks.append(block.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
        try:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1]
        finally:
            for h in hooks:
                h.remove()
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


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
