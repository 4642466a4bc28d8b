"""How the kernels read and write one KV element: float, or a 1-byte code with a per-token scale
(`KV_FORMAT`, a constexpr; the numbers are `paged_kv.FLOAT` .. `paged_kv.FP8_E5M2`).

    FLOAT     the float pool: the element itself (float32 / bfloat16 / float16)
    INT8      int8 bits in a uint8: value = code * scale           (nanokv/quant/int8.py)
    FP8_E4M3  float8_e4m3fn bits: value = fp8(code) * scale        (nanokv/quant/fp8.py)
    FP8_E5M2  float8_e5m2 bits

Both directions use integer bit operations and a float16 bitcast, not Triton's fp8 types: they
are exact on every GPU (no fp8 hardware needed) and in the interpreter (whose fp8 conversion
does not carry a rounded-up mantissa into the exponent). Encoding rounds half to even, as
PyTorch's casts do, so a code written here equals the one `quantize_int8` / `quantize_fp8`
writes for the same input.
"""

from __future__ import annotations

import triton
import triton.language as tl

# KV_FORMAT values (constexpr in the kernels): nanokv.kernels.triton.paged_kv.FLOAT, INT8, ...


@triton.jit
def code_values(codes, KV_FORMAT: tl.constexpr):
    """uint8 codes -> their float32 values before the scale (exact)."""
    if KV_FORMAT == 1:  # INT8
        return codes.to(tl.int8, bitcast=True).to(tl.float32)
    c = codes.to(tl.uint16)
    if KV_FORMAT == 2:  # FP8_E4M3: sign | exponent and mantissa at float16's place, / 2**8
        half = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
        return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    # FP8_E5M2: the high byte of a float16
    return (c << 8).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _shift_round(mant, shift):
    """mant / 2**shift rounded half to even, for mant >= 0, 1 <= shift <= 31 and
    mant + 2**(shift - 1) < 2**31."""
    half = (tl.full(mant.shape, 1, tl.int32) << (shift - 1)) - 1
    return (mant + half + ((mant >> shift) & 1)) >> shift


@triton.jit
def round_half_even(y):
    """float32 with |y| < 2**22 -> the nearest int32, ties to even (torch.round)."""
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    mant = (bits & 0x7FFFFF) | 0x800000  # y = mant * 2**(e - 150)
    shift = tl.minimum(tl.maximum(150 - e, 1), 31)
    r = _shift_round(mant, shift)
    return tl.where(bits < 0, -r, r)


@triton.jit
def fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """float32 y within the format's range -> its fp8 bits (MANT mantissa bits, exponent bias
    BIAS) as int32, rounded half to even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    e = mag >> 23
    # normal: drop the low mantissa bits (a carry runs into the exponent), re-bias
    drop: tl.constexpr = 23 - MANT
    normal = _shift_round(mag, drop) - ((127 - BIAS) << MANT)
    # subnormal: |y| in units of the smallest subnormal, 2**(1 - BIAS - MANT)
    mant = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(151 - BIAS - MANT - e, 1), 31)
    sub = _shift_round(mant, shift)
    return tl.where(e >= 128 - BIAS, normal, sub) | sign


@triton.jit
def encode_codes(y, KV_FORMAT: tl.constexpr):
    """float32 y = x / scale (|y| <= CODE_MAX) -> uint8 codes."""
    if KV_FORMAT == 1:  # INT8
        r = tl.minimum(tl.maximum(round_half_even(y), -127), 127)
        return r.to(tl.int8).to(tl.uint8, bitcast=True)
    if KV_FORMAT == 2:  # FP8_E4M3
        return fp8_bits(y, 3, 7).to(tl.uint8)
    return fp8_bits(y, 2, 15).to(tl.uint8)  # FP8_E5M2
