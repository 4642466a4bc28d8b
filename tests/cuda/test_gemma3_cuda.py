"""On a CUDA GPU (skipped elsewhere): Gemma 3 (sliding and full layers, each kind with its
RoPE, four norms a layer, the gelu-tanh MLP) on the GPU's attention backend, with and without
CUDA graphs, against Hugging Face's prompt logits and teacher-forced greedy tokens. The same
checks run on CPU in tests/model/test_gemma3.py."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_tiny_model, check_teacher_forced, load_hf

from nanokv import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gemma3_matches_hf_on_cuda(tmp_path, enforce_eager):
    model = build_tiny_model(str(tmp_path / "gemma3"), "gemma3", tokenizer=False,
                             num_hidden_layers=4, max_position_embeddings=256)
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=256, block_size=16, device="cuda",
              dtype="float32", max_num_batched_tokens=64, enforce_eager=enforce_eager)
    rng = random.Random(2)
    batch = [[rng.randrange(1, 250) for _ in range(n)] for n in (5, 33, 120, 70)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            return_prompt_logits=True)
    hf = load_hf(model)
    for prompt, out in zip(batch, llm.generate(batch, params, use_tqdm=False)):
        check_teacher_forced(hf, prompt, out, atol=1e-3)
    llm.engine.check_invariants()
