/* The 8 x 8 float transpose of AVX2 registers: the AVX2 slot-lanes key pass
 * (kvquant_slot_keys_avx2.h) and the standalone loop timings (benchmarks/
 * micro_kvquant_avx2_loops.c) include it. AVX2 builds only. */
#ifndef NANOKV_TRANSPOSE8_AVX2_H
#define NANOKV_TRANSPOSE8_AVX2_H

#include <immintrin.h>

/* rows r[0..7] of 8 floats -> columns: r[i] lane u = the input r[u] lane i */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

#endif
