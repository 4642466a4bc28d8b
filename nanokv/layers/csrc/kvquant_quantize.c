/* KVQuant's quantize-on-write, straight into the store's buffers:
 *
 *   kvquant_quantize_tokens  per token (values, and keys without per-channel statistics): each
 *                            of a step's T tokens and each KV head is one group of D channels,
 *                            written at the token's flat slot
 *   kvquant_quantize_blocks  per channel (keys): each block that fills in the step and each KV
 *                            head is one group of B x D elements, statistics per channel over
 *                            the block's tokens, written at the block's id
 *
 * The reference is `quantize_blocks` (nanokv/quant/kvquant.py) followed by the store's `_put`;
 * per group:
 *
 *   outliers  the `side` = cap / 2 highest and `side` lowest scores, highest first: per token,
 *             the channels' values (a token's z-scores rank them as its values do); per channel,
 *             each element's z-score in its channel over the block's valid slots, or with
 *             calibrated (lower, upper) thresholds the distance beyond them over their span. An
 *             element picked from both ends is listed once (the bottom entry marked unused);
 *             sink slots (valid 0) are never outliers. An entry holds its delta, x minus its
 *             dense decoding (centroid * half + offset, the reader's float operations). Unused
 *             entries: index -1 (255 in a uint8 index), delta 0. A per-channel list is in index
 *             order (slot-major), its unused entries last.
 *   offset, half   (max + min) / 2 and (max - min) / 2 over the rest (per channel: the valid,
 *             non-outlier slots), clamped to +-65504 and rounded to fp16 (0 when nothing is left)
 *   codes     xn = clamp((x - offset) / max(half, FLT_MIN), -1, 1), then the nearest of the
 *             2^bits centroids: bucketize on the midpoints (the count of midpoints < xn), or
 *             round-half-even of (xn + 1) * (2^bits - 1) / 2 on the uniform grid; packed as
 *             `nanokv.quant.packing.pack` (low bits first; 3-bit codes in 24-bit groups)
 *
 * Per-token buffers, flat over the pool's slots (block * B + slot): codes [slots, H, P] uint8;
 * offset, half [slots, H] fp16; oidx [slots, H, cap] (idx_bytes 1 or 2); oval [slots, H, cap].
 * Per-channel buffers, by block id: offset, half [nb, H, D]; oidx, oval [nb, H, cap] (idx_bytes
 * 2 or 4, index slot * D + channel). Sparse kind 0 fp16, 1 bf16, 2 fp32. x float32. The
 * per-channel z-scores sum in double where PyTorch sums in float32, so an element whose score
 * ties the last one picked within rounding may be chosen differently, and a per-token group
 * whose smallest or largest value is a zero of both signs may take either zero for its offset;
 * everything else is the reference's to the byte (tests/unit/test_kvquant_write.py). The loops
 * over a group's elements are written for the compiler to vectorize (`encode_row`,
 * `untaken_min_max`, the runs of `top_k`). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#define MAX_D 1024 /* the largest head_dim */

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* float -> IEEE half, round to nearest even, overflow to inf, NaN kept (as torch's .to) */
static uint16_t f32_to_f16(float f) {
    const uint32_t u = float_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds past 65504 */
    if (a < 0x38800000u) { /* below the smallest normal half: a subnormal (or zero) */
        /* a * 2^24 rounds to the subnormal's integer; the FPU rounds to nearest even */
        const float scaled = bits_to_float(a) * 16777216.0f;
        return sign | (uint16_t)nearbyintf(scaled);
    }
    /* normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even */
    uint32_t h = ((a >> 13) - ((127 - 15) << 10));
    const uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}

/* float -> bfloat16, round to nearest even (NaN kept quiet) */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float fp16_clamped(float x, uint16_t *bits) {
    x = x < -65504.0f ? -65504.0f : (x > 65504.0f ? 65504.0f : x);
    *bits = f32_to_f16(x);
    return f16_to_f32(*bits);
}

static void store_sparse(void *oval, int64_t i, float x, int64_t kind) {
    if (kind == 0) ((uint16_t *)oval)[i] = f32_to_f16(x);
    else if (kind == 1) ((uint16_t *)oval)[i] = f32_to_bf16(x);
    else ((float *)oval)[i] = x;
}

static void store_index(void *oidx, int64_t i, int64_t v, int64_t bytes) {
    if (bytes == 1) ((uint8_t *)oidx)[i] = (uint8_t)(v < 0 ? 255 : v);
    else if (bytes == 2) ((int16_t *)oidx)[i] = (int16_t)v;
    else ((int32_t *)oidx)[i] = (int32_t)v;
}

static void pack_codes(const uint8_t *c, int64_t D, int64_t bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, c, (size_t)D);
    } else if (bits == 3) { /* 8 codes -> a 24-bit little-endian word */
        for (int64_t g = 0; g * 8 < D; g++) {
            uint32_t w = 0;
            for (int64_t j = 0; j < 8 && g * 8 + j < D; j++) w |= (uint32_t)c[g * 8 + j] << (3 * j);
            out[3 * g] = (uint8_t)w;
            out[3 * g + 1] = (uint8_t)(w >> 8);
            out[3 * g + 2] = (uint8_t)(w >> 16);
        }
    } else {
        const int64_t per = 8 / bits;
        for (int64_t g = 0; g * per < D; g++) {
            uint32_t w = 0;
            for (int64_t j = 0; j < per && g * per + j < D; j++)
                w |= (uint32_t)c[g * per + j] << (bits * j);
            out[g] = (uint8_t)w;
        }
    }
}

/* the codebook's midpoints (mids[levels]), or NULL for the uniform grid */
static const float *midpoints(const float *codebook, int64_t levels, float *mids) {
    if (codebook == NULL) return NULL;
    for (int64_t j = 0; j < levels; j++) mids[j] = (codebook[j + 1] + codebook[j]) / 2.0f;
    return mids;
}

/* one element's code: normalised by the group's fp16 offset and half-range (denom =
 * max(half, FLT_MIN)), then the nearest centroid (mids: the codebook's midpoints, or NULL) */
static inline uint8_t encode(float x, float off, float denom, int64_t levels,
                             const float *mids) {
    float xn = (x - off) / denom;
    xn = xn < -1.0f ? -1.0f : (xn > 1.0f ? 1.0f : xn);
    if (mids == NULL) {
        float r = nearbyintf((xn + 1.0f) * ((float)levels / 2.0f));
        r = r < 0.0f ? 0.0f : (r > (float)levels ? (float)levels : r);
        return (uint8_t)r;
    }
    int64_t n = 0;
    if (levels <= 15) {  /* 2- to 4-bit: the midpoints below xn counted without a branch (they
                          * ascend, so the count is the first not below it) */
        for (int64_t j = 0; j < levels; j++) n += mids[j] < xn;
        return (uint8_t)n;
    }
    while (n < levels && mids[n] < xn) n++;
    return (uint8_t)n;
}

/* `encode` over a row of D elements, with per-element (step 1) or shared (step 0) offset and
 * denominator: the same float operations, written as loops the compiler vectorizes */
static void encode_row(const float *x, const float *off, const float *denom, int64_t step,
                       int64_t D, int64_t levels, const float *mids, uint8_t *c) {
    if (mids == NULL) {
        const float scale = (float)levels / 2.0f, top = (float)levels;
        for (int64_t i = 0; i < D; i++) {
            float xn = (x[i] - off[i * step]) / denom[i * step];
            xn = xn < -1.0f ? -1.0f : (xn > 1.0f ? 1.0f : xn);
            float r = nearbyintf((xn + 1.0f) * scale);
            r = r < 0.0f ? 0.0f : (r > top ? top : r);
            c[i] = (uint8_t)(int32_t)r;
        }
    } else if (levels <= 15) {
        for (int64_t i = 0; i < D; i++) {
            float xn = (x[i] - off[i * step]) / denom[i * step];
            xn = xn < -1.0f ? -1.0f : (xn > 1.0f ? 1.0f : xn);
            int32_t n = 0;
            for (int64_t j = 0; j < levels; j++) n += mids[j] < xn;
            c[i] = (uint8_t)n;
        }
    } else {
        for (int64_t i = 0; i < D; i++)
            c[i] = encode(x[i], off[i * step], denom[i * step], levels, mids);
    }
}

/* a code's dense decoding, centroid * half + offset, with the reader's float operations
 * (`nanokv.quant.kvquant.decode`: the uniform grid's code * (2 / levels) - 1, or the codebook's
 * centroid; then times the fp16 half-range, plus the fp16 offset, each rounded to float) */
static inline float dense_value(uint8_t code, float off, float hr, int64_t levels,
                                const float *codebook) {
    const float centroid = codebook != NULL
        ? codebook[code] : (float)code * (float)(2.0 / (double)levels) - 1.0f;
    return centroid * hr + off;
}

/* the delta of element i of a token-head row (its code c[i]) to its dense decoding; 0 for an
 * unused entry (i < 0) */
static inline float row_delta(const float *row, const uint8_t *c, int64_t i, float off, float hr,
                              int64_t levels, const float *codebook) {
    return i < 0 ? 0.0f : row[i] - dense_value(c[i], off, hr, levels, codebook);
}

static inline int64_t packed_bytes(int64_t D, int64_t bits) {
    return bits == 3 ? (D + 7) / 8 * 3 : (D * bits + 7) / 8;
}

/* the smallest and largest of x[i] over the i not taken (lo = INFINITY, hi = -INFINITY when
 * every one is; D <= MAX_D): elementwise, then halving, loops the compiler vectorizes. Min and
 * max give the same values in any order (a row whose extreme is a zero of both signs may give
 * either zero). */
static void untaken_min_max(const float *x, const uint8_t *taken, int64_t D, float *lo,
                            float *hi) {
    float l[MAX_D], h[MAX_D];
    for (int64_t i = 0; i < D; i++) {
        l[i] = taken[i] ? INFINITY : x[i];
        h[i] = taken[i] ? -INFINITY : x[i];
    }
    for (int64_t n = D; n > 1;) { /* [0, half) against [rest, n): the middle one stays */
        const int64_t half = n / 2, rest = n - half;
        for (int64_t i = 0; i < half; i++) {
            l[i] = l[i + rest] < l[i] ? l[i + rest] : l[i];
            h[i] = h[i + rest] > h[i] ? h[i + rest] : h[i];
        }
        n = rest;
    }
    *lo = D ? l[0] : INFINITY;
    *hi = D ? h[0] : -INFINITY;
}

/* the n-th extreme channel of x not yet taken: largest (dir > 0) or smallest; ties go to the
 * lower channel. The extreme value first (vectorized), then its first untaken channel; the
 * plain scan where that finds none (NaNs). */
static int64_t next_extreme(const float *x, const uint8_t *taken, int64_t D, int dir) {
    float lo, hi;
    untaken_min_max(x, taken, D, &lo, &hi);
    const float target = dir > 0 ? hi : lo;
    for (int64_t i = 0; i < D; i++)
        if (!taken[i] && x[i] == target) return i;
    int64_t best = -1;
    for (int64_t i = 0; i < D; i++) {
        if (taken[i]) continue;
        if (best < 0 || (dir > 0 ? x[i] > x[best] : x[i] < x[best])) best = i;
    }
    return best;
}

#define MAX_CAP 256
#define TOP_K_RUN 16 /* top_k's runs of scores */
#define PARALLEL_ELEMENTS 65536 /* a call this large (a prefill chunk) splits across threads */

/* the cache lines of bytes [p, p + n), prefetched for writing */
static inline void prefetch_for_write(const void *p, int64_t n) {
    const uintptr_t line = ~(uintptr_t)63;
    const uintptr_t first = (uintptr_t)p & line, last = ((uintptr_t)p + n - 1) & line;
    for (uintptr_t a = first; a <= last; a += 64) __builtin_prefetch((const void *)a, 1, 3);
}

/* A decode step writes one token of each running request: T slots in as many blocks, whose
 * lines of the five buffers the step's attention pass over the whole pool has evicted (and whose
 * pages are often out of the TLB): with those lines cold the call took 2.5x its time with them
 * warm (45 tokens of the shipped model's 4 heads of 32). The lines of every token are requested
 * first, so that their misses overlap (0.9x the call's time in the engine). */
static void prefetch_token_slots(const int64_t *slots, int64_t T, int64_t H, int64_t packed,
                                 int64_t cap, int64_t idx_bytes, int64_t sparse_bytes,
                                 const uint8_t *codes, const uint16_t *offset,
                                 const uint16_t *half, const void *oidx, const void *oval) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t g = slots[t] * H; /* the token's (slot, head 0) */
        prefetch_for_write(codes + g * packed, H * packed);
        prefetch_for_write(offset + g, H * 2);
        prefetch_for_write(half + g, H * 2);
        if (cap) {
            prefetch_for_write((const uint8_t *)oidx + g * cap * idx_bytes, H * cap * idx_bytes);
            prefetch_for_write((const uint8_t *)oval + g * cap * sparse_bytes,
                               H * cap * sparse_bytes);
        }
    }
}

int kvquant_quantize_tokens(const float *x, const uint8_t *valid, const int64_t *slots,
                            int64_t T, int64_t H, int64_t D, int64_t bits,
                            const float *codebook, int64_t cap, uint8_t *codes,
                            uint16_t *offset, uint16_t *half, void *oidx, int64_t idx_bytes,
                            void *oval, int64_t sparse_kind) {
    if (D > MAX_D || cap > MAX_CAP || cap % 2 || (bits != 2 && bits != 3 && bits != 4 && bits != 8)
        || (idx_bytes != 1 && idx_bytes != 2))
        return 1;
    const int64_t levels = ((int64_t)1 << bits) - 1;
    const int64_t packed = packed_bytes(D, bits);
    const int64_t side = cap / 2;
    float mids[255];
    const float *book = midpoints(codebook, levels, mids);
    if (T * H * D < PARALLEL_ELEMENTS)  /* a decode step (a prefill chunk's slots are in order) */
        prefetch_token_slots(slots, T, H, packed, cap, idx_bytes, sparse_kind == 2 ? 4 : 2, codes,
                             offset, half, oidx, oval);
    #pragma omp parallel for schedule(static) if (T * H * D >= PARALLEL_ELEMENTS)
    for (int64_t th = 0; th < T * H; th++) {
        const int64_t t = th / H, h = th % H;
        const float *row = x + th * D;
        const int64_t g = slots[t] * H + h; /* the group's flat (slot, head) */
        uint8_t taken[MAX_D], c[MAX_D];
        int64_t top[MAX_CAP / 2], bottom[MAX_CAP / 2];
        memset(taken, 0, (size_t)D);
        int64_t n_top = 0, n_bottom = 0;
        if (valid[t] && side) {
            const int64_t picks = side < D ? side : D;
            for (int64_t j = 0; j < picks; j++) {
                top[n_top] = next_extreme(row, taken, D, +1);
                taken[top[n_top++]] = 1;
            }
            /* the bottom side ranks all channels again (a channel may be picked twice) */
            uint8_t seen[MAX_D];
            memset(seen, 0, (size_t)D);
            for (int64_t j = 0; j < picks; j++) {
                const int64_t i = next_extreme(row, seen, D, -1);
                seen[i] = 1;
                bottom[n_bottom++] = taken[i] ? -1 : i;
            }
            for (int64_t j = 0; j < n_bottom; j++)
                if (bottom[j] >= 0) taken[bottom[j]] = 1;
        }
        float lo, hi;
        untaken_min_max(row, taken, D, &lo, &hi);
        if (isinf(lo)) lo = hi = 0.0f; /* every channel an outlier */
        uint16_t off_bits, half_bits;
        const float off = fp16_clamped((hi + lo) / 2.0f, &off_bits);
        const float hr = fp16_clamped((hi - lo) / 2.0f, &half_bits);
        const float denom = hr > FLT_MIN ? hr : FLT_MIN;
        encode_row(row, &off, &denom, 0, D, levels, book, c);
        pack_codes(c, D, bits, codes + g * packed);
        offset[g] = off_bits;
        half[g] = half_bits;
        /* entries: the top side (largest first), then the bottom side (smallest first), each
         * with its delta to the dense decoding */
        for (int64_t j = 0; j < side; j++) {
            const int64_t i = j < n_top ? top[j] : -1;
            store_index(oidx, g * cap + j, i, idx_bytes);
            store_sparse(oval, g * cap + j, row_delta(row, c, i, off, hr, levels, codebook),
                         sparse_kind);
            const int64_t b = j < n_bottom ? bottom[j] : -1;
            store_index(oidx, g * cap + side + j, b, idx_bytes);
            store_sparse(oval, g * cap + side + j, row_delta(row, c, b, off, hr, levels, codebook),
                         sparse_kind);
        }
    }
    return 0;
}

/* ---- per channel: blocks of B tokens ---------------------------------------------------- */

typedef struct {
    float score;
    int64_t index;
} Pick;

/* a is worse than b: a lower score, or the same score at a higher index (ties: lower first) */
static inline int worse(Pick a, Pick b) {
    return a.score < b.score || (a.score == b.score && a.index > b.index);
}

static void sift_down(Pick *heap, int64_t n, int64_t i) {
    for (;;) {
        int64_t w = i, l = 2 * i + 1, r = l + 1;
        if (l < n && worse(heap[l], heap[w])) w = l;
        if (r < n && worse(heap[r], heap[w])) w = r;
        if (w == i) return;
        const Pick t = heap[i];
        heap[i] = heap[w];
        heap[w] = t;
        i = w;
    }
}

static int better_first(const void *a, const void *b) {
    const Pick *x = a, *y = b;
    return worse(*x, *y) ? 1 : (worse(*y, *x) ? -1 : 0);
}

/* the k best finite scores of n at or above floor_score, best first, into out (its length:
 * the number found): a min-heap of the k best so far, scanning in index order (a tie keeps the
 * earlier index). run_max (or NULL): each whole run of TOP_K_RUN scores' maximum; a run below
 * the floor is skipped. */
static int64_t heap_top_k(const float *scores, int64_t n, int64_t k, float floor_score,
                          const float *run_max, Pick *out) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (run_max != NULL && i % TOP_K_RUN == 0 && i + TOP_K_RUN <= n
            && run_max[i / TOP_K_RUN] < floor_score) {
            i += TOP_K_RUN - 1; /* a run with nothing at or above the floor */
            continue;
        }
        const float v = scores[i];
        if (v == -INFINITY || v < floor_score) continue;
        const Pick p = {v, i};
        if (m < k) {
            out[m++] = p;
            if (m == k)
                for (int64_t j = k / 2 - 1; j >= 0; j--) sift_down(out, k, j);
        } else if (worse(out[0], p)) {
            out[0] = p;
            sift_down(out, k, 0);
        }
    }
    qsort(out, (size_t)m, sizeof(Pick), better_first);
    return m;
}

/* heap_top_k over all n scores, with a floor first: the k-th best of the maxima of runs of
 * TOP_K_RUN scores is at most the k-th best score (k runs hold a score at least that high), so
 * no score below it is among the k best, and the heap sees only the few runs that reach it.
 * run_max: scratch of n / TOP_K_RUN floats. */
static int64_t top_k(const float *scores, int64_t n, int64_t k, float *run_max, Pick *out) {
    const int64_t runs = n / TOP_K_RUN;
    if (k == 0 || k > runs) return heap_top_k(scores, n, k, -INFINITY, NULL, out);
    for (int64_t r = 0; r < runs; r++) { /* vectorized: each run's maximum */
        float best = -INFINITY;
        for (int64_t j = 0; j < TOP_K_RUN; j++) {
            const float v = scores[r * TOP_K_RUN + j];
            best = v > best ? v : best;
        }
        run_max[r] = best;
    }
    const int64_t found = heap_top_k(run_max, runs, k, -INFINITY, NULL, out);
    const float floor_score = found == k ? out[k - 1].score : -INFINITY;
    return heap_top_k(scores, n, k, floor_score, run_max, out);
}

static int ascending(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* One block-head group of kvquant_quantize_blocks: x points at its slot 0, channel 0 (slot j
 * is row_stride floats further), ok [B] its valid slots; codes at its slot 0 (slot j is H *
 * packed bytes further), offset / half at its channel 0. Scratch: up, down [B * D] scores
 * (down followed by B * D / TOP_K_RUN floats for top_k), taken [B * D] zeros (left zero),
 * picks [2 * side + 2]. Returns the m outliers: their
 * indexes (slot * D + channel, ascending) in listed_index, their deltas in up[0 .. m). */
static int64_t quantize_channel_group(const float *x, int64_t row_stride, const uint8_t *ok,
                                   int64_t B, int64_t D, int64_t h, int64_t H, int64_t levels,
                                   const float *mids, const float *codebook,
                                   const float *thresholds, int64_t side, int64_t packed,
                                   int64_t bits, float *up, float *down, uint8_t *taken,
                                   Pick *picks, int64_t *listed_index, uint8_t *codes,
                                   uint16_t *offset, uint16_t *half) {
    const int64_t elems = B * D;
    Pick *top = picks, *bottom = picks + side + 1;
    #define X(j, d) x[(j) * row_stride + (d)]
    /* slot-major passes: per-channel sums in double, then each element's score */
    double sum[MAX_D], sq[MAX_D];
    float mean[MAX_D], sd[MAX_D], lo_t[MAX_D], hi_t[MAX_D], span[MAX_D];
    if (thresholds != NULL) { /* calibrated (lower, upper) [2, H, D] */
        for (int64_t d = 0; d < D; d++) {
            lo_t[d] = thresholds[h * D + d];
            hi_t[d] = thresholds[(H + h) * D + d];
            const float w = hi_t[d] - lo_t[d];
            span[d] = w > 1e-6f ? w : 1e-6f;
        }
        for (int64_t j = 0; j < B; j++) {
            const float *row = &X(j, 0);
            for (int64_t d = 0; d < D; d++) {
                const float v = row[d];
                up[j * D + d] = ok[j] && v > hi_t[d] ? (v - hi_t[d]) / span[d] : -INFINITY;
                down[j * D + d] = ok[j] && v < lo_t[d] ? (lo_t[d] - v) / span[d] : -INFINITY;
            }
        }
    } else {
        double count = 0.0;
        for (int64_t d = 0; d < D; d++) sum[d] = sq[d] = 0.0;
        for (int64_t j = 0; j < B; j++) {
            if (!ok[j]) continue;
            const float *row = &X(j, 0);
            for (int64_t d = 0; d < D; d++) sum[d] += row[d];
            count += 1.0;
        }
        count = count > 1.0 ? count : 1.0;
        for (int64_t d = 0; d < D; d++) mean[d] = (float)(sum[d] / count);
        for (int64_t j = 0; j < B; j++) {
            if (!ok[j]) continue;
            const float *row = &X(j, 0);
            for (int64_t d = 0; d < D; d++) {
                const double e = (double)(row[d] - mean[d]);
                sq[d] += e * e;
            }
        }
        for (int64_t d = 0; d < D; d++) sd[d] = sqrtf((float)(sq[d] / count)) + 1e-6f;
        for (int64_t j = 0; j < B; j++) {
            const float *row = &X(j, 0);
            for (int64_t d = 0; d < D; d++) {
                const float z = (row[d] - mean[d]) / sd[d];
                up[j * D + d] = ok[j] ? z : -INFINITY;
                down[j * D + d] = ok[j] ? -z : -INFINITY;
            }
        }
    }
    const int64_t k = side < elems ? side : elems;
    float *run_max = down + elems;
    const int64_t n_top = side ? top_k(up, elems, k, run_max, top) : 0;
    const int64_t n_bottom = side ? top_k(down, elems, k, run_max, bottom) : 0;
    int64_t m = 0; /* the marked elements: picked by either end, listed once */
    for (int64_t j = 0; j < n_top; j++) taken[listed_index[m++] = top[j].index] = 1;
    for (int64_t j = 0; j < n_bottom; j++)
        if (!taken[bottom[j].index]) taken[listed_index[m++] = bottom[j].index] = 1;
    float lo[MAX_D], hi[MAX_D], off[MAX_D], hrs[MAX_D], denom[MAX_D];
    for (int64_t d = 0; d < D; d++) lo[d] = INFINITY, hi[d] = -INFINITY;
    for (int64_t j = 0; j < B; j++) {
        if (!ok[j]) continue;
        const float *row = &X(j, 0);
        const uint8_t *out = taken + j * D;
        for (int64_t d = 0; d < D; d++) {
            const float v = out[d] ? INFINITY : row[d], w = out[d] ? -INFINITY : row[d];
            lo[d] = v < lo[d] ? v : lo[d];
            hi[d] = w > hi[d] ? w : hi[d];
        }
    }
    for (int64_t j = 0; j < m; j++) taken[listed_index[j]] = 0; /* zeros for the next group */
    for (int64_t d = 0; d < D; d++) {
        if (isinf(lo[d])) lo[d] = hi[d] = 0.0f;
        uint16_t ob, hb;
        off[d] = fp16_clamped((hi[d] + lo[d]) / 2.0f, &ob);
        const float hr = fp16_clamped((hi[d] - lo[d]) / 2.0f, &hb);
        hrs[d] = hr;
        denom[d] = hr > FLT_MIN ? hr : FLT_MIN;
        offset[d] = ob;
        half[d] = hb;
    }
    uint8_t c[MAX_D];
    for (int64_t j = 0; j < B; j++) {
        encode_row(&X(j, 0), off, denom, 1, D, levels, mids, c);
        pack_codes(c, D, bits, codes + j * H * packed);
    }
    /* the list in index order (slot-major), each entry's delta to its dense decoding */
    qsort(listed_index, (size_t)m, sizeof(int64_t), ascending);
    for (int64_t j = 0; j < m; j++) {
        const int64_t e = listed_index[j], d = e % D;
        const float v = X(e / D, d);
        const uint8_t code = encode(v, off[d], denom[d], levels, mids);
        up[j] = v - dense_value(code, off[d], hrs[d], levels, codebook); /* scores spent */
    }
    #undef X
    return m;
}

int kvquant_quantize_blocks(const float *x, const uint8_t *valid, const int64_t *block_ids,
                            int64_t n, int64_t B, int64_t H, int64_t D, int64_t bits,
                            const float *codebook, const float *thresholds, int64_t cap,
                            uint8_t *codes, uint16_t *offset, uint16_t *half, void *oidx,
                            int64_t idx_bytes, void *oval, int64_t sparse_kind) {
    if (cap % 2 || (bits != 2 && bits != 3 && bits != 4 && bits != 8)
        || (idx_bytes != 2 && idx_bytes != 4) || D > MAX_D)
        return 1;
    const int64_t levels = ((int64_t)1 << bits) - 1, packed = packed_bytes(D, bits);
    const int64_t side = cap / 2, elems = B * D;
    float mids[255];
    const float *book = midpoints(codebook, levels, mids);
    int failed = 0;
    #pragma omp parallel reduction(| : failed)
    {
        /* each thread's scratch, reused by its groups */
        float *up = malloc((size_t)(elems * 2 + elems / TOP_K_RUN) * sizeof(float));
        uint8_t *taken = calloc((size_t)elems, 1);
        Pick *picks = malloc((size_t)(side + 1) * 2 * sizeof(Pick));
        int64_t *listed = malloc((size_t)(2 * side + 1) * sizeof(int64_t));
        const int ready = up != NULL && taken != NULL && picks != NULL && listed != NULL;
        failed |= !ready;
        #pragma omp for schedule(dynamic)
        for (int64_t bh = 0; bh < n * H; bh++) {
            if (!ready) continue;
            const int64_t b = bh / H, h = bh % H, blk = block_ids[b];
            const int64_t m = quantize_channel_group(
                x + (b * B * H + h) * D, H * D, valid + b * B, B, D, h, H, levels, book,
                codebook, thresholds, side, packed, bits, up, up + elems, taken, picks, listed,
                codes + (blk * B * H + h) * packed, offset + (blk * H + h) * D,
                half + (blk * H + h) * D);
            const int64_t g = (blk * H + h) * cap; /* its list: unused entries last */
            for (int64_t j = 0; j < cap; j++) {
                store_index(oidx, g + j, j < m ? listed[j] : -1, idx_bytes);
                store_sparse(oval, g + j, j < m ? up[j] : 0.0f, sparse_kind);
            }
        }
        free(up), free(taken), free(picks), free(listed);
    }
    return failed ? 2 : 0;
}
