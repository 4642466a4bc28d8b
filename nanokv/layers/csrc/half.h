/* Half-precision element conversions shared by the quantized kernels (decode, quantize-on-write):
 * exact, branch-free, vectorisable. */
#ifndef NANOKV_HALF_H
#define NANOKV_HALF_H
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half: exponent and mantissa moved into a float's low exponent bits, then scaled by
 * 2^(127 - 15); also right for subnormals (the float is then subnormal and scales exactly).
 * F16C's conversion where the build has it (the same exact result, one instruction). */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    float mag = bits_to_float((uint32_t)(h & 0x7FFF) << 13) * 0x1p112f;
    return (h & 0x8000) ? -mag : mag;
#endif
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_float((uint32_t)h << 16); }
#endif
