"""On a CUDA GPU (skipped elsewhere): Gemma 3 (sliding and full layers, each kind with its
RoPE, four norms a layer, the gelu-tanh MLP) and Gemma 2 (the same layer with one RoPE, no q / k
norms, the attention logit soft-cap in the Triton kernels) on the GPU's attention backend, with
and without CUDA graphs, and with a request sliced by the hybrid KV cache manager, against
Hugging Face's prompt logits and teacher-forced greedy tokens. The same checks run on CPU in
tests/model/test_gemma3.py, test_gemma2.py and test_hybrid_kv.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, check_cuda_engine, record_slicing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# each architecture's attention logit soft-cap in the tiny models (tests/tiny_models.py)
SOFT_CAPS = {"gemma3": None, "gemma2": 2.0}


@pytest.mark.parametrize("arch", sorted(SOFT_CAPS))
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gemma_matches_hf_on_cuda(tmp_path, arch, enforce_eager):
    model = build_tiny_model(str(tmp_path / arch), arch, tokenizer=False,
                             num_hidden_layers=4, max_position_embeddings=256)
    llm = check_cuda_engine(model, seed=2, vocab=250, enforce_eager=enforce_eager)
    assert llm.engine.attention_backend.soft_cap == SOFT_CAPS[arch]
    assert (llm.engine.runner.graphs is None) == enforce_eager


@pytest.mark.parametrize("arch", sorted(SOFT_CAPS))
def test_gemma_sliced_requests_on_cuda(tmp_path, monkeypatch, arch):
    """The hybrid KV cache manager on the GPU: ten blocks hold the four requests only with a
    request sliced (per-layer flat block tables through the Triton kernels, soft-capping for
    Gemma 2, its slices packed by copies on the GPU); the same checks against HF."""
    sliced = record_slicing(monkeypatch)
    model = build_tiny_model(str(tmp_path / arch), arch, tokenizer=False,
                             num_hidden_layers=6, max_position_embeddings=256,
                             layer_types=["sliding_attention"] * 2 + ["full_attention"]
                             + ["sliding_attention"] * 3)
    check_cuda_engine(model, seed=2, vocab=250, num_kv_blocks=10)
    assert sliced
