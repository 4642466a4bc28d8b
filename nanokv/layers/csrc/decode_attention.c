/* Paged decode attention for CPUs: one query token per request over that request's cached
 * slots, read in place from the KV pool (no gather copy), float32.
 *
 * Layout. q, out: [B, Hq, D] (q already multiplied by the softmax scale). k, v: the pool's slots
 * [num_slots, Hkv, D]. Request b's slots are the runs of consecutive slots
 * [run_start[r], run_start[r] + run_len[r]) for r in [run_ptr[b], run_ptr[b + 1]), in logical
 * order (a run = consecutive pool blocks of its block table).
 *
 * One pass over K and V (online softmax, as flash-decoding does): slots are taken in tiles of
 * TILE; for each tile the scores of every query head, the running max m and sum l of each head
 * are updated, the accumulator rescaled when the max grows, then P_tile @ V_tile is added. One
 * OpenMP work item is one request with all its heads, so a slot's K row for all KV heads
 * (Hkv * D contiguous floats) is read in one sweep; per-head items would stride by Hkv * D
 * floats, a page apart for 8 x 128, which defeats the hardware prefetchers (2x slower here).
 * Even so the prefetchers stop at each 4 KiB page (a slot's row at 8 x 128 floats): each slot's
 * K and V rows are prefetched about AHEAD_BYTES before they are read (`prefetch_row`).
 * soft_cap > 0: each score s becomes soft_cap * tanh(s / soft_cap) before the softmax (Gemma 2's
 * attention logit soft-cap); 0: none.
 * The reference is `nanokv.layers.attention._decode_per_request` (PyTorch). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 16

/* As a slot's K / V row is read, the row of the slot AHEAD_BYTES on (at least the next slot)
 * in the run is prefetched (locality 2). On a 2-core Intel Xeon, 3-8 requests x 3k slots, two
 * threads, the pool read from memory: rows of 8 x 128 floats (a slot ahead) 0.80x their time
 * with 4 KiB pages and 0.97x with transparent huge pages (the engine's pool); rows of 4 x 32
 * floats (4 slots ahead) 0.76x with either. 8-16 KiB ahead was 1.17-1.24x SLOWER with huge
 * pages (0.80x without). */
#define AHEAD_BYTES 2048

static inline void prefetch_row(const float *row, int64_t n) {
    for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(row + i, 0, 2);
}

int decode_attention(const float *q, const float *k, const float *v, float *out,
                     const int64_t *run_ptr, const int64_t *run_start, const int64_t *run_len,
                     int64_t num_requests, int64_t num_q_heads, int64_t num_kv_heads,
                     int64_t head_dim, float soft_cap) {
    const int64_t Hq = num_q_heads, Hkv = num_kv_heads, D = head_dim;
    const int64_t group = Hq / Hkv;
    const int64_t row = Hkv * D, row_bytes = row * (int64_t)sizeof(float);
    const int64_t ahead_slots = AHEAD_BYTES > row_bytes ? AHEAD_BYTES / row_bytes : 1;
    int failed = 0;
    #pragma omp parallel
    {
        float *acc = malloc(sizeof(float) * Hq * D);     /* [Hq, D] running P @ V */
        float *scores = malloc(sizeof(float) * Hq * TILE); /* [Hq, TILE] */
        float *m = malloc(sizeof(float) * Hq);           /* running max per head */
        float *l = malloc(sizeof(float) * Hq);           /* running sum of exp per head */
        if (!acc || !scores || !m || !l) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_requests; b++) {
            if (failed) continue;
            for (int64_t h = 0; h < Hq; h++) { m[h] = -FLT_MAX; l[h] = 0.f; }
            for (int64_t i = 0; i < Hq * D; i++) acc[i] = 0.f;
            const float *qb = q + b * Hq * D;
            for (int64_t r = run_ptr[b]; r < run_ptr[b + 1]; r++) {
                const int64_t start = run_start[r], len = run_len[r];
                for (int64_t t0 = 0; t0 < len; t0 += TILE) {
                    const int64_t n = len - t0 < TILE ? len - t0 : TILE;
                    /* slots of this tile with a slot ahead_slots on in the run */
                    const int64_t ahead = len - t0 - ahead_slots < n ? len - t0 - ahead_slots : n;
                    for (int64_t t = 0; t < n; t++) {                 /* scores = q K^T */
                        const float *krow = k + (start + t0 + t) * Hkv * D;
                        if (t < ahead) prefetch_row(krow + ahead_slots * row, row);
                        for (int64_t h = 0; h < Hq; h++) {
                            const float *kr = krow + (h / group) * D, *qh = qb + h * D;
                            float s = 0.f;
                            #pragma omp simd reduction(+:s)
                            for (int64_t d = 0; d < D; d++) s += qh[d] * kr[d];
                            if (soft_cap > 0.f) s = soft_cap * tanhf(s / soft_cap);
                            scores[h * TILE + t] = s;
                        }
                    }
                    for (int64_t h = 0; h < Hq; h++) {                 /* online softmax */
                        float *sc = scores + h * TILE;
                        float mx = m[h];
                        for (int64_t t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
                        const float corr = expf(m[h] - mx);
                        float sum = 0.f;
                        for (int64_t t = 0; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
                        l[h] = l[h] * corr + sum;
                        m[h] = mx;
                        if (corr != 1.f) {
                            float *ah = acc + h * D;
                            #pragma omp simd
                            for (int64_t d = 0; d < D; d++) ah[d] *= corr;
                        }
                    }
                    for (int64_t t = 0; t < n; t++) {                 /* acc += P V */
                        const float *vrow = v + (start + t0 + t) * Hkv * D;
                        if (t < ahead) prefetch_row(vrow + ahead_slots * row, row);
                        for (int64_t h = 0; h < Hq; h++) {
                            const float p = scores[h * TILE + t], *vr = vrow + (h / group) * D;
                            float *ah = acc + h * D;
                            #pragma omp simd
                            for (int64_t d = 0; d < D; d++) ah[d] += p * vr[d];
                        }
                    }
                }
            }
            float *ob = out + b * Hq * D;
            for (int64_t h = 0; h < Hq; h++) {
                const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
                for (int64_t d = 0; d < D; d++) ob[h * D + d] = acc[h * D + d] * inv;
            }
        }
        free(acc); free(scores); free(m); free(l);
    }
    return failed ? -1 : 0;
}
