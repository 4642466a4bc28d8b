"""Sliding-window models over quantized KV caches (int8, fp8, KVQuant, KIVI): in the engine, every
decode call of the C kernels equals dequantize-then-dense (`reference_quantized_attention`) over
the request's own block table and the layer's window, the blocks behind a window on every layer
freed after each step (Mistral) or kept (a hybrid Qwen2); a sequence's tokens do not depend on how
its prompt is chunked, on which CPU backend runs it (the C decode kernels or PyTorch over the
dequantized blocks), on prefix hits or on two tensor-parallel ranks; the blocks behind the
window freed after every step (brute force), so a pool smaller than one max_model_len request
serves it."""

import pytest
import torch
from test_sliding_window import (  # noqa: F401 (models: the fixture)
    MODELS,
    check_window_tables,
    models,
    prompts,
    run_by_steps,
)

from nanokv import LLM, SamplingParams
from nanokv.attention.native_quantized import NativeQuantizedBackend
from nanokv.quant.attention import reference_quantized_attention
from nanokv.utils import cdiv

CACHES = {  # name: engine options
    "int8": dict(kv_cache_dtype="int8"),
    "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
    "kvquant4": dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
    "kivi2": dict(kv_cache_dtype="kivi", kv_quant_bits=2),
}
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def engine(models, name, cache, **options):  # noqa: F811 (the fixture's value)
    return LLM(models[name], skip_tokenizer_init=True, max_model_len=256, block_size=16,
               **CACHES[cache], **options)


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", ["mistral", "qwen2_hybrid"])
def test_decodes_equal_the_reference_over_each_window(models, monkeypatch, name, cache):  # noqa: F811
    """Every decode call: each request against dequantize-then-dense over its table as the
    engine holds it (the freed blocks gone from its front) with the layer's window."""
    real_build, real_decode = NativeQuantizedBackend.build, NativeQuantizedBackend.decode
    steps, checked = [], []

    def build(self, common):
        steps.append(common)
        return real_build(self, common)

    def decode(self, layer, q, k, v, at, scale):
        out = real_decode(self, layer, q, k, v, at, scale)
        store, common = self.kv_cache, steps[-1]
        window = store.layout.window(layer)
        for i, (table, n) in enumerate(zip(common.decode_block_tables,
                                           common.decode_context_lens)):
            ref = reference_quantized_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], store,
                                                layer, table, n - 1, scale, store.rope,
                                                window=window)
            torch.testing.assert_close(out[i:i + 1], ref, atol=2e-5, rtol=1e-4)
        checked.append(window)
        return out

    monkeypatch.setattr(NativeQuantizedBackend, "build", build)
    monkeypatch.setattr(NativeQuantizedBackend, "decode", decode)
    llm = engine(models, name, cache, max_num_batched_tokens=24)
    outs = llm.generate(prompts(3), PARAMS, use_tqdm=False)
    assert type(llm.engine.attention_backend) is NativeQuantizedBackend
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outs)
    assert MODELS[name][2] in checked  # windowed layers decoded
    # slots a table holds (from its first block on): with a window on every layer the window's
    # blocks only (at most W - 1 + B), else the whole context (the 90-token prompt and more)
    longest = max(n for c in steps for n in c.decode_context_lens)
    assert longest > 90 if name == "qwen2_hybrid" else longest < MODELS[name][2] + 16


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", ["mistral", "qwen2_hybrid"])
def test_tokens_do_not_depend_on_chunks_backend_or_prefix_hits(models, name, cache):  # noqa: F811
    """Decode's view: whole prompts, 16-token chunks, the PyTorch backend and a second run over
    the prefix cache all give the same greedy tokens."""
    batch = prompts(8)
    whole = engine(models, name, cache, max_num_batched_tokens=512)
    want = [o.token_ids for o in whole.generate(batch, PARAMS, use_tqdm=False)]
    chunked = engine(models, name, cache, max_num_batched_tokens=16)
    assert [o.token_ids for o in chunked.generate(batch, PARAMS, use_tqdm=False)] == want
    again = chunked.generate(batch, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > 0
    torch_path = engine(models, name, cache, max_num_batched_tokens=16, attention_backend="torch")
    assert [o.token_ids for o in torch_path.generate(batch, PARAMS, use_tqdm=False)] == want
    chunked.engine.check_invariants()


@pytest.mark.parametrize("cache", ["int8", "kvquant4"])
def test_a_small_pool_frees_the_blocks_behind_the_window(models, cache):  # noqa: F811
    """Mistral (a window of W = 12 on every layer) on a quantized pool of 6 blocks (96 tokens)
    with max_model_len 256: after every step each running request's table starts at the block
    of its next token's first visible slot and holds at most cdiv(W - 1 + T, B) + 1 blocks;
    100-150-token prompts run, several at once, with the tokens of a pool large enough for all
    of them at once."""
    window, bs, budget = MODELS["mistral"][2], 16, 16
    cap = cdiv(window - 1 + budget, bs) + 1
    batch = prompts(11, (100, 150, 120))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = engine(models, "mistral", cache, max_num_batched_tokens=budget, num_kv_blocks=6)
    assert small.engine.kv_cache_plan.blocks_per_request == cap
    most_running = 0

    def check_tables(engine) -> None:
        nonlocal most_running
        assert check_window_tables(engine, window, bs) <= cap
        most_running = max(most_running, len(engine.scheduler.running))

    outputs = run_by_steps(small.engine, batch, params, check_tables)
    assert most_running >= 2
    assert small.engine.block_manager.num_free_blocks == 6
    large = engine(models, "mistral", cache, max_num_batched_tokens=budget)
    want = large.generate(batch, params, use_tqdm=False)
    assert [outputs[str(i)].token_ids for i in range(len(batch))] == [o.token_ids for o in want]


@pytest.mark.parametrize("cache", ["int8", "kivi2"])  # (KVQuant runs on one rank only)
def test_tensor_parallel_ranks_apply_the_window(models, cache):  # noqa: F811
    """Two ranks (gloo), each holding one of the two KV heads in its own quantized cache (the
    codes' statistics are per KV head: sharding changes none of them) with rank 0's windows:
    the greedy tokens of one process."""
    batch = prompts(6)
    want = [o.token_ids for o in engine(models, "qwen3", cache, max_num_batched_tokens=32)
            .generate(batch, PARAMS, use_tqdm=False)]
    llm = engine(models, "qwen3", cache, max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(batch, PARAMS, use_tqdm=False)] == want
        llm.engine.check_invariants()
    finally:
        llm.engine.close()
