"""Each architecture's config flags read as its Hugging Face class reads them, checked against
HF transformers' own forward (float32): biases (Llama's attention_bias on q/k/v and o, mlp_bias;
Qwen2's q/k/v bias; Qwen3's attention_bias; Mistral's none), the scaled RoPE types, a head size
other than hidden / heads, a sharded checkpoint, the mixtures of experts (Qwen3-MoE, Qwen2-MoE,
Mixtral), and sliding-window flags that leave every layer
on full attention (active windows: test_sliding_window.py). Configs nanokv cannot run as HF does
are refused before any weight is read."""

import os
import random

import pytest
import torch

from nanokv import LLM, SamplingParams
from tiny_models import edit_json, hf_greedy, load_hf

VOCAB, MAX_NEW, MAX_LEN = 200, 6, 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
              rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=VOCAB - 1)


def build(out_dir: str, arch: str, seed: int = 0, max_shard_size: str | None = None,
          **overrides) -> str:
    """A tiny random checkpoint of `arch` with every weight and bias drawn at random (biases
    that stayed zero would hide a missing one)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and the [experts, out, in] stacks of a MoE
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
    model = model.to(torch.float32).eval()
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size
                                      else {}))
    return out_dir


def edit_config(model_dir: str, **fields) -> None:
    """Set fields in config.json after saving (flags a config class would not keep)."""
    edit_json(os.path.join(model_dir, "config.json"), **fields)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (7, 90)]


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}

VARIANTS = {
    "llama_attention_and_mlp_bias": ("llama", dict(attention_bias=True, mlp_bias=True), {}),
    "qwen2_qkv_bias_tied": ("qwen2", dict(tie_word_embeddings=True), {}),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True, head_dim=24), {}),
    # Mistral ignores both bias flags; a window no shorter than the model length is no window
    "mistral_bias_flags_ignored": ("mistral", dict(sliding_window=MAX_LEN), {}),
    # Qwen's sliding layers start at max_window_layers: none of the 2 here
    "qwen2_sliding_flag_without_sliding_layers": (
        "qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), {}),
    "llama_yarn": ("llama", dict(rope_parameters=YARN), {}),
    "qwen3_llama3_rope": ("qwen3", dict(rope_parameters=LLAMA3), {}),
    "llama_linear_rope_head_dim_24": ("llama", dict(rope_parameters=LINEAR, head_dim=24), {}),
    "llama_sharded": ("llama", dict(), dict(max_shard_size="40KB")),
    # mixtures of experts: Qwen3-MoE with a dense layer (mlp_only_layers) and renormalized
    # top-k weights, and without; Qwen2-MoE's shared expert and every other layer sparse
    # (decoder_sparse_step); Mixtral's checkpoint names (block_sparse_moe, w1 / w2 / w3)
    "qwen3_moe_dense_layer_norm_topk": ("qwen3_moe", dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40, mlp_only_layers=[1],
        norm_topk_prob=True, num_hidden_layers=3), {}),
    "qwen3_moe_top1_attention_bias": ("qwen3_moe", dict(
        num_experts=4, num_experts_per_tok=1, moe_intermediate_size=48, attention_bias=True,
        norm_topk_prob=False), {}),
    "qwen2_moe_shared_expert_sparse_step": ("qwen2_moe", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
        shared_expert_intermediate_size=72, decoder_sparse_step=2, num_hidden_layers=3), {}),
    "mixtral_sharded": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2),
                        dict(max_shard_size="40KB")),
}
# flags written into config.json that the HF class does not read (no tensors behind them)
IGNORED_FLAGS = {"mistral_bias_flags_ignored": dict(attention_bias=True, mlp_bias=True),
                 "qwen3_attention_bias": dict(mlp_bias=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_hf(tmp_path, variant):
    arch, overrides, save = VARIANTS[variant]
    model_dir = build(str(tmp_path / variant), arch, seed=len(variant), **save, **overrides)
    if variant in IGNORED_FLAGS:
        edit_config(model_dir, **IGNORED_FLAGS[variant])
    if "max_shard_size" in save:
        assert os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json"))
    hf = load_hf(model_dir)
    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=MAX_LEN, block_size=16)
    batch = prompts(len(variant))
    with torch.no_grad():
        expected_logits = [hf(torch.tensor([p])).logits[0].float() for p in batch]  # [n, V]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                            return_prompt_logits=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    for prompt, out, logits in zip(batch, outs, expected_logits):
        torch.testing.assert_close(out.prompt_logits, logits, atol=1e-4, rtol=1e-4)
        assert out.token_ids == hf_greedy(hf, prompt, MAX_NEW)[0]


def test_biases_are_loaded_where_hf_has_them(tmp_path):
    """The projections that carry a bias, per architecture (a dropped bias would also fail the
    strict loader; this names which)."""
    cases = {"llama": ("llama", dict(attention_bias=True), {"qkv_proj", "o_proj"}),
             "qwen2": ("qwen2", {}, {"qkv_proj"}),
             "qwen3": ("qwen3", dict(attention_bias=True), {"qkv_proj", "o_proj"}),
             "mistral": ("mistral", dict(sliding_window=None), set())}
    for name, (arch, overrides, expected) in cases.items():
        model_dir = build(str(tmp_path / name), arch, **overrides)
        model = LLM(model_dir, skip_tokenizer_init=True, max_model_len=64,
                    block_size=16).engine.runner.model
        layer = model.layers[0]
        with_bias = {n for n, m in (("qkv_proj", layer.self_attn.qkv_proj),
                                    ("o_proj", layer.self_attn.o_proj),
                                    ("gate_up_proj", layer.mlp.gate_up_proj),
                                    ("down_proj", layer.mlp.down_proj))
                     if getattr(m, "bias", None) is not None}
        assert with_bias == expected, name


@pytest.mark.parametrize("where", ["rope_parameters", "top_level"])
def test_partial_rotary_factor_is_refused(tmp_path, where):
    model_dir = build(str(tmp_path / "m"), "llama")
    if where == "rope_parameters":
        edit_config(model_dir, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5})
    else:
        edit_config(model_dir, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.5 .*supported: 1\.0"):
        LLM(model_dir, skip_tokenizer_init=True, max_model_len=64, block_size=16)


def test_llama_sliding_window_is_refused_unless_the_model_length_fits(tmp_path):
    """Hugging Face's Llama attends over the whole context in its forward and over a sliding
    window in generate: no one attention to match (Mistral's and Qwen's windows are served:
    tests/model/test_sliding_window.py)."""
    model_dir = build(str(tmp_path / "llama"), "llama", sliding_window=16)
    with pytest.raises(ValueError, match=r"sliding_window 16 of LlamaForCausalLM is not "
                                         r"supported.*max_model_len <= 16"):
        LLM(model_dir, skip_tokenizer_init=True, max_model_len=64, block_size=16)
    # within the window, attention is the same as full attention: HF's greedy tokens
    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=16, block_size=16)
    prompt = prompts(3)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(load_hf(model_dir), prompt, MAX_NEW)[0]


@pytest.mark.parametrize("value,match", [
    (0, r"sliding_window must be an integer >= 1 or null, got 0"),
    (-3, r"sliding_window must be an integer >= 1 or null, got -3"),
    (2.5, r"sliding_window.*expected int"),  # transformers' own config check
])
def test_a_bad_sliding_window_is_refused(tmp_path, value, match):
    model_dir = build(str(tmp_path / "mistral"), "mistral")
    edit_config(model_dir, sliding_window=value)
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, skip_tokenizer_init=True, max_model_len=64, block_size=16)
