"""On a CUDA GPU (skipped elsewhere): mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared
expert) on the GPU's attention backend, with CUDA graphs asked for and left out (the expert loop
reads its row counts on the host), against Hugging Face's prompt logits and teacher-forced
greedy tokens. The same checks run on CPU in tests/model/test_moe.py."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_tiny_model, check_teacher_forced, load_hf

from nanokv import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_matches_hf_on_cuda_without_graphs(tmp_path, arch):
    model = build_tiny_model(str(tmp_path / arch), arch, tokenizer=False,
                             max_position_embeddings=256)
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=256, block_size=16, device="cuda",
              dtype="float32", max_num_batched_tokens=64, enforce_eager=False)
    assert llm.engine.runner.graphs is None
    rng = random.Random(1)
    batch = [[rng.randrange(1, 200) for _ in range(n)] for n in (5, 33, 120, 70)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            return_prompt_logits=True)
    hf = load_hf(model)
    for prompt, out in zip(batch, llm.generate(batch, params, use_tqdm=False)):
        check_teacher_forced(hf, prompt, out, atol=1e-3)
    llm.engine.check_invariants()
