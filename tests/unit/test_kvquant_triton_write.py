"""KVQuant's quantize-on-write as Triton kernels (`nanokv/kernels/triton/kvquant_write.py`, the
store's write on CUDA) against the PyTorch path (`LayerCodec.quantize` + `KVQuantStore._put`):
the same bytes in every buffer for the C kernels' cases (every bit width, codebook or uniform
grid, calibrated thresholds or z-scores, outlier fractions, sparse dtypes, int16 / int32
indexes, sink tokens, blocks filled from staged and new keys, keys kept per token, keys and
values as strided views), bfloat16
keys and values (the GPU's model dtype) with a bfloat16 staging, block size 32, the dequantized
cache where ties make the outlier choice arbitrary; bad inputs refused.

On a CUDA machine the kernels compile and run on the GPU; without one they run in Triton's
interpreter on CPU (TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported).
"""

import pytest
import torch

from triton_device import triton_device

DEVICE = triton_device()  # the module skips without a GPU or the interpreter

from kvquant_write_cases import (  # noqa: E402
    BLOCK,
    CONFIGS,
    EXTRA,
    HKV,
    NUM_BLOCKS,
    STEPS,
    assert_same_bytes,
    config_for,
    write_steps,
)

from nanokv.cache.kv_pool import KVLayout  # noqa: E402
from nanokv.quant import KVQuantConfig, KVQuantStore  # noqa: E402


# the interpreter's numpy casts warn where a delta passes fp16's range: it becomes inf, as
# PyTorch's `.to(torch.float16)` makes it (the bytes are compared)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def _stores(config, head_dim, dtype=torch.float32, block=BLOCK):
    """(the Triton path's store, the PyTorch path's) on DEVICE."""
    layout = KVLayout(2, HKV, head_dim, block, dtype)
    stores = [KVQuantStore(layout, NUM_BLOCKS, config, num_staging_blocks=4, device=DEVICE)
              for _ in range(2)]
    stores[0].triton_write, stores[0].native_write = True, False
    stores[1].triton_write, stores[1].native_write = False, False
    return stores


@pytest.mark.parametrize("name", list(CONFIGS) + list(EXTRA))
def test_same_bytes_as_the_pytorch_path(name):
    config, head_dim = config_for(name)
    triton_store, reference = _stores(config, head_dim)
    write_steps((triton_store, reference), STEPS, head_dim, seed=len(name), device=DEVICE,
                strided=name == "mixed-8-4")
    assert assert_same_bytes(triton_store, reference) >= 10


@pytest.mark.parametrize("name", ["4bit", "3bit-nuq", "2bit-nuq-thresholds"])
def test_bfloat16_keys_and_values(name):
    """The GPU's model dtype: keys and values arrive in bfloat16 and wait in a bfloat16
    staging."""
    config, head_dim = config_for(name)
    triton_store, reference = _stores(config, head_dim, torch.bfloat16)
    write_steps((triton_store, reference), STEPS, head_dim, seed=7, device=DEVICE,
                dtype=torch.bfloat16)
    assert assert_same_bytes(triton_store, reference) >= 10


def test_block_size_32():
    config = KVQuantConfig(bits=4, outlier_fraction=0.03)
    triton_store, reference = _stores(config, 32, block=32)
    # block 0 fills within the prefill; block 1 from its 9 staged keys and 23 new ones, block 6
    # (with a second request's sink) from 1 and 31
    steps = [(list(range(0, 40)), list(range(40))), ([40, 192], [40, 0]),
             (list(range(41, 64)) + list(range(193, 224)),
              list(range(41, 64)) + list(range(1, 32)))]
    write_steps((triton_store, reference), steps, 32, seed=3, device=DEVICE)
    assert assert_same_bytes(triton_store, reference) >= 10


def test_constant_rows_read_back_the_same():
    """Every channel equal: which channels the outlier lists name is a tie either way; what
    the store gives back is the constant exactly."""
    config = KVQuantConfig(bits=4, outlier_fraction=0.05)
    triton_store, reference = _stores(config, 32)
    x = torch.full((16, HKV, 32), 0.375, device=DEVICE)
    x[2] = -2.5
    for store in (triton_store, reference):
        plan = store.begin_step(list(range(16)), list(range(16)))
        store.write(0, plan, x, x)
    ids = torch.tensor([0], device=DEVICE)
    for store in (triton_store, reference):
        keys, values = store.read_blocks(0, ids)
        torch.testing.assert_close(values[0], x, atol=0, rtol=0)
        torch.testing.assert_close(keys[0], x, atol=0, rtol=0)


def test_bad_inputs_are_refused():
    from nanokv.kernels.triton import kvquant_write

    store = _stores(KVQuantConfig(bits=4), 32)[0]
    parts = {f: store.buffers[f"v_{f}0"] for f in ("codes", "offset", "half", "oidx", "oval")}
    x = torch.randn(2, HKV, 32, device=DEVICE)
    ok = torch.ones(2, dtype=torch.bool, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    tables = kvquant_write.codebook_tables(None, DEVICE)
    with pytest.raises(ValueError, match="unsupported x torch.float64"):
        kvquant_write.quantize_tokens(x.double(), ok, slots, parts, 4, tables)
    with pytest.raises(ValueError, match="unsupported bits 5"):
        kvquant_write.quantize_tokens(x, ok, slots, parts, 5, tables)
    with pytest.raises(ValueError, match="must be"):
        kvquant_write.quantize_tokens(x, ok[:1], slots, parts, 4, tables)
