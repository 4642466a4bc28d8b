"""Gemma 2's decoder (`Gemma2ForCausalLM`) against Hugging Face transformers' own forward (eager
attention, the one that applies the soft-cap; float32): Gemma 3's layer without q / k norms,
with one RoPE, and the attention logit soft-cap (2.0 in the tiny model, so it caps most scores)
on every attention path: the C decode kernel, the PyTorch paths (prefill's explicit steps), the
Triton kernels (interpreter), the hybrid KV cache manager's per-layer tables (sliced requests)
with preemption and prefix hits, two tensor-parallel ranks; the KV policies score with it; what
is refused (a quantized KV cache, a draft model with another soft-cap, a bad cap)."""

from __future__ import annotations

import os

import pytest
import torch
from test_gemma3 import prompts  # the same prompt mix (7, 40, 110 tokens)
from tiny_models import (build_tiny_model, check_preemption_then_prefix_hits,
                         check_teacher_forced, check_two_ranks, edit_json, load_hf,
                         record_slicing)

from nanokv import LLM, SamplingParams
from nanokv.models.gemma2 import Gemma2ForCausalLM

WINDOW = 24
SOFT_CAP = 2.0
OPTIONS = dict(skip_tokenizer_init=True, block_size=16, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("gemma2") / "m"), "gemma2", seed=3,
                            tokenizer=False, num_hidden_layers=4)


@pytest.fixture(scope="module")
def hf(gemma2):
    model = load_hf(gemma2, attn_implementation="eager")
    assert model.config.attn_logit_softcapping == SOFT_CAP
    return model


def run(path: str, batch, max_tokens: int = 12, logits: bool = True, **options):
    llm = LLM(path, **{"max_model_len": 256, **OPTIONS, **options})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            return_prompt_logits=logits)
    return llm, llm.generate(batch, params, use_tqdm=False)


def test_the_layers_are_what_hf_builds(gemma2, hf):
    """No q / k norms, one RoPE for every layer, sliding layers and full ones in turn, the
    query_pre_attn_scalar scale; the soft-cap reaches the attention backend."""
    llm = LLM(gemma2, max_model_len=256, **OPTIONS)
    model = llm.engine.model
    assert all(layer.self_attn.q_norm is None and layer.self_attn.k_norm is None
               for layer in model.layers)
    assert len(model.rotaries()) == 1
    assert all(layer.self_attn.rotary is model.rotary for layer in model.layers)
    assert type(model).layer_windows(hf.config, 256) == (WINDOW, None, WINDOW, None)
    assert model.layers[0].self_attn.scale == 24 ** -0.5
    assert model.logits_soft_cap == llm.engine.attention_backend.soft_cap == SOFT_CAP
    assert any("scores soft-capped at 2 (attn_logit_softcapping)" in line
               for line in llm.engine.startup_lines)


@pytest.mark.parametrize("backend", ["native", "torch", "triton"])
def test_logits_and_tokens_equal_hf(gemma2, hf, backend):
    """Prompts well past the window (the sliding layers drop most of the context), chunked
    prefill over a cached prefix, decodes: prompt logits and greedy tokens equal HF's."""
    batch, steps, atol = prompts(1, 5), 16, 1e-4
    if backend == "triton":
        from triton_device import triton_ready

        if not triton_ready():
            pytest.skip("the Triton backend runs on CPU only under TRITON_INTERPRET=1")
        # the interpreter runs each kernel call in Python: the two longest prompts, 8 tokens
        batch, steps, atol = sorted(batch, key=len)[-2:], 8, 1e-3
    assert max(map(len, batch)) > WINDOW * 4
    llm, outs = run(gemma2, batch, max_tokens=steps, attention_backend=backend)
    assert llm.engine.attention_backend.name == backend
    for prompt, out in zip(batch, outs):
        check_teacher_forced(hf, prompt, out, atol=atol)


def test_without_the_soft_cap_the_logits_are_not_hf(gemma2, hf, monkeypatch):
    """The check above can fail: with the soft-cap left out the logits are far from HF's."""
    monkeypatch.setattr(Gemma2ForCausalLM, "attention_soft_cap", staticmethod(lambda cfg: None))
    batch = prompts(1, 3)
    _, outs = run(gemma2, batch)
    worst = 0.0
    for prompt, out in zip(batch, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0]
        worst = max(worst, float((out.prompt_logits - logits).abs().max()))
    assert worst > 0.05


def test_sliced_requests_preemption_and_prefix_hits_keep_hf_tokens(gemma2, hf, monkeypatch):
    """Eight requests sharing a 40-token prefix over a pool that holds them only with their
    sliding layers' blocks given back (the hybrid KV cache manager's per-layer tables) and
    preemption; then the same prompts over the prefix cache."""
    sliced = record_slicing(monkeypatch)
    batch = prompts(2, 8, shared=40)
    llm, outs = run(gemma2, batch, max_tokens=24, logits=False, num_kv_blocks=16)
    assert sliced
    check_preemption_then_prefix_hits(llm, hf, batch, outs, 24)


def test_two_tensor_parallel_ranks_give_one_process_tokens(gemma2):
    """Heads and MLP split over 2 ranks, each rank's backend soft-capping: one process's
    tokens and schedule, with chunks, preemption and prefix hits."""
    check_two_ranks(gemma2, prompts(6, 8, shared=20), max_model_len=256, num_kv_blocks=16,
                    **OPTIONS)


def test_kv_policies_score_with_the_soft_cap(tmp_path, monkeypatch):
    """Windows beyond max_model_len (none active): a KV policy may run, and its attention
    probabilities are the soft-capped ones."""
    import nanokv.policies.apply as apply

    path = build_tiny_model(str(tmp_path / "m"), "gemma2", seed=4, tokenizer=False,
                            num_hidden_layers=2, sliding_window=4096)
    caps = []
    original = apply.window_attention

    def window_attention(q_window, keys, scale, soft_cap=None):
        caps.append(soft_cap)
        return original(q_window, keys, scale, soft_cap)

    monkeypatch.setattr(apply, "window_attention", window_attention)
    _, outs = run(path, prompts(3, 2), logits=False, kv_policy="snapkv", kv_budget=32,
                  max_model_len=512)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert caps and set(caps) == {SOFT_CAP}


def test_what_nanokv_does_not_run_is_refused(gemma2, tmp_path):
    with pytest.raises(ValueError, match=r"soft-caps its attention scores \(attn_logit_softcapping "
                                         r"2.0\), which the attention kernels of kv_cache_dtype "
                                         r"'int8' do not apply"):
        LLM(gemma2, max_model_len=64, kv_cache_dtype="int8", **OPTIONS)
    uncapped = tmp_path / "uncapped"
    os.system(f"cp -r {gemma2} {uncapped}")
    edit_json(str(uncapped / "config.json"), attn_logit_softcapping=None)
    with pytest.raises(ValueError, match=r"soft-caps its attention scores at None, the model at "
                                         r"2.0"):
        LLM(gemma2, max_model_len=64, speculative_config={
            "method": "draft_model", "model": str(uncapped), "num_speculative_tokens": 2},
            **OPTIONS)
    for bad in (-1.0, 0.0):  # (HF's config itself refuses non-floats)
        edit_json(str(uncapped / "config.json"), attn_logit_softcapping=bad)
        with pytest.raises(ValueError, match="attn_logit_softcapping must be a finite number > 0"):
            LLM(str(uncapped), max_model_len=64, **OPTIONS)


def test_only_a_backend_that_applies_the_soft_cap_is_chosen():
    """The selector passes over backends that apply no soft-cap, and such a backend refuses
    to be built with one."""
    from nanokv.attention.native_quantized import NativeQuantizedBackend
    from nanokv.attention.selector import select_backend

    from nanokv.cache.kv_cache import KVCacheOptions
    from nanokv.cache.layout import KVLayout
    from nanokv.cache.registry import kv_cache_settings

    layout = KVLayout(2, 2, 32, 16, torch.float32)
    cls, settings = kv_cache_settings(KVCacheOptions("int8", 4), layout)
    cache = cls.create(layout, 8, torch.device("cpu"), settings)
    with pytest.raises(ValueError, match=r"it applies no attention logit soft-cap \(the model's "
                                         r"is 2.0\)"):
        select_backend("auto", cache, torch.device("cpu"), SOFT_CAP)
    assert select_backend("auto", cache, torch.device("cpu"))[0] is NativeQuantizedBackend
    with pytest.raises(ValueError, match="applies no attention logit soft-cap"):
        NativeQuantizedBackend(cache, torch.device("cpu"), SOFT_CAP)
