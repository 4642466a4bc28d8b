"""On a CUDA GPU (skipped elsewhere): Gemma 2 (one RoPE, no q / k norms, the attention logit
soft-cap in the Triton kernels) with and without CUDA graphs, and with a request sliced by the
hybrid KV cache manager, against Hugging Face's prompt logits and teacher-forced greedy tokens.
The same checks run on CPU in tests/model/test_gemma2.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, check_cuda_engine, record_slicing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gemma2_matches_hf_on_cuda(tmp_path, enforce_eager):
    model = build_tiny_model(str(tmp_path / "gemma2"), "gemma2", tokenizer=False,
                             num_hidden_layers=4, max_position_embeddings=256)
    llm = check_cuda_engine(model, seed=2, vocab=250, enforce_eager=enforce_eager)
    assert llm.engine.attention_backend.soft_cap == 2.0
    assert (llm.engine.runner.graphs is None) == enforce_eager


def test_gemma2_sliced_requests_on_cuda(tmp_path, monkeypatch):
    """Ten blocks hold the four requests only with a request sliced (per-layer tables through
    the soft-capping Triton kernels)."""
    sliced = record_slicing(monkeypatch)
    model = build_tiny_model(str(tmp_path / "gemma2"), "gemma2", tokenizer=False,
                             num_hidden_layers=6, max_position_embeddings=256,
                             layer_types=["sliding_attention"] * 2 + ["full_attention"]
                             + ["sliding_attention"] * 3)
    check_cuda_engine(model, seed=2, vocab=250, num_kv_blocks=10)
    assert sliced
