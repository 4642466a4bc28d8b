"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) in the engine:
greedy tokens and prompt logits against Hugging Face transformers through batching, chunked
prefill, prefix hits, preemption and quantized KV caches, with sliding windows (HF's forward
over the whole sequence with its window mask), on two tensor-parallel ranks (one process's
tokens), and under LoRA adapters on the attention projections (PEFT's model the oracle);
what cannot run is refused before loading. (Parity of each config's flags:
test_hf_architectures.py; the block against its dense formula: tests/unit/test_moe_block.py.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import (
    build_lora_adapter,
    build_tiny_model,
    check_teacher_forced,
    check_two_ranks,
    hf_greedy,
    load_hf,
    load_hf_lora,
)

from nanokv import LLM, SamplingParams
from nanokv.lora import LoRARequest

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
FLAGS = {  # a dense layer beside the sparse ones where the config has one
    "qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_hidden_layers=3, decoder_sparse_step=2),
    "mixtral": dict(),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_tiny_model(str(root / arch), arch, seed=i, tokenizer=False,
                                   max_position_embeddings=512, **FLAGS[arch])
            for i, arch in enumerate(ARCHS)}


def prompts(seed: int, n: int, shared: int = 0) -> list[list[int]]:
    """n prompts of 5-140 tokens, the first `shared` tokens common to all (prefix hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 255) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 255) for _ in range(rng.randrange(5, 140 - shared))]
            for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                        return_prompt_logits=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_chunked_and_preempted_requests_match_hf(models, arch):
    """Eight requests at once in 64-token steps over a pool too small for all of them
    (preemption), then again over the prefix cache."""
    llm = LLM(models[arch], skip_tokenizer_init=True, max_model_len=256, block_size=16,
              num_kv_blocks=16, max_num_batched_tokens=64)
    hf = load_hf(models[arch])
    batch = prompts(len(arch), 8, shared=20)
    first = llm.generate(batch, GREEDY, use_tqdm=False)
    for prompt, out in zip(batch, first):
        check_teacher_forced(hf, prompt, out)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    again = llm.generate(batch, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert llm.engine.stats().prefix_cache_hits > stats.prefix_cache_hits
    llm.engine.check_invariants()


@pytest.mark.parametrize("kv_cache_dtype,same", [("int8", 5), ("kvquant", 3)])
def test_quantized_kv_caches_serve_a_mixture_of_experts(models, kv_cache_dtype, same):
    """The KV cache is the attention's: int8 gives the float pool's greedy tokens here, 4-bit
    KVQuant its first tokens and most whole sequences (its rounding flips near ties later)."""
    path = models["qwen3_moe"]
    batch = prompts(9, 5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(path, skip_tokenizer_init=True, max_model_len=256, block_size=16)
    want = [o.token_ids for o in ref.generate(batch, params, use_tqdm=False)]
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, block_size=16,
              kv_cache_dtype=kv_cache_dtype)
    got = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert sum(g == w for g, w in zip(got, want)) >= same


WINDOWS = {  # the architecture's window flags; the window
    "qwen3_moe": (dict(use_sliding_window=True, sliding_window=20), 20),  # every layer
    "qwen2_moe": (dict(use_sliding_window=True, sliding_window=12, max_window_layers=3),
                  12),  # layers 0 and 2 (Qwen2-MoE's layer_types)
    "mixtral": (dict(sliding_window=12), 12),  # every layer
}


@pytest.mark.parametrize("arch", ARCHS)
def test_sliding_windows_match_hf(tmp_path, arch):
    flags, window = WINDOWS[arch]
    path = build_tiny_model(str(tmp_path / arch), arch, seed=5, tokenizer=False,
                            max_position_embeddings=256, **FLAGS[arch], **flags)
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, block_size=16,
              max_num_batched_tokens=32)
    windows = llm.engine.kv_cache.layout.sliding_windows
    assert window in windows and (arch != "qwen2_moe" or None in windows)
    hf = load_hf(path)
    batch = prompts(3, 3)
    for prompt, out in zip(batch, llm.generate(batch, GREEDY, use_tqdm=False)):
        check_teacher_forced(hf, prompt, out)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_two_tensor_parallel_ranks_give_one_process_tokens(models, arch):
    """Every expert's width split over 2 ranks (the shared expert's too), the router
    replicated, one all-reduce per block: one process's tokens and schedule, with prefix hits,
    chunks and preemption."""
    check_two_ranks(models[arch], prompts(11, 8, shared=20), skip_tokenizer_init=True,
                    max_model_len=256, block_size=16, num_kv_blocks=16,
                    max_num_batched_tokens=64)


def test_a_width_two_ranks_cannot_split_is_refused(tmp_path):
    path = build_tiny_model(str(tmp_path / "odd"), "qwen3_moe", tokenizer=False,
                            moe_intermediate_size=41)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's "
                                         r"MLP width 41"):
        LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2)


def test_lora_on_the_attention_projections_matches_peft(models, tmp_path):
    """An adapter of q/k/v/o in every layer applies as PEFT applies it; one on a sparse
    layer's MLP is refused, saying which layer and what it may adapt, with nothing allocated.
    The dense layer (mlp_only_layers) still takes an MLP adapter."""
    path = models["qwen3_moe"]
    adapter = build_lora_adapter(path, str(tmp_path / "attn"),
                                 targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    peft = load_hf_lora(path, adapter)
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, block_size=16,
              enable_lora=True, max_lora_rank=8)
    batch = prompts(21, 3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lora = LoRARequest("attn", 1, adapter)
    outs = llm.generate(batch, params, lora_request=lora, use_tqdm=False)
    plain = llm.generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # the adapter matters
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(peft, prompt, 8)[0]

    from benchmark_scripts import load_benchmark

    writer = load_benchmark("make_lora_adapters")
    mlp = tmp_path / "mlp"
    writer.write_adapter(Path(path), mlp, 8, 16, 0.08, 1, ("down_proj",))
    engine = llm.engine
    with pytest.raises(ValueError, match=r"layer 0 down_proj cannot take an adapter \(a "
                                         r"mixture of experts' MLP takes none\); this layer's "
                                         r"projections: \['k_proj', 'o_proj', 'q_proj', "
                                         r"'v_proj'\]"):
        engine.add_request(batch[0], params, lora_request=LoRARequest("mlp", 2, str(mlp)))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.engine.runner.lora.shapes[1].keys() >= {"gate_proj", "up_proj", "down_proj"}


def test_every_expert_is_loaded_or_the_checkpoint_is_refused(models, tmp_path):
    """A checkpoint missing one expert's tensor is refused, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = models["mixtral"]
    dst = tmp_path / "missing"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*experts\.3\.w3\.weight"):
        LLM(str(dst), skip_tokenizer_init=True, max_model_len=64, block_size=16)
