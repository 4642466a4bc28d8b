"""Speculative decoding through the attention backends CUDA takes, run here: the Triton
kernels in Triton's interpreter (the float pool, int8, KVQuant and KIVI codes read in place) and
the PyTorch backends, each over its draft rows as decode entries. Oracle: the same backend
without speculative_config, token for token; drafts must be accepted."""

from __future__ import annotations

import pytest

from nanokv import LLM, SamplingParams
from triton_device import triton_ready

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
        "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7, 8] * 5, [40, 41, 42] * 6 + [40], [90, 91, 92, 93, 94] * 4]
CACHES = {"float": {}, "int8": dict(kv_cache_dtype="int8"),
          "kvquant": dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
          "kivi": dict(kv_cache_dtype="kivi", kv_quant_bits=2)}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_drafts_through_the_backend_equal_decoding_alone(tiny_llama, backend, cache):
    if backend == "triton" and not triton_ready():
        pytest.skip("the Triton backends run on CPU only under TRITON_INTERPRET=1 with triton")
    options = dict(block_size=16, max_model_len=128, skip_tokenizer_init=True,
                   attention_backend=backend, **CACHES[cache])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(tiny_llama, **options)
    spec = LLM(tiny_llama, speculative_config=SPEC, **options)
    assert spec.engine.attention_backend.name == backend
    want = [o.token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0
    spec.engine.check_invariants()
