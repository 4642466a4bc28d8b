"""KVQuant's quantize-on-write in C (`nanokv.quant.native_write`: per token, and per channel
when a key block fills) against the PyTorch path (`LayerCodec.quantize` + `KVQuantStore._put`):
the same bytes in every buffer for every bit width, codebook or uniform grid, calibrated
thresholds or z-scores, outlier fraction, sparse dtype, int16 / int32 outlier indexes, sink
tokens, blocks filled from staged and new keys, keys kept per token; the same dequantized cache
where ties make the outlier choice arbitrary (constant rows); bad inputs refused."""

import pytest
import torch
from narrow_builds import run_narrow_build

from nanokv.cache.kv_pool import KVLayout
from nanokv.layers.native_attention import NativeKernelUnavailable
from nanokv.quant import KVQuantConfig, KVQuantStore, native_write
from quant_stores import codebooks, kvquant_config

try:
    native_write._LIBRARY.get()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"KVQuant write kernel unavailable: {e}", allow_module_level=True)

HKV, BLOCK, NUM_BLOCKS = 2, 16, 12

CONFIGS = {
    "4bit": 32, "3bit-nuq": 64, "2bit-nuq-thresholds": 32, "mixed-8-4": 48,
    "ablation-per-token-post-rope": 32,
}
EXTRA = {
    "4bit-bf16-sparse-wide": (lambda: KVQuantConfig(bits=4, sparse_dtype="bfloat16",
                                                    outlier_fraction=0.1), 40),
    "3bit-fp32-sparse": (lambda: KVQuantConfig(bits=3, sparse_dtype="float32",
                                               value_codebooks=codebooks(3, 5)), 24),
    "2bit-no-outliers": (lambda: KVQuantConfig(bits=2, outlier_fraction=0.0), 32),
    "4bit-int16-index": (lambda: KVQuantConfig(bits=4, outlier_fraction=0.02), 300),
}


def _config(name):
    if name in CONFIGS:
        return kvquant_config(name, CONFIGS[name]), CONFIGS[name]
    make, dim = EXTRA[name]
    return make(), dim


def _stores(config, head_dim):
    layout = KVLayout(2, HKV, head_dim, BLOCK, torch.float32)
    stores = [KVQuantStore(layout, NUM_BLOCKS, config, num_staging_blocks=4) for _ in range(2)]
    stores[1].native_write = False  # the PyTorch reference path
    assert stores[0].native_write
    return stores


def _activations(num_tokens, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HKV, head_dim, generator=gen)
    spikes = torch.rand(num_tokens, HKV, head_dim, generator=gen) < 0.03
    x = torch.where(spikes, x * 40, x)  # outliers of both signs
    x[0, 0, :3] = torch.tensor([70000.0, -1e-6, 3e-6])  # past fp16's range and subnormal
    return x


def _write(stores, steps, head_dim, seed):
    for i, (slots, positions) in enumerate(steps):
        k = _activations(len(slots), head_dim, seed + 2 * i)
        v = _activations(len(slots), head_dim, seed + 2 * i + 1)
        for store in stores:
            plan = store.begin_step(slots, positions)
            for layer in range(2):
                store.write(layer, plan, k * (layer + 1), v - layer)


STEPS = [(list(range(0, 21)), list(range(21))),  # a prefill of 21 tokens from position 0
         ([21, 48], [21, 0]),  # a decode, and a second request's first (sink) token
         ([22, 49, 50], [22, 1, 2]),
         # block 1 fills from its 7 staged keys and 9 new ones; block 3 (with the sink) from 3
         # and 13
         (list(range(23, 32)) + list(range(51, 64)), list(range(23, 32)) + list(range(3, 16)))]


def _entries(store, name):
    """A buffer's outlier list with entries in index order (values alongside): the order of
    entries whose scores tie (the same value, as the spikes written to every step) is
    unspecified, and readers do not depend on it."""
    index = store.buffers[name].long()
    value = store.buffers[name.replace("oidx", "oval")]
    order = index.argsort(dim=-1, stable=True)
    return index.gather(-1, order), value.gather(-1, order).view(torch.uint8)


def _as_bytes(buf):
    return buf.view(torch.uint8) if buf.dtype.is_floating_point else buf


@pytest.mark.parametrize("name", list(CONFIGS) + list(EXTRA))
def test_same_bytes_as_the_pytorch_path(name):
    config, head_dim = _config(name)
    native, reference = _stores(config, head_dim)
    _write((native, reference), STEPS, head_dim, seed=len(name))
    checked = 0
    for key, buf in reference.buffers.items():
        if buf.numel() == 0 or "_oval" in key:
            continue
        if "_oidx" in key:
            for got, want in zip(_entries(native, key), _entries(reference, key)):
                assert torch.equal(got, want), key
        else:
            assert torch.equal(_as_bytes(native.buffers[key]), _as_bytes(buf)), key
        checked += 1
    assert checked >= 10


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
