/* sum8: the horizontal sums of 8 AVX2 vectors at once, used by the quantized decode kernels.
 * Included on AVX2 builds without AVX-512. */
#ifndef NANOKV_SUM8_H
#define NANOKV_SUM8_H
#include <immintrin.h>

/* lane t of the result = the sum of the lanes of v[t], for 8 vectors: pairwise horizontal adds
 * within each 128-bit half, then the two halves added */
static inline __m256 sum8(const __m256 *v) {
    const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b03 = _mm256_hadd_ps(a01, a23), b47 = _mm256_hadd_ps(a45, a67);
    /* b03: lanes 0-3 the sums of v[0..3] over their lanes 0-3, lanes 4-7 over lanes 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(b03, b47, 0x20),
                         _mm256_permute2f128_ps(b03, b47, 0x31));
}

#endif
