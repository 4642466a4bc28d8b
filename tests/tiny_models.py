"""Tiny random-weight Hugging Face checkpoints the tests build themselves (no downloads)."""

from __future__ import annotations

import os

import torch

VOCAB = 320
TOKENIZER_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The grass is green. The sky is blue. The sun is yellow. Here we go.",
    "import os\nimport sys\nprint('hello world')\n",
    "class Block:\n    def __init__(self, block_id):\n        self.block_id = block_id\n",
] * 20


def build_tokenizer(out_dir: str) -> int:
    """A byte-level BPE tokenizer (vocab < VOCAB) saved for AutoTokenizer. Returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)
    return fast.eos_token_id


def build_tiny_model(out_dir: str, arch: str = "llama", seed: int = 0, tokenizer: bool = True,
                     **overrides) -> str:
    """Write a tiny random HF checkpoint (float32 safetensors + config) and return its path."""
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    eos = build_tokenizer(out_dir) if tokenizer else VOCAB - 1
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=0)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(tie_word_embeddings=False, **common))
    elif arch == "qwen3":
        common.setdefault("head_dim", 32)
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(tie_word_embeddings=True, **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    elif arch == "qwen3_moe":  # 8 experts of width 48, top 2, renormalized
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                   norm_topk_prob=True, head_dim=32)
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(tie_word_embeddings=True, **{**moe, **common}))
    elif arch == "qwen2_moe":  # 6 experts of width 48, top 2, a shared expert of width 96
        moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                   shared_expert_intermediate_size=96)
        model = transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(**{**moe, **common}))
    elif arch == "mixtral":  # 4 experts of intermediate_size, top 2
        moe = dict(num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**moe, **common}))
    elif arch == "gemma3":  # sliding layers (window 24) and full ones in turn, gelu-tanh MLP
        layers = common["num_hidden_layers"]
        gemma = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                     hidden_activation="gelu_pytorch_tanh",
                     layer_types=["full_attention" if i % 2 else "sliding_attention"
                                  for i in range(layers)])
        model = transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(**{**gemma, **common}))
    elif arch == "gemma2":  # as gemma3, no q/k norms, one RoPE, attention soft-cap 2 (active)
        layers = common["num_hidden_layers"]
        gemma = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                     hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=2.0,
                     final_logit_softcapping=30.0,
                     layer_types=["full_attention" if i % 2 else "sliding_attention"
                                  for i in range(layers)])
        model = transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**{**gemma, **common}))
    else:
        raise ValueError(arch)
    # a larger init than HF's default makes the logits peaked, so greedy ties are rare
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and the [experts, out, in] stacks of a MoE
                p.normal_(0, 0.08)
            elif name.endswith("bias"):  # only with attention_bias / mlp_bias: not left zero
                p.normal_(0, 0.3)
            elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # 1 + w: w at 0
                p.normal_(0, 0.3)
    model = model.to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def edit_json(path: str, **fields) -> None:
    """Set fields of a saved JSON file (config.json, adapter_config.json: flags a config class
    would not keep, or values a test changes)."""
    import json

    with open(path) as f:
        data = json.load(f)
    data.update(fields)
    with open(path, "w") as f:
        json.dump(data, f)


def load_hf(path: str, attn_implementation: str | None = None):
    """attn_implementation: HF's ("eager": the one that applies an attention soft-cap)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attn_implementation).eval()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF transformers' greedy tokens and raw logits ([steps, vocab]) for one prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([step[0] for step in out.logits]).float()


def check_teacher_forced(hf_model, prompt: list[int], out, atol: float = 1e-4) -> None:
    """An engine's output against HF's forward over the prompt and the output's tokens: its
    prompt logits (when it returned them) within atol, and each greedy token the argmax of HF's
    logits at its position with the tokens before it as input (HF's own generate can disagree
    with its forward, e.g. on sliding windows)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    if out.prompt_logits is not None:
        torch.testing.assert_close(out.prompt_logits.cpu(), logits[:len(prompt)], atol=atol,
                                   rtol=atol)
    assert out.token_ids == logits[len(prompt) - 1:-1].argmax(-1).tolist()


def record_slicing(monkeypatch) -> list[tuple[str, int]]:
    """The requests the hybrid KV cache manager slices (`BlockManager.slice_for_windows`), as
    (request id, its cached slots then), appended as they are sliced."""
    from nanokv.cache.block_manager import BlockManager

    calls = []
    original = BlockManager.slice_for_windows

    def slice_for_windows(self, request, windows):
        calls.append((request.request_id, request.num_cached_slots))
        return original(self, request, windows)

    monkeypatch.setattr(BlockManager, "slice_for_windows", slice_for_windows)
    return calls


def check_preemption_then_prefix_hits(llm, hf_model, batch: list[list[int]], outs,
                                      max_tokens: int) -> None:
    """A run that preempted: each output equal to HF's (teacher-forced); the same prompts again
    give the same tokens with more prefix-cache hits; block accounting holds."""
    from nanokv import SamplingParams

    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    for prompt, out in zip(batch, outs):
        check_teacher_forced(hf_model, prompt, out)
    again = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert llm.engine.stats().prefix_cache_hits > stats.prefix_cache_hits
    llm.engine.check_invariants()


def check_two_ranks(path: str, batch: list[list[int]], **options) -> None:
    """Greedy tokens of `batch` (12 each) on 2 tensor-parallel ranks equal one process's, with
    the same schedule (stats), preemptions among them (options: a pool too small for all)."""
    from nanokv import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(path, **options)
    want = [o.token_ids for o in one.generate(batch, params, use_tqdm=False)]
    two = LLM(path, tensor_parallel_size=2, **options)
    try:
        assert [o.token_ids for o in two.generate(batch, params, use_tqdm=False)] == want
        assert two.engine.stats() == one.engine.stats()
        assert two.engine.stats().num_preemptions > 0
    finally:
        two.engine.close()


def check_cuda_engine(model: str, seed: int, vocab: int, **options):
    """A CUDA float32 engine's prompt logits and teacher-forced greedy tokens against HF's
    (1e-3: the GPU's kernels round differently) on 4 prompts of 5-120 tokens, 16 tokens each,
    and its block accounting after them; returns the `LLM`."""
    import random

    from nanokv import LLM, SamplingParams

    llm = LLM(model, skip_tokenizer_init=True, max_model_len=256, block_size=16, device="cuda",
              dtype="float32", max_num_batched_tokens=64, **options)
    rng = random.Random(seed)
    batch = [[rng.randrange(1, vocab) for _ in range(n)] for n in (5, 33, 120, 70)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            return_prompt_logits=True)
    hf = load_hf(model)
    for prompt, out in zip(batch, llm.generate(batch, params, use_tqdm=False)):
        check_teacher_forced(hf, prompt, out, atol=1e-3)
    llm.engine.check_invariants()
    return llm


def build_noisy_copy(src: str, out_dir: str, scale: float, seed: int = 7) -> str:
    """A copy of the checkpoint at `src` with Gaussian noise of std `scale` added to every
    matrix: a draft model that agrees with it often, not always (config and tokenizer
    copied)."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), out_dir)
    gen = torch.Generator().manual_seed(seed)
    for path in glob.glob(os.path.join(src, "*.safetensors")):
        weights = {name: w + scale * torch.randn(w.shape, generator=gen) if w.dim() == 2 else w
                   for name, w in load_file(path).items()}
        save_file(weights, os.path.join(out_dir, os.path.basename(path)),
                  metadata={"format": "pt"})
    return out_dir


def build_lora_adapter(model_dir: str, out_dir: str, rank: int = 8, alpha: float = 16,
                       targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"),
                       seed: int = 1, std: float = 0.08, **lora_options) -> str:
    """A PEFT LoRA adapter of the checkpoint at `model_dir` written by PEFT itself, its A and B
    random (PEFT starts B at zero, which would change nothing). Returns out_dir."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_hf(model_dir), LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
        **lora_options))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_hf_lora(model_dir: str, adapter_dir: str):
    """Hugging Face transformers' model with the PEFT adapter applied (PEFT's own LoRA layers:
    the oracle of nanokv's)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(model_dir), adapter_dir).eval()


def write_lora_adapter(model_dir: str, out_dir: str, rank: int = 8, alpha: float = 16,
                       targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
                       seed: int = 1, std: float = 0.08) -> str:
    """A LoRA adapter in PEFT's file format written without PEFT (machines without it: the
    CUDA tests), its A and B random: benchmarks/make_lora_adapters.py's writer. Returns
    out_dir."""
    from pathlib import Path

    from benchmark_scripts import load_benchmark

    load_benchmark("make_lora_adapters").write_adapter(Path(model_dir), Path(out_dir), rank,
                                                       alpha, std, seed, targets)
    return out_dir


def merge_lora(model_dir: str, adapter_dir: str, out_dir: str) -> str:
    """The checkpoint with a LoRA adapter merged into its weights (W + alpha / r * B A): the
    model the adapter makes, as plain weights (config and tokenizer copied)."""
    import glob
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    scaling = config["lora_alpha"] / config["r"]
    lora = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, name), out_dir)
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        weights = load_file(path)
        for name in weights:
            key = "base_model.model." + name.removesuffix(".weight")
            if f"{key}.lora_A.weight" in lora:
                a, b = lora[f"{key}.lora_A.weight"], lora[f"{key}.lora_B.weight"]
                weights[name] = weights[name] + scaling * (b @ a)
        save_file(weights, os.path.join(out_dir, os.path.basename(path)),
                  metadata={"format": "pt"})
    return out_dir
