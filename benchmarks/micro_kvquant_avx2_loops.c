/* Standalone timings of the AVX2 KVQuant decode loops, their data in cache: what each loop
 * costs alone, per slot and KV head, without the kernel around it (4-bit codes, head_dim 128,
 * 8 KV heads, 2 query heads per KV head, rotate-half RoPE over the whole head, 256-slot blocks).
 * Not the kernel (nanokv/layers/csrc/kvquant_block_avx2.h): its loops' arithmetic on random
 * data, with the kernel's own byte-plane look-up (byte_planes_avx2.h), to compare loop designs
 * before building one into it.
 *
 *     cc -O3 -march=native -mno-avx512f benchmarks/micro_kvquant_avx2_loops.c -o /tmp/loops
 *     /tmp/loops
 *
 * Loops (each reports the best of 20 rounds, ns per slot and KV head):
 *   value_byte_planes  the value pass as built: 32 codes looked up through the codebook's 4 byte
 *                      planes (vpshufb), weighed into 2 heads x 4 accumulators
 *   value_permutes     the same with the 16-entry table as two permutes and a blend
 *   key_channel_lanes  the channel-lanes key pass (the kernel's where the slot-lanes pass does
 *                      not fit): channels in the lanes, a row's 32 codes by byte
 *                      planes, permuted back to channel order, scaled, rotated, dotted with 2
 *                      query heads (the dots of 8 channels summed at the end of a row)
 *   key_slot_lanes     the AVX-512 pass's design on AVX2, the kernel's where a layer fits
 *                      (kvquant_slot_keys_avx2.h): a tile's 8 slots in the lanes, each
 *                      channel one look-up in its own table (centroids already scaled: two
 *                      permutes and a blend), the tile's RoPE rows and code words transposed,
 *                      no horizontal sum
 * The numbers only compare loops within one run on one machine. */

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../nanokv/layers/csrc/byte_planes_avx2.h" /* the kernel's lut_planes4, centroids32 */
#include "../nanokv/layers/csrc/transpose8_avx2.h"  /* the kernel's transpose8 */

enum { SLOTS = 256, HKV = 8, D = 128, M = D / 2, PACKED = D / 2, POSITIONS = 4096 };

static uint8_t codes[SLOTS * HKV * PACKED] __attribute__((aligned(64)));
static float rope[POSITIONS * D] __attribute__((aligned(64))); /* [pos][cos M | sin M] */
static float lut[16], q[HKV * 2 * D], half[HKV * D], off[HKV * D], pa[2 * SLOTS], acc[2 * D];
static float tables[HKV * D * 16] __attribute__((aligned(64))); /* [g, channel, code] */
static float scores[HKV * 2 * SLOTS];
static float tile_cos[M * 8] __attribute__((aligned(64))), tile_sin[M * 8] __attribute__((aligned(64)));
static __m256i planes[4];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* the 2 heads' accumulators of channels [d, d + 32) in and out */
static inline void acc_load(int d, __m256 a[2][4]) {
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++) a[h][c] = _mm256_loadu_ps(acc + h * D + d + 8 * c);
}

static inline void acc_store(int d, __m256 a[2][4]) {
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + h * D + d + 8 * c, a[h][c]);
}

static __attribute__((noinline)) void value_byte_planes(int g) {
    const uint8_t *rows = codes + g * PACKED;
    for (int d = 0; d < D; d += 32) {
        __m256 a[2][4];
        acc_load(d, a);
        for (int t = 0; t < SLOTS; t++) {
            __m256 v[4];
            centroids32(rows + t * HKV * PACKED, d, planes, 0, v);
            const __m256 p0 = _mm256_broadcast_ss(pa + t), p1 = _mm256_broadcast_ss(pa + SLOTS + t);
            for (int c = 0; c < 4; c++) {
                a[0][c] = _mm256_fmadd_ps(p0, v[c], a[0][c]);
                a[1][c] = _mm256_fmadd_ps(p1, v[c], a[1][c]);
            }
        }
        acc_store(d, a);
    }
}

static __attribute__((noinline)) void value_permutes(int g) {
    const __m256 lo = _mm256_loadu_ps(lut), hi = _mm256_loadu_ps(lut + 8);
    const uint8_t *rows = codes + g * PACKED;
    for (int d = 0; d < D; d += 32) {
        __m256 a[2][4];
        acc_load(d, a);
        for (int t = 0; t < SLOTS; t++) {
            const uint8_t *p = rows + t * HKV * PACKED + d / 2;
            const __m256 p0 = _mm256_broadcast_ss(pa + t), p1 = _mm256_broadcast_ss(pa + SLOTS + t);
            for (int c = 0; c < 4; c += 2) {  /* 8 bytes: 16 channels, even ones low nibbles */
                const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + c * 4)));
                const __m256i wh = _mm256_srli_epi32(w, 4);
                const __m256 even = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, w),
                    _mm256_permutevar8x32_ps(hi, w), _mm256_castsi256_ps(_mm256_slli_epi32(w, 28)));
                const __m256 odd = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, wh),
                    _mm256_permutevar8x32_ps(hi, wh), _mm256_castsi256_ps(_mm256_slli_epi32(w, 24)));
                a[0][c] = _mm256_fmadd_ps(p0, even, a[0][c]);
                a[1][c] = _mm256_fmadd_ps(p1, even, a[1][c]);
                a[0][c + 1] = _mm256_fmadd_ps(p0, odd, a[0][c + 1]);
                a[1][c + 1] = _mm256_fmadd_ps(p1, odd, a[1][c + 1]);
            }
        }
        acc_store(d, a);
    }
}

/* a channel pair (a, b) rotated (rotate-half: a cos - b sin, b cos + a sin) and dotted with
 * two query heads' channels: dot[0..3] += qa0 ra, qb0 rb, qa1 ra, qb1 rb */
static inline __attribute__((always_inline)) void rotate_dot2(
        __m256 a, __m256 b, __m256 c1, __m256 s1, __m256 qa0, __m256 qb0, __m256 qa1,
        __m256 qb1, __m256 dot[4]) {
    const __m256 ra = _mm256_fmsub_ps(a, c1, _mm256_mul_ps(b, s1));
    const __m256 rb = _mm256_fmadd_ps(b, c1, _mm256_mul_ps(a, s1));
    dot[0] = _mm256_fmadd_ps(qa0, ra, dot[0]);
    dot[1] = _mm256_fmadd_ps(qb0, rb, dot[1]);
    dot[2] = _mm256_fmadd_ps(qa1, ra, dot[2]);
    dot[3] = _mm256_fmadd_ps(qb1, rb, dot[3]);
}

static inline float hsum(__m256 x) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_hadd_ps(a, a);
    return _mm_cvtss_f32(_mm_hadd_ps(a, a));
}

static __attribute__((noinline)) void key_channel_lanes(int pos0) {
    for (int t = 0; t < SLOTS; t++) {
        const float *cs = rope + (pos0 + t) * D, *sn = cs + M;
        for (int g = 0; g < HKV; g++) {
            const uint8_t *row = codes + (t * HKV + g) * PACKED;
            const float *hf = half + g * D, *of = off + g * D, *q0 = q + g * 2 * D;
            __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};  /* head 0's halves a, b; head 1's */
            for (int j = 0; j < M; j += 32) {
                __m256 ca[4], cb[4];
                centroids32(row, j, planes, 1, ca);  /* in channel order */
                centroids32(row, j + M, planes, 1, cb);
                for (int c = 0; c < 4; c++) {
                    const int jj = j + 8 * c;
                    const __m256 a = _mm256_fmadd_ps(ca[c], _mm256_loadu_ps(hf + jj), _mm256_loadu_ps(of + jj));
                    const __m256 b = _mm256_fmadd_ps(cb[c], _mm256_loadu_ps(hf + jj + M), _mm256_loadu_ps(of + jj + M));
                rotate_dot2(a, b, _mm256_loadu_ps(cs + jj), _mm256_loadu_ps(sn + jj),
                            _mm256_loadu_ps(q0 + jj), _mm256_loadu_ps(q0 + jj + M),
                            _mm256_loadu_ps(q0 + D + jj), _mm256_loadu_ps(q0 + D + jj + M), dot);
                }
            }
            scores[(g * 2) * SLOTS + t] = hsum(_mm256_add_ps(dot[0], dot[1]));
            scores[(g * 2 + 1) * SLOTS + t] = hsum(_mm256_add_ps(dot[2], dot[3]));
        }
    }
}

/* channel s of a word of 8 codes, in the 8 slots' lanes, from the channel's 16-entry table */
static inline __attribute__((always_inline)) __m256 slot_lookup(__m256i word, int s, const float *t) {
    const __m256i idx = _mm256_srli_epi32(word, 4 * s);
    const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(word, 28 - 4 * s));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(t), idx),
                            _mm256_permutevar8x32_ps(_mm256_load_ps(t + 8), idx), sel);
}

static __attribute__((noinline)) void key_slot_lanes(int pos0) {
    for (int t0 = 0; t0 < SLOTS; t0 += 8) {
        for (int c0 = 0; c0 < M; c0 += 8) {  /* the tile's RoPE rows, [channel, slot] */
            __m256 r[8], z[8];
            for (int u = 0; u < 8; u++) {
                r[u] = _mm256_loadu_ps(rope + (pos0 + t0 + u) * D + c0);
                z[u] = _mm256_loadu_ps(rope + (pos0 + t0 + u) * D + M + c0);
            }
            transpose8(r);
            transpose8(z);
            for (int i = 0; i < 8; i++) {
                _mm256_store_ps(tile_cos + (c0 + i) * 8, r[i]);
                _mm256_store_ps(tile_sin + (c0 + i) * 8, z[i]);
            }
        }
        for (int g = 0; g < HKV; g++) {
            __m256i word[16];  /* word j of the 8 slots' rows */
            for (int w = 0; w < 2; w++) {
                __m256 r[8];
                for (int u = 0; u < 8; u++)
                    r[u] = _mm256_loadu_ps((const float *)(codes + ((t0 + u) * HKV + g) * PACKED + 32 * w));
                transpose8(r);
                for (int i = 0; i < 8; i++) word[8 * w + i] = _mm256_castps_si256(r[i]);
            }
            const float *tb = tables + g * D * 16, *q0 = q + g * 2 * D;
            __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int j = 0; j < 8; j++) {
#pragma GCC unroll 8
                for (int s = 0; s < 8; s++) {
                    const int c = 8 * j + s;  /* the pair (c, c + M) */
                    const __m256 a = slot_lookup(word[j], s, tb + c * 16);
                    const __m256 b = slot_lookup(word[j + 8], s, tb + (c + M) * 16);
                rotate_dot2(a, b, _mm256_load_ps(tile_cos + c * 8), _mm256_load_ps(tile_sin + c * 8),
                            _mm256_broadcast_ss(q0 + c), _mm256_broadcast_ss(q0 + c + M),
                            _mm256_broadcast_ss(q0 + D + c), _mm256_broadcast_ss(q0 + D + c + M), dot);
                }
            }
            _mm256_storeu_ps(scores + (g * 2) * SLOTS + t0, _mm256_add_ps(dot[0], dot[1]));
            _mm256_storeu_ps(scores + (g * 2 + 1) * SLOTS + t0, _mm256_add_ps(dot[2], dot[3]));
        }
    }
}

static double best_ns(void (*f)(int), int by_head) {
    double best = 1e30;
    for (int r = 0; r < 20; r++) {
        const double t0 = now();
        for (int it = 0; it < 50; it++)
            if (by_head) for (int g = 0; g < HKV; g++) f(g);
            else f((it * SLOTS) % (POSITIONS - SLOTS));
        const double t = (now() - t0) / (50.0 * HKV * SLOTS) * 1e9;
        if (t < best) best = t;
    }
    return best;
}

int main(void) {
    srand(1);
    for (int i = 0; i < 16; i++) lut[i] = -1.f + 0.13f * (float)i;
    lut_planes4(lut, 4, planes);
    for (size_t i = 0; i < sizeof codes; i++) codes[i] = (uint8_t)rand();
    for (int i = 0; i < POSITIONS * D; i++) rope[i] = (float)(rand() % 1000) / 1000.f;
    for (int i = 0; i < HKV * 2 * D; i++) q[i] = (float)(rand() % 1000) / 1000.f;
    for (int i = 0; i < HKV * D; i++) { half[i] = 0.5f; off[i] = 0.1f; }
    for (int i = 0; i < HKV * D * 16; i++) tables[i] = lut[i % 16] * 0.5f + 0.1f;
    for (int i = 0; i < 2 * SLOTS; i++) pa[i] = (float)(rand() % 1000) / 1000.f;
    printf("value_byte_planes  %6.2f ns per slot and KV head\n", best_ns(value_byte_planes, 1));
    printf("value_permutes     %6.2f\n", best_ns(value_permutes, 1));
    printf("key_channel_lanes  %6.2f\n", best_ns(key_channel_lanes, 0));
    printf("key_slot_lanes     %6.2f\n", best_ns(key_slot_lanes, 0));
    printf("(checksum %g)\n", (double)(acc[0] + scores[3]));
    return 0;
}
