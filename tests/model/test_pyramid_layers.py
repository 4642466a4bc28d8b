"""PyramidKV's per-layer budgets in the engine: per-layer block tables (layer slices) against
Hugging Face with a different attention mask in every layer, and the blocks really saved."""

import pytest
import torch

from nanokv import LLM, SamplingParams
from policy_oracles import hf_greedy_with_visibility, prompt_of, run_checked, spy_plans
from tiny_models import build_tiny_model, load_hf

BS = 16


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-llama4")), "llama", seed=3,
                            num_hidden_layers=4)


def per_layer_masked_hf_greedy(hf, prompt: list[int], kept: list[torch.Tensor],
                               steps: int) -> list[int]:
    """Greedy decode where, in layer l, generated tokens see only the prompt slots kept[l]
    (`[C_l]` shared by heads or `[Hkv, C_l]` per KV head) and each other: one selection applied
    once the prompt is computed."""
    return hf_greedy_with_visibility(hf, prompt, [(len(prompt), kept)], steps)


@pytest.mark.parametrize("per_head", [True, False])
def test_pyramidkv_matches_per_layer_masked_hf(tiny_llama4, monkeypatch, per_head):
    plans = spy_plans(monkeypatch)
    prompt = prompt_of(140)
    steps = 12
    llm = LLM(tiny_llama4, block_size=BS, max_model_len=256, kv_policy="pyramidkv",
              kv_budget=48, kv_policy_options={"window": 8, "per_head": per_head})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps,
                                                ignore_eos=True))[0]
    assert len(plans) == 1
    counts = plans[0].layer_num_slots
    assert len(set(counts)) > 1 and counts == sorted(counts, reverse=True)
    kept = plans[0].kept
    expected = per_layer_masked_hf_greedy(load_hf(tiny_llama4), prompt, kept, steps)
    assert out.token_ids == expected
    # blocks held at the end: the layer slices packed, not the largest layer's table
    final = [c + steps - 1 for c in counts]  # the last output is never cached
    packed = -(-sum(-(-c // BS) for c in final) // len(final))
    shared = -(-max(final) // BS)
    assert out.kv_blocks_at_finish == packed < shared
    llm.engine.check_invariants()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_pyramidkv_reference_path_matches(tiny_llama4, monkeypatch):
    """A control the oracle must fail: ignoring the per-layer masks (SnapKV-like shared mask of
    layer 0's kept set) gives different tokens, so the test above is sensitive to the layers."""
    plans = spy_plans(monkeypatch)
    prompt = prompt_of(140)
    llm = LLM(tiny_llama4, block_size=BS, max_model_len=256, kv_policy="pyramidkv",
              kv_budget=48, kv_policy_options={"window": 8, "per_head": False})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                ignore_eos=True))[0]
    kept = plans[0].kept
    wrong = per_layer_masked_hf_greedy(load_hf(tiny_llama4), prompt, [kept[0]] * len(kept), 12)
    assert out.token_ids != wrong


def test_pyramidkv_memory_saved_and_reused(tiny_llama4):
    """At a fixed pool, PyramidKV requests hold fewer blocks than the largest layer's budget
    would need, freed blocks serve other requests, nothing leaks (invariants every step)."""
    prompts = [prompt_of(120 + 9 * i, seed=i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(tiny_llama4, block_size=BS, max_model_len=256, num_kv_blocks=30,
              kv_policy="pyramidkv", kv_compression_ratio=0.75,
              kv_policy_options={"window": 4})
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))

    def packed(running):
        for r in running:
            if r.layer_slices is not None:
                lengths = r.layer_slices.lengths(r.num_computed_tokens)
                assert len(r.block_table) == r.layer_slices.blocks_needed(lengths)
                assert len(r.block_table) < -(-max(lengths) // BS)

    outs = run_checked(engine, packed)
    assert len(outs) == len(prompts)
    assert all(len(o.token_ids) == 20 for o in outs.values())
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_pyramidkv_survives_preemption(tiny_llama4):
    """A pool too small for all requests: ragged requests are preempted, recomputed and
    compressed again; outputs equal an unconstrained run's, no block leaks."""
    prompts = [prompt_of(100 + 9 * i, seed=10 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    opts = dict(block_size=BS, max_model_len=176, max_num_batched_tokens=32,
                kv_policy="pyramidkv", kv_budget=40,
                kv_policy_options={"window": 4})
    ref = LLM(tiny_llama4, **opts).generate(prompts, params)
    small = LLM(tiny_llama4, num_kv_blocks=11, **opts)
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    small.engine.check_invariants()
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
