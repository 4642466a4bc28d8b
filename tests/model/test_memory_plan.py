"""The memory plan knows the attention backend: decode scratch is reserved per block only for a
backend that dequantizes the blocks it reads (PyTorch over a store); with one that reads the
codes in place (the C kernels) those bytes hold blocks. Block counts checked by brute force
against the KV cache spec's bytes."""

import pytest

from nanokv.engine import assembly, kv_cache_plan
from nanokv.engine.llm import LLM
from nanokv.layers.native_attention import NativeKernelUnavailable
from nanokv.layers.native_quant_attention import load_quant_kernels

AVAILABLE = 9 * 2**20  # MemAvailable as the plan sees it
ACTIVATION = 2 * 2**20  # peak activations as the profiler reports them


def _kernels_build() -> bool:
    try:
        load_quant_kernels()
    except NativeKernelUnavailable:
        return False
    return True


def most_blocks(budget: int, fixed: int, per_block: int) -> int:
    """The largest n with fixed + n * per_block <= budget, counted up one block at a time."""
    n = 0
    while fixed + (n + 1) * per_block <= budget:
        n += 1
    return n


@pytest.mark.skipif(not _kernels_build(), reason="quantized C kernels unavailable here")
@pytest.mark.parametrize("kv,extra", [("int8", {}), ("kvquant", {"kv_quant_bits": 4})])
def test_in_place_backend_gets_the_scratch_as_blocks(tiny_qwen3, monkeypatch, kv, extra):
    monkeypatch.setattr(kv_cache_plan, "available_host_memory", lambda: AVAILABLE)
    monkeypatch.setattr(assembly, "measure_activation_bytes",
                        lambda *args, **kwargs: (ACTIVATION, "fixed by the test"))
    engines = {}
    for backend in ("native", "torch"):
        llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=16, kv_cache_dtype=kv,
                  attention_backend=backend, max_num_seqs=64, max_model_len=512, **extra)
        engines[backend] = llm.engine
    native, torch_ = engines["native"], engines["torch"]
    assert native.attention_backend.name == "native"
    assert not native.attention_backend.dequantizes_blocks
    assert torch_.attention_backend.dequantizes_blocks
    spec = native.kv_cache_plan.spec
    assert spec.scratch_bytes_per_block > 0 and spec == torch_.kv_cache_plan.spec
    budget = int((AVAILABLE - ACTIVATION) * native.config.kv_cache_memory_fraction)
    expect_native = most_blocks(budget, spec.fixed_bytes, spec.bytes_per_block)
    expect_torch = most_blocks(budget, spec.fixed_bytes,
                               spec.bytes_per_block + spec.scratch_bytes_per_block)
    assert expect_native < 64 * 512 // 16  # the max_num_seqs cap does not bind here
    assert native.block_manager.num_blocks == expect_native
    assert torch_.block_manager.num_blocks == expect_torch < expect_native
    for e in (native, torch_):  # what was allocated is the plan's pool, nothing more
        assert e.kv_cache.num_blocks == e.block_manager.num_blocks
        assert e.kv_cache.nbytes == spec.pool_bytes(e.block_manager.num_blocks)
    assert "decode dequantization buffers" in torch_.kv_cache_plan.source
    assert "decode dequantization buffers" not in native.kv_cache_plan.source


def test_explicit_budget_reserves_no_scratch_for_either_backend(tiny_qwen3):
    budget = 2**20  # kv_cache_memory: transient buffers come out of other memory
    counts = {}
    for backend in ("auto", "torch"):
        e = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=16, kv_cache_dtype="int8",
                attention_backend=backend, kv_cache_memory=budget, max_num_seqs=4,
                max_model_len=256).engine
        spec = e.kv_cache_plan.spec
        counts[backend] = e.block_manager.num_blocks
        assert counts[backend] == most_blocks(budget, spec.fixed_bytes, spec.bytes_per_block)
    assert counts["auto"] == counts["torch"]
