"""The cases both quantize-on-write kernels' tests write (tests/unit/test_kvquant_write.py: C;
test_kvquant_triton_write.py: Triton), and how they compare a store's buffers with the PyTorch
path's."""

import torch

from nanokv.quant import KVQuantConfig
from quant_stores import codebooks, kvquant_config

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


def config_for(name):
    if name in CONFIGS:
        return kvquant_config(name, CONFIGS[name]), CONFIGS[name]
    make, dim = EXTRA[name]
    return make(), dim


def activations(num_tokens, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HKV, head_dim, generator=gen)
    spikes = torch.rand(num_tokens, HKV, head_dim, generator=gen) < 0.03
    x = torch.where(spikes, x * 40, x)  # outliers of both signs
    x[0, 0, :3] = torch.tensor([70000.0, -1e-6, 3e-6])  # past fp16's range and subnormal
    return x


def _strided(x):
    """x as a view with a gap after each head (as the K / V views of a fused QKV output)."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., :x.shape[-1]] = x
    return wide[..., :x.shape[-1]]


def write_steps(stores, steps, head_dim, seed, device="cpu", dtype=torch.float32,
                strided=False):
    """Each step's keys and values (made on the CPU in float32, then moved to device and
    dtype; `strided`: as views with gaps) written to both layers of every store."""
    for i, (slots, positions) in enumerate(steps):
        k = activations(len(slots), head_dim, seed + 2 * i)
        v = activations(len(slots), head_dim, seed + 2 * i + 1)
        for store in stores:
            plan = store.begin_step(slots, positions)
            for layer in range(2):
                kl, vl = (x.to(device, dtype) for x in (k * (layer + 1), v - layer))
                if strided:
                    kl, vl = _strided(kl), _strided(vl)
                store.write(layer, plan, kl, vl)


STEPS = [(list(range(0, 21)), list(range(21))),  # a prefill of 21 tokens from position 0
         ([21, 48], [21, 0]),  # a decode, and a second request's first (sink) token
         ([22, 49, 50], [22, 1, 2]),
         # block 1 fills from its 7 staged keys and 9 new ones; block 3 (with the sink) from 3
         # and 13
         (list(range(23, 32)) + list(range(51, 64)), list(range(23, 32)) + list(range(3, 16)))]


def entries(store, name):
    """A buffer's outlier list with entries in index order (values alongside): the order of
    entries whose scores tie (the same value, as the spikes written to every step) is
    unspecified, and readers do not depend on it."""
    index = store.buffers[name].long()
    value = store.buffers[name.replace("oidx", "oval")]
    order = index.argsort(dim=-1, stable=True)
    return index.gather(-1, order), value.gather(-1, order).view(torch.uint8)


def as_bytes(buf):
    return buf.view(torch.uint8) if buf.dtype.is_floating_point else buf


def assert_same_bytes(store, reference) -> int:
    """Every buffer of `store` equal to `reference`'s byte for byte (outlier lists compared in
    index order, `entries`); returns how many buffers were compared."""
    checked = 0
    for key, buf in reference.buffers.items():
        if buf.numel() == 0 or "_oval" in key:
            continue
        if "_oidx" in key:
            for got, want in zip(entries(store, key), entries(reference, key)):
                assert torch.equal(got, want), key
        else:
            assert torch.equal(as_bytes(store.buffers[key]), as_bytes(buf)), key
        checked += 1
    return checked
