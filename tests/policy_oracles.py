"""Oracles shared by the KV-policy engine tests: seeded prompts, a spy on the engine's
selections, and Hugging Face greedy decoding with the cache each layer and KV head really held
(a different 4-D attention mask per layer, through forward pre-hooks)."""

import random

import torch

import nanokv.engine.policy_runner as kv_policy_module
from tiny_models import VOCAB


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 30) for _ in range(n)]


def spy_plans(monkeypatch) -> list:
    """Every CompressionPlan the engine's policy runner makes, in order."""
    plans = []
    real = kv_policy_module.plan_compression

    def spy(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(kv_policy_module, "plan_compression", spy)
    return plans


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

    def compact_spy(self, request, policy, budget, q_windows, **kwargs):
        current.clear()
        done = real_compact(self, request, policy, budget, q_windows, **kwargs)
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


def run_checked(engine, check=None) -> dict:
    """Step the engine to the end; after every step check the block accounting and call
    check(running requests). Returns the finished outputs by request id."""
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.check_invariants()
        if check is not None:
            check(engine.scheduler.running)
    return outs
