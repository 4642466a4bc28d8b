/* sum16: the horizontal sums of 16 AVX-512 vectors at once, used by the quantized decode
 * kernels. Included on AVX-512F builds. */
#ifndef NANOKV_SUM16_H
#define NANOKV_SUM16_H
#include <immintrin.h>

/* lane t of the result = the sum of the lanes of v[t], for 16 vectors: four levels of pairwise
 * lane exchanges and adds. The tree leaves sums in bit-reversed order, so the inputs are taken
 * bit-reversed. */
static inline __m512 sum16(const __m512 *v) {
    static const int rev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                          30, 31);
    const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i hi2 = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                          31);
    const __m512i lo3 = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    const __m512i hi3 = _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                          31);
    const __m512i lo4 = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    const __m512i hi4 = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                                          31);
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        const __m512 x = v[rev[2 * i]], y = v[rev[2 * i + 1]];
        a[i] = _mm512_add_ps(_mm512_permutex2var_ps(x, lo1, y), _mm512_permutex2var_ps(x, hi1, y));
    }
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], lo2, a[2 * i + 1]),
                             _mm512_permutex2var_ps(a[2 * i], hi2, a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * i], lo3, b[2 * i + 1]),
                             _mm512_permutex2var_ps(b[2 * i], hi3, b[2 * i + 1]));
    return _mm512_add_ps(_mm512_permutex2var_ps(c[0], lo4, c[1]),
                         _mm512_permutex2var_ps(c[0], hi4, c[1]));
}

#endif
