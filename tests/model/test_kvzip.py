"""KVzip in the engine: its reconstruction scores against Hugging Face's own attention
probabilities, the cache the engine keeps against what the policy chose (and against Hugging Face
decoding with exactly that cache), scratch blocks returned, options checked."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import nanokv.engine.policy_runner as runner_module
from nanokv import LLM, SamplingParams
from nanokv.policies import make_policy
from nanokv.policies.kvzip import chunk_scores, reconstruction_chunks
from nanokv.policies.scoring import edge_mask, select_with_protected
from policy_oracles import hf_greedy_with_visibility, prompt_of, record_selections, run_checked

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def capture_scores(monkeypatch) -> list:
    """Every reconstruction-score list the engine computes (per layer [Hkv, n])."""
    seen = []
    real = runner_module.PolicyRunner._reconstruction_scores

    def spy(self, request, policy):
        scores = real(self, request, policy)
        seen.append((list(request.token_ids_range(0, request.num_cached_slots)), policy, scores))
        return scores

    monkeypatch.setattr(runner_module.PolicyRunner, "_reconstruction_scores", spy)
    return seen


def hf_reference_scores(path: str, context: list[int], policy, max_tokens: int) -> list:
    """KVzip's scores from HF eager attention: for each chunk, one causal forward over
    context[:seen] + the chunk's tokens; the chunk rows' probabilities restricted to sinks + the
    chunk's context slots + the chunk's own tokens, renormalised, max over rows and GQA group."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(path)
    cfg = hf.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    n = len(context)
    out = [torch.zeros(cfg.num_key_value_heads, n) for _ in range(cfg.num_hidden_layers)]
    chunks = policy.chunks(context, lambda text: tok.encode(text, add_special_tokens=False),
                           max_tokens)
    for chunk in chunks:
        seen = n if policy.context == "full" else chunk.end
        ids = context[:seen] + chunk.token_ids
        with torch.no_grad():
            attns = hf(torch.tensor([ids]), output_attentions=True).attentions
        t = len(chunk.token_ids)
        sink = min(policy.n_sink, chunk.start)
        cols = (list(range(sink)) + list(range(chunk.start, chunk.end))
                + list(range(seen, seen + t)))
        for layer, a in enumerate(attns):
            p = a[0, :, seen:, cols]  # [Hq, T, S]
            p = p / p.sum(-1, keepdim=True)
            p = p[..., sink:sink + chunk.end - chunk.start]  # [Hq, T, e - s]
            p = p.reshape(cfg.num_key_value_heads, group, t, -1).amax(dim=(1, 2))
            out[layer][:, chunk.start:chunk.end] = p
    return out


@pytest.mark.parametrize("context", ["full", "prefix"])
def test_scores_equal_hf_attention(tiny_model, monkeypatch, context):
    captured = capture_scores(monkeypatch)
    prompt = prompt_of(70, seed=4)
    # chunks of 24 context tokens over blocks of 16: several chunks, partial blocks copied
    options = {"chunk_size": 24, "context": context}
    llm = LLM(tiny_model, block_size=16, max_model_len=256, kv_policy="kvzip", kv_budget=30,
              kv_policy_options=options)
    llm.generate([prompt], GREEDY)
    (ctx, policy, scores), = captured
    assert ctx == prompt and len(policy.chunks(ctx, llm.engine._encode_plain, 4096)) == 3
    expected = hf_reference_scores(tiny_model, prompt, policy, 4096)
    for got, want in zip(scores, expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert llm.engine.policies.stats.reconstruction_tokens == sum(
        len(c.token_ids) for c in policy.chunks(ctx, llm.engine._encode_plain, 4096))


def test_chunks_fit_the_step_budget(tiny_qwen3, monkeypatch):
    captured = capture_scores(monkeypatch)
    prompt = prompt_of(90, seed=5)
    # a step budget of 100 tokens (the repeat prompts take about 70 with this tokenizer): every
    # chunk of the pass (prompt + suffix + context) fits it
    llm = LLM(tiny_qwen3, block_size=16, max_model_len=256, max_num_batched_tokens=100,
              kv_policy="kvzip", kv_budget=30)
    llm.generate([prompt], GREEDY)
    (ctx, policy, scores), = captured
    chunks = policy.chunks(ctx, llm.engine._encode_plain, 100)
    assert len(chunks) > 2 and max(len(c.token_ids) for c in chunks) <= 100
    assert [c.start for c in chunks[1:]] == [c.end for c in chunks[:-1]] and chunks[-1].end == 90
    expected = hf_reference_scores(tiny_qwen3, prompt, policy, 100)
    for got, want in zip(scores, expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("per_head,layer_budgets", [(True, "uniform"), (False, "uniform"),
                                                     (True, "scores")])
def test_engine_keeps_what_kvzip_chose(tiny_model, monkeypatch, per_head, layer_budgets):
    captured = capture_scores(monkeypatch)
    events = record_selections(monkeypatch)
    prompt = prompt_of(75, seed=6)
    budget = 28
    llm = LLM(tiny_model, block_size=16, max_model_len=256, kv_policy="kvzip", kv_budget=budget,
              kv_policy_options={"chunk_size": 32, "per_head": per_head, "window": 3,
                                 "layer_budgets": layer_budgets})
    engine = llm.engine
    engine.add_request(prompt, GREEDY, request_id="a")
    free_before = engine.block_manager.num_free_blocks
    outs = run_checked(engine)
    (_, policy, scores), = captured
    (computed, kept), = events
    assert computed == len(prompt)
    protected = edge_mask(len(prompt), 4, 3)
    budgets = policy.scored_layer_budgets(scores, len(prompt))
    assert sum(budgets) == budget * len(scores)
    if layer_budgets == "uniform":
        assert budgets == [budget] * len(scores)
    else:  # the L x Hkv x (C - protected) best scores of the cache, counted per layer
        free = torch.stack(scores).masked_fill(protected, float("-inf"))  # [L, Hkv, n]
        k = (budget - 7) * free.shape[0] * free.shape[1]
        threshold = free.flatten().sort(descending=True).values[k - 1]
        counts = [int((f >= threshold).sum()) / f.shape[0] + 7 for f in free]
        assert all(abs(b - c) <= 1 for b, c in zip(budgets, counts, strict=True))
        assert len(set(budgets)) > 1  # these scores do spread the layers apart
    for layer, layer_scores in enumerate(scores):
        ranked = layer_scores if per_head else layer_scores.mean(0)
        assert torch.equal(kept[layer], select_with_protected(ranked, budgets[layer], protected))
    # the greedy tokens are HF's with each layer and head seeing exactly the kept slots
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert outs["a"].token_ids == hf_greedy_with_visibility(hf, prompt, events, 6)
    assert outs["a"].kv_slots_at_finish == budget + 5  # the mean over layers
    # scratch blocks of the pass went back: everything is free again
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert free_before <= engine.block_manager.num_blocks


def test_a_pass_short_of_scratch_blocks_gets_them_from_newer_requests(tiny_qwen3):
    """Three requests fill a 16-block pool before their compression point; each pass needs 8-9
    scratch blocks and finds too few. The oldest waiting pass gets its blocks at the next step
    (the scheduler keeps them free, preempting newer requests, never older ones), so a request
    stays uncompressed past its point for more than one step only while an older request holds
    the blocks. Blocks all back at the end."""
    llm = LLM(tiny_qwen3, block_size=16, max_model_len=256, kv_policy="kvzip", kv_budget=30,
              num_kv_blocks=16, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for j in range(3):
        engine.add_request(prompt_of(75, seed=j), params, request_id=str(j))
    waited, late = {}, []
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        running = engine.scheduler.running
        for i, r in enumerate(running):
            if r.num_computed_tokens >= r.compress_point and not r.compressed:
                waited[r.request_id] = waited.get(r.request_id, 0) + 1
                if waited[r.request_id] > 1 and i == 0:
                    late.append((r.request_id, r.num_computed_tokens))
    assert waited, "no pass had to wait for scratch blocks: the scenario lost its point"
    assert not late, late  # the oldest running request never waited a second step
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_pure_scores_and_chunks():
    ctx = list(range(10, 30))
    chunks = reconstruction_chunks(ctx, 8, [1, 2], [3], [4], prev_tail=2)
    assert [(c.start, c.end) for c in chunks] == [(0, 8), (8, 16), (16, 20)]
    assert chunks[0].token_ids == [1, 2, 4] + ctx[:8]
    assert chunks[1].token_ids == [3, 16, 17, 4] + ctx[8:16]
    # one query head per KV head, one query, keys = sink + chunk + itself: plain softmax
    q = torch.randn(1, 2, 4)
    keys = torch.randn(6, 2, 4)
    own = torch.randn(1, 2, 4)
    got = chunk_scores(q, keys, own, 2, 5, n_sink=1, scale=0.5)  # [2, 3]
    subset = torch.cat([keys[:1], keys[2:5], own])  # [5, 2, 4]
    p = ((q[0, :, None, :] * subset.transpose(0, 1)).sum(-1) * 0.5).softmax(-1)  # [2, 5]
    torch.testing.assert_close(got, p[:, 1:4])
    # queries taken a few rows at a time give the same scores (GQA group of 2, 7 queries)
    q, own = torch.randn(7, 4, 4), torch.randn(7, 2, 4)
    whole = chunk_scores(q, keys, own, 1, 6, n_sink=2, scale=0.5)
    torch.testing.assert_close(chunk_scores(q, keys, own, 1, 6, 2, 0.5, rows_per_block=3), whole)
    # with the model's attention logit soft-cap (Gemma 2): the softmax of the capped scores
    q, own = torch.randn(1, 2, 4) * 4, torch.randn(1, 2, 4)
    got = chunk_scores(q, keys, own, 2, 5, n_sink=1, scale=0.5, soft_cap=1.0)
    subset = torch.cat([keys[:1], keys[2:5], own])  # [5, 2, 4]
    raw = (q[0, :, None, :] * subset.transpose(0, 1)).sum(-1) * 0.5  # [2, 5]
    torch.testing.assert_close(got, torch.tanh(raw).softmax(-1)[:, 1:4])


def test_options_and_where_it_runs(tiny_qwen3):
    with pytest.raises(ValueError, match="context"):
        make_policy("kvzip", budget=32, context="middle")
    with pytest.raises(ValueError, match="budget"):
        make_policy("kvzip", budget=4, window=8)
    with pytest.raises(ValueError, match="float KV pool"):
        LLM(tiny_qwen3, block_size=16, max_model_len=256, kv_policy="kvzip", kv_budget=32,
            kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="step budget"):
        LLM(tiny_qwen3, block_size=16, max_model_len=256, kv_policy="kvzip", kv_budget=32,
            max_num_batched_tokens=40)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(tiny_qwen3, block_size=16, max_model_len=256, kv_policy="kvzip", kv_budget=32,
            skip_tokenizer_init=True)
