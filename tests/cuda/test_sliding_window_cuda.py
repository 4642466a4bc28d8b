"""On a CUDA GPU (skipped elsewhere): a model with a sliding window on every layer (Mistral's
sliding_window) on the Triton kernels (auto's choice: decode splits and prefill tiles from each
query's window) and on PyTorch's CUDA path (its padded decode batch masked to each request's
window), with Hugging Face's prompt logits and teacher-forced greedy tokens, and the blocks
behind the window freed; and the quantized caches with a window (Triton against PyTorch's CUDA
path). The same checks run on CPU in tests/model/test_sliding_window.py and
test_sliding_window_quantized.py and, for the kernels, in Triton's interpreter
(tests/unit/test_triton_attention.py, test_triton_kvquant.py)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_tiny_model, check_teacher_forced, load_hf

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
        check_teacher_forced(hf, prompt, out, atol=1e-3)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.engine.check_invariants()


@pytest.mark.parametrize("kv", [dict(kv_cache_dtype="int8"),
                                dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
                                dict(kv_cache_dtype="kivi", kv_quant_bits=2)])
def test_quantized_caches_with_a_window_on_cuda(tmp_path, kv):
    """The quantized caches with a window on every layer: the Triton kernels (auto's choice:
    the int8 store's paged kernels, KVQuant / KIVI's decode over codes and the STAGED prefill,
    each from the window's first slot) give the greedy tokens of PyTorch's CUDA path over the
    dequantized blocks, whole prompts and 16-token chunks alike (decode's view); the blocks
    behind the window freed. CPU: tests/model/test_sliding_window_quantized.py."""
    model = build_tiny_model(str(tmp_path / "mistral"), "mistral", tokenizer=False,
                             max_position_embeddings=256, sliding_window=12)
    rng = random.Random(1)
    batch = [[rng.randrange(1, 200) for _ in range(n)] for n in (7, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for backend, chunk in (("auto", 512), ("auto", 16), ("torch", 16)):
        llm = LLM(model, skip_tokenizer_init=True, max_model_len=256, block_size=16,
                  device="cuda", dtype="float32", max_num_batched_tokens=chunk,
                  attention_backend=backend, **kv)
        assert llm.engine.attention_backend.name == ("triton" if backend == "auto" else "torch")
        runs.append([o.token_ids for o in llm.generate(batch, params, use_tqdm=False)])
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert runs[0] == runs[1] == runs[2]
