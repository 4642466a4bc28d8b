"""int8 / fp8 / KVQuant block quantization against float references, with error bounds.

Documented bounds (uniform grids, per element, outliers and sinks excepted):
  int8:       |x - x_hat| <= scale / 2, scale = max|x| / 127 per token and head
  fp8 e4m3:   relative error <= 2**-4 (normal range), e5m2: <= 2**-3
  KVQuant b:  |x - x_hat| <= half_range / (2**b - 1) (+ fp16 rounding of offset / half-range)
RMS error on N(0, 1) data, block of 16 tokens x 64 channels, 2 / 3 / 4 / 8 bits (measured over
8 seeds): per channel 0.32-0.33 / 0.137-0.142 / 0.064-0.066 / 0.0037-0.0039, per token
0.448-0.457 / 0.189-0.197 / 0.088-0.091 / 0.0051-0.0054 (a token's range spans 64 samples, a
channel's 16). RMS_BOUND below leaves ~10% headroom.
"""

import dataclasses

import pytest

import torch

from nanokv.quant.codebook import fisher_kmeans
from nanokv.quant.fp8 import dequantize_fp8, quantize_fp8
from nanokv.quant.int8 import dequantize_int8, quantize_int8
from nanokv.quant.kvquant import KVQuantConfig, dequantize_blocks, outlier_capacity, quantize_blocks

RMS_BOUND = {True: {2: 0.37, 3: 0.16, 4: 0.073, 8: 0.0043},  # per channel
             False: {2: 0.50, 3: 0.22, 4: 0.10, 8: 0.006}}  # per token


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_int8_bound_and_storage():
    x = randn(5, 16, 2, 64) * 3
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.uint8 and scale.shape == (5, 16, 2)
    err = (dequantize_int8(codes, scale) - x).abs()
    assert bool((err <= scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all())
    zero_codes, zero_scale = quantize_int8(torch.zeros(2, 8))
    assert torch.equal(dequantize_int8(zero_codes, zero_scale), torch.zeros(2, 8))


@pytest.mark.parametrize("fmt,rel", [("e4m3", 2 ** -4), ("e5m2", 2 ** -3)])
def test_fp8_relative_bound(fmt, rel):
    x = randn(4, 16, 2, 64) * 5
    codes, scale = quantize_fp8(x, fmt)
    assert codes.dtype == torch.uint8
    deq = dequantize_fp8(codes, scale, fmt)
    # scaled so max |x| sits at the format's max: every value well above the subnormals
    big = x.abs() > scale.unsqueeze(-1) * 2 ** -6 * 1000
    err = (deq - x).abs()
    assert bool((err[big] <= x.abs()[big] * rel).all())
    assert float(err.max()) < float(x.abs().max()) * rel


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("per_channel", [True, False])
def test_uniform_block_bounds(bits, per_channel):
    x = randn(3, 16, 2, 64, seed=bits)
    valid = torch.ones(3, 16, dtype=torch.bool)
    q = quantize_blocks(x, valid, bits=bits, per_channel=per_channel)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < 2 ** bits
    deq = dequantize_blocks(q, bits=bits, per_channel=per_channel)
    unsq = 1 if per_channel else 3
    half = q.half_range.float().unsqueeze(unsq)
    off = q.offset.float().unsqueeze(unsq)
    bound = half / (2 ** bits - 1) * (1 + 1e-3) + 1e-3 * (off.abs() + half)
    assert bool(((deq - x).abs() <= bound).all())
    assert float((deq - x).pow(2).mean().sqrt()) < RMS_BOUND[per_channel][bits]


def test_outliers_come_back_and_do_not_stretch_the_range():
    x = randn(2, 16, 2, 64, seed=3)
    planted = [(0, 3, 1, 7, 40.0), (1, 9, 0, 0, -55.0), (0, 15, 0, 63, 33.0)]
    for b, s, h, d, val in planted:
        x[b, s, h, d] = val
    valid = torch.ones(2, 16, dtype=torch.bool)
    for per_channel in (True, False):
        q = quantize_blocks(x, valid, bits=4, per_channel=per_channel, outlier_fraction=0.01)
        assert q.outlier_index.shape == (2, 2, outlier_capacity(16, 64, 0.01))
        deq = dequantize_blocks(q, bits=4, per_channel=per_channel)
        # the same codes and statistics with the outlier lists emptied: the dense decoding
        dense = dequantize_blocks(dataclasses.replace(q, outlier_index=q.outlier_index[..., :0],
                                                      outlier_delta=q.outlier_delta[..., :0]),
                                  bits=4, per_channel=per_channel)
        for b, s, h, d, val in planted:
            assert int(s * 64 + d) in q.outlier_index[b, h].tolist()
            # back to within the fp16 rounding of its distance from the dense decoding, which
            # sits at the edge of the (unstretched) range
            miss = abs(val - float(dense[b, s, h, d]))
            assert miss > 25
            assert abs(float(deq[b, s, h, d]) - val) <= miss * 2.0 ** -11 + 1e-6
        keep = x.abs() < 30
        assert float((deq - x)[keep].abs().max()) < 0.7  # the outliers did not set the scale
    # per channel without outliers, a planted value stretches its channel's range 10x or more
    without = dequantize_blocks(quantize_blocks(x, valid, bits=4, per_channel=True), bits=4,
                                per_channel=True)
    b, _, h, d, _ = planted[0]
    assert float((without - x)[b, :, h, d].abs().max()) > 1.0


@pytest.mark.parametrize("sparse_dtype, ulp", [(torch.float16, 2.0 ** -11),
                                                (torch.bfloat16, 2.0 ** -8),
                                                (torch.float32, 2.0 ** -23)])
@pytest.mark.parametrize("bits, per_channel", [(4, True), (2, True), (3, False)])
def test_every_outlier_comes_back_within_its_deltas_rounding(sparse_dtype, ulp, bits,
                                                            per_channel):
    """Every listed element (not only planted ones) dequantizes to x within the sparse dtype's
    rounding of its distance from the dense decoding; elements not listed are the dense
    decoding itself."""
    x = randn(3, 16, 2, 32, seed=bits) * torch.linspace(0.5, 4, 32)  # channels of other scales
    x[0, 5, 1, 3] = 60.0
    valid = torch.ones(3, 16, dtype=torch.bool)
    valid[1, 0] = False  # a sink slot: never an outlier
    q = quantize_blocks(x, valid, bits=bits, per_channel=per_channel, outlier_fraction=0.05,
                        sparse_dtype=sparse_dtype)
    assert q.outlier_delta.dtype == sparse_dtype
    deq = dequantize_blocks(q, bits=bits, per_channel=per_channel)
    dense = dequantize_blocks(dataclasses.replace(q, outlier_index=q.outlier_index[..., :0],
                                                  outlier_delta=q.outlier_delta[..., :0]),
                              bits=bits, per_channel=per_channel)
    listed = torch.zeros(3, 2, 16 * 32, dtype=torch.bool)  # [n, H, B * D]
    for b in range(3):
        for h in range(2):
            for i in q.outlier_index[b, h].tolist():
                if i >= 0:
                    listed[b, h, i] = True
    listed = listed.view(3, 2, 16, 32).permute(0, 2, 1, 3)  # [n, B, H, D]
    assert int(listed.sum()) > 20 and not listed[1, 0].any()
    miss = (x - dense).abs()
    err = (deq - x).abs()
    assert bool((err[listed] <= miss[listed] * ulp + 1e-6).all())
    assert torch.equal(deq[~listed], dense[~listed])


def test_calibrated_key_thresholds_pick_only_values_beyond_them():
    x = randn(1, 16, 1, 8, seed=4)
    x[0, 5, 0, 2] = 9.0
    thr = torch.stack([torch.full((1, 8), -3.0), torch.full((1, 8), 3.0)])  # [2, H, D]
    q = quantize_blocks(x, torch.ones(1, 16, dtype=torch.bool), bits=4, per_channel=True,
                        outlier_fraction=0.1, thresholds=thr)
    picked = [i for i in q.outlier_index[0, 0].tolist() if i >= 0]
    assert picked == [5 * 8 + 2]


def test_invalid_slots_are_left_out_of_key_statistics():
    x = randn(1, 16, 1, 8, seed=5)
    x[0, 0] = 1000.0  # a sink token with huge keys
    valid = torch.ones(1, 16, dtype=torch.bool)
    valid[0, 0] = False
    q = quantize_blocks(x, valid, bits=4, per_channel=True)
    deq = dequantize_blocks(q, bits=4, per_channel=True)
    assert float((deq - x)[0, 1:].abs().max()) < 0.5


def test_nuq_reproduces_values_on_its_centroids():
    levels = torch.tensor([-1.0, -0.2, 0.3, 1.0])
    gen = torch.Generator().manual_seed(6)
    idx = torch.randint(0, 4, (2, 16, 2, 32), generator=gen)
    idx[..., 0], idx[..., 1] = 0, 3  # each token spans [-1, 1] exactly
    x = levels[idx] * 2.5 + 0.5  # per token: offset 0.5, half-range 2.5
    valid = torch.ones(2, 16, dtype=torch.bool)
    q = quantize_blocks(x, valid, bits=2, per_channel=False, codebook=levels)
    torch.testing.assert_close(dequantize_blocks(q, bits=2, per_channel=False, codebook=levels),
                               x, atol=1e-6, rtol=0)
    uniform = dequantize_blocks(quantize_blocks(x, valid, bits=2, per_channel=False), bits=2,
                                per_channel=False)
    assert float((uniform - x).abs().max()) > 0.3


def test_fisher_kmeans_recovers_known_distributions():
    gen = torch.Generator().manual_seed(7)
    uni = torch.rand(100_000, generator=gen) * 2 - 1  # Lloyd-Max for U(-1, 1): +-0.25, +-0.75
    torch.testing.assert_close(fisher_kmeans(uni, None, 4),
                               torch.tensor([-0.75, -0.25, 0.25, 0.75]), atol=0.02, rtol=0)
    centers = torch.tensor([-0.8, -0.1, 0.3, 0.9])
    mix = centers[torch.randint(0, 4, (50_000,), generator=gen)]
    mix = (mix + 0.01 * torch.randn(50_000, generator=gen)).clamp(-1, 1)
    torch.testing.assert_close(fisher_kmeans(mix, None, 4), centers, atol=0.01, rtol=0)
    assert torch.equal(fisher_kmeans(mix, None, 4), fisher_kmeans(mix, None, 4))  # determinism


def test_fisher_weights_steer_the_centroids():
    gen = torch.Generator().manual_seed(8)
    x = torch.cat([torch.rand(20_000, generator=gen) - 1, torch.rand(20_000, generator=gen)])
    w = torch.cat([torch.zeros(20_000), torch.ones(20_000)])  # only [0, 1) matters
    c = fisher_kmeans(x, w, 4)
    assert list(c) == sorted(c) and -1 <= float(c.min()) and float(c.max()) <= 1
    assert int((c > 0).sum()) >= 3  # the centroids crowd where the Fisher weight is


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 5}, "bits"), ({"outlier_fraction": 0.5}, "outlier_fraction"),
    ({"num_sink_tokens": -1}, "num_sink_tokens"), ({"layer_bits": (4, 6)}, "layer_bits"),
    ({"sparse_dtype": "int8"}, "sparse_dtype"), ({"per_channel_keys": 1}, "per_channel_keys"),
    ({"per_channel_keys": False, "key_outlier_thresholds": torch.zeros(1, 2, 1, 4)},
     "per_channel"),
    ({"bits": 2, "key_codebooks": ((-1.0, float("nan"), 0.5, 1.0),)}, "finite centroids"),
    ({"layer_bits": 4}, "layer_bits must be a list"),
    ({"bits": 2, "value_codebooks": (None, (float("-inf"), 0.0, 0.5, 1.0))}, "finite"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVQuantConfig(**kwargs)


def test_config_validate_for_model_and_fingerprint():
    cfg = KVQuantConfig(bits=2, key_codebooks=((-1, 0, 0.5, 1), None))
    cfg.validate_for(2, 1, 8, 16)
    with pytest.raises(ValueError, match="layers"):
        cfg.validate_for(3, 1, 8, 16)
    with pytest.raises(ValueError, match="centroids"):
        KVQuantConfig(bits=3, key_codebooks=((-1, 0, 0.5, 1), None)).validate_for(2, 1, 8, 16)
    with pytest.raises(ValueError, match="num_sink_tokens"):
        KVQuantConfig(num_sink_tokens=32).validate_for(2, 1, 8, 16)
    assert cfg.fingerprint() == cfg.replace().fingerprint()
    assert cfg.fingerprint() != cfg.replace(outlier_fraction=0.0).fingerprint()
