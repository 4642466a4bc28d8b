"""A quantized KV cache gives a sequence the same outputs however its prompt is chunked and
however much of it a prefix-cache hit supplies: every prefill token attends as decode would
(`nanokv.quant.decode_view`). Brute force: the same prompts prefilled in chunks of different
sizes, and sent again to hit the prefix cache, against each other."""

import random

import pytest

from nanokv import LLM, SamplingParams
from tiny_models import VOCAB

STORES = [dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8_e4m3"),
          dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
          dict(kv_cache_dtype="kvquant", kv_quant_bits=2), dict(kv_cache_dtype="kivi",
                                                                kv_quant_bits=2)]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 30) for _ in range(n)]


def make(model_dir, budget, **kv):
    return LLM(model_dir, skip_tokenizer_init=True, block_size=16, num_kv_blocks=64,
               max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=256, **kv)


@pytest.mark.parametrize("kv", STORES, ids=lambda kv: f"{kv['kv_cache_dtype']}"
                         f"{kv.get('kv_quant_bits', '')}")
def test_prompt_logits_do_not_depend_on_chunking(tiny_model, kv):
    prompt = tokens(100, 11)
    params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
    logits = {budget: make(tiny_model, budget, **kv).generate([prompt], params)[0].prompt_logits
              for budget in (16, 23, 128)}  # chunks on block edges, across them, one chunk
    for budget in (23, 128):
        diff = (logits[budget] - logits[16]).abs()
        # equal but for float rounding, which now and then moves a K/V element across a
        # rounding edge of its code (int8: a mean of 2.5e-5, a largest 6e-4 here); chunks that
        # attend to each other fresh differ far more (a mean of 6e-4 to 0.18)
        assert float(diff.mean()) < 1e-4 and float(diff.max()) < 5e-3, budget


@pytest.mark.parametrize("kv", STORES, ids=lambda kv: f"{kv['kv_cache_dtype']}"
                         f"{kv.get('kv_quant_bits', '')}")
def test_prefix_hits_leave_outputs_unchanged(tiny_model, kv):
    shared = tokens(41, 0)  # 2 full blocks and 9 tokens
    prompts = [shared + tokens(n, i + 1) for i, n in enumerate((5, 30, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    cold = make(tiny_model, 32, enable_prefix_caching=False, **kv).generate(prompts, params)
    llm = make(tiny_model, 32, **kv)
    first = llm.generate(prompts[:1], params)  # its blocks then serve the others' prefix
    warm = llm.generate(prompts, params)  # ... and its own whole prompt but the last block
    assert [o.num_cached_tokens for o in warm] == [32, 32, 32]
    assert first[0].token_ids == cold[0].token_ids
    for hit, ref in zip(warm, cold):
        assert hit.token_ids == ref.token_ids
        for got, want in zip(hit.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
            assert abs(got.logprob - want.logprob) < 1e-3  # 8e-5 at most here
            assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(got.top, want.top))
