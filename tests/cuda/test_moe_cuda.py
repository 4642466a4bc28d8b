"""On a CUDA GPU (skipped elsewhere): mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared
expert) on the GPU's attention backend, with CUDA graphs asked for and left out (the expert loop
reads its row counts on the host), against Hugging Face's prompt logits and teacher-forced
greedy tokens. The same checks run on CPU in tests/model/test_moe.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, check_cuda_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_matches_hf_on_cuda_without_graphs(tmp_path, arch):
    model = build_tiny_model(str(tmp_path / arch), arch, tokenizer=False,
                             max_position_embeddings=256)
    llm = check_cuda_engine(model, seed=1, vocab=200, enforce_eager=False)
    assert llm.engine.runner.graphs is None
