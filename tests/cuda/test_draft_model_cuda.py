"""On a CUDA GPU (skipped elsewhere): draft-model speculative decoding gives the tokens decoding
alone gives (the same engine without speculative_config, CUDA graphs on: steps with drafts run
eagerly, the draft model's passes always), over the float pool and int8, with drafts accepted.
The same checks run on CPU in tests/model/test_draft_model.py."""

from __future__ import annotations

import pytest
import torch

from nanokv import LLM, SamplingParams
from tiny_models import VOCAB, build_noisy_copy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_draft_model_outputs_are_decoding_alone_on_cuda(tiny_model, kv_cache_dtype, tmp_path):
    draft = build_noisy_copy(tiny_model, str(tmp_path / "draft"), 0.005)
    prompts = [[(7 * i + j) % (VOCAB - 10) + 2 for j in range(n)] * 3
               for i, n in enumerate((5, 8, 11, 30))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256,
                   skip_tokenizer_init=True, enforce_eager=False, kv_cache_dtype=kv_cache_dtype)
    want = [o.outputs[0].token_ids
            for o in LLM(tiny_model, **options).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_model, speculative_config={"model": draft, "num_speculative_tokens": 4},
              **options)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    llm.engine.check_invariants()
