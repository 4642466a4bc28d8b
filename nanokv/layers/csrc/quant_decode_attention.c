/* Paged decode attention that reads quantized KV codes in place, for CPUs: one query token per
 * request over that request's cached slots, the step's own token attended with its fresh
 * float32 K/V (as `nanokv.quant.attention.reference_quantized_attention` does).
 *
 * One pass with an online softmax, as decode_attention.c, one OpenMP work item per request.
 * Slots are taken in tiles of TILE = 16:
 *   1. the tile's keys, every KV head, are decoded into [Hkv, TILE, D] (per-thread: 64 KiB at
 *      Hkv 8, D 128, in L2), rotated there when the store keeps keys before RoPE, reading the
 *      codes in address order: a stream the hardware prefetchers follow (per KV head, a row
 *      apart, left the int8 kernel slower than float32 on an AVX2 EPYC);
 *   2. per KV head, the scores of its query heads (GQA: the group shares the decoded keys), all
 *      TILE slots of a head at once: one accumulator per slot over D, then the 16 sums reduced
 *      together (a shuffle tree, 15 adds for 16 dot products instead of a reduction each);
 *   3. the online softmax of those heads over the tile (a vector exp on the guarded paths);
 *   4. the tile's values decoded the same way, added to each head's accumulator, a column chunk
 *      at a time in registers over the tile's slots.
 * Decoded rows never leave the per-thread buffers. Plain C the compiler vectorises, plus
 * AVX-512 and AVX2 paths where they pay (guarded: the plain C builds and runs everywhere).
 * int8 and fp8 keys after RoPE on AVX-512 and AVX2 skip the buffer: each 16 (8) codes are widened in
 * the score's and the value's FMA loops, the rows read in place with the next tile's
 * prefetched (AVX-512: 0.29x float32's time for 8 requests x 2800 slots of a Qwen3-0.6B layer
 * on a Xeon, against 0.5x through the buffer) or, where a KV head's rows are far apart, from a
 * copy of the tile made in address order (AVX2: 0.43-0.53x on an EPYC, against 0.59-0.72x in
 * place, at 8 KV heads of 128); codes_tile. fp8 codes take the same path (four instructions
 * for 16 codes, load_fp8_row); through the buffer they ran at about float32's time.
 *
 * The fp8 / fp16 / bf16 decodes are bit shifts and one multiply by a power of two, exact for
 * normal and subnormal numbers.
 *
 * Two entry points:
 *   pertoken_decode_attention  int8 / fp8 e4m3 / fp8 e5m2 codes, a float32 scale per token and
 *                              KV head (`nanokv.quant.pertoken_store`); slots as runs of
 *                              consecutive pool slots (as decode_attention.c)
 *   kvquant_decode_attention   KVQuant's packed 2/3/4/8-bit codes (`nanokv.quant.kvquant_store`):
 *                              per-channel (per block) or per-token statistics in fp16, a
 *                              codebook (uniform or nuq) as a table, sparse outliers, sink
 *                              slots, the partial block's keys from staging; by block table.
 *                              AVX-512 and AVX2 builds take KVQuant's common layout a block at
 *                              a time with the codes decoded in registers and outliers and
 *                              sinks as corrections (kvquant_block.h); other layouts and
 *                              builds a row at a time (kvquant_row_block)
 * q, out: [B, Hq, D] (q already multiplied by the softmax scale); k_new, v_new: [B, Hkv, D], the
 * step's own token of each request (keys after RoPE). Return: 0, or -1 when scratch allocation
 * failed. */
#include <float.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16

/* ---- scalar decodes: exact, branch-free, vectorisable -------------------------------------- */
#include "half.h"

/* fp8 e4m3fn (bias 7) and e5m2 (bias 15); the stores clamp to the finite range, so no NaN/inf.
 * A code's exponent and mantissa shifted under float32's (SHIFT: 23 less its mantissa bits),
 * then one multiply by 2^(127 - its bias) (SCALE); the vector loads use the same constants */
#define E4M3_SHIFT 20
#define E4M3_SCALE 0x1p120f
#define E5M2_SHIFT 21
#define E5M2_SCALE 0x1p112f
static inline float e4m3_to_f32(uint8_t c) {
    float mag = bits_to_float((uint32_t)(c & 0x7F) << E4M3_SHIFT) * E4M3_SCALE;
    return (c & 0x80) ? -mag : mag;
}

static inline float e5m2_to_f32(uint8_t c) {
    float mag = bits_to_float((uint32_t)(c & 0x7F) << E5M2_SHIFT) * E5M2_SCALE;
    return (c & 0x80) ? -mag : mag;
}

/* the bits a vector load keeps of a sign-extended code shifted by `shift`: float32's sign and
 * the code's exponent and mantissa (the extension's copies in between dropped) */
static inline uint32_t fp8_keep(int shift) { return 0x80000000u | (0x7Fu << shift); }

/* sparse / staging element kinds: 0 float16, 1 bfloat16, 2 float32 (always inlined: a call
 * site that passes a constant kind gets that kind's load alone) */
static inline __attribute__((always_inline)) float load_any(const void *p, int64_t i,
                                                            int64_t kind) {
    if (kind == 2) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return kind == 1 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* index element sizes 1 (uint8), 2 (int16), 4 (int32) (always inlined, as load_any) */
static inline __attribute__((always_inline)) int64_t load_index(const void *p, int64_t i,
                                                                int64_t bytes) {
    if (bytes == 1) return ((const uint8_t *)p)[i];
    if (bytes == 2) return ((const int16_t *)p)[i];
    return ((const int32_t *)p)[i];
}

/* ---- the online softmax over tiles, shared ---------------------------------------------------- */
typedef struct {
    float *acc;    /* [Hq, D] running P @ V */
    float *scores; /* [Hq, TILE] */
    float *m, *l;  /* [Hq] running max and sum of exp */
    /* per slot of the tile: a key's score is ks[t] * (q . kt[t]); a value is
     * va[t] * vt[t] + vb[t] (the per-token scales and offsets, applied once per slot) */
    float ks[TILE], va[TILE], vb[TILE];
} Softmax;

static int softmax_alloc(Softmax *s, int64_t Hq, int64_t D) {
    s->acc = malloc(sizeof(float) * Hq * D);
    s->scores = malloc(sizeof(float) * Hq * TILE);
    s->m = malloc(sizeof(float) * Hq);
    s->l = malloc(sizeof(float) * Hq);
    for (int t = 0; t < TILE; t++) { s->ks[t] = 1.f; s->va[t] = 1.f; s->vb[t] = 0.f; }
    return s->acc && s->scores && s->m && s->l;
}

static void softmax_free(Softmax *s) {
    free(s->acc); free(s->scores); free(s->m); free(s->l);
}

static void softmax_reset(Softmax *s, int64_t Hq, int64_t D) {
    for (int64_t h = 0; h < Hq; h++) { s->m[h] = -FLT_MAX; s->l[h] = 0.f; }
    memset(s->acc, 0, sizeof(float) * Hq * D);
}

/* a . b over D floats (the vector path ends with a shuffle tree: compilers reduce an
 * `omp simd` sum through the stack, one scalar add per lane) */
static inline float dot(const float *a, const float *b, int64_t D) {
#if defined(__AVX512F__)
    if (D % 32 == 0) {
        __m512 x = _mm512_setzero_ps(), y = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32) {
            x = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), x);
            y = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), y);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(x, y));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 16 == 0) {
        __m256 x = _mm256_setzero_ps(), y = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            x = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), x);
            y = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), y);
        }
        x = _mm256_add_ps(x, y);
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        return _mm_cvtss_f32(r);
    }
#endif
    float acc = 0.f;
    #pragma omp simd reduction(+:acc)
    for (int64_t d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

/* Cephes' expf for the vector exps: x = n ln2 + r with r = x - n * (LN2_HI + LN2_LO), e^r a
 * degree-5 polynomial in r, times 2^n */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
/* n = round(x / ln2) and p = e^r for x = n ln2 + r, in W-bit vectors (W: 512 or 256, the
 * intrinsics' width; ROUND: that width's round-to-nearest intrinsic) */
#define EXP_REDUCED(W, T, ROUND, x, n, p) do {                                               \
        n = ROUND(_mm##W##_mul_ps(x, _mm##W##_set1_ps(EXP_LOG2E)),                           \
                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                            \
        const T r_ = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(EXP_LN2_LO),                     \
                                        _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(EXP_LN2_HI), x)); \
        p = _mm##W##_set1_ps(EXP_POLY[0]);                                                   \
        for (int i_ = 1; i_ < 6; i_++)                                                       \
            p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(EXP_POLY[i_]));                    \
        p = _mm##W##_fmadd_ps(_mm##W##_mul_ps(p, r_), r_,                                    \
                              _mm##W##_add_ps(r_, _mm##W##_set1_ps(1.f)));                   \
    } while (0)
#endif

#if defined(__AVX512F__)
#include "sum16.h"

/* e^x for x <= 0 (Cephes' expf, EXP_*); within 2 ulp of expf */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n, p;
    EXP_REDUCED(512, __m512, _mm512_roundscale_ps, x, n, p);
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "sum8.h"

/* e^x for x <= 0, as exp512 (Cephes' expf); 2^n by adding n to the exponent bits, so x is
 * clamped at -86 (2^n stays a normal number: e^-86 = 4e-38 stands for anything smaller) */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-86.f));
    __m256 n, p;
    EXP_REDUCED(256, __m256, _mm256_round_ps, x, n, p);
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

static inline float hmax256(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum256(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
#endif

#if defined(__AVX512F__)
/* 16 channels of slot t's row: a decoded float row of the tile ([TILE, D]), or int8 codes
 * widened (rows: the tile's row pointers) */
typedef __m512 (*RowLoad)(const void *rows, int64_t t, int64_t d, int64_t D);
static inline __m512 load_f32_row(const void *rows, int64_t t, int64_t d, int64_t D) {
    return _mm512_loadu_ps((const float *)rows + t * D + d);
}
static inline __m512 load_i8_row(const void *rows, int64_t t, int64_t d, int64_t D) {
    (void)D;
    const uint8_t *p = ((const uint8_t *const *)rows)[t] + d;
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* fp8 codes widened as e4m3_to_f32 / e5m2_to_f32 do, 16 at a time: sign-extended to 32 bits and
 * shifted (the code's sign bit lands on float32's), the extension's copies between the sign and
 * the magnitude masked off (fp8_keep), then the one multiply (exact, subnormal codes included) */
static inline __m512 load_fp8_row(const void *rows, int64_t t, int64_t d, int shift,
                                  float scale) {
    const uint8_t *p = ((const uint8_t *const *)rows)[t] + d;
    const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(x, shift),
                                          _mm512_set1_epi32((int)fp8_keep(shift)));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(scale));
}
static inline __m512 load_e4m3_row(const void *rows, int64_t t, int64_t d, int64_t D) {
    (void)D;
    return load_fp8_row(rows, t, d, E4M3_SHIFT, E4M3_SCALE);
}
static inline __m512 load_e5m2_row(const void *rows, int64_t t, int64_t d, int64_t D) {
    (void)D;
    return load_fp8_row(rows, t, d, E5M2_SHIFT, E5M2_SCALE);
}

/* scores[h, t] = ks[t] * (q_h . row_t) for the heads [h0, h0 + group), all TILE slots of a
 * head at once (D % 16 == 0); always inlined with a constant `load` */
static inline __attribute__((always_inline)) void score16(Softmax *s, const float *qb,
                                                          const void *rows, int64_t h0,
                                                          int64_t group, int64_t D,
                                                          RowLoad load) {
    for (int64_t h = h0; h < h0 + group; h++) {
        const float *qh = qb + h * D;
        __m512 acc[TILE];
        for (int t = 0; t < TILE; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 qv = _mm512_loadu_ps(qh + d);
            #pragma GCC unroll 16
            for (int t = 0; t < TILE; t++)
                acc[t] = _mm512_fmadd_ps(qv, load(rows, t, d, D), acc[t]);
        }
        _mm512_storeu_ps(s->scores + h * TILE,
                         _mm512_mul_ps(sum16(acc), _mm512_loadu_ps(s->ks)));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 channels of slot t's row, as load_f32_row / load_i8_row on AVX2 */
typedef __m256 (*RowLoad8)(const void *rows, int64_t t, int64_t d, int64_t D);
static inline __m256 load_f32_row8(const void *rows, int64_t t, int64_t d, int64_t D) {
    return _mm256_loadu_ps((const float *)rows + t * D + d);
}
static inline __m256 load_i8_row8(const void *rows, int64_t t, int64_t d, int64_t D) {
    (void)D;
    const uint8_t *p = ((const uint8_t *const *)rows)[t] + d;
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* fp8 codes widened 8 at a time (load_fp8_row on AVX2) */
static inline __m256 load_fp8_row8(const void *rows, int64_t t, int64_t d, int shift,
                                   float scale) {
    const uint8_t *p = ((const uint8_t *const *)rows)[t] + d;
    const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(x, shift),
                                          _mm256_set1_epi32((int)fp8_keep(shift)));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(scale));
}
static inline __m256 load_e4m3_row8(const void *rows, int64_t t, int64_t d, int64_t D) {
    (void)D;
    return load_fp8_row8(rows, t, d, E4M3_SHIFT, E4M3_SCALE);
}
static inline __m256 load_e5m2_row8(const void *rows, int64_t t, int64_t d, int64_t D) {
    (void)D;
    return load_fp8_row8(rows, t, d, E5M2_SHIFT, E5M2_SCALE);
}

/* scores[h, t] = ks[t] * (q_h . row_t) for the heads [h0, h0 + group) and slots [0, n), 8
 * slots' accumulators at a time (16 registers; D % 8 == 0); always inlined with a constant
 * `load` */
static inline __attribute__((always_inline)) void score8(Softmax *s, const float *qb,
                                                         const void *rows, int64_t h0,
                                                         int64_t group, int64_t n, int64_t D,
                                                         RowLoad8 load) {
    for (int64_t h = h0; h < h0 + group; h++) {
        const float *qh = qb + h * D;
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            __m256 acc[8];
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                #pragma GCC unroll 8
                for (int t = 0; t < 8; t++)
                    acc[t] = _mm256_fmadd_ps(qv, load(rows, t0 + t, d, D), acc[t]);
            }
            _mm256_storeu_ps(s->scores + h * TILE + t0,
                             _mm256_mul_ps(sum8(acc), _mm256_loadu_ps(s->ks + t0)));
        }
    }
}
#endif

/* scores[h, t] = ks[t] * (q_h . rows[t]) for the query heads [h0, h0 + group) and the tile's
 * slots (rows: [TILE, D], all TILE rows readable; scores past n are never used) */
static inline void score_tile(Softmax *s, const float *qb, const float *rows, int64_t h0,
                              int64_t group, int64_t n, int64_t D) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        score16(s, qb, rows, h0, group, D, load_f32_row);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0 && TILE == 16) {
        score8(s, qb, rows, h0, group, n, D, load_f32_row8);
        return;
    }
#endif
    for (int64_t h = h0; h < h0 + group; h++)
        for (int64_t t = 0; t < n; t++)
            s->scores[h * TILE + t] = s->ks[t] * dot(qb + h * D, rows + t * D, D);
}

/* fold the tile's n scores of heads [h0, h0 + group) into their running max / sum; the scores
 * become the tile's P */
static inline void softmax_tile(Softmax *s, int64_t h0, int64_t group, int64_t n, int64_t D) {
    for (int64_t h = h0; h < h0 + group; h++) {
        float *sc = s->scores + h * TILE;
        float mx = s->m[h], sum = 0.f;
#if defined(__AVX512F__)
        if (TILE == 16) {
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            const __m512 x = _mm512_maskz_loadu_ps(live, sc);
            const float tile_max = _mm512_mask_reduce_max_ps(live, x);
            mx = tile_max > mx ? tile_max : mx;
            const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x,
                                                                        _mm512_set1_ps(mx))));
            _mm512_storeu_ps(sc, p);
            sum = _mm512_reduce_add_ps(p);
        } else
#elif defined(__AVX2__) && defined(__FMA__)
        if (TILE == 16) {
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_set1_epi32((int)n), lane));
            const __m256 live1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_set1_epi32((int)n - 8), lane));
            const __m256 low = _mm256_set1_ps(-FLT_MAX);
            const __m256 x0 = _mm256_blendv_ps(low, _mm256_loadu_ps(sc), live0);
            const __m256 x1 = _mm256_blendv_ps(low, _mm256_loadu_ps(sc + 8), live1);
            const float tile_max = hmax256(_mm256_max_ps(x0, x1));
            mx = tile_max > mx ? tile_max : mx;
            const __m256 m8 = _mm256_set1_ps(mx);
            const __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(x0, m8)), live0);
            const __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(x1, m8)), live1);
            _mm256_storeu_ps(sc, p0);
            _mm256_storeu_ps(sc + 8, p1);
            sum = hsum256(_mm256_add_ps(p0, p1));
        } else
#endif
        {
            for (int64_t t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
            for (int64_t t = 0; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
        }
        const float corr = expf(s->m[h] - mx);
        s->l[h] = s->l[h] * corr + sum;
        s->m[h] = mx;
        if (corr != 1.f) {
            float *ah = s->acc + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) ah[d] *= corr;
        }
    }
}

/* acc_h += sum_t P[h, t] * (va[t] * rows[t] + vb[t]) (rows: [n, D] at a row stride) for heads
 * [h0, h0 + group): the accumulator of a head stays in registers over the tile's slots on the
 * guarded vector paths (a column chunk at a time) */
static inline void accumulate_tile(Softmax *s, const float *rows, int64_t stride, int64_t h0,
                                   int64_t group, int64_t n, int64_t D) {
    float pa[TILE];
    for (int64_t h = h0; h < h0 + group; h++) {
        float *ph = s->scores + h * TILE;
        float pb = 0.f;
        for (int64_t t = 0; t < n; t++) { pb += ph[t] * s->vb[t]; pa[t] = ph[t] * s->va[t]; }
        float *ah = s->acc + h * D;
#if defined(__AVX512F__)
        if (D % 64 == 0) {
            const __m512 bias = _mm512_set1_ps(pb);
            for (int64_t d = 0; d < D; d += 64) {
                __m512 a0 = _mm512_add_ps(_mm512_loadu_ps(ah + d), bias);
                __m512 a1 = _mm512_add_ps(_mm512_loadu_ps(ah + d + 16), bias);
                __m512 a2 = _mm512_add_ps(_mm512_loadu_ps(ah + d + 32), bias);
                __m512 a3 = _mm512_add_ps(_mm512_loadu_ps(ah + d + 48), bias);
                for (int64_t t = 0; t < n; t++) {
                    const __m512 p = _mm512_set1_ps(pa[t]);
                    const float *v = rows + t * stride + d;
                    a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v), a0);
                    a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16), a1);
                    a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 32), a2);
                    a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 48), a3);
                }
                _mm512_storeu_ps(ah + d, a0); _mm512_storeu_ps(ah + d + 16, a1);
                _mm512_storeu_ps(ah + d + 32, a2); _mm512_storeu_ps(ah + d + 48, a3);
            }
            continue;
        }
        if (D % 32 == 0) {  /* small heads (the shipped model's 32) */
            const __m512 bias = _mm512_set1_ps(pb);
            for (int64_t d = 0; d < D; d += 32) {
                __m512 a0 = _mm512_add_ps(_mm512_loadu_ps(ah + d), bias);
                __m512 a1 = _mm512_add_ps(_mm512_loadu_ps(ah + d + 16), bias);
                for (int64_t t = 0; t < n; t++) {
                    const __m512 p = _mm512_set1_ps(pa[t]);
                    const float *v = rows + t * stride + d;
                    a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v), a0);
                    a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16), a1);
                }
                _mm512_storeu_ps(ah + d, a0); _mm512_storeu_ps(ah + d + 16, a1);
            }
            continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (D % 32 == 0) {
            const __m256 bias = _mm256_set1_ps(pb);
            for (int64_t d = 0; d < D; d += 32) {
                __m256 a0 = _mm256_add_ps(_mm256_loadu_ps(ah + d), bias);
                __m256 a1 = _mm256_add_ps(_mm256_loadu_ps(ah + d + 8), bias);
                __m256 a2 = _mm256_add_ps(_mm256_loadu_ps(ah + d + 16), bias);
                __m256 a3 = _mm256_add_ps(_mm256_loadu_ps(ah + d + 24), bias);
                for (int64_t t = 0; t < n; t++) {
                    const __m256 p = _mm256_set1_ps(pa[t]);
                    const float *v = rows + t * stride + d;
                    a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
                    a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
                    a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
                    a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
                }
                _mm256_storeu_ps(ah + d, a0); _mm256_storeu_ps(ah + d + 8, a1);
                _mm256_storeu_ps(ah + d + 16, a2); _mm256_storeu_ps(ah + d + 24, a3);
            }
            continue;
        }
#endif
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) ah[d] += pb;
        for (int64_t t = 0; t < n; t++) {
            const float p = pa[t], *v = rows + t * stride;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) ah[d] += p * v[d];
        }
    }
}

/* the step's own token: one more tile of one slot, its K/V fresh in float32 */
static void attend_fresh(Softmax *s, const float *qb, const float *kn, const float *vn,
                         int64_t Hq, int64_t Hkv, int64_t D) {
    const int64_t group = Hq / Hkv;
    for (int64_t g = 0; g < Hkv; g++) {
        for (int64_t h = g * group; h < (g + 1) * group; h++)
            s->scores[h * TILE] = dot(qb + h * D, kn + g * D, D);
        /* one live slot: the plain softmax path */
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            float *sc = s->scores + h * TILE;
            const float mx = sc[0] > s->m[h] ? sc[0] : s->m[h];
            const float corr = expf(s->m[h] - mx);
            sc[0] = expf(sc[0] - mx);
            s->l[h] = s->l[h] * corr + sc[0];
            s->m[h] = mx;
            float *ah = s->acc + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) ah[d] = ah[d] * corr + sc[0] * vn[g * D + d];
        }
    }
}

static void softmax_finish(const Softmax *s, float *ob, int64_t Hq, int64_t D) {
    for (int64_t h = 0; h < Hq; h++) {
        const float inv = s->l[h] > 0.f ? 1.f / s->l[h] : 0.f;
        for (int64_t d = 0; d < D; d++) ob[h * D + d] = s->acc[h * D + d] * inv;
    }
}

/* ---- RoPE (rotate-half, as nanokv.layers.rotary) on a decoded key row of one head --------- */
static inline void rope_head(float *x, const float *cos, const float *sin, int64_t rot_dim) {
    const int64_t half = rot_dim / 2;
    #pragma omp simd
    for (int64_t d = 0; d < half; d++) {
        const float a = x[d], b = x[d + half];
        x[d] = a * cos[d] - b * sin[d];
        x[d + half] = b * cos[d + half] + a * sin[d + half];
    }
}

/* ==== int8 / fp8 per-token codes ============================================================= */
enum { FMT_INT8 = 0, FMT_E4M3 = 1, FMT_E5M2 = 2 };

/* x = decode(codes) over one head's D channels (the token's scale is applied once per slot:
 * to its score, to its weight in P @ V; RoPE is linear, so it commutes with the scale) */
static inline void pertoken_head(float *restrict x, const uint8_t *restrict c, int64_t D,
                                 int fmt) {
    if (fmt == FMT_INT8) {
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) x[d] = (float)(int8_t)c[d];
    } else if (fmt == FMT_E4M3) {
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) x[d] = e4m3_to_f32(c[d]);
    } else {
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) x[d] = e5m2_to_f32(c[d]);
    }
}

/* The tile's rows of every KV head (codes [num_slots, Hkv, D]), decoded in address order into
 * x [Hkv, TILE, D] with each row's scale in scale [Hkv, TILE]: the pool is read front to back,
 * as the float32 kernel reads it, which the hardware prefetchers follow (reading a KV head's
 * rows of the tile a row apart, as the other stores do, left the int8 kernel slower than
 * float32 on a CPU whose prefetchers did not follow that stride). */
static inline __attribute__((always_inline)) void pertoken_tile(
        float *restrict x, float *restrict scale, const uint8_t *codes, const float *scales,
        int64_t first, int64_t n, int64_t Hkv, int64_t D, int fmt, const int32_t *slot_positions,
        const float *cos, const float *sin, int64_t rot_dim) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = first + t;
        const int64_t pos = rot_dim && slot_positions[slot] > 0 ? slot_positions[slot] : 0;
        for (int64_t g = 0; g < Hkv; g++) {
            float *row = x + (g * TILE + t) * D;
            scale[g * TILE + t] = scales[slot * Hkv + g];
            pertoken_head(row, codes + (slot * Hkv + g) * D, D, fmt);
            if (rot_dim) rope_head(row, cos + pos * rot_dim, sin + pos * rot_dim, rot_dim);
        }
    }
}

/* the rows a pass reads next, requested ahead into L2 in address order (a pass that visits a
 * KV head at a time reads each slot's row in pieces a row apart, which the hardware
 * prefetchers do not follow); the int8 path and the KVQuant block path (kvquant_block.h) */
static inline void prefetch_rows(const uint8_t *first, int64_t nbytes) {
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(first + off, 0, 2);
}

/* 0: int8 through the decoded tile buffer as the other formats (the reference for the fused
 * path, and an A/B switch: pertoken_set_int8_fused) */
static int nanokv_int8_fused = 1;
void pertoken_set_int8_fused(int on) { nanokv_int8_fused = on; }
/* the fused path's tile copied in address order first (codes_tile): 1 always, 0 never (read in
 * place with prefetches), -1 by the layer's shape (int8_stage_fits). The default is where each
 * was measured faster: by shape on AVX2 (an EPYC), in place on AVX-512 (a Xeon); A/B switch */
#if defined(__AVX512F__)
static int nanokv_int8_stage = 0;
#else
static int nanokv_int8_stage = -1;
#endif
void pertoken_set_int8_stage(int mode) { nanokv_int8_stage = mode < 0 ? -1 : mode > 0; }
int pertoken_int8_stage(void) { return nanokv_int8_stage; }

/* whether the copy pays for a layer (measured on the AVX2 EPYC, 16 requests x 1k slots): only
 * when a KV head's rows are far apart (a slot's row of every head >= 512 bytes) and each is
 * more than one cache line (head_dim >= 128): 0.48x float32's time against 0.54-0.60x in place
 * at 4 and 8 KV heads of 128; at 64 or 32 channels, or 2 KV heads of 128, in place was faster
 * (0.45x against 0.49x at 8 x 64; 0.34-0.43x against 0.56-0.61x at 4 x 32, the shipped model) */
static inline int int8_stage_fits(int64_t Hkv, int64_t D) {
    return nanokv_int8_stage > 0 || (nanokv_int8_stage < 0 && Hkv * D >= 512 && D >= 128);
}
int pertoken_int8_stage_fits(int64_t Hkv, int64_t D) { return int8_stage_fits(Hkv, D); }
static int nanokv_int8_prefetch = 1;  /* in place: the next tile's codes prefetched */
void pertoken_set_int8_prefetch(int on) { nanokv_int8_prefetch = on; }

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* ---- int8 / fp8 codes read straight into registers (AVX-512 / AVX2; keys after RoPE) ------- *
 * The tile path above decodes a tile of every KV head into a float buffer (64 KiB at Hkv 8,
 * D 128: L2) and reads it back; the int8 decode is two instructions and the fp8 one four, so
 * the kernel instead widens each 16 codes where they are used, in the score's and the value's
 * FMA loops (the load: load_i8_row, load_e4m3_row, load_e5m2_row). */
/* acc_h += sum_{t < n} P[h, t] * va[t] * codes_t for the heads [h0, h0 + group), 32 columns
 * of up to 8 heads at a time in registers: each 16 codes widened once for all of them.
 * D % 32 == 0. */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void accumulate_tile_codes(
        Softmax *s, const uint8_t *const *row, int64_t h0, int64_t group, int64_t n, int64_t D,
        RowLoad load) {
    float pa[8][TILE];
    for (int64_t j0 = 0; j0 < group; j0 += 8) {
        const int64_t heads = group - j0 < 8 ? group - j0 : 8;
        for (int64_t j = 0; j < heads; j++)
            for (int64_t t = 0; t < n; t++)
                pa[j][t] = s->scores[(h0 + j0 + j) * TILE + t] * s->va[t];
        for (int64_t d = 0; d < D; d += 32) {
            __m512 a[8][2];
            for (int64_t j = 0; j < heads; j++) {
                const float *ah = s->acc + (h0 + j0 + j) * D + d;
                a[j][0] = _mm512_loadu_ps(ah);
                a[j][1] = _mm512_loadu_ps(ah + 16);
            }
            for (int64_t t = 0; t < n; t++) {
                const __m512 v0 = load(row, t, d, D), v1 = load(row, t, d + 16, D);
                for (int64_t j = 0; j < heads; j++) {
                    const __m512 p = _mm512_set1_ps(pa[j][t]);
                    a[j][0] = _mm512_fmadd_ps(p, v0, a[j][0]);
                    a[j][1] = _mm512_fmadd_ps(p, v1, a[j][1]);
                }
            }
            for (int64_t j = 0; j < heads; j++) {
                float *ah = s->acc + (h0 + j0 + j) * D + d;
                _mm512_storeu_ps(ah, a[j][0]);
                _mm512_storeu_ps(ah + 16, a[j][1]);
            }
        }
    }
}
#else
/* the same on AVX2: 16 columns of `heads` (1..4) heads at a time (8 accumulators), always
 * inlined with `heads` constant (a runtime count left the accumulators on the stack) */
static inline __attribute__((always_inline)) void accumulate_heads_codes(
        Softmax *s, const uint8_t *const *row, int64_t h0, int64_t n, int64_t D,
        const int heads, RowLoad8 load) {
    float pa[4][TILE];
    for (int j = 0; j < heads; j++)
        for (int64_t t = 0; t < n; t++) pa[j][t] = s->scores[(h0 + j) * TILE + t] * s->va[t];
    for (int64_t d = 0; d < D; d += 16) {
        __m256 a[4][2];
        for (int j = 0; j < heads; j++) {
            const float *ah = s->acc + (h0 + j) * D + d;
            a[j][0] = _mm256_loadu_ps(ah);
            a[j][1] = _mm256_loadu_ps(ah + 8);
        }
        for (int64_t t = 0; t < n; t++) {
            const __m256 v0 = load(row, t, d, D), v1 = load(row, t, d + 8, D);
            for (int j = 0; j < heads; j++) {
                const __m256 p = _mm256_set1_ps(pa[j][t]);
                a[j][0] = _mm256_fmadd_ps(p, v0, a[j][0]);
                a[j][1] = _mm256_fmadd_ps(p, v1, a[j][1]);
            }
        }
        for (int j = 0; j < heads; j++) {
            float *ah = s->acc + (h0 + j) * D + d;
            _mm256_storeu_ps(ah, a[j][0]);
            _mm256_storeu_ps(ah + 8, a[j][1]);
        }
    }
}

static inline __attribute__((always_inline)) void accumulate_tile_codes(
        Softmax *s, const uint8_t *const *row, int64_t h0, int64_t group, int64_t n, int64_t D,
        RowLoad8 load) {
    for (int64_t j0 = 0; j0 < group; j0 += 4) {
        switch (group - j0 < 4 ? group - j0 : 4) {
        case 1: accumulate_heads_codes(s, row, h0 + j0, n, D, 1, load); break;
        case 2: accumulate_heads_codes(s, row, h0 + j0, n, D, 2, load); break;
        case 3: accumulate_heads_codes(s, row, h0 + j0, n, D, 3, load); break;
        default: accumulate_heads_codes(s, row, h0 + j0, n, D, 4, load); break;
        }
    }
}
#endif

/* one tile of n slots from pool slot `first`, every KV head, int8 codes in registers. Either
 * the tile's key and value rows are first copied in address order into `stage` ([2, TILE,
 * Hkv, D] bytes: 32 KiB at Hkv 8, D 128) and read from there, or (stage NULL) read in place, a
 * KV head at a time; either way the next tile's next_n slots from `next` (0: none) are
 * prefetched while this tile's heads are worked on: for the copy the next tile's rows in
 * address order, 1 / Hkv of them a head (without, the copy waited for memory while nothing
 * else ran; on a Zen 4's AVX2 build 0.92-0.97x the time where the rows come from memory, 16
 * requests or 16k tokens, but 1.08-1.12x where one layer's rows stay in L3, one request up
 * to 4k tokens, which a model of many layers does not see), in place a head's rows of the
 * next tile a head at a time. On an AVX-512
 * Xeon the prefetch let the loads find their rows in L1 (5.3 against 4.0 ms for 8 requests x
 * 2800 slots, one Qwen3-0.6B layer); on an AVX2 EPYC it did not (a KV head's rows are 1 KiB
 * apart, a stride its prefetchers do not follow), and the copy, a sequential read they do
 * follow, took 0.36-0.42x float32's time against 0.58-0.64x in place at 8 KV heads of 128
 * (int8_stage_fits). */
#if defined(__AVX512F__)
typedef RowLoad CodesLoad;
#else
typedef RowLoad8 CodesLoad;
#endif
static inline __attribute__((always_inline)) void codes_tile_load(
        Softmax *s, const float *qb, const uint8_t *k_codes, const uint8_t *v_codes,
        const float *k_scales, const float *v_scales, int64_t first, int64_t n, int64_t Hkv,
        int64_t D, int64_t group, int64_t next, int64_t next_n, uint8_t *stage,
        CodesLoad load) {
    const int64_t row_bytes = Hkv * D;
    const uint8_t *k_rows = k_codes + first * row_bytes, *v_rows = v_codes + first * row_bytes;
    if (stage) {
        memcpy(stage, k_rows, n * row_bytes);
        memcpy(stage + TILE * row_bytes, v_rows, n * row_bytes);
        k_rows = stage;
        v_rows = stage + TILE * row_bytes;
    }
    for (int64_t g = 0; g < Hkv; g++) {
        /* rows past n: the last live row again, so that every load stays in the pool or the
         * stage's live rows (those scores are never used) */
        const uint8_t *kr[TILE], *vr[TILE];
        for (int64_t t = 0; t < TILE; t++) {
            const int64_t at = (t < n ? t : n - 1) * row_bytes + g * D;
            kr[t] = k_rows + at;
            vr[t] = v_rows + at;
        }
        for (int64_t t = 0; t < n; t++) {
            s->ks[t] = k_scales[(first + t) * Hkv + g];
            s->va[t] = v_scales[(first + t) * Hkv + g];
        }
        if (stage && next_n) {  /* the next tile's rows in address order, 1 / Hkv a head */
            const int64_t bytes = next_n * row_bytes;
            const int64_t share = (bytes / Hkv + 63) / 64 * 64, at = g * share;
            const int64_t len = at >= bytes ? 0 : bytes - at < share ? bytes - at : share;
            prefetch_rows(k_codes + next * row_bytes + at, len);
            prefetch_rows(v_codes + next * row_bytes + at, len);
        }
        for (int64_t t = 0; !stage && t < next_n; t++) {  /* this head's rows of the next tile */
            prefetch_rows(k_codes + (next + t) * row_bytes + g * D, D);
            prefetch_rows(v_codes + (next + t) * row_bytes + g * D, D);
        }
#if defined(__AVX512F__)
        score16(s, qb, kr, g * group, group, D, load);
#else
        score8(s, qb, kr, g * group, group, n, D, load);
#endif
        softmax_tile(s, g * group, group, n, D);
        accumulate_tile_codes(s, vr, g * group, group, n, D, load);
    }
}

/* codes_tile_load with the format's load as a constant (inside the OpenMP region the format
 * is a runtime value: a load through a pointer would be a call per 16 codes) */
static inline void codes_tile(Softmax *s, const float *qb, const uint8_t *k_codes,
                              const uint8_t *v_codes, const float *k_scales,
                              const float *v_scales, int64_t first, int64_t n, int64_t Hkv,
                              int64_t D, int64_t group, int64_t next, int64_t next_n,
                              uint8_t *stage, int fmt) {
#define CODES_TILE(load) codes_tile_load(s, qb, k_codes, v_codes, k_scales, v_scales, first, \
                                         n, Hkv, D, group, next, next_n, stage, load)
#if defined(__AVX512F__)
    if (fmt == FMT_INT8) CODES_TILE(load_i8_row);
    else if (fmt == FMT_E4M3) CODES_TILE(load_e4m3_row);
    else CODES_TILE(load_e5m2_row);
#else
    if (fmt == FMT_INT8) CODES_TILE(load_i8_row8);
    else if (fmt == FMT_E4M3) CODES_TILE(load_e4m3_row8);
    else CODES_TILE(load_e5m2_row8);
#endif
#undef CODES_TILE
}
#endif

static inline __attribute__((always_inline)) int pertoken_impl(
        const float *q, const uint8_t *k_codes, const uint8_t *v_codes, const float *k_scales,
        const float *v_scales, const float *k_new, const float *v_new, float *out,
        const int64_t *run_ptr, const int64_t *run_start, const int64_t *run_len,
        const int32_t *slot_positions, const float *cos, const float *sin, int64_t rot_dim,
        int64_t num_requests, int64_t Hq, int64_t Hkv, int64_t D, int fmt) {
    int failed = 0;
    const int64_t row = Hkv * D, group = Hq / Hkv;
    /* int8 and fp8 with keys after RoPE: the codes widened in registers (codes_tile) */
    const int fused = !rot_dim && D % 32 == 0 && nanokv_int8_fused;
    const int stage = fused && int8_stage_fits(Hkv, D);
    (void)fused;
    (void)stage;
    #pragma omp parallel
    {
        Softmax s;
        /* the decoded tile of every KV head: [Hkv, TILE, D] keys, then values (64 KiB at
         * Hkv 8, D 128: L2, not L1), and their scales [Hkv, TILE]; zeroed: score_tile may read
         * the rows past a partial tile (their scores are unused); also the int8 path's stage
         * (codes_tile: 2 TILE Hkv D bytes) */
        float *kv = calloc(Hkv * TILE * D, sizeof(float));
        float *scale = calloc(Hkv * TILE, sizeof(float));
        if (!softmax_alloc(&s, Hq, D) || !kv || !scale) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_requests; b++) {
            if (failed) continue;
            softmax_reset(&s, Hq, D);
            const float *qb = q + b * Hq * D;
            for (int64_t r = run_ptr[b]; r < run_ptr[b + 1]; r++) {
                const int64_t start = run_start[r], len = run_len[r];
                for (int64_t t0 = 0; t0 < len; t0 += TILE) {
                    const int64_t n = len - t0 < TILE ? len - t0 : TILE, first = start + t0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
                    if (fused) {
                        /* the next tile: in this run, else the next run's first */
                        int64_t next = first + TILE, next_n = len - t0 - TILE;
                        if (next_n <= 0) {
                            next = r + 1 < run_ptr[b + 1] ? run_start[r + 1] : 0;
                            next_n = r + 1 < run_ptr[b + 1] ? run_len[r + 1] : 0;
                        }
                        /* the next tile prefetched (by a head's rows, or in address order
                         * for the copy) */
                        next_n = !nanokv_int8_prefetch ? 0 : (next_n < TILE ? next_n : TILE);
                        codes_tile(&s, qb, k_codes, v_codes, k_scales, v_scales, first, n,
                                   Hkv, D, group, next, next_n, stage ? (uint8_t *)kv : NULL,
                                   fmt);
                        continue;
                    }
#endif
                    pertoken_tile(kv, scale, k_codes, k_scales, first, n, Hkv, D, fmt,
                                  slot_positions, cos, sin, rot_dim);
                    for (int64_t g = 0; g < Hkv; g++) {
                        memcpy(s.ks, scale + g * TILE, sizeof(float) * n);
                        score_tile(&s, qb, kv + g * TILE * D, g * group, group, n, D);
                        softmax_tile(&s, g * group, group, n, D);
                    }
                    pertoken_tile(kv, scale, v_codes, v_scales, first, n, Hkv, D, fmt, NULL,
                                  NULL, NULL, 0);
                    for (int64_t g = 0; g < Hkv; g++) {
                        memcpy(s.va, scale + g * TILE, sizeof(float) * n);
                        accumulate_tile(&s, kv + g * TILE * D, D, g * group, group, n, D);
                    }
                }
            }
            attend_fresh(&s, qb, k_new + b * row, v_new + b * row, Hq, Hkv, D);
            softmax_finish(&s, out + b * Hq * D, Hq, D);
        }
        softmax_free(&s);
        free(kv);
        free(scale);
    }
    return failed ? -1 : 0;
}

/* fmt: 0 int8, 1 fp8 e4m3fn, 2 fp8 e5m2. Caches: this layer's codes [num_slots, Hkv, D] and
 * scales [num_slots, Hkv]; slot_positions [num_slots] and cos/sin [positions, rot_dim] only when
 * rot_dim > 0 (keys stored before RoPE). Runs cover each request's cached slots, not the new
 * token. */
int pertoken_decode_attention(const float *q, const uint8_t *k_codes, const uint8_t *v_codes,
                              const float *k_scales, const float *v_scales, const float *k_new,
                              const float *v_new, float *out, const int64_t *run_ptr,
                              const int64_t *run_start, const int64_t *run_len,
                              const int32_t *slot_positions, const float *cos, const float *sin,
                              int64_t rot_dim, int64_t num_requests, int64_t num_q_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t fmt) {
    /* one instantiation per format: the decode is resolved at compile time in the inner loops */
    if (fmt == FMT_INT8)
        return pertoken_impl(q, k_codes, v_codes, k_scales, v_scales, k_new, v_new, out, run_ptr,
                             run_start, run_len, slot_positions, cos, sin, rot_dim, num_requests,
                             num_q_heads, num_kv_heads, head_dim, FMT_INT8);
    if (fmt == FMT_E4M3)
        return pertoken_impl(q, k_codes, v_codes, k_scales, v_scales, k_new, v_new, out, run_ptr,
                             run_start, run_len, slot_positions, cos, sin, rot_dim, num_requests,
                             num_q_heads, num_kv_heads, head_dim, FMT_E4M3);
    return pertoken_impl(q, k_codes, v_codes, k_scales, v_scales, k_new, v_new, out, run_ptr,
                         run_start, run_len, slot_positions, cos, sin, rot_dim, num_requests,
                         num_q_heads, num_kv_heads, head_dim, FMT_E5M2);
}

/* ==== KVQuant and KIVI ======================================================================= *
 * KIVI (`nanokv.quant.kivi_store`) is read as the same layout: per-channel keys per block
 * (min as offset, scale as half, the codes' own values as the table), per-token values with
 * `groups` statistics per head, after-RoPE keys, no outliers or sinks, and both keys and values
 * of a partial block in staging. */
typedef struct {
    const uint8_t *codes;      /* [nb, B, Hkv, packed] */
    const uint16_t *offset;    /* fp16: per channel [nb, Hkv, D]; per token [nb, B, Hkv,
                                  groups] (KIVI: groups of D / groups channels) */
    const uint16_t *half;      /* same; a code's value is lut[c] * half + offset */
    const void *oidx;          /* per channel [nb, Hkv, cap] (slot * D + channel); per token
                                  [nb, B, Hkv, cap] (channel); unused: < 0 or out of range */
    const void *oval;          /* same shape, sparse kind: an outlier's delta, its exact
                                  value minus lut[c] * half + offset (added to the decoding) */
    const float *lut;          /* [2^bits] centroid of each code (uniform grid or codebook) */
    const void *sink;          /* [nb, N, Hkv, D] sparse kind */
    int64_t per_channel, bits, packed, cap, idx_bytes, groups;
} KVQuantSide;

typedef struct {
    KVQuantSide k, v;
    const int16_t *sink_slot;      /* [nb, N]: slot of position p, -1 none */
    const void *staging;           /* [S, B, Hkv, D] this layer's staged (partial-block) keys */
    const void *staging_v;         /* same for values (KIVI: the whole partial block waits in
                                      full precision), NULL when values are never staged */
    const int32_t *staging_index;  /* [nb]: staging row, -1 none */
    const int32_t *slot_positions; /* [nb, B] */
    const float *cos, *sin;        /* [positions, rot_dim] */
    int64_t num_sinks, sparse_kind, staging_kind, rot_dim;
    int64_t block_size, num_q_heads, num_kv_heads, head_dim;
    int64_t rope_halves_equal;     /* cos[:, d] == cos[:, d + R/2] and so for sin (rotate-half
                                      tables: cat(freqs, freqs)) */
    const float *rope_tiles;       /* NULL, or where the halves repeat, the tables' first halves
                                      by tiles of 16 positions, each transposed: [ceil(positions /
                                      16), 2 (cos, sin), R / 2, 16] (the AVX-512 slot-lanes key
                                      pass reads a tile of consecutive positions in place) */
    const float *rope_rows;        /* NULL, or where the halves repeat, the tables' first halves
                                      side by side: [positions, 2 (cos, sin), R / 2] (the AVX2
                                      key pass: one stream of R floats per position) */
} KVQuantLayer;

static inline void unpack_codes(const uint8_t *p, int64_t bits, int64_t D, uint8_t *c) {
    if (bits == 8) {
        memcpy(c, p, D);
    } else if (bits == 4) {
        for (int64_t i = 0; i < D / 2; i++) { c[2 * i] = p[i] & 15; c[2 * i + 1] = p[i] >> 4; }
        if (D & 1) c[D - 1] = p[D / 2] & 15;
    } else if (bits == 2) {
        for (int64_t i = 0; i < D / 4; i++) {
            const uint8_t x = p[i];
            c[4 * i] = x & 3; c[4 * i + 1] = (x >> 2) & 3;
            c[4 * i + 2] = (x >> 4) & 3; c[4 * i + 3] = x >> 6;
        }
        for (int64_t d = D / 4 * 4; d < D; d++) c[d] = (p[d / 4] >> (2 * (d & 3))) & 3;
    } else { /* 3: eight codes in a 24-bit little-endian word */
        for (int64_t g = 0; g < (D + 7) / 8; g++) {
            const uint32_t w = p[3 * g] | (uint32_t)p[3 * g + 1] << 8 | (uint32_t)p[3 * g + 2] << 16;
            for (int64_t j = 0; j < 8 && 8 * g + j < D; j++) c[8 * g + j] = (w >> (3 * j)) & 7;
        }
    }
}

#if defined(__AVX512F__)
/* a codebook of up to 16 centroids as one register, for table permutes (unused entries 0) */
static inline __m512 lut16(const float *lut, int64_t bits) {
    float t16[16] = {0};
    memcpy(t16, lut, sizeof(float) << bits);
    return _mm512_loadu_ps(t16);
}

/* the codes of channels [c0, c0 + 16) of a packed row, one per 32-bit lane (c0 % 16 == 0) */
static inline __m512i codes16(const uint8_t *p, int64_t bits, int64_t c0) {
    if (bits == 4) {  /* 8 bytes, channel 2i in the low nibble */
        uint64_t w;
        memcpy(&w, p + c0 / 2, sizeof w);
        const __m128i b = _mm_cvtsi64_si128((long long)w), low4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    }
    if (bits == 2) {  /* a 32-bit word, channel j at bits 2j */
        uint32_t w;
        memcpy(&w, p + c0 / 4, sizeof w);
        const __m512i shift = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                                28, 30);
        return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w), shift),
                                _mm512_set1_epi32(3));
    }
    /* 3 bits: two 24-bit little-endian words of eight codes */
    const uint8_t *b = p + c0 / 8 * 3;
    const uint32_t w0 = b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16;
    const uint32_t w1 = b[3] | (uint32_t)b[4] << 8 | (uint32_t)b[5] << 16;
    const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32((int)w0)),
                                             _mm256_set1_epi32((int)w1), 1);
    const __m512i shift = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18,
                                            21);
    return _mm512_and_si512(_mm512_srlv_epi32(words, shift), _mm512_set1_epi32(7));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* lut[idx] for 8 lanes of a table of up to 16 entries held as its halves (lo, hi): bit 3 of the
 * index, moved to the sign bit, picks the upper half */
static inline __m256 lut16_lookup8(__m256 lo, __m256 hi, __m256i idx) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* a codebook of 2^bits centroids as the halves (lo, hi) of a 16-entry table for centroids8,
 * repeated to fill it (so the bits above a code in its lane do not matter) */
static inline void lut_halves8(const float *lut, int64_t bits, __m256 *lo, __m256 *hi) {
    float t16[16];
    for (int i = 0; i < 16; i++) t16[i] = lut[i & ((1 << bits) - 1)];
    *lo = _mm256_loadu_ps(t16);
    *hi = _mm256_loadu_ps(t16 + 8);
}

/* lut[codes] of channels [c0, c0 + 8) of a packed 2, 3 or 4-bit row (c0 % 8 == 0; channel i at
 * bits i * bits of its group's 8 * bits bits, as unpack_codes reads them): those bits broadcast
 * and shifted per lane, the code left in each lane's low bits with the next codes above it,
 * which the lookup ignores (the permutes read bits 0-2, the 16-entry blend bit 3, and
 * lut_halves8's tables repeat) */
static inline __attribute__((always_inline)) __m256 centroids8(const uint8_t *p, int64_t bits,
                                                               int64_t c0, __m256 lo, __m256 hi) {
    const uint8_t *b = p + c0 / 8 * bits;
    uint32_t w;
    if (bits == 4) {
        memcpy(&w, b, sizeof w);
        const __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                            _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        return lut16_lookup8(lo, hi, x);
    }
    w = b[0] | (uint32_t)b[1] << 8;
    if (bits == 3) w |= (uint32_t)b[2] << 16;
    const __m256i shift = bits == 2 ? _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)
                                    : _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    return _mm256_permutevar8x32_ps(lo, _mm256_srlv_epi32(_mm256_set1_epi32((int)w), shift));
}

#include "byte_planes_avx2.h"  /* lut_planes4, centroids32 */
#endif

/* x[d] = lut[c[d]]: codebooks of up to 16 centroids are looked up in registers on the guarded
 * vector paths (a table permute; compilers emit a scalar loop or gathers for this) */
static inline void lookup_row(float *restrict x, const uint8_t *restrict c,
                              const float *restrict lut, int64_t bits, int64_t D) {
    int64_t d = 0;
    (void)bits;
#if defined(__AVX512F__)
    if (bits <= 4) {
        const __m512 table = lut16(lut, bits);
        for (; d + 16 <= D; d += 16) {
            const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + d)));
            _mm512_storeu_ps(x + d, _mm512_permutexvar_ps(idx, table));
        }
    }
#elif defined(__AVX2__)
    if (bits <= 4) {
        __m256 lo, hi;
        lut_halves8(lut, bits, &lo, &hi);
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(x + d, lut16_lookup8(
                lo, hi, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + d)))));
    }
#endif
    for (; d < D; d++) x[d] = lut[c[d]];
}

/* x = lut[codes] over one head's D channels (p: its packed codes; c: D bytes of scratch); 2, 3
 * and 4-bit codes are split and looked up in registers on the AVX-512 and AVX2 paths */
static inline void decode_codes(float *restrict x, const uint8_t *restrict p,
                                const float *restrict lut, int64_t bits, int64_t D,
                                uint8_t *restrict c) {
#if defined(__AVX512F__)
    if (bits == 4 && D % 32 == 0) {
        const __m512 table = lut16(lut, bits);
        const __m128i low4 = _mm_set1_epi8(0x0F);
        for (int64_t d = 0; d < D; d += 32) {  /* 16 bytes: channel 2i in the low nibble */
            const __m128i b = _mm_loadu_si128((const __m128i *)(p + d / 2));
            const __m128i lo = _mm_and_si128(b, low4);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
            const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);
            _mm512_storeu_ps(x + d, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c0), table));
            _mm512_storeu_ps(x + d + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c1), table));
        }
        return;
    }
    if ((bits == 2 || bits == 3) && D % 16 == 0) {
        const __m512 table = lut16(lut, bits);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(x + d, _mm512_permutexvar_ps(codes16(p, bits, d), table));
        return;
    }
#elif defined(__AVX2__)
    if (bits >= 2 && bits <= 4 && D % 8 == 0) {
        __m256 lo, hi;
        lut_halves8(lut, bits, &lo, &hi);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(x + d, centroids8(p, bits, d, lo, hi));
        return;
    }
#endif
    unpack_codes(p, bits, D, c);
    lookup_row(x, c, lut, bits, D);
}

/* per-thread scratch of the KVQuant kernel beyond the softmax */
typedef struct {
    uint8_t *codes;             /* [D] */
    float *k_off, *k_half;      /* [Hkv, D] the block's per-channel key statistics */
    int64_t *first, *next;      /* the block's key outliers listed per (slot, head):
                                   [B * Hkv], [Hkv * cap] */
    int64_t *o_ch;              /* [Hkv * cap] channel */
    float *o_val;               /* [Hkv * cap] the outliers' deltas */
    float *kt, *vt;             /* [Hkv, TILE, D] the tile's decoded keys, values */
    float *va, *vb;             /* [Hkv, TILE] the values' scales and offsets */
} KVQuantScratch;

/* the scratch of one thread (`tiles`: also kt, vt, va, vb, for attention); 1 when all of it
 * was allocated (free it either way) */
static int kvquant_scratch_alloc(KVQuantScratch *w, const KVQuantLayer *L, int tiles) {
    const int64_t Hkv = L->num_kv_heads, D = L->head_dim, B = L->block_size;
    const int64_t ocap = L->k.per_channel ? Hkv * L->k.cap : 0;
    memset(w, 0, sizeof *w);
    w->codes = malloc(D + 8);
    w->k_off = malloc(sizeof(float) * Hkv * D);
    w->k_half = malloc(sizeof(float) * Hkv * D);
    w->first = malloc(sizeof(int64_t) * B * Hkv);
    w->next = malloc(sizeof(int64_t) * (ocap + 1));
    w->o_ch = malloc(sizeof(int64_t) * (ocap + 1));
    w->o_val = malloc(sizeof(float) * (ocap + 1));
    int ok = w->codes && w->k_off && w->k_half && w->first && w->next && w->o_ch && w->o_val;
    if (tiles) {
        /* zeroed: score_tile may read the rows past a partial tile (their scores are unused) */
        w->kt = calloc(Hkv * TILE * D, sizeof(float));
        w->vt = calloc(Hkv * TILE * D, sizeof(float));
        w->va = calloc(Hkv * TILE, sizeof(float));
        w->vb = calloc(Hkv * TILE, sizeof(float));
        ok = ok && w->kt && w->vt && w->va && w->vb;
    }
    return ok;
}

static void kvquant_scratch_free(KVQuantScratch *w) {
    free(w->codes); free(w->k_off); free(w->k_half); free(w->first); free(w->next);
    free(w->o_ch); free(w->o_val); free(w->kt); free(w->vt); free(w->va); free(w->vb);
}

static inline void load_head(float *x, const void *src, int64_t base, int64_t D, int64_t kind) {
    if (kind == 2) {
        memcpy(x, (const float *)src + base, sizeof(float) * D);
    } else {
        for (int64_t d = 0; d < D; d++) x[d] = load_any(src, base + d, kind);
    }
}

/* one head's row (block blk, slot t, head h) of a per-token side (values; keys without
 * per-channel statistics) */
static void per_token_head(const KVQuantLayer *L, const KVQuantSide *S, int64_t blk, int64_t t,
                           int64_t h, float *restrict x, uint8_t *codes) {
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const int64_t i = (blk * B + t) * Hkv + h;  /* (block, slot, head) */
    decode_codes(x, S->codes + i * S->packed, S->lut, S->bits, D, codes);
    const int64_t width = D / S->groups;
    for (int64_t gi = 0; gi < S->groups; gi++) {
        const float off = f16_to_f32(S->offset[i * S->groups + gi]);
        const float half = f16_to_f32(S->half[i * S->groups + gi]);
        float *restrict xg = x + gi * width;
        #pragma omp simd
        for (int64_t d = 0; d < width; d++) xg[d] = xg[d] * half + off;
    }
    for (int64_t j = 0; j < S->cap; j++) {  /* an outlier: its delta added */
        const int64_t ch = load_index(S->oidx, i * S->cap + j, S->idx_bytes);
        if (ch >= 0 && ch < D) x[ch] += load_any(S->oval, i * S->cap + j, L->sparse_kind);
    }
}

/* a sink slot's full-precision row replaces the decoded one */
static inline void sink_head(const KVQuantLayer *L, const void *sink, int64_t blk, int64_t t,
                             int64_t h, float *x) {
    const int64_t Hkv = L->num_kv_heads, D = L->head_dim;
    for (int64_t p = 0; p < L->num_sinks; p++)
        if (L->sink_slot[blk * L->num_sinks + p] == t)
            load_head(x, sink, ((blk * L->num_sinks + p) * Hkv + h) * D, D, L->sparse_kind);
}

/* the block's per-channel key statistics and its outliers listed by (slot, head) */
static void key_block_setup(const KVQuantLayer *L, int64_t blk, KVQuantScratch *w) {
    const KVQuantSide *S = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const uint16_t *off = S->offset + blk * Hkv * D, *half = S->half + blk * Hkv * D;
    for (int64_t i = 0; i < Hkv * D; i++) {
        w->k_off[i] = f16_to_f32(off[i]);
        w->k_half[i] = f16_to_f32(half[i]);
    }
    for (int64_t i = 0; i < B * Hkv; i++) w->first[i] = -1;
    int64_t n = 0;
    for (int64_t h = 0; h < Hkv; h++) {
        const int64_t base = (blk * Hkv + h) * S->cap;
        for (int64_t j = 0; j < S->cap; j++) {
            const int64_t idx = load_index(S->oidx, base + j, S->idx_bytes);
            if (idx < 0 || idx >= B * D) continue;
            const int64_t at = idx / D * Hkv + h;  /* (slot, head) */
            w->o_ch[n] = idx % D;
            w->o_val[n] = load_any(S->oval, base + j, L->sparse_kind);
            w->next[n] = w->first[at];
            w->first[at] = n++;
        }
    }
}

/* the sink index of slot t of block blk, or -1 */
static inline int64_t sink_of(const KVQuantLayer *L, int64_t blk, int64_t t) {
    for (int64_t p = 0; p < L->num_sinks; p++)
        if (L->sink_slot[blk * L->num_sinks + p] == t) return p;
    return -1;
}

/* one head's key row, rotated to position `pos` when the store keeps keys before RoPE. The
 * common case (per-channel statistics, no outlier, no sink) takes the affine map and the
 * rotation in one pass over the looked-up centroids. */
static void key_head(const KVQuantLayer *L, int64_t blk, int64_t t, int64_t h, int64_t staged,
                     int64_t pos, float *restrict x, KVQuantScratch *w) {
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const KVQuantSide *S = &L->k;
    const float *cos = L->cos + pos * R, *sin = L->sin + pos * R;
    if (staged >= 0) {  /* a partial block: its keys in full precision */
        load_head(x, L->staging, ((staged * B + t) * Hkv + h) * D, D, L->staging_kind);
    } else if (!S->per_channel) {
        per_token_head(L, S, blk, t, h, x, w->codes);
        sink_head(L, S->sink, blk, t, h, x);
    } else {
        const float *restrict half = w->k_half + h * D, *restrict off = w->k_off + h * D;
        decode_codes(x, S->codes + ((blk * B + t) * Hkv + h) * S->packed, S->lut, S->bits, D,
                     w->codes);
        int exact = sink_of(L, blk, t) < 0 && (R == D || R == 0);
        /* an outlier enters as its delta over the half-range, added to its centroid (the
         * affine map takes it to the decoding plus the delta, to float rounding), so the row
         * stays one pass */
        for (int64_t e = w->first[t * Hkv + h]; exact && e >= 0; e = w->next[e]) {
            const int64_t ch = w->o_ch[e];
            if (half[ch] == 0.f) exact = 0;
            else x[ch] += w->o_val[e] / half[ch];
        }
        if (exact && R == 0) {
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) x[d] = x[d] * half[d] + off[d];
            return;
        }
        if (exact) {
            /* the second half's cos / sin: the first half's when the tables repeat (half the
             * table bytes read per slot) */
            const int64_t m = R / 2, hi = L->rope_halves_equal ? 0 : m;
            #pragma omp simd
            for (int64_t d = 0; d < m; d++) {
                const float a = x[d] * half[d] + off[d], b = x[d + m] * half[d + m] + off[d + m];
                x[d] = a * cos[d] - b * sin[d];
                x[d + m] = b * cos[d + hi] + a * sin[d + hi];
            }
            return;
        }
        decode_codes(x, S->codes + ((blk * B + t) * Hkv + h) * S->packed, S->lut, S->bits, D,
                     w->codes);
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) x[d] = x[d] * half[d] + off[d];
        for (int64_t e = w->first[t * Hkv + h]; e >= 0; e = w->next[e])
            x[w->o_ch[e]] += w->o_val[e];
        sink_head(L, S->sink, blk, t, h, x);
    }
    if (R) rope_head(x, cos, sin, R);
}

/* one head's value row as x * (*a) + (*b): the looked-up centroids with the token's scale and
 * offset left to the P @ V step, or (a row with outliers or a sink) the decoded row itself */
static void value_head(const KVQuantLayer *L, int64_t blk, int64_t t, int64_t h,
                       int64_t staged, float *restrict x, float *a, float *b,
                       KVQuantScratch *w) {
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const KVQuantSide *S = &L->v;
    const int64_t i = (blk * B + t) * Hkv + h;  /* (block, slot, head) */
    const int64_t p = sink_of(L, blk, t);
    *a = 1.f;
    *b = 0.f;
    if (staged >= 0 && L->staging_v) {
        load_head(x, L->staging_v, ((staged * B + t) * Hkv + h) * D, D, L->staging_kind);
        return;
    }
    if (p >= 0) {
        load_head(x, S->sink, ((blk * L->num_sinks + p) * Hkv + h) * D, D, L->sparse_kind);
        return;
    }
    const float half = f16_to_f32(S->half[i]), off = f16_to_f32(S->offset[i]);
    if (half == 0.f || S->groups > 1) {
        per_token_head(L, S, blk, t, h, x, w->codes);
        return;
    }
    decode_codes(x, S->codes + i * S->packed, S->lut, S->bits, D, w->codes);
    for (int64_t j = 0; j < S->cap; j++) {  /* as keys: the delta over the half-range added */
        const int64_t ch = load_index(S->oidx, i * S->cap + j, S->idx_bytes);
        if (ch >= 0 && ch < D) x[ch] += load_any(S->oval, i * S->cap + j, L->sparse_kind) / half;
    }
    *a = half;
    *b = off;
}

/* one block (its slots [from, len)) of a request's attention, a row at a time: every layout the
 * stores have (staged keys, per-token keys, value groups, partial RoPE, 8-bit codes); the
 * reference of the block path */
static void kvquant_row_block(const KVQuantLayer *L, int64_t blk, int64_t from, int64_t len,
                              const float *qb, Softmax *s, KVQuantScratch *w) {
    const int64_t Hkv = L->num_kv_heads, D = L->head_dim, B = L->block_size;
    const int64_t group = L->num_q_heads / Hkv;
    const int64_t staged = L->k.per_channel ? L->staging_index[blk] : -1;
    if (L->k.per_channel && staged < 0) key_block_setup(L, blk, w);
    for (int64_t t0 = from; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        /* the tile's rows of every KV head in address order (the codes are [B, Hkv, packed]
         * per block), as the per-token kernel reads them: a stream the hardware prefetchers
         * follow */
        for (int64_t t = 0; t < n; t++) {
            int64_t pos = L->rot_dim ? L->slot_positions[blk * B + t0 + t] : 0;
            pos = pos < 0 ? 0 : pos;
            for (int64_t g = 0; g < Hkv; g++)
                key_head(L, blk, t0 + t, g, staged, pos, w->kt + (g * TILE + t) * D, w);
        }
        for (int64_t g = 0; g < Hkv; g++) {  /* keys come decoded: s->ks stays 1 */
            score_tile(s, qb, w->kt + g * TILE * D, g * group, group, n, D);
            softmax_tile(s, g * group, group, n, D);
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t g = 0; g < Hkv; g++) {
                const int64_t i = g * TILE + t;
                value_head(L, blk, t0 + t, g, staged, w->vt + i * D, w->va + i, w->vb + i, w);
            }
        for (int64_t g = 0; g < Hkv; g++) {
            memcpy(s->va, w->va + g * TILE, sizeof(float) * n);
            memcpy(s->vb, w->vb + g * TILE, sizeof(float) * n);
            accumulate_tile(s, w->vt + g * TILE * D, D, g * group, group, n, D);
        }
    }
}

/* The first n slots of blocks blk_ids[0 .. nblk) decoded into float32 rows, keys rotated to
 * their positions when the store keeps them before RoPE: k_out, v_out [n, Hkv, D] (what the
 * PyTorch path's `read_blocks` gives, for a prefill chunk's cached prefix), a block per work
 * item, through the row path's key_head / value_head. */
int kvquant_read_blocks(const KVQuantLayer *L, const int64_t *blk_ids, int64_t nblk, int64_t n,
                        float *k_out, float *v_out) {
    const int64_t Hkv = L->num_kv_heads, D = L->head_dim, B = L->block_size;
    int failed = 0;
    #pragma omp parallel
    {
        KVQuantScratch w;
        if (!kvquant_scratch_alloc(&w, L, 0)) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < nblk; j++) {
            if (failed) continue;
            const int64_t blk = blk_ids[j], len = n - j * B < B ? n - j * B : B;
            const int64_t staged = L->k.per_channel ? L->staging_index[blk] : -1;
            if (L->k.per_channel && staged < 0) key_block_setup(L, blk, &w);
            for (int64_t t = 0; t < len; t++) {
                int64_t pos = L->rot_dim ? L->slot_positions[blk * B + t] : 0;
                pos = pos < 0 ? 0 : pos;
                float *krow = k_out + (j * B + t) * Hkv * D, *vrow = v_out + (j * B + t) * Hkv * D;
                for (int64_t g = 0; g < Hkv; g++) {
                    float a, b, *x = vrow + g * D;
                    key_head(L, blk, t, g, staged, pos, krow + g * D, &w);
                    value_head(L, blk, t, g, staged, x, &a, &b, &w);
                    if (a != 1.f || b != 0.f) {
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) x[d] = x[d] * a + b;
                    }
                }
            }
        }
        kvquant_scratch_free(&w);
    }
    return failed ? -1 : 0;
}

/* 1: the slot-lanes key pass where it fits (AVX-512 builds: kvquant_slot_keys_avx512.h), 0:
 * the planar pass; an A/B switch (`nanokv.layers.native_quant_attention.set_slot_keys`) */
static int nanokv_slot_keys = 1;
void kvquant_set_slot_keys(int on) { nanokv_slot_keys = on; }
/* whether the block path reads a layer's compact RoPE table where it has one (the AVX-512
 * slot-lanes key pass L->rope_tiles, else it transposes the tile's rows itself; the AVX2 key
 * pass L->rope_rows, else the full tables): an A/B switch */
static int nanokv_rope_tiles = 1;
void kvquant_set_rope_tiles(int on) { nanokv_rope_tiles = on; }
/* 1: the AVX2 key pass of heads of 32 channels in instances with head_dim a constant
 * (block_key_heads, kvquant_block_avx2.h), 0: head_dim read at run time; an A/B switch */
static int nanokv_fixed_head_dims = 1;
void kvquant_set_fixed_head_dims(int on) { nanokv_fixed_head_dims = on; }

/* The block path: AVX-512 builds, and AVX2 builds with FMA and F16C (the vector kernels of
 * kvquant_block_avx512.h / kvquant_block_avx2.h around the shared parts of kvquant_block.h).
 * ROPE_LAYOUT: which compact RoPE table that path reads where the halves repeat (the caller
 * builds that one): 1 KVQuantLayer.rope_tiles (AVX-512), 2 rope_rows (AVX2), 0 neither */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BLOCK_PATH 1
#define ROPE_LAYOUT 1
#include "kvquant_block.h"
#include "kvquant_block_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_BLOCK_PATH 1
#define ROPE_LAYOUT 2
#include "kvquant_block.h"
#include "kvquant_block_avx2.h"
#else
#define HAVE_BLOCK_PATH 0
#define ROPE_LAYOUT 0
#endif

int kvquant_rope_layout(void) { return ROPE_LAYOUT; }

#if HAVE_BLOCK_PATH
/* the key pass of a block (its first n slots), every KV head, query heads FAST_MAX_HEADS at a
 * time: scores into w->scores */
static void block_key_pass(const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n,
                           const float *qb, BlockScratch *w) {
    const int64_t group = L->num_q_heads / L->num_kv_heads;
    const int planar = block_key_operands(L, blk, n, w);
    for (int64_t h0 = 0; h0 < group; h0 += FAST_MAX_HEADS) {
        const int nh = (int)(group - h0 < FAST_MAX_HEADS ? group - h0 : FAST_MAX_HEADS);
        block_key_heads(L, blk, next_blk, n, qb, h0, nh, planar, w);
    }
}

/* the value pass of KV head g over a block's first n slots (P already in w->pa, w->pb) into
 * the accumulators of its query heads, FAST_MAX_HEADS at a time */
static void block_value_pass(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                             float *acc0, const float *pb, const BlockScratch *w,
                             int64_t patches) {
    const int64_t D = L->head_dim, group = L->num_q_heads / L->num_kv_heads;
    for (int64_t h0 = 0; h0 < group; h0 += FAST_MAX_HEADS) {
        const int nh = (int)(group - h0 < FAST_MAX_HEADS ? group - h0 : FAST_MAX_HEADS);
        block_value_heads(L, blk, g, n, acc0 + h0 * D, h0, nh, pb, w, patches);
    }
}

/* the block's key outliers of head g as score corrections, then its sink slots' exact scores */
static void block_key_fixes(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                            const float *q0, int64_t group, float *sg, BlockScratch *w) {
    block_key_outliers(L, blk, g, n, q0, group, sg, w);
    block_key_sinks(L, blk, g, n, q0, group, sg, w);
}

/* one block (its first n slots, keys not staged) of request b's attention, every KV head;
 * next_blk: the request's next block (its first rows are prefetched), -1 none */
static void kvquant_block_fast(const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n,
                               const float *qb, Softmax *s, BlockScratch *w) {
    const KVQuantSide *K = &L->k, *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const int64_t group = L->num_q_heads / Hkv;
    for (int64_t p = 0; p < L->num_sinks; p++) {
        const int64_t t = L->sink_slot[blk * L->num_sinks + p];
        if (t >= 0 && t < n) w->sink_at[t] = (int16_t)p;
    }
    for (int64_t t = 0; t < n; t++) w->live[t] = w->sink_at[t] < 0 ? 1.f : 0.f;
    /* the block's key statistics, float16 -> float32: [Hkv, D] */
    const uint16_t *off16 = K->offset + blk * Hkv * D, *half16 = K->half + blk * Hkv * D;
    block_stats_f32(w->k_off, off16, Hkv * D);
    block_stats_f32(w->k_half, half16, Hkv * D);
    /* ... and its value statistics, every slot's of every KV head: [B, Hkv] half-ranges, then
     * offsets (B % 16 == 0) */
    const float *vh = w->v_stats, *vo = w->v_stats + B * Hkv;
    block_stats_f32(w->v_stats, V->half + blk * B * Hkv, B * Hkv);
    block_stats_f32(w->v_stats + B * Hkv, V->offset + blk * B * Hkv, B * Hkv);
    block_key_pass(L, blk, next_blk, n, qb, w);
    /* value outliers: patched into the value pass (small heads: every KV head's patches at once,
     * block_value_patches, or a KV head's at a time, value_patches), or after every KV head's
     * value pass, 16 at a time (block_value_outliers16), or a KV head at a time
     * (block_value_fixes) */
    const int patched = V->cap > 0 && D <= 64;
    const int patched_all = patched && block_value_patches_fit(L);
    const int unscaled = patched_all && block_value_patches(L, blk, n, w);
    const int late = !patched && value_outliers16_fit(L);
    for (int64_t g = 0; g < Hkv; g++) {
        const float *q0 = qb + g * group * D;
        float *acc0 = s->acc + g * group * D, *sg = w->scores + g * group * B;
        block_key_fixes(L, blk, g, n, q0, group, sg, w);
        block_softmax(s, g * group, group, n, B, D, sg);
        /* P * the slot's value half-range, and P . offsets per head; sink slots added apart */
        float *pbh = w->pb;
        for (int64_t t = 0; t < n; t++) {  /* KV head g's of the block's statistics */
            w->v_half[t] = vh[t * Hkv + g];
            w->v_off[t] = vo[t * Hkv + g];
        }
        for (int64_t hh = 0; hh < group; hh++) {
            const float *ph = sg + hh * B, *live = w->live;
            float *pah = w->pa + hh * B, sum = 0.f;
            #pragma omp simd reduction(+:sum)
            for (int64_t t = 0; t < n; t++) {
                const float p = ph[t] * live[t];
                pah[t] = p * w->v_half[t];
                sum += p * w->v_off[t];
            }
            pbh[hh] = sum;
        }
        if (patched && (!patched_all || unscaled))
            value_patches(L, blk, g, n, acc0, group, sg, w, !patched_all);
        block_value_pass(L, blk, g, n, acc0, pbh, w, patched ? V->cap : 0);
        block_value_fixes(L, blk, g, n, acc0, group, sg, w, patched || late);
    }
    if (late) block_value_outliers16(L, blk, n, s->acc, w);
    for (int64_t p = 0; p < L->num_sinks; p++) {
        const int64_t t = L->sink_slot[blk * L->num_sinks + p];
        if (t >= 0 && t < n) w->sink_at[t] = -1;
    }
}
#endif

/* Request b's cached slots: the first past[b] slots of its blocks blk_ids[blk_ptr[b] ..
 * blk_ptr[b + 1]), less the first skip[b] slots of its first block (a sliding window's start;
 * skip NULL: none). Blocks go through the block path where it fits (AVX-512 and AVX2 builds;
 * the layout of `block_path_fits`; keys not staged), else a row at a time (a first block read
 * from a slot past its first too). */
int kvquant_decode_attention(const KVQuantLayer *L, const float *q, const float *k_new,
                             const float *v_new, float *out, const int64_t *blk_ptr,
                             const int64_t *blk_ids, const int64_t *past, const int64_t *skip,
                             int64_t num_requests) {
    const int64_t Hq = L->num_q_heads, Hkv = L->num_kv_heads, D = L->head_dim;
    const int64_t B = L->block_size, row = Hkv * D;
#if HAVE_BLOCK_PATH
    const int block_path = block_path_fits(L);
#endif
    int failed = 0;
    #pragma omp parallel
    {
        Softmax s;
        KVQuantScratch w;
        int ok = kvquant_scratch_alloc(&w, L, 1);
        ok = softmax_alloc(&s, Hq, D) && ok;
#if HAVE_BLOCK_PATH
        BlockScratch bw = {0};
        if (block_path) ok = block_scratch_alloc(&bw, Hkv, Hq / Hkv, B, D, L->k.cap, L->v.cap) && ok;
#endif
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_requests; b++) {
            if (failed) continue;
            softmax_reset(&s, Hq, D);
            const float *qb = q + b * Hq * D;
#if HAVE_BLOCK_PATH
            if (block_path) block_request_queries(L, qb, &bw);
#endif
            for (int64_t j = blk_ptr[b]; j < blk_ptr[b + 1]; j++) {
                const int64_t blk = blk_ids[j], first_slot = (j - blk_ptr[b]) * B;
                const int64_t len = past[b] - first_slot < B ? past[b] - first_slot : B;
                if (len <= 0) break;
                const int64_t from = skip && j == blk_ptr[b] ? skip[b] : 0;
#if HAVE_BLOCK_PATH
                if (block_path && from == 0 && L->staging_index[blk] < 0) {
                    const int64_t next = j + 1 < blk_ptr[b + 1] && past[b] > first_slot + B
                                         ? blk_ids[j + 1] : -1;
                    kvquant_block_fast(L, blk, next, len, qb, &s, &bw);
                    continue;
                }
#endif
                kvquant_row_block(L, blk, from, len, qb, &s, &w);
            }
            attend_fresh(&s, qb, k_new + b * row, v_new + b * row, Hq, Hkv, D);
            softmax_finish(&s, out + b * Hq * D, Hq, D);
        }
        softmax_free(&s);
        kvquant_scratch_free(&w);
#if HAVE_BLOCK_PATH
        if (block_path) block_scratch_free(&bw);
#endif
    }
    return failed ? -1 : 0;
}
