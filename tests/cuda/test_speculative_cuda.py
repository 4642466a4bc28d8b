"""On a CUDA GPU (skipped elsewhere): speculative decoding (n-gram drafts) gives the tokens
decoding alone gives. Verification steps (a request's token and its drafts, one decode row
each) run eagerly through the CUDA decode kernels while steps without drafts replay decode
graphs; oracles: Hugging Face
transformers' greedy tokens and the same engine without speculative_config (eager), over the
float pool, the int8 / fp8 stores, the kvquant / kivi stores (their Triton writes, drafts before
a block's last slot), and under preemption. Every run asserts that drafts were
accepted, else it would test nothing."""

from __future__ import annotations

import pytest
import torch

from nanokv import LLM, SamplingParams
from tiny_models import hf_greedy, load_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}


def looping_prompts(count: int = 6) -> list[list[int]]:
    """Prompts of a short segment repeated (n-grams to draft from), of different lengths."""
    prompts = []
    for i in range(count):
        segment = [(7 * i + 13 * j) % 200 + 3 for j in range(3 + i)]
        prompts.append(segment * (2 + i % 3) + segment[:i % 2])
    return prompts


def engine(model: str, enforce_eager: bool, speculative: bool, **options) -> LLM:
    return LLM(model, device=DEVICE, dtype="float32", block_size=16, max_model_len=128,
               max_num_seqs=8, skip_tokenizer_init=True, enforce_eager=enforce_eager,
               speculative_config=SPEC if speculative else None, **options)


def accepted(llm: LLM) -> int:
    return llm.engine.scheduler.spec_stats.num_accepted_tokens


@pytest.mark.parametrize("options", [
    dict(), dict(num_kv_blocks=12), dict(kv_cache_dtype="int8"),
    dict(kv_cache_dtype="fp8", num_kv_blocks=12), dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
    dict(kv_cache_dtype="kivi", kv_quant_bits=2, num_kv_blocks=12)],
    ids=["float", "preemption", "int8", "fp8_preemption", "kvquant", "kivi_preemption"])
def test_greedy_drafts_equal_decoding_alone_and_hf(tiny_model, options):
    prompts = looping_prompts()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = engine(tiny_model, enforce_eager=True, speculative=False, **options)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = engine(tiny_model, enforce_eager=False, speculative=True, **options)
    got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert accepted(spec) > 0
    if "num_kv_blocks" in options:
        assert spec.engine.scheduler.num_preemptions > 0
    if "kv_cache_dtype" not in options:  # a float pool: Hugging Face's greedy tokens too
        hf = load_hf(tiny_model)
        assert want == [hf_greedy(hf, p, 30)[0] for p in prompts]
    spec.engine.check_invariants()
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_seeded_sampling_with_drafts_equals_decoding_alone(tiny_llama):
    prompts = looping_prompts()
    params = [SamplingParams(temperature=0.6, top_k=8, top_p=0.9, seed=40 + i, max_tokens=30,
                             ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    plain = engine(tiny_llama, enforce_eager=True, speculative=False)
    spec = engine(tiny_llama, enforce_eager=False, speculative=True)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert accepted(spec) > 0
