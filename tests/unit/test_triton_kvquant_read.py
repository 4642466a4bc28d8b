"""The Triton read of a KVQuant / KIVI store's blocks into dense K/V (`nanokv/kernels/triton/
kvquant_read.py`: a prefill chunk's cached prefix on CUDA) against the store's own
`read_blocks` (dequantize in PyTorch, rotate keys kept before RoPE): every store layout the
Triton backend serves, block sizes 16, 32 and 256, blocks written part-way (staged rows),
sinks, key outliers in one and in several chunks, bfloat16 staging.

On a CUDA machine the kernel runs on the GPU; without one in Triton's interpreter on CPU
(TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported).
"""

import pytest
import torch

from triton_device import triton_device

DEVICE = triton_device()  # the module skips without a GPU or the interpreter

from quant_stores import NUM_LAYERS, check_policy_view, fill, make_store  # noqa: E402

from nanokv.attention.triton_quantized import TritonQuantizedBackend  # noqa: E402
from nanokv.kernels.triton.kvquant_read import kvquant_read_blocks  # noqa: E402
from nanokv.utils import cdiv  # noqa: E402

STORES = ["kvquant:4bit", "kvquant:3bit-nuq", "kvquant:2bit-nuq-thresholds",
          "kvquant:mixed-8-4", "kvquant:per-channel-post-rope", "kvquant:4bit-outliers5",
          "kivi:2", "kivi:4"]


def check_read(store, tables, lens, atol=2e-5, rtol=1e-4):
    """Every written slot of every table's blocks, through the kernel, against read_blocks
    (the blocks given in one list, as the backend gives a step's prefixes)."""
    backend = TritonQuantizedBackend(store, store.device)
    ids = [b for t in tables for b in t]
    written = torch.zeros(len(ids), store.block_size, dtype=torch.bool)
    row = 0
    for t, n in zip(tables, lens):
        for j in range(len(t)):
            written[row, :min(store.block_size, n - j * store.block_size)] = True
            row += 1
    block_ids = torch.tensor(ids, dtype=torch.int32, device=store.device)
    rope = store.rotary.rotate if store.pre_rope_keys else None
    for layer in range(NUM_LAYERS):
        k_ref, v_ref = store.read_blocks(layer, block_ids, rope)  # [n, B, Hkv, D]
        k_out, v_out = torch.full_like(k_ref, float("nan")), torch.full_like(v_ref, float("nan"))
        kvquant_read_blocks(backend.layer_views(layer), block_ids, k_out, v_out)
        torch.testing.assert_close(k_out[written], k_ref[written], atol=atol, rtol=rtol)
        torch.testing.assert_close(v_out[written], v_ref[written], atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("block_size,d", [(16, 32), (32, 64)])
def test_read_equals_the_stores_read_blocks(kind, block_size, d):
    lens = [1, block_size - 1, block_size, 2 * block_size + 5, 3 * block_size]
    store = make_store(kind, d, block_size, sum(cdiv(n, block_size) for n in lens) + 2,
                       len(lens), device=DEVICE)
    tables = fill(store, lens, block_size // 2 + 3, seed=block_size + d)
    if "2bit" in kind or "outliers5" in kind:
        assert bool((store.buffers["k_oidx0"] >= 0).any())  # outliers kept
    assert bool((store.buffers["staging_index"] >= 0).any())  # a partial block staged
    check_read(store, tables, lens)


def test_read_blocks_of_256_with_key_outliers_in_several_chunks():
    """Blocks of 256 slots (16 programs a block and KV head), 5% key outliers: 820 entries a
    block and KV head at D = 64, 13 chunks of 64."""
    lens = [256, 300, 600]
    store = make_store("kvquant:4bit-outliers5", 64, 256, 6, len(lens), device=DEVICE)
    tables = fill(store, lens, 200, seed=3)
    assert int((store.buffers["k_oidx0"] >= 0).sum(-1).max()) > 64 * 4
    check_read(store, tables, lens)


def test_read_with_bfloat16_staging():
    lens = [20, 37]
    store = make_store("kvquant:2bit-nuq-thresholds", 32, 16, 6, len(lens),
                       staging_dtype=torch.bfloat16, device=DEVICE)
    tables = fill(store, lens, 9, seed=5)
    check_read(store, tables, lens)


def test_read_refuses_bad_arguments():
    store = make_store("kvquant:4bit", 32, 16, 4, 1, device=DEVICE)
    views = TritonQuantizedBackend(store, store.device).layer_views(0)
    ids = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    good = torch.empty(2, 16, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="k_out, v_out must be"):
        kvquant_read_blocks(views, ids, torch.empty(1, 16, 2, 32, device=DEVICE), good[:1])
    with pytest.raises(ValueError, match="block_ids must be"):
        kvquant_read_blocks(views, ids.float(), good, good.clone())
    kvquant_read_blocks(views, ids[:0], good, good.clone())  # nothing to read


@pytest.mark.parametrize("kind", ["kvquant:2bit-nuq-thresholds", "kvquant:4bit-outliers5",
                                  "kivi:2"])
def test_policy_views_read_through_the_kernel(kind):
    """The backend installs its read as the store's block reader: a policy's view of each
    request (sinks, outliers, keys before RoPE, partial blocks staged) equals the view through
    `read_blocks`."""
    lens = [5, 16, 37]
    store = make_store(kind, 32, 16, 8, len(lens), device=DEVICE)
    assert store.block_reader is None
    TritonQuantizedBackend(store, store.device)
    tables = fill(store, lens, 11, seed=9)
    check_policy_view(store, tables, lens)


@pytest.mark.parametrize("kind", ["kvquant:ablation-per-token-post-rope", "int8"])
def test_built_directly_over_a_store_it_cannot_read(kind):
    """The selector asks why_not before it builds the backend; built directly over a store its
    kernels cannot read, the backend refuses (it would read the codes wrongly)."""
    store = make_store(kind, 32, 16, 8, 2, device=DEVICE)
    with pytest.raises(ValueError, match="cannot serve this cache"):
        TritonQuantizedBackend(store, store.device)
    assert store.block_reader is None
