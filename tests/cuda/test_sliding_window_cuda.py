"""On a CUDA GPU (skipped elsewhere): a model with a sliding window on every layer (Mistral's
sliding_window) on the Triton kernels (auto's choice: decode splits and prefill tiles from each
query's window) and on PyTorch's CUDA path (its padded decode batch masked to each request's
window), with Hugging Face's prompt logits and teacher-forced greedy tokens, and the blocks
behind the window freed. The same checks run on CPU in tests/model/test_sliding_window.py and,
for the kernels, in Triton's interpreter (tests/unit/test_triton_attention.py)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_tiny_model, load_hf

from nanokv import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("backend,chosen", [("auto", "triton"), ("torch", "torch")])
def test_sliding_window_matches_hf_on_cuda(tmp_path, backend, chosen):
    model = build_tiny_model(str(tmp_path / "mistral"), "mistral", tokenizer=False,
                             max_position_embeddings=256, sliding_window=12)
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=256, block_size=16, device="cuda",
              dtype="float32", max_num_batched_tokens=32, attention_backend=backend)
    assert llm.engine.attention_backend.name == chosen
    rng = random.Random(0)
    batch = [[rng.randrange(1, 200) for _ in range(n)] for n in (7, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                            return_prompt_logits=True)
    hf = load_hf(model)
    for prompt, out in zip(batch, llm.generate(batch, params, use_tqdm=False)):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        torch.testing.assert_close(out.prompt_logits.cpu(), logits[:len(prompt)], atol=1e-3,
                                   rtol=1e-3)
        assert out.token_ids == logits[len(prompt) - 1:-1].argmax(-1).tolist()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.engine.check_invariants()
