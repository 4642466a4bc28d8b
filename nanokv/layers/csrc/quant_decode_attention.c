/* Paged decode attention that reads quantized KV codes in place, for CPUs: one query token per
 * request over that request's cached slots, the step's own token attended with its fresh
 * float32 K/V (as `nanokv.quant.attention.reference_quantized_attention` does).
 *
 * Same pass as decode_attention.c: slots in tiles of TILE, an online softmax per query head, one
 * OpenMP work item per request with all its heads. A slot's row (all KV heads) is dequantized
 * into a small per-thread float buffer (Hkv x D floats, stays in L1), its key rotated there when
 * the store keeps keys before RoPE, then dotted with the query heads of each KV head (GQA: one
 * dequantization per KV head, reused by its query heads); values the same way into the
 * accumulator. Dequantized rows never go to memory beyond that buffer.
 *
 * Plain C the compiler vectorises (no intrinsics): the fp8 / fp16 / bf16 decodes are bit shifts
 * and one multiply by a power of two, exact for normal and subnormal numbers.
 *
 * Two entry points:
 *   pertoken_decode_attention  int8 / fp8 e4m3 / fp8 e5m2 codes, a float32 scale per token and
 *                              KV head (`nanokv.quant.pertoken_store`); slots as runs of
 *                              consecutive pool slots (as decode_attention.c)
 *   kvquant_decode_attention   KVQuant's packed 2/3/4/8-bit codes (`nanokv.quant.kvquant_store`):
 *                              per-channel (per block) or per-token statistics in fp16, a
 *                              codebook (uniform or nuq) as a table, sparse outliers, sink
 *                              slots, the partial block's keys from staging; by block table
 * q, out: [B, Hq, D] (q already multiplied by the softmax scale); k_new, v_new: [B, Hkv, D], the
 * step's own token of each request (keys after RoPE). Return: 0, or -1 when scratch allocation
 * failed. */
#include <float.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16

/* ---- scalar decodes: exact, branch-free, vectorisable -------------------------------------- */
static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half: exponent and mantissa moved into a float's low exponent bits, then scaled by
 * 2^(127 - 15); also right for subnormals (the float is then subnormal and scales exactly). */
static inline float f16_to_f32(uint16_t h) {
    float mag = bits_to_float((uint32_t)(h & 0x7FFF) << 13) * 0x1p112f;
    return (h & 0x8000) ? -mag : mag;
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

/* fp8 e4m3fn (bias 7) and e5m2 (bias 15); the stores clamp to the finite range, so no NaN/inf */
static inline float e4m3_to_f32(uint8_t c) {
    float mag = bits_to_float((uint32_t)(c & 0x7F) << 20) * 0x1p120f;
    return (c & 0x80) ? -mag : mag;
}

static inline float e5m2_to_f32(uint8_t c) {
    float mag = bits_to_float((uint32_t)(c & 0x7F) << 21) * 0x1p112f;
    return (c & 0x80) ? -mag : mag;
}

/* sparse / staging element kinds: 0 float16, 1 bfloat16, 2 float32 */
static inline float load_any(const void *p, int64_t i, int64_t kind) {
    if (kind == 2) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return kind == 1 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* index element sizes 1 (uint8), 2 (int16), 4 (int32) */
static inline int64_t load_index(const void *p, int64_t i, int64_t bytes) {
    if (bytes == 1) return ((const uint8_t *)p)[i];
    if (bytes == 2) return ((const int16_t *)p)[i];
    return ((const int32_t *)p)[i];
}

/* ---- the online softmax, shared --------------------------------------------------------------- */
typedef struct {
    float *acc;    /* [Hq, D] running P @ V */
    float *scores; /* [Hq, TILE] */
    float *m, *l;  /* [Hq] running max and sum of exp */
    float *krow;   /* [Hkv, D] one dequantized key row */
    float *vrow;   /* [TILE, Hkv, D] the tile's dequantized values (L2) */
} Softmax;

static int softmax_alloc(Softmax *s, int64_t Hq, int64_t Hkv, int64_t D) {
    s->acc = malloc(sizeof(float) * Hq * D);
    s->scores = malloc(sizeof(float) * Hq * TILE);
    s->m = malloc(sizeof(float) * Hq);
    s->l = malloc(sizeof(float) * Hq);
    s->krow = malloc(sizeof(float) * Hkv * D);
    s->vrow = malloc(sizeof(float) * TILE * Hkv * D);
    return s->acc && s->scores && s->m && s->l && s->krow && s->vrow;
}

static void softmax_free(Softmax *s) {
    free(s->acc); free(s->scores); free(s->m); free(s->l); free(s->krow); free(s->vrow);
}

static void softmax_reset(Softmax *s, int64_t Hq, int64_t D) {
    for (int64_t h = 0; h < Hq; h++) { s->m[h] = -FLT_MAX; s->l[h] = 0.f; }
    memset(s->acc, 0, sizeof(float) * Hq * D);
}

/* a . b over D floats. The vector paths (guarded: plain C elsewhere) end with a shuffle tree;
 * compilers reduce an `omp simd` sum through the stack with one scalar add per lane, which
 * costs as much as the products at D = 128. */
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

/* scores[:, t] = q . krow for every query head (krow: [Hkv, D]) */
static inline void score_row(Softmax *s, const float *qb, const float *krow, int64_t t,
                             int64_t Hq, int64_t Hkv, int64_t D) {
    const int64_t group = Hq / Hkv;
    for (int64_t h = 0; h < Hq; h++)
        s->scores[h * TILE + t] = dot(qb + h * D, krow + (h / group) * D, D);
}

/* fold the tile's n scores into the running max / sum; scores become the tile's P */
static inline void softmax_tile(Softmax *s, int64_t n, int64_t Hq, int64_t D) {
    for (int64_t h = 0; h < Hq; h++) {
        float *sc = s->scores + h * TILE;
        float mx = s->m[h];
        for (int64_t t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
        const float corr = expf(s->m[h] - mx);
        float sum = 0.f;
        for (int64_t t = 0; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
        s->l[h] = s->l[h] * corr + sum;
        s->m[h] = mx;
        if (corr != 1.f) {
            float *ah = s->acc + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) ah[d] *= corr;
        }
    }
}

/* acc += P[:, t] * vrow (vrow: [Hkv, D]) */
static inline void accumulate_row(Softmax *s, const float *vrow, int64_t t, int64_t Hq,
                                  int64_t Hkv, int64_t D) {
    const int64_t group = Hq / Hkv;
    for (int64_t h = 0; h < Hq; h++) {
        const float p = s->scores[h * TILE + t], *vr = vrow + (h / group) * D;
        float *ah = s->acc + h * D;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) ah[d] += p * vr[d];
    }
}

/* acc += P[:, :n] @ vtile (vtile: [n, Hkv, D]): the accumulator of a head stays in registers
 * over the tile's slots on the guarded vector paths (a column chunk at a time) */
static inline void accumulate_tile(Softmax *s, const float *vtile, int64_t n, int64_t Hq,
                                   int64_t Hkv, int64_t D) {
    const int64_t row = Hkv * D;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const int64_t group = Hq / Hkv;
#endif
#if defined(__AVX512F__)
    if (D % 64 == 0) {
        for (int64_t h = 0; h < Hq; h++) {
            const float *vh = vtile + (h / group) * D, *ph = s->scores + h * TILE;
            float *ah = s->acc + h * D;
            for (int64_t d = 0; d < D; d += 64) {
                __m512 a0 = _mm512_loadu_ps(ah + d), a1 = _mm512_loadu_ps(ah + d + 16);
                __m512 a2 = _mm512_loadu_ps(ah + d + 32), a3 = _mm512_loadu_ps(ah + d + 48);
                for (int64_t t = 0; t < n; t++) {
                    const __m512 p = _mm512_set1_ps(ph[t]);
                    const float *v = vh + t * row + d;
                    a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v), a0);
                    a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16), a1);
                    a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 32), a2);
                    a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 48), a3);
                }
                _mm512_storeu_ps(ah + d, a0); _mm512_storeu_ps(ah + d + 16, a1);
                _mm512_storeu_ps(ah + d + 32, a2); _mm512_storeu_ps(ah + d + 48, a3);
            }
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 32 == 0) {
        for (int64_t h = 0; h < Hq; h++) {
            const float *vh = vtile + (h / group) * D, *ph = s->scores + h * TILE;
            float *ah = s->acc + h * D;
            for (int64_t d = 0; d < D; d += 32) {
                __m256 a0 = _mm256_loadu_ps(ah + d), a1 = _mm256_loadu_ps(ah + d + 8);
                __m256 a2 = _mm256_loadu_ps(ah + d + 16), a3 = _mm256_loadu_ps(ah + d + 24);
                for (int64_t t = 0; t < n; t++) {
                    const __m256 p = _mm256_set1_ps(ph[t]);
                    const float *v = vh + t * row + d;
                    a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
                    a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
                    a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
                    a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
                }
                _mm256_storeu_ps(ah + d, a0); _mm256_storeu_ps(ah + d + 8, a1);
                _mm256_storeu_ps(ah + d + 16, a2); _mm256_storeu_ps(ah + d + 24, a3);
            }
        }
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++) accumulate_row(s, vtile + t * row, t, Hq, Hkv, D);
}

/* the step's own token: one more tile of one slot, its K/V fresh in float32 */
static void attend_fresh(Softmax *s, const float *qb, const float *kn, const float *vn,
                         int64_t Hq, int64_t Hkv, int64_t D) {
    score_row(s, qb, kn, 0, Hq, Hkv, D);
    softmax_tile(s, 1, Hq, D);
    accumulate_row(s, vn, 0, Hq, Hkv, D);
}

static void softmax_finish(const Softmax *s, float *ob, int64_t Hq, int64_t D) {
    for (int64_t h = 0; h < Hq; h++) {
        const float inv = s->l[h] > 0.f ? 1.f / s->l[h] : 0.f;
        for (int64_t d = 0; d < D; d++) ob[h * D + d] = s->acc[h * D + d] * inv;
    }
}

/* ---- RoPE (rotate-half, as nanokv.layers.rotary) on a dequantized key row ------------------ */
static inline void rope_row(float *row, const float *cos, const float *sin, int64_t rot_dim,
                            int64_t Hkv, int64_t D) {
    const int64_t half = rot_dim / 2;
    for (int64_t h = 0; h < Hkv; h++) {
        float *x = row + h * D;
        #pragma omp simd
        for (int64_t d = 0; d < half; d++) {
            const float a = x[d], b = x[d + half];
            x[d] = a * cos[d] - b * sin[d];
            x[d + half] = b * cos[d + half] + a * sin[d + half];
        }
    }
}

/* ==== int8 / fp8 per-token codes ============================================================= */
enum { FMT_INT8 = 0, FMT_E4M3 = 1, FMT_E5M2 = 2 };

static inline void pertoken_row(float *row, const uint8_t *codes, const float *scales,
                                int64_t Hkv, int64_t D, int fmt) {
    for (int64_t h = 0; h < Hkv; h++) {
        const uint8_t *c = codes + h * D;
        const float sc = scales[h];
        float *x = row + h * D;
        if (fmt == FMT_INT8) {
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) x[d] = (float)(int8_t)c[d] * sc;
        } else if (fmt == FMT_E4M3) {
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) x[d] = e4m3_to_f32(c[d]) * sc;
        } else {
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) x[d] = e5m2_to_f32(c[d]) * sc;
        }
    }
}

static inline __attribute__((always_inline)) int pertoken_impl(
        const float *q, const uint8_t *k_codes, const uint8_t *v_codes, const float *k_scales,
        const float *v_scales, const float *k_new, const float *v_new, float *out,
        const int64_t *run_ptr, const int64_t *run_start, const int64_t *run_len,
        const int32_t *slot_positions, const float *cos, const float *sin, int64_t rot_dim,
        int64_t num_requests, int64_t Hq, int64_t Hkv, int64_t D, int fmt) {
    int failed = 0;
    const int64_t row = Hkv * D;
    #pragma omp parallel
    {
        Softmax s;
        if (!softmax_alloc(&s, Hq, Hkv, D)) {
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
                    const int64_t n = len - t0 < TILE ? len - t0 : TILE;
                    for (int64_t t = 0; t < n; t++) {
                        const int64_t slot = start + t0 + t;
                        float *kr = s.krow;
                        pertoken_row(kr, k_codes + slot * row, k_scales + slot * Hkv, Hkv, D,
                                     fmt);
                        if (rot_dim) {
                            const int64_t pos = slot_positions[slot] < 0 ? 0 : slot_positions[slot];
                            rope_row(kr, cos + pos * rot_dim, sin + pos * rot_dim, rot_dim, Hkv,
                                     D);
                        }
                        score_row(&s, qb, kr, t, Hq, Hkv, D);
                    }
                    softmax_tile(&s, n, Hq, D);
                    for (int64_t t = 0; t < n; t++) {
                        const int64_t slot = start + t0 + t;
                        pertoken_row(s.vrow + t * row, v_codes + slot * row,
                                     v_scales + slot * Hkv, Hkv, D, fmt);
                    }
                    accumulate_tile(&s, s.vrow, n, Hq, Hkv, D);
                }
            }
            attend_fresh(&s, qb, k_new + b * row, v_new + b * row, Hq, Hkv, D);
            softmax_finish(&s, out + b * Hq * D, Hq, D);
        }
        softmax_free(&s);
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

/* ==== KVQuant ================================================================================ */
typedef struct {
    const uint8_t *codes;      /* [nb, B, Hkv, packed] */
    const uint16_t *offset;    /* fp16: per channel [nb, Hkv, D]; per token [nb, B, Hkv] */
    const uint16_t *half;      /* same */
    const void *oidx;          /* per channel [nb, Hkv, cap] (slot * D + channel); per token
                                  [nb, B, Hkv, cap] (channel); unused: < 0 or out of range */
    const void *oval;          /* same shape, sparse kind */
    const float *lut;          /* [2^bits] centroid of each code (uniform grid or codebook) */
    const void *sink;          /* [nb, N, Hkv, D] sparse kind */
    int64_t per_channel, bits, packed, cap, idx_bytes;
} KVQuantSide;

typedef struct {
    KVQuantSide k, v;
    const int16_t *sink_slot;      /* [nb, N]: slot of position p, -1 none */
    const void *staging;           /* [S, B, Hkv, D] this layer's staged (partial-block) keys */
    const int32_t *staging_index;  /* [nb]: staging row, -1 none */
    const int32_t *slot_positions; /* [nb, B] */
    const float *cos, *sin;        /* [positions, rot_dim] */
    int64_t num_sinks, sparse_kind, staging_kind, rot_dim;
    int64_t block_size, num_q_heads, num_kv_heads, head_dim;
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

/* x[d] = lut[c[d]]: codebooks of up to 16 centroids are looked up in registers on the guarded
 * vector paths (a table permute; compilers emit a scalar loop or gathers for this) */
static inline void lookup_row(float *restrict x, const uint8_t *restrict c,
                              const float *restrict lut, int64_t bits, int64_t D) {
    int64_t d = 0;
    (void)bits;
#if defined(__AVX512F__)
    if (bits <= 4) {
        float t16[16] = {0};
        memcpy(t16, lut, sizeof(float) << bits);
        const __m512 table = _mm512_loadu_ps(t16);
        for (; d + 16 <= D; d += 16) {
            const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + d)));
            _mm512_storeu_ps(x + d, _mm512_permutexvar_ps(idx, table));
        }
    }
#elif defined(__AVX2__)
    if (bits <= 4) {
        float t16[16] = {0};
        memcpy(t16, lut, sizeof(float) << bits);
        const __m256 lo = _mm256_loadu_ps(t16), hi = _mm256_loadu_ps(t16 + 8);
        for (; d + 8 <= D; d += 8) {
            const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + d)));
            const __m256 a = _mm256_permutevar8x32_ps(lo, idx);
            const __m256 b = _mm256_permutevar8x32_ps(hi, idx);
            /* bit 3 of the index, moved to the sign bit, picks the upper half */
            _mm256_storeu_ps(x + d, _mm256_blendv_ps(a, b,
                                                     _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28))));
        }
    }
#endif
    for (; d < D; d++) x[d] = lut[c[d]];
}

/* x = lut[c] * half + off per channel (per-channel statistics) */
static inline void centroid_row(float *restrict x, const uint8_t *restrict c,
                                const float *restrict lut, int64_t bits,
                                const float *restrict half, const float *restrict off,
                                int64_t D) {
    lookup_row(x, c, lut, bits, D);
    #pragma omp simd
    for (int64_t d = 0; d < D; d++) x[d] = x[d] * half[d] + off[d];
}

/* per-thread scratch of the KVQuant kernel beyond the softmax */
typedef struct {
    uint8_t *codes;             /* [D] */
    float *k_off, *k_half;      /* [Hkv, D] the block's per-channel key statistics */
    int64_t *first, *next;      /* per-slot lists of the block's key outliers: [B], [Hkv * cap] */
    int64_t *o_pos;             /* [Hkv * cap] h * D + channel */
    float *o_val;               /* [Hkv * cap] */
} KVQuantScratch;

/* one slot's dequantized row (all KV heads) of a per-token side (values; keys without
 * per-channel statistics) */
static void per_token_row(const KVQuantLayer *L, const KVQuantSide *S, int64_t blk, int64_t t,
                          float *row, uint8_t *codes) {
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    for (int64_t h = 0; h < Hkv; h++) {
        const int64_t i = (blk * B + t) * Hkv + h;  /* (block, slot, head) */
        unpack_codes(S->codes + i * S->packed, S->bits, D, codes);
        const float off = f16_to_f32(S->offset[i]), half = f16_to_f32(S->half[i]);
        float *restrict x = row + h * D;
        lookup_row(x, codes, S->lut, S->bits, D);
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) x[d] = x[d] * half + off;
        for (int64_t j = 0; j < S->cap; j++) {
            const int64_t ch = load_index(S->oidx, i * S->cap + j, S->idx_bytes);
            if (ch >= 0 && ch < D) x[ch] = load_any(S->oval, i * S->cap + j, L->sparse_kind);
        }
    }
}

/* the block's per-channel key statistics and its outliers listed by slot */
static void key_block_setup(const KVQuantLayer *L, int64_t blk, KVQuantScratch *w) {
    const KVQuantSide *S = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const uint16_t *off = S->offset + blk * Hkv * D, *half = S->half + blk * Hkv * D;
    for (int64_t i = 0; i < Hkv * D; i++) {
        w->k_off[i] = f16_to_f32(off[i]);
        w->k_half[i] = f16_to_f32(half[i]);
    }
    for (int64_t t = 0; t < B; t++) w->first[t] = -1;
    int64_t n = 0;
    for (int64_t h = 0; h < Hkv; h++) {
        const int64_t base = (blk * Hkv + h) * S->cap;
        for (int64_t j = 0; j < S->cap; j++) {
            const int64_t idx = load_index(S->oidx, base + j, S->idx_bytes);
            if (idx < 0 || idx >= B * D) continue;
            const int64_t t = idx / D;
            w->o_pos[n] = h * D + idx % D;
            w->o_val[n] = load_any(S->oval, base + j, L->sparse_kind);
            w->next[n] = w->first[t];
            w->first[t] = n++;
        }
    }
}

static void key_row(const KVQuantLayer *L, int64_t blk, int64_t t, int64_t staged, float *row,
                    KVQuantScratch *w) {
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const KVQuantSide *S = &L->k;
    if (staged >= 0) {  /* a partial block: its keys in full precision */
        const int64_t base = ((staged * B + t) * Hkv) * D;
        if (L->staging_kind == 2) {
            memcpy(row, (const float *)L->staging + base, sizeof(float) * Hkv * D);
        } else {
            for (int64_t i = 0; i < Hkv * D; i++) row[i] = load_any(L->staging, base + i,
                                                                     L->staging_kind);
        }
        return;
    }
    if (!S->per_channel) {
        per_token_row(L, S, blk, t, row, w->codes);
    } else {
        for (int64_t h = 0; h < Hkv; h++) {
            unpack_codes(S->codes + ((blk * B + t) * Hkv + h) * S->packed, S->bits, D, w->codes);
            centroid_row(row + h * D, w->codes, S->lut, S->bits, w->k_half + h * D,
                         w->k_off + h * D, D);
        }
        for (int64_t e = w->first[t]; e >= 0; e = w->next[e]) row[w->o_pos[e]] = w->o_val[e];
    }
    for (int64_t p = 0; p < L->num_sinks; p++) {
        if (L->sink_slot[blk * L->num_sinks + p] == t) {
            const int64_t base = (blk * L->num_sinks + p) * Hkv * D;
            for (int64_t i = 0; i < Hkv * D; i++) row[i] = load_any(S->sink, base + i,
                                                                    L->sparse_kind);
        }
    }
}

static void value_row(const KVQuantLayer *L, int64_t blk, int64_t t, float *row,
                      KVQuantScratch *w) {
    const int64_t Hkv = L->num_kv_heads, D = L->head_dim;
    per_token_row(L, &L->v, blk, t, row, w->codes);
    for (int64_t p = 0; p < L->num_sinks; p++) {
        if (L->sink_slot[blk * L->num_sinks + p] == t) {
            const int64_t base = (blk * L->num_sinks + p) * Hkv * D;
            for (int64_t i = 0; i < Hkv * D; i++) row[i] = load_any(L->v.sink, base + i,
                                                                    L->sparse_kind);
        }
    }
}

/* Request b's cached slots: the first past[b] slots of its blocks blk_ids[blk_ptr[b] ..
 * blk_ptr[b + 1]). */
int kvquant_decode_attention(const KVQuantLayer *L, const float *q, const float *k_new,
                             const float *v_new, float *out, const int64_t *blk_ptr,
                             const int64_t *blk_ids, const int64_t *past, int64_t num_requests) {
    const int64_t Hq = L->num_q_heads, Hkv = L->num_kv_heads, D = L->head_dim;
    const int64_t B = L->block_size, row = Hkv * D;
    const int64_t ocap = L->k.per_channel ? Hkv * L->k.cap : 0;
    int failed = 0;
    #pragma omp parallel
    {
        Softmax s;
        KVQuantScratch w;
        w.codes = malloc(D + 8);
        w.k_off = malloc(sizeof(float) * row);
        w.k_half = malloc(sizeof(float) * row);
        w.first = malloc(sizeof(int64_t) * B);
        w.next = malloc(sizeof(int64_t) * (ocap + 1));
        w.o_pos = malloc(sizeof(int64_t) * (ocap + 1));
        w.o_val = malloc(sizeof(float) * (ocap + 1));
        if (!softmax_alloc(&s, Hq, Hkv, D) || !w.codes || !w.k_off || !w.k_half || !w.first
                || !w.next || !w.o_pos || !w.o_val) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_requests; b++) {
            if (failed) continue;
            softmax_reset(&s, Hq, D);
            const float *qb = q + b * Hq * D;
            for (int64_t j = blk_ptr[b]; j < blk_ptr[b + 1]; j++) {
                const int64_t blk = blk_ids[j], first_slot = (j - blk_ptr[b]) * B;
                const int64_t len = past[b] - first_slot < B ? past[b] - first_slot : B;
                if (len <= 0) break;
                const int64_t staged = L->k.per_channel ? L->staging_index[blk] : -1;
                if (L->k.per_channel && staged < 0) key_block_setup(L, blk, &w);
                for (int64_t t0 = 0; t0 < len; t0 += TILE) {
                    const int64_t n = len - t0 < TILE ? len - t0 : TILE;
                    for (int64_t t = 0; t < n; t++) {
                        float *kr = s.krow;
                        key_row(L, blk, t0 + t, staged, kr, &w);
                        if (L->rot_dim) {
                            int64_t pos = L->slot_positions[blk * B + t0 + t];
                            pos = pos < 0 ? 0 : pos;
                            rope_row(kr, L->cos + pos * L->rot_dim, L->sin + pos * L->rot_dim,
                                     L->rot_dim, Hkv, D);
                        }
                        score_row(&s, qb, kr, t, Hq, Hkv, D);
                    }
                    softmax_tile(&s, n, Hq, D);
                    for (int64_t t = 0; t < n; t++) value_row(L, blk, t0 + t, s.vrow + t * row, &w);
                    accumulate_tile(&s, s.vrow, n, Hq, Hkv, D);
                }
            }
            attend_fresh(&s, qb, k_new + b * row, v_new + b * row, Hq, Hkv, D);
            softmax_finish(&s, out + b * Hq * D, Hq, D);
        }
        softmax_free(&s);
        free(w.codes); free(w.k_off); free(w.k_half); free(w.first); free(w.next);
        free(w.o_pos); free(w.o_val);
    }
    return failed ? -1 : 0;
}
