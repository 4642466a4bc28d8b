"""Gemma 3's text decoder (`Gemma3ForCausalLM`) against Hugging Face transformers' own forward
(float32): four norms a layer with 1 + w weights, the embedding scaled by sqrt(hidden), the
query_pre_attn_scalar softmax scale, the gelu-tanh MLP, and sliding layers (window 24) beside
full ones, each kind with its own RoPE (10k / 1M bases; linear scaling on the full layers, as
Gemma 3 4B+), with batching, chunked prefill, preemption and prefix hits; the Triton backend;
a final logit soft-cap; int8 weights and an int8 KV cache; 2 ranks; LoRA against PEFT; the text
decoder of a multimodal checkpoint (Gemma3ForConditionalGeneration); what is refused (an
attention soft-cap, which HF's Gemma 3 does not apply; bidirectional attention; a KV store that
keeps keys before RoPE)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from tiny_models import (build_tiny_model, check_preemption_then_prefix_hits,
                         check_teacher_forced, check_two_ranks, edit_json, load_hf)

from nanokv import LLM, SamplingParams

WINDOW = 24
LINEAR_FULL = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                  "rope_theta": 1000000.0}}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("gemma3") / "m"), "gemma3", seed=3,
                            tokenizer=False, num_hidden_layers=4)


def prompts(seed: int, n: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 250) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 250) for _ in range(rng.choice((7, 40, 110)))]
            for _ in range(n)]


def run(path: str, batch, max_tokens: int = 12, logits: bool = True, **options):
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, block_size=16,
              max_num_batched_tokens=48, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            return_prompt_logits=logits)
    return llm, llm.generate(batch, params, use_tqdm=False)


def test_the_layers_are_what_hf_builds(gemma):
    """Sliding and full layers alternate, each with its kind's RoPE; the windows reach the KV
    layout; the norms hold 1 + w."""
    model = LLM(gemma, skip_tokenizer_init=True, max_model_len=256, block_size=16).engine.model
    hf = load_hf(gemma)
    kinds = [layer.self_attn.rotary.layer_type for layer in model.layers]
    assert kinds == hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert model.sliding_rotary is not model.rotary and model.rotary.layer_type == "full_attention"
    assert not torch.equal(model.sliding_rotary.cos, model.rotary.cos)
    assert type(model).layer_windows(hf.config, 256) == (WINDOW, None, WINDOW, None)
    torch.testing.assert_close(model.layers[1].pre_feedforward_layernorm.weight,
                               1 + hf.model.layers[1].pre_feedforward_layernorm.weight)
    assert model.layers[0].self_attn.scale == 24 ** -0.5


@pytest.mark.parametrize("rope", ["default", "linear_on_full_layers"])
def test_logits_and_tokens_equal_hf(gemma, tmp_path, rope):
    path = gemma
    if rope != "default":
        path = build_tiny_model(str(tmp_path / rope), "gemma3", seed=4, tokenizer=False,
                                num_hidden_layers=4, rope_parameters=LINEAR_FULL)
    hf = load_hf(path)
    batch = prompts(1, 5)
    assert max(map(len, batch)) > WINDOW * 4  # the sliding layers drop most of the context
    _, outs = run(path, batch, max_tokens=16)
    for prompt, out in zip(batch, outs):
        check_teacher_forced(hf, prompt, out)


def test_preemption_and_prefix_hits_keep_hf_tokens(gemma):
    """8 requests over a pool that cannot hold them all at once (recompute preemption), then the
    same prompts again over the prefix cache."""
    batch = prompts(2, 8, shared=40)
    llm, outs = run(gemma, batch, max_tokens=24, logits=False, num_kv_blocks=24)
    check_preemption_then_prefix_hits(llm, load_hf(gemma), batch, outs, 24)


def test_the_triton_backend_equals_hf(gemma):
    """The GPU's attention kernels (under Triton's interpreter on CPU): each layer's window and
    the query_pre_attn_scalar scale reach them."""
    from triton_device import triton_ready

    if not triton_ready():
        pytest.skip("the Triton backend runs on CPU only under TRITON_INTERPRET=1 with triton")
    hf = load_hf(gemma)
    batch = prompts(7, 3)
    _, outs = run(gemma, batch, max_tokens=8, attention_backend="triton")
    for prompt, out in zip(batch, outs):
        check_teacher_forced(hf, prompt, out, atol=1e-3)


def test_a_lora_adapter_matches_peft(gemma, tmp_path):
    """An adapter of every projection (q/k/v/o, gate/up/down) applies as PEFT applies it."""
    pytest.importorskip("peft")
    from tiny_models import build_lora_adapter, load_hf_lora

    from nanokv.lora import LoRARequest

    adapter = build_lora_adapter(gemma, str(tmp_path / "adapter"))
    peft = load_hf_lora(gemma, adapter)
    batch = prompts(9, 2)
    llm = LLM(gemma, skip_tokenizer_init=True, max_model_len=256, block_size=16,
              enable_lora=True, max_lora_rank=8)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        lora_request=LoRARequest("a", 1, adapter), use_tqdm=False)
    for prompt, out in zip(batch, outs):
        check_teacher_forced(peft, prompt, out)


def test_final_logit_softcap(gemma, tmp_path):
    """Gemma 2's final soft-cap, tanh(logits / c) * c, where a config sets it."""
    path = tmp_path / "softcap"
    os.system(f"cp -r {gemma} {path}")
    edit_json(str(path / "config.json"), final_logit_softcapping=3.0)
    hf = load_hf(str(path))
    batch = prompts(3, 2)
    _, outs = run(str(path), batch)
    for prompt, out in zip(batch, outs):
        check_teacher_forced(hf, prompt, out)
        assert out.prompt_logits.abs().max() < 3.0


def test_int8_weights_and_int8_kv(gemma):
    """Int8 weights (the embedding's scale applied to its dequantized rows) against HF over
    the dequantized weights; an int8 KV cache (keys after RoPE) runs beside two RoPEs."""
    from test_int8_weights import hf_dequantized

    hf = hf_dequantized(gemma)
    batch = prompts(5, 3)
    _, outs = run(gemma, batch, quantization="int8")
    for prompt, out in zip(batch, outs):
        check_teacher_forced(hf, prompt, out)
    _, outs = run(gemma, batch, kv_cache_dtype="int8", logits=False)
    assert all(len(o.token_ids) == 12 for o in outs)


@pytest.mark.parametrize("fields,match", [
    (dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping 50.0 is not supported for "
                                        r"Gemma 3"),
    (dict(use_bidirectional_attention=True), r"use_bidirectional_attention is not supported"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2),
     r"layer_types must name each of the 4 layers 'sliding_attention' or 'full_attention'"),
])
def test_what_nanokv_does_not_run_is_refused(gemma, tmp_path, fields, match):
    path = tmp_path / "bad"
    os.system(f"cp -r {gemma} {path}")
    edit_json(str(path / "config.json"), **fields)
    with pytest.raises(ValueError, match=match):
        LLM(str(path), skip_tokenizer_init=True, max_model_len=64)


def test_a_store_of_pre_rope_keys_is_refused(gemma):
    """KVQuant rotates its pre-RoPE keys with the model's one RoPE: Gemma 3's layers have two."""
    with pytest.raises(ValueError, match=r"keeps keys before RoPE .* Gemma3ForCausalLM's layers "
                                         r"have 2"):
        LLM(gemma, skip_tokenizer_init=True, max_model_len=64, kv_cache_dtype="kvquant")


def test_two_tensor_parallel_ranks_give_one_process_tokens(gemma):
    """Heads and MLP split over 2 ranks, the extra norms and both RoPEs replicated: one
    process's tokens and schedule, with chunks, preemption and prefix hits."""
    check_two_ranks(gemma, prompts(6, 8, shared=20), skip_tokenizer_init=True, max_model_len=256,
                    block_size=16, num_kv_blocks=24, max_num_batched_tokens=48)


def test_the_text_decoder_of_a_multimodal_checkpoint(tmp_path):
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: the decoder is built from its
    text_config and read from `language_model.`, the vision tower and projector skipped; its
    tokens are HF's multimodal model's on text prompts; the simulator sizes the decoder."""
    import transformers

    from nanokv.sim.step_model import ModelShape

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                query_pre_attn_scalar=24, sliding_window=WINDOW, max_position_embeddings=256,
                layer_types=["sliding_attention", "full_attention"] * 2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(8)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
        boi_token_index=253, eoi_token_index=254))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if name.endswith("norm.weight") else 0.08)
    path = str(tmp_path / "mm")
    hf.float().eval().save_pretrained(path)
    batch = [[random.Random(i).randrange(1, 250) for _ in range(n)] for i, n in enumerate((9, 80))]
    llm, outs = run(path, batch)
    assert type(llm.engine.model).__name__ == "Gemma3ForConditionalGeneration"
    assert llm.engine.hf_config.num_hidden_layers == 4  # the text_config
    for prompt, out in zip(batch, outs):
        check_teacher_forced(hf, prompt, out)
    shape = ModelShape.load(path)
    assert (shape.num_layers, shape.hidden_size, shape.head_dim) == (4, 64, 32)
