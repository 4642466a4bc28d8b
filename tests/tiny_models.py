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
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    eos = build_tokenizer(out_dir) if tokenizer else VOCAB - 1
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=0)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(tie_word_embeddings=False, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen3":
        common.setdefault("head_dim", 32)
        cfg = Qwen3Config(tie_word_embeddings=True, **common)
        model = Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # a larger init than HF's default makes the logits peaked, so greedy ties are rare
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):  # only with attention_bias / mlp_bias: not left zero
                p.normal_(0, 0.3)
    model = model.to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF transformers' greedy tokens and raw logits ([steps, vocab]) for one prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([step[0] for step in out.logits]).float()


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
