"""KVQuant's quantize-on-write in C (`nanokv.quant.native_write`: per token, and per channel
when a key block fills) against the PyTorch path (`LayerCodec.quantize` + `KVQuantStore._put`):
the same bytes in every buffer for every bit width, codebook or uniform grid, calibrated
thresholds or z-scores, outlier fraction, sparse dtype, int16 / int32 outlier indexes, sink
tokens, blocks filled from staged and new keys, keys kept per token; the same dequantized cache
where ties make the outlier choice arbitrary (constant rows); bad inputs refused."""

import pytest
import torch
from kvquant_write_cases import (BLOCK, CONFIGS, EXTRA, HKV, NUM_BLOCKS, STEPS,
                                 assert_same_bytes, config_for, write_steps)
from narrow_builds import run_narrow_build

from nanokv.cache.kv_pool import KVLayout
from nanokv.layers.native_attention import NativeKernelUnavailable
from nanokv.quant import KVQuantConfig, KVQuantStore, native_write

try:
    native_write._LIBRARY.get()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"KVQuant write kernel unavailable: {e}", allow_module_level=True)


def _stores(config, head_dim):
    layout = KVLayout(2, HKV, head_dim, BLOCK, torch.float32)
    stores = [KVQuantStore(layout, NUM_BLOCKS, config, num_staging_blocks=4) for _ in range(2)]
    stores[1].native_write = False  # the PyTorch reference path
    assert stores[0].native_write
    return stores


@pytest.mark.parametrize("name", list(CONFIGS) + list(EXTRA))
def test_same_bytes_as_the_pytorch_path(name):
    config, head_dim = config_for(name)
    native, reference = _stores(config, head_dim)
    write_steps((native, reference), STEPS, head_dim, seed=len(name))
    assert assert_same_bytes(native, reference) >= 10


def test_constant_rows_read_back_the_same():
    """Every channel equal: which channels the outlier list names is a tie either way; what
    the store gives back is the constant exactly."""
    config = KVQuantConfig(bits=4, outlier_fraction=0.05)
    native, reference = _stores(config, 32)
    x = torch.full((5, HKV, 32), 0.375)
    x[2] = -2.5
    for store in (native, reference):
        plan = store.begin_step(list(range(5)), list(range(5)))
        store.write(0, plan, x, x)
    ids = torch.tensor([0])
    for store in (native, reference):
        _, values = store.read_blocks(0, ids)
        torch.testing.assert_close(values[0, :5], x, atol=0, rtol=0)


def test_bad_inputs_are_refused():
    config = KVQuantConfig(bits=4)
    store = _stores(config, 32)[0]
    parts = {f: store.buffers[f"v_{f}0"] for f in ("codes", "offset", "half", "oidx", "oval")}
    x = torch.randn(2, HKV, 32)
    with pytest.raises(ValueError, match="slots must lie"):
        native_write.quantize_tokens(x, torch.ones(2, dtype=torch.bool),
                                     torch.tensor([0, NUM_BLOCKS * BLOCK]), parts, 4, None)
    with pytest.raises(ValueError, match="takes float32"):
        native_write.quantize_tokens(x.double(), torch.ones(2, dtype=torch.bool),
                                     torch.tensor([0, 1]), parts, 4, None)
    with pytest.raises(ValueError, match="must be"):
        native_write.quantize_tokens(x, torch.ones(3, dtype=torch.bool), torch.tensor([0, 1]),
                                     parts, 4, None)


def test_a_build_without_avx512_gives_the_same_bytes(tmp_path):
    """The same checks with the library built without AVX-512 (an AVX2 machine's width)."""
    run_narrow_build(__file__, "(same_bytes or constant_rows) and not build", tmp_path,
                     "kvquant_quantize")
