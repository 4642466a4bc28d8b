"""int8 quantize-on-write in C (`csrc/int8_quantize.c`) against the PyTorch path
(`quantize_int8`, then index_copy_) byte for byte: random rows, all-zero rows, rows whose codes
fall on .5 (round half to even), tiny magnitudes, one and many tokens (the threaded split),
slots in any order; the int8 store's write equal to the base class's PyTorch write; bad slots
refused with nothing written; and the same built without AVX-512 and without AVX2."""

import pytest
import torch
from narrow_builds import run_narrow_build

from nanokv.layers.native_attention import NativeKernelUnavailable
from nanokv.quant import native_int8
from nanokv.quant.int8 import quantize_int8

try:
    native_int8._LIBRARY.get()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"int8 write kernel unavailable: {e}", allow_module_level=True)


def rows(t: int, h: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=gen) * torch.rand(t, h, 1, generator=gen) * 10
    x[0, 0] = 0.0  # scale 0
    if t > 1:  # codes on .5: amax 127 gives scale 1, so x / scale = x exactly
        x[1, 0] = torch.arange(d) % 7 - 3.5
        x[1, 0, 0] = 127.0
    if t > 2:
        x[2, -1] *= 1e-38  # around FLT_MIN
    return x


def reference_write(x, slots, codes, scales):
    c, s = quantize_int8(x)
    codes.index_copy_(0, slots, c)
    scales.index_copy_(0, slots, s)


@pytest.mark.parametrize("t,h,d", [(1, 8, 128), (3, 4, 32), (37, 2, 64), (600, 8, 128)])
def test_equals_the_pytorch_path(t, h, d):
    x = rows(t, h, d, seed=t + h + d)
    slots = torch.randperm(2 * t + 5, generator=torch.Generator().manual_seed(t))[:t]
    got = (torch.zeros(2 * t + 5, h, d, dtype=torch.uint8), torch.zeros(2 * t + 5, h))
    want = (got[0].clone(), got[1].clone())
    native_int8.quantize_write(x, slots, *got)
    reference_write(x, slots, *want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_int8_store_writes_what_the_pytorch_path_writes(monkeypatch):
    from nanokv.cache.layout import KVLayout
    from nanokv.quant.pertoken_store import Int8KVStore

    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, block_size=16,
                      dtype=torch.float32)
    native, plain = Int8KVStore(layout, num_blocks=6), Int8KVStore(layout, num_blocks=6)
    slots = [3, 17, 40, 41, 90]
    plan = native.plan_write(slots, list(range(len(slots))))
    for layer in range(2):
        k, v = rows(5, 4, 32, seed=layer), rows(5, 4, 32, seed=10 + layer)
        native.write(layer, plan, k, v)
        with monkeypatch.context() as m:  # the PyTorch path: the kernel reported unavailable
            m.setattr(native_int8, "native_int8_available", lambda: False)
            plain.write(layer, plan, k, v)
    for name in native.buffers:
        assert torch.equal(native.buffers[name], plain.buffers[name]), name


def test_bad_inputs_are_refused_and_nothing_is_written():
    codes, scales = torch.zeros(8, 2, 16, dtype=torch.uint8), torch.zeros(8, 2)
    x = torch.randn(2, 2, 16)
    with pytest.raises(IndexError, match="outside"):
        native_int8.quantize_write(x, torch.tensor([1, 8]), codes, scales)
    assert not codes.any() and not scales.any()
    with pytest.raises(ValueError, match="int8 write takes"):
        native_int8.quantize_write(x.double(), torch.tensor([1, 2]), codes, scales)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        native_int8.quantize_write(x, torch.tensor([1]), codes, scales)


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx2"])
def test_a_narrower_build_equals_the_pytorch_path(tmp_path, flags):
    run_narrow_build(__file__, "test_equals_the_pytorch_path", tmp_path, "int8_quantize",
                     flags=flags, timeout=300)
