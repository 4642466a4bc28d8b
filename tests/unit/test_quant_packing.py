"""Bit packing: exact round trips for 2/3/4/8 bits, the byte counts, the 3-bit layout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanokv.quant.packing import pack, packed_dim, unpack


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 5, 8, 13, 64, 128])
def test_round_trip_exact(bits, n):
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 2 ** bits, (3, 4, n), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 4, packed_dim(n, bits))
    assert torch.equal(unpack(packed, bits, n), codes)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]),
       codes=st.lists(st.integers(0, 255), min_size=1, max_size=40))
def test_round_trip_property(bits, codes):
    c = torch.tensor([x % (2 ** bits) for x in codes], dtype=torch.uint8)
    assert torch.equal(unpack(pack(c, bits), bits, len(codes)), c)


def test_packed_sizes():
    assert [packed_dim(128, b) for b in (2, 3, 4, 8)] == [32, 48, 64, 128]
    assert packed_dim(8, 3) == 3 and packed_dim(9, 3) == 6  # 8 codes -> 3 bytes, padded


def test_three_bit_layout_is_little_endian_24_bit_word():
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert pack(codes, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert pack(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]


def test_bad_bits_and_shapes_raise():
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(4, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="packed"):
        unpack(torch.zeros(3, dtype=torch.uint8), 4, 16)
