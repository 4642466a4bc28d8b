"""KIVI's quantize-on-write as a Triton kernel (`nanokv/kernels/triton/kivi_write.py`, the
store's write on CUDA) against the PyTorch path (`KIVIStore._quantize_blocks`): the same bytes in
every buffer (codes, fp16 min / scale rounded outward, staging) for 2 and 4 bits, value groups of
32, 16 and 8 channels, head dims that are not powers of two, blocks filled from staged and new
tokens, values past fp16's range and subnormal, constant groups, bfloat16 tokens and staging,
block size 32; bad inputs refused.

On a CUDA machine the kernel compiles and runs on the GPU; without one it runs in Triton's
interpreter on CPU (TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported).
"""

import pytest
import torch

from triton_device import triton_device

DEVICE = triton_device()  # the module skips without a GPU or the interpreter

from kvquant_write_cases import HKV, NUM_BLOCKS, STEPS, assert_same_bytes, write_steps  # noqa: E402

from nanokv.cache.kv_pool import KVLayout  # noqa: E402
from nanokv.quant.kivi_store import KIVIStore  # noqa: E402


def _stores(bits, head_dim, group_size, dtype=torch.float32, block=16):
    """(the Triton path's store, the PyTorch path's) on DEVICE."""
    layout = KVLayout(2, HKV, head_dim, block, dtype)
    stores = [KIVIStore(layout, NUM_BLOCKS, DEVICE, bits=bits, group_size=group_size,
                        num_staging_blocks=4) for _ in range(2)]
    stores[0].triton_write, stores[1].triton_write = True, False
    return stores


@pytest.mark.parametrize("bits,head_dim,group_size", [(2, 32, 32), (4, 32, 16), (2, 48, 16),
                                                      (4, 40, 8), (2, 128, 32)])
def test_same_bytes_as_the_pytorch_path(bits, head_dim, group_size):
    triton_store, reference = _stores(bits, head_dim, group_size)
    write_steps((triton_store, reference), STEPS, head_dim, seed=bits + head_dim, device=DEVICE)
    assert bool((reference.buffers["k_scale"] != 0).any())  # blocks were quantized
    assert bool((reference.buffers["staging_k"] != 0).any())  # and tokens staged
    assert assert_same_bytes(triton_store, reference) == 9


def test_bfloat16_tokens_and_staging():
    triton_store, reference = _stores(2, 32, 32, torch.bfloat16)
    write_steps((triton_store, reference), STEPS, 32, seed=5, device=DEVICE,
                dtype=torch.bfloat16)
    assert assert_same_bytes(triton_store, reference) == 9


def test_block_size_32_and_strided_tokens():
    triton_store, reference = _stores(4, 32, 16, block=32)
    steps = [(list(range(0, 40)), list(range(40))), ([40, 192], [40, 0]),
             (list(range(41, 64)) + list(range(193, 224)),
              list(range(41, 64)) + list(range(1, 32)))]
    write_steps((triton_store, reference), steps, 32, seed=3, device=DEVICE, strided=True)
    assert assert_same_bytes(triton_store, reference) == 9


def test_constant_groups_read_back_exactly():
    """A constant channel (keys) or group (values) has scale 0 and codes 0: read back exactly."""
    triton_store, reference = _stores(2, 32, 16)
    x = torch.full((16, HKV, 32), 0.375, device=DEVICE)
    x[:, 1] = -2.5
    for store in (triton_store, reference):
        store.write(0, store.begin_step(list(range(16)), list(range(16))), x, x)
    assert assert_same_bytes(triton_store, reference) == 9
    keys, values = triton_store.read_blocks(0, torch.tensor([0], device=DEVICE))
    torch.testing.assert_close(keys[0], x, atol=0, rtol=0)
    torch.testing.assert_close(values[0], x, atol=0, rtol=0)


def test_groups_below_fp16s_smallest_step():
    """Groups whose min or scale falls between zero and fp16's smallest subnormal: rounded
    outward past zero (nextafter from +-0), as the PyTorch path."""
    triton_store, reference = _stores(2, 32, 8)
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(16, HKV, 32, generator=gen) * 1e-8 - 1e-9  # min < 0 < max, span << 2^-24
    x[:, 1] = torch.rand(16, 32, generator=gen) * 1e-8  # min >= 0
    x = x.to(DEVICE)
    for store in (triton_store, reference):
        store.write(0, store.begin_step(list(range(16)), list(range(16))), x, -x)
    assert bool((reference.buffers["k_scale"][0, 0].view(torch.int16) == 1).any())
    assert bool((reference.buffers["k_min"][0, 0].view(torch.int16) == -32767).any())
    assert assert_same_bytes(triton_store, reference) == 9


def test_padded_entries_are_skipped():
    """Block id -1 (a CUDA graph's padding) writes nothing."""
    from nanokv.kernels.triton import kivi_write

    store = _stores(2, 32, 32)[0]
    buf = store.buffers
    before = {name: b.clone() for name, b in buf.items()}
    x = torch.randn(16, HKV, 32, device=DEVICE)
    src = torch.arange(16, device=DEVICE)[None] + 4 * 16  # every slot from the step's tokens
    staging = buf["staging_k"][0].view(-1, HKV, 32)
    kivi_write.quantize_blocks(x, staging, src, torch.tensor([-1], device=DEVICE),
                               buf["k_codes"][0], buf["k_min"][0], buf["k_scale"][0], 2, True)
    assert all(torch.equal(buf[name], before[name]) for name in buf)
    kivi_write.quantize_blocks(x, staging, src, torch.tensor([3], device=DEVICE),
                               buf["k_codes"][0], buf["k_min"][0], buf["k_scale"][0], 2, True)
    assert not torch.equal(buf["k_codes"][0, 3], before["k_codes"][0, 3])


def test_group_sizes_not_a_power_of_two_stay_on_pytorch():
    """The kernel takes value groups of a power of two channels (`fits`); a CUDA store with
    others keeps the PyTorch write (a CPU store always does)."""
    from nanokv.kernels.triton import kivi_write

    assert [g for g in range(1, 65) if kivi_write.fits(g)] == [1, 2, 4, 8, 16, 32, 64]
    layout = KVLayout(1, HKV, 48, 16, torch.float32)
    odd, even = (KIVIStore(layout, 4, DEVICE, bits=2, group_size=g, num_staging_blocks=1)
                 for g in (12, 16))
    assert not odd.triton_write
    assert even.triton_write == (DEVICE.type == "cuda")


def test_bad_inputs_are_refused():
    from nanokv.kernels.triton import kivi_write

    store = _stores(2, 32, 32)[0]
    buf = store.buffers
    x = torch.randn(16, HKV, 32, device=DEVICE)
    src = torch.arange(16, device=DEVICE)[None]
    ids = torch.tensor([0], device=DEVICE)
    staging = buf["staging_v"][0].view(-1, HKV, 32)
    args = (buf["v_codes"][0], buf["v_min"][0], buf["v_scale"][0])
    with pytest.raises(ValueError, match=r"unsupported x \[T, H, D\] torch.float64"):
        kivi_write.quantize_blocks(x.double(), staging, src, ids, *args, 2, False, 32)
    with pytest.raises(ValueError, match="bits 3"):
        kivi_write.quantize_blocks(x, staging, src, ids, *args, 3, False, 32)
    with pytest.raises(ValueError, match="group_size 12"):
        kivi_write.quantize_blocks(x, staging, src, ids, *args, 2, False, 12)
    with pytest.raises(ValueError, match="lo / scale"):  # value statistics given for keys
        kivi_write.quantize_blocks(x, staging, src, ids, *args, 2, True)
