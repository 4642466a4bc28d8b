/* y = x @ w.T (+ bias) for a few rows of x: the decode step's LM head, where a GEMM library's
 * blocking for 8 rows reads a 600 MB weight at well under the memory's speed.
 *
 *   x [M, K] float32, w [N, K] float32 (row-major, as nn.Linear keeps it), y [M, N], M <= 16
 *
 * Each row of w is read once, front to back, and dotted with all M rows of x (which stay in L1 /
 * L2); rows of w are split across threads in contiguous runs. 16 rows of w at a time leave their
 * M x 16 dot vectors in a scratch tile, reduced together (16 vectors into one of 16 sums) and
 * stored as 16 outputs of each row of x; rows of x 8 at a time, R rows of w sharing each load of
 * x. On AVX2 builds without AVX-512 the same by 8-float
 * vectors: with 16 registers, the rows of x go 4 at a time (R rows of w share each load of x,
 * R * 4 accumulators), and the R rows of w stay in L1 across those groups. Plain C where both
 * are missing (the compiler's vectoriser). The reference is `torch.nn.functional.linear`. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16 /* vector paths: how many rows of w ahead a row is prefetched */
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

#include "sum16.h"

/* rows of x per pass over the 16 rows of w: all of them up to 8; 9-16 rows in two groups, each
 * group (32 KB of x: L1) over the 16 rows (64 KB: the first group reads them from memory, the
 * second from L2). One group of 16 rows, 16 accumulators over one row of w, streamed all of x
 * from L2 for every row of w: 45.5 ms for 16 rows of the 151,936 x 1,024 LM head on a Zen 5
 * EPYC against 15.6 ms for 8; two groups each over R rows of w, 31.8 ms; two groups each over
 * the 16 rows, 22.1 ms (oneDNN 19.2; docs/results/linear/README.md) */
enum { X_GROUP = 8 };

/* rows [n0 + i, n0 + i + R) of w (K % 16 == 0) dotted with the MC rows of x from x0: their dot
 * vectors into tile[m * 16 + i + r] (always inlined with R and MC constant: R * MC
 * accumulators in registers) */
static inline __attribute__((always_inline)) void dots_avx512(
        const float *x0, const float *wr, int64_t K, const int R, const int MC, const int m0,
        const int i, __m512 *tile /* [M, 16] */) {
    enum { R_MAX = 4, MC_MAX = X_GROUP };
    __m512 acc[R_MAX][MC_MAX];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[R_MAX];
        for (int r = 0; r < R; r++) {
            if (m0 == 0)  /* the rows 16 ahead, requested early (a line per 16 floats) */
                _mm_prefetch((const char *)(wr + (r + PREFETCH_ROWS) * K + k), _MM_HINT_T0);
            wv[r] = _mm512_loadu_ps(wr + r * K + k);
        }
        for (int m = 0; m < MC; m++) {
            const __m512 xv = _mm512_loadu_ps(x0 + m * K + k);
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) tile[(m0 + m) * 16 + i + r] = acc[r][m];
}

/* rows [n0, n0 + 16) of w dotted with the M rows of x: y[m, n0 + i] (always inlined with M
 * constant) */
static inline __attribute__((always_inline)) void rows16(
        const float *x, const float *w, float *y, int64_t n0, int64_t N, int64_t K, const int M,
        __m512 *tile /* [M, 16] */) {
    /* R rows of w per pass share each load of x: R * min(M, X_GROUP) accumulators, at most 16 */
    const int G = M < X_GROUP ? M : X_GROUP;
    const int R = G <= 4 ? 4 : 2;
    for (int m0 = 0; m0 < M; m0 += G) {
        const int mc = M - m0 < G ? M - m0 : G;
        for (int i = 0; i < 16; i += R) {
            const float *wr = w + (n0 + i) * K;
            switch (mc) {  /* the last group may be shorter */
#define GROUP(c) case c: dots_avx512(x + m0 * K, wr, K, R, c, m0, i, tile); break;
            GROUP(1) GROUP(2) GROUP(3) GROUP(4) GROUP(5) GROUP(6) GROUP(7) GROUP(8)
#undef GROUP
            }
        }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * N + n0, sum16(tile + m * 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "sum8.h"

/* rows of x per pass over R rows of w: 4 (groups of 2 were slower from 3 rows on, of 8 at 16
 * rows; docs/results/linear/README.md) */
enum { X_GROUP = 4 };

/* rows [n0 + i, n0 + i + R) of w (K % 16 == 0) dotted with the MC rows of x from x0: their 8-lane
 * dot vectors into tile[m * 16 + i + r] (always inlined with R and MC constant: R * MC
 * accumulators in registers) */
static inline __attribute__((always_inline)) void dots_avx2(
        const float *x0, const float *wr, int64_t K, const int R, const int MC, const int m0,
        const int i, __m256 *tile /* [M, 16] */) {
    enum { R_MAX = 8, MC_MAX = X_GROUP };
    __m256 acc[R_MAX][MC_MAX];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        if (m0 == 0)  /* the rows 16 ahead, requested early (a line per 16 floats) */
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(wr + (r + PREFETCH_ROWS) * K + k), _MM_HINT_T0);
        for (int64_t kk = k; kk < k + 16; kk += 8) {
            __m256 wv[R_MAX];
            for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(wr + r * K + kk);
            for (int m = 0; m < MC; m++) {
                const __m256 xv = _mm256_loadu_ps(x0 + m * K + kk);
                for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) tile[(m0 + m) * 16 + i + r] = acc[r][m];
}

/* rows [n0, n0 + 16) of w dotted with the M rows of x: y[m, n0 + i] (always inlined with M
 * constant) */
static inline __attribute__((always_inline)) void rows16(
        const float *x, const float *w, float *y, int64_t n0, int64_t N, int64_t K, const int M,
        __m256 *tile /* [M, 16] */) {
    /* R rows of w per pass: R * min(M, X_GROUP) accumulators, at most 8 */
    const int G = M < X_GROUP ? M : X_GROUP;
    const int R = G <= 1 ? 8 : (G <= 2 ? 4 : 2);
    for (int i = 0; i < 16; i += R) {
        const float *wr = w + (n0 + i) * K;
        for (int m0 = 0; m0 < M; m0 += G) {
            const int mc = M - m0 < G ? M - m0 : G;
            switch (mc) {  /* the last group may be shorter */
#define GROUP(c) case c: dots_avx2(x + m0 * K, wr, K, R, c, m0, i, tile); break;
            GROUP(1) GROUP(2) GROUP(3) GROUP(4)
#undef GROUP
            }
        }
    }
    for (int m = 0; m < M; m++) {
        _mm256_storeu_ps(y + m * N + n0, sum8(tile + m * 16));
        _mm256_storeu_ps(y + m * N + n0 + 8, sum8(tile + m * 16 + 8));
    }
}
#endif

/* one output y[m, n] the plain way */
static inline float dot_row(const float *x, const float *w, int64_t K) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int64_t k = 0; k < K; k++) s += x[k] * w[k];
    return s;
}

/* returns 0, or -1 when M is out of range */
int small_m_linear(const float *x, const float *w, const float *bias, float *y, int64_t M,
                   int64_t N, int64_t K) {
    if (M < 1 || M > 16) return -1;
    #pragma omp parallel
    {
#if defined(__AVX512F__)
        __m512 tile[16 * 16];
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 tile[16 * 16];
#endif
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 16) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
            if (K % 16 == 0 && n0 + 16 <= N) {
                switch (M) {  /* instances with M constant: accumulators in registers */
#define CASE(c) case c: rows16(x, w, y, n0, N, K, c, tile); break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
                CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
                }
                continue;
            }
#endif
            for (int64_t n = n0; n < n0 + 16 && n < N; n++)
                for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_row(x + m * K, w + n * K, K);
        }
    }
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
    return 0;
}
