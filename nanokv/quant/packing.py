"""Bit packing of small integer codes into uint8, along the last dimension.

    bits 8: one code per byte (identity)
    bits 4: two codes per byte, the first in the low nibble
    bits 2: four codes per byte, the first in the lowest two bits
    bits 3: eight codes in three bytes (a 24-bit little-endian word, code i at bits 3i..3i+2)

The last dimension is padded with zero codes to a whole group (2, 4 or 8 codes); `unpack` takes
the original length and drops the padding, so `unpack(pack(c, b), b, n) == c` exactly.
"""

from __future__ import annotations

import torch

from nanokv.utils import cdiv

SUPPORTED_BITS = (2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {list(SUPPORTED_BITS)}, got {bits!r}")


def packed_dim(num_codes: int, bits: int) -> int:
    """Bytes that hold `num_codes` codes of `bits` bits (including the padding)."""
    _check_bits(bits)
    if bits == 3:
        return cdiv(num_codes, 8) * 3
    per_byte = 8 // bits
    return cdiv(num_codes, per_byte)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., n] integers in [0, 2**bits) -> uint8 [..., packed_dim(n, bits)]."""
    _check_bits(bits)
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    n = codes.shape[-1]
    group = 8 if bits == 3 else 8 // bits
    pad = -n % group
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    lead = codes.shape[:-1]
    grouped = codes.view(*lead, -1, group).to(torch.int32)  # [..., groups, group]
    shifts = torch.arange(group, dtype=torch.int32, device=codes.device) * bits
    word = (grouped << shifts).sum(-1, dtype=torch.int32)  # [..., groups], < 2**(group*bits)
    if bits == 3:  # a 24-bit word per group -> three bytes, little endian
        byte_shifts = torch.tensor([0, 8, 16], dtype=torch.int32, device=codes.device)
        out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF  # [..., groups, 3]
        return out.to(torch.uint8).reshape(*lead, -1)
    return word.to(torch.uint8)  # [..., groups] (group * bits == 8)


def unpack(packed: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """uint8 [..., packed_dim(num_codes, bits)] -> uint8 codes [..., num_codes]."""
    _check_bits(bits)
    if packed.shape[-1] != packed_dim(num_codes, bits):
        raise ValueError(f"packed last dim {packed.shape[-1]} does not hold {num_codes} "
                         f"{bits}-bit codes (expected {packed_dim(num_codes, bits)})")
    if bits == 8:
        return packed
    lead = packed.shape[:-1]
    mask = (1 << bits) - 1
    if bits == 3:
        triples = packed.view(*lead, -1, 3).to(torch.int32)  # [..., groups, 3]
        word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)  # [..., groups]
        group = 8
    else:
        word = packed.to(torch.int32)
        group = 8 // bits
    shifts = torch.arange(group, dtype=torch.int32, device=packed.device) * bits
    codes = (word.unsqueeze(-1) >> shifts) & mask  # [..., groups, group]
    return codes.reshape(*lead, -1)[..., :num_codes].to(torch.uint8)
