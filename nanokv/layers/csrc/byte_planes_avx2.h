/* The AVX2 look-up of 32 4-bit codes through a codebook's byte planes (vpshufb): the value and
 * key passes of KVQuant's AVX2 block path (kvquant_block_avx2.h) and the standalone loop timings
 * (benchmarks/micro_kvquant_avx2_loops.c) include it. AVX2 builds only. */
#ifndef NANOKV_BYTE_PLANES_AVX2_H
#define NANOKV_BYTE_PLANES_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* a codebook of 2^bits centroids as 4 byte planes of a 16-entry table (repeated to fill it,
 * as lut_halves8's) for centroids32: plane k holds byte k of every centroid (little-endian),
 * in both 128-bit lanes (vpshufb looks up within a lane) */
static inline void lut_planes4(const float *lut, int64_t bits, __m256i planes[4]) {
    uint8_t bytes[4][16];
    for (int i = 0; i < 16; i++) {
        uint32_t u;
        memcpy(&u, lut + (i & ((1 << bits) - 1)), sizeof u);
        for (int k = 0; k < 4; k++) bytes[k][i] = (uint8_t)(u >> (8 * k));
    }
    for (int k = 0; k < 4; k++)
        planes[k] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes[k]));
}

/* where centroids32 leaves channel c of its 8 (position p holds channel ORDER[p]) and the
 * permutes between that order and the natural one */
#define CENTROIDS32_ORDER 0, 2, 4, 6, 1, 3, 5, 7
#define CENTROIDS32_NATURAL 0, 4, 1, 5, 2, 6, 3, 7 /* natural[c] = position of channel c */

/* lut[codes] of channels [c0, c0 + 32) of a packed 4-bit row (c0 even), exactly: out[i] holds
 * channels [c0 + 8i, c0 + 8i + 8) in CENTROIDS32_ORDER, or in natural order when `natural`
 * (one permute each). The row's 16 bytes: low nibbles (even channels) in lane 0, high nibbles
 * (odd channels) in lane 1; each of the 4 bytes of the 32 centroids looked up at once (vpshufb
 * in a byte plane), then interleaved back into floats (bytes into 16-bit halves, halves into
 * floats; the in-lane interleaves leave the even / odd order). 20 instructions for 32 channels,
 * where centroids8 takes 28. */
static inline __attribute__((always_inline)) void centroids32(
        const uint8_t *p, int64_t c0, const __m256i planes[4], const int natural,
        __m256 out[4]) {
    const __m256i bytes = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(p + c0 / 2)));
    const __m256i codes = _mm256_and_si256(
        _mm256_blend_epi32(bytes, _mm256_srli_epi16(bytes, 4), 0xF0), _mm256_set1_epi8(0x0F));
    const __m256i b0 = _mm256_shuffle_epi8(planes[0], codes);
    const __m256i b1 = _mm256_shuffle_epi8(planes[1], codes);
    const __m256i b2 = _mm256_shuffle_epi8(planes[2], codes);
    const __m256i b3 = _mm256_shuffle_epi8(planes[3], codes);
    const __m256i lo01 = _mm256_unpacklo_epi8(b0, b1), lo23 = _mm256_unpacklo_epi8(b2, b3);
    const __m256i hi01 = _mm256_unpackhi_epi8(b0, b1), hi23 = _mm256_unpackhi_epi8(b2, b3);
    out[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(lo01, lo23));
    out[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(lo01, lo23));
    out[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(hi01, hi23));
    out[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(hi01, hi23));
    if (natural) {
        const __m256i back = _mm256_setr_epi32(CENTROIDS32_NATURAL);
        for (int i = 0; i < 4; i++) out[i] = _mm256_permutevar8x32_ps(out[i], back);
    }
}

#endif
