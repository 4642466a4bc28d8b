/* y = x @ w.T (+ bias) over a weight packed in column panels: the linear layers on CPU where
 * this is faster than oneDNN (measured per weight shape at load, `Linear.keep_faster_path`),
 * first of all the LM head, whose vocabulary matrix (Qwen3: 151,936 x 1,024 float32, 622 MB) is
 * the largest weight a decode step reads, at whatever row count the step brings (a few decode
 * rows, a prefill chunk's thousands, every prompt position for prompt logits).
 *
 *   x [M, K] float32; panels [P, K, 32] float32, P = ceil(N / 32): panels[p, k, j] = w[32 p + j, k]
 *   (0 past N); y [M, N] float32
 *
 * The 32 outputs of a panel lie across the lanes of the accumulators, so a step over k is one
 * load of the panel's row k (two 16-float vectors) and, for each row of x, one broadcast of
 * x[m, k] and two FMAs: no horizontal sums, and the weight is read once, front to back, in
 * contiguous 128 KiB panels (at 1,024 columns). Panels are split across threads. The rows of x go
 * G at a time (AVX-512: 8, 16 accumulators; AVX2: 6, over each half of a panel in turn, 12
 * accumulators, or up to 2 over the whole panel, 8; plain C: 8), each group over the panel
 * while it sits in L2, so the weight comes from memory once per tile of about 256 rows of x
 * (once for a decode step; AVX2 takes a decode step's rows two at a time, `group_rows`, and
 * brings the next panel into L2 during the passes over this one, `next_panel_share`; AVX-512
 * prefetches ahead in the stream it reads, `STREAM_AHEAD`). x is
 * first copied group-major ([M / gr][K][gr], gr = group_rows(M)) so a group's broadcasts for
 * one k are adjacent. Plain C where AVX2 is missing (the compiler's vectoriser).
 * The reference is `torch.nn.functional.linear` on the unpacked weight.
 *
 * Int8 weights (weight-only quantization, `panel_linear_int8`): the same panels of int8 codes
 * [P, K, 32] and a float32 scale per output column, w[n, k] = code[n, k] * scale[n]. Each panel
 * row is widened to float32 in registers (AVX-512: two 16-lane conversions; AVX2: four 8-lane)
 * and the passes are the float kernel's; the scale multiplies each output once, at the store:
 * y = scale * (x @ code.T) + bias. A quarter of the bytes a step over k, so a decode step that
 * streams its weights from memory reads a quarter as much. The reference is F.linear over the
 * dequantized weight (code * scale). */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

enum { PANEL = 32 };

/* G: the most rows of x per pass over a panel; group_rows(M): the rows per pass for M rows */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define G 6
/* a decode step's few rows (up to 16) two at a time over whole panels, as they stream from
 * memory (groups of six took 1.1-1.2x the time at 8 rows); more rows six at a time */
static inline int64_t group_rows(int64_t M) { return M > 16 ? 6 : 2; }
#else
#define G 8
static inline int64_t group_rows(int64_t M) { (void)M; return G; }
#endif

/* rows of x per pass over all the panels, a whole number of groups: at a prefill's thousands of
 * rows, a tile's groups (about 256 rows x K floats) stay in L2 / L3 while the panels stream past
 * them (a 4,096 x 1,024 x 3,072 product took 1.41x oneDNN's time untiled, 1.29x tiled on a Zen 4
 * EPYC; 4,096 x 1,024 x 4,096 1.01x -> 0.86x) */
enum { M_TILE_ROWS = 256 };

/* calls of at most this many rows prefetch the next panel (next_panel_share): a decode step's
 * batch (Qwen3-0.6B's step at 17-48 rows, groups of six over half panels: 0.73-0.88x; at 64
 * rows 0.97-1.04x, near the arithmetic's bound; a prefill's thousands of rows are bound by the
 * arithmetic, not by reading the panels) */
enum { DECODE_ROWS = 48 };

int panel_width(void) { return PANEL; }

/* panels[p, k, j] = w[32 p + j, k], zero past row N - 1 of w [N, K] */
void pack_panels(const float *w, float *panels, int64_t N, int64_t K) {
    const int64_t P = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        float *dst = panels + p * K * PANEL;
        for (int j = 0; j < PANEL; j++) {
            const int64_t n = p * PANEL + j;
            for (int64_t k = 0; k < K; k++) dst[k * PANEL + j] = n < N ? w[n * K + k] : 0.f;
        }
    }
}

/* one output row segment: y_row[n0 + j] = acc[j] (x scale: int8 weights; NULL for float32
 * panels and widened int8 ones, which carry their scale) (+ bias), j < 32, only columns below
 * N */
static inline void store_row(float *y_row, const float *acc, const float *scale,
                             const float *bias, int64_t n0, int64_t N) {
    const int64_t n_end = n0 + PANEL < N ? n0 + PANEL : N;
    for (int64_t n = n0; n < n_end; n++)
        y_row[n] = acc[n - n0] * (scale ? scale[n] : 1.f) + (bias ? bias[n] : 0.f);
}

/* bytes of one weight: a float32 panel's or an int8 one's (I8: a constant where inlined) */
static inline int64_t weight_bytes(const int I8) { return I8 ? 1 : (int64_t)sizeof(float); }

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* step k's share bytes from pf on, into L2 (_MM_HINT_T2: not L1; on AVX2 a weight that sits in
 * L3 lost with T0 and T1, by 1.16-1.26x at 3 rows; from memory they were alike) */
static inline __attribute__((always_inline)) void prefetch_step(const char *pf, int64_t k,
                                                                int64_t share) {
    for (int64_t o = 0; o < share; o += 64) _mm_prefetch(pf + k * share + o, _MM_HINT_T2);
}
#endif

#if defined(__AVX512F__)
/* 16 weights of a panel from element i on, as float32 (int8 codes widened: I8 constant) */
static inline __attribute__((always_inline)) __m512 load16(const void *pw, int64_t i,
                                                           const int I8) {
    if (I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)((const int8_t *)pw + i))));
    return _mm512_loadu_ps((const float *)pw + i);
}

/* the MC rows of group xg ([K][MC], x's rows m0..m0 + MC) times panel pw ([K][32], float32 or
 * int8 codes: I8, with scale per column) into y, each step over k prefetching `share` bytes
 * from pf on (pf NULL: none; `STREAM_AHEAD`) (always inlined with MC and I8 constant: 2 * MC
 * accumulators in registers) */
static inline __attribute__((always_inline)) void panel_group_pass(
        const float *xg, const void *pw, const float *scale, float *y, const float *bias,
        int64_t n0, int64_t N, int64_t K, int64_t m0, const int MC, const char *pf,
        int64_t share, const int prefetch, const int I8) {
    __m512 acc[G][2];
    for (int m = 0; m < MC; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (prefetch) prefetch_step(pf, k, share);
        const __m512 w0 = load16(pw, k * PANEL, I8);
        const __m512 w1 = load16(pw, k * PANEL + 16, I8);
        for (int m = 0; m < MC; m++) {
            const __m512 xb = _mm512_set1_ps(xg[k * MC + m]);
            acc[m][0] = _mm512_fmadd_ps(w0, xb, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(w1, xb, acc[m][1]);
        }
    }
    #pragma GCC unroll 8
    for (int m = 0; m < MC; m++) {
        float *y_row = y + (m0 + m) * N;
        if (n0 + PANEL <= N) {
            __m512 b0 = _mm512_setzero_ps(), b1 = b0;
            if (bias) b0 = _mm512_loadu_ps(bias + n0), b1 = _mm512_loadu_ps(bias + n0 + 16);
            if (I8) {
                _mm512_storeu_ps(y_row + n0, _mm512_fmadd_ps(
                    acc[m][0], _mm512_loadu_ps(scale + n0), b0));
                _mm512_storeu_ps(y_row + n0 + 16, _mm512_fmadd_ps(
                    acc[m][1], _mm512_loadu_ps(scale + n0 + 16), b1));
            } else {
                _mm512_storeu_ps(y_row + n0, _mm512_add_ps(acc[m][0], b0));
                _mm512_storeu_ps(y_row + n0 + 16, _mm512_add_ps(acc[m][1], b1));
            }
        } else {  /* the last panel: columns past N are padding */
            float tail[PANEL];
            _mm512_storeu_ps(tail, acc[m][0]);
            _mm512_storeu_ps(tail + 16, acc[m][1]);
            store_row(y_row, tail, scale, bias, n0, N);
        }
    }
}

static inline __attribute__((always_inline)) void panel_group(
        const float *xg, const void *pw, const float *scale, float *y, const float *bias,
        int64_t n0, int64_t N, int64_t K, int64_t m0, const int MC, const char *pf,
        int64_t share, const int I8) {
    if (pf)  /* the loop without prefetches stays as it was */
        panel_group_pass(xg, pw, scale, y, bias, n0, N, K, m0, MC, pf, share, 1, I8);
    else
        panel_group_pass(xg, pw, scale, y, bias, n0, N, K, m0, MC, pf, share, 0, I8);
}
#elif defined(__AVX2__) && defined(__FMA__)

/* 8 weights of a panel from element i on, as float32 (int8 codes widened: I8 constant) */
static inline __attribute__((always_inline)) __m256 load8(const void *pw, int64_t i,
                                                          const int I8) {
    if (I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)pw + i))));
    return _mm256_loadu_ps((const float *)pw + i);
}

/* the MC rows of group xg times the columns [16 h, 16 h + 16) of panel pw into acc (MC <= 6:
 * 2 * MC accumulators, two weight vectors and a broadcast, 15 of the 16 registers), with share
 * bytes of the next panel from pf on prefetched into L2 each step over k where `prefetch` (a
 * constant, as in panel_pass) */
static inline __attribute__((always_inline)) void panel_half(
        const float *xg, const void *pw, int64_t K, const int MC, int h, __m256 acc[G][2],
        const char *pf, int64_t share, const int prefetch, const int I8) {
    for (int m = 0; m < MC; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (prefetch) prefetch_step(pf, k, share);
        const __m256 w0 = load8(pw, k * PANEL + 16 * h, I8);
        const __m256 w1 = load8(pw, k * PANEL + 16 * h + 8, I8);
        for (int m = 0; m < MC; m++) {
            const __m256 xb = _mm256_broadcast_ss(xg + k * MC + m);
            acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
        }
    }
}

/* the MC <= 2 rows of group xg times the whole panel pw into acc (4 * MC accumulators), with
 * share bytes of the next panel from pf on prefetched into L2 each step over k (always inlined
 * with `prefetch` constant: the loop without it stays as it was) */
static inline __attribute__((always_inline)) void panel_pass(
        const float *xg, const void *pw, int64_t K, const int MC, __m256 acc[2][4],
        const char *pf, int64_t share, const int prefetch, const int I8) {
    for (int m = 0; m < MC; m++)
        for (int v = 0; v < 4; v++) acc[m][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (prefetch) prefetch_step(pf, k, share);
        __m256 wv[4];
        for (int v = 0; v < 4; v++) wv[v] = load8(pw, k * PANEL + 8 * v, I8);
        for (int m = 0; m < MC; m++) {
            const __m256 xb = _mm256_broadcast_ss(xg + k * MC + m);
            for (int v = 0; v < 4; v++) acc[m][v] = _mm256_fmadd_ps(wv[v], xb, acc[m][v]);
        }
    }
}

/* the 8 outputs of acc at column col of panel n0 for one row of x: into y_row (x scale where
 * I8, + bias), or into tail_row on the last panel (columns past N being padding; store_row
 * scales and copies them after) */
static inline __attribute__((always_inline)) void store8(
        __m256 acc, float *y_row, float *tail_row, const float *scale, const float *bias,
        int64_t n0, int64_t col, int whole, const int I8) {
    if (!whole) {
        _mm256_storeu_ps(tail_row + col, acc);
        return;
    }
    const __m256 b = bias ? _mm256_loadu_ps(bias + n0 + col) : _mm256_setzero_ps();
    _mm256_storeu_ps(y_row + n0 + col,
                     I8 ? _mm256_fmadd_ps(acc, _mm256_loadu_ps(scale + n0 + col), b)
                        : _mm256_add_ps(acc, b));
}

/* as above with 8-float vectors, a panel row being four of them: up to two rows of x over the
 * whole panel (4 * MC accumulators), more (a prefill's groups of G = 6) over its two halves in
 * turn (12 accumulators a half: twelve FMAs for every two weight loads and six broadcasts,
 * where whole-panel passes of two rows took four weight loads for eight FMAs and were bound by
 * reading the panel from L2). Both kinds of pass also bring `share` bytes a step over k from pf
 * on into L2 (pf NULL: none; next_panel_share; a group of halves takes two passes' shares) */
static inline __attribute__((always_inline)) void panel_group(
        const float *xg, const void *pw, const float *scale, float *y, const float *bias,
        int64_t n0, int64_t N, int64_t K, int64_t m0, const int MC, const char *pf,
        int64_t share, const int I8) {
    float tail[G][PANEL];  /* the last panel's rows, columns past N being padding */
    const int whole = n0 + PANEL <= N;
    if (MC > 2) {
        for (int h = 0; h < 2; h++) {
            __m256 acc[G][2];
            if (pf)  /* each half a pass of its own */
                panel_half(xg, pw, K, MC, h, acc, pf + h * K * share, share, 1, I8);
            else
                panel_half(xg, pw, K, MC, h, acc, pf, share, 0, I8);
            for (int m = 0; m < MC; m++)
                for (int v = 0; v < 2; v++)
                    store8(acc[m][v], y + (m0 + m) * N, tail[m], scale, bias, n0,
                           16 * h + 8 * v, whole, I8);
        }
    } else {
        __m256 acc[2][4];
        if (pf)
            panel_pass(xg, pw, K, MC, acc, pf, share, 1, I8);
        else
            panel_pass(xg, pw, K, MC, acc, pf, share, 0, I8);
        for (int m = 0; m < MC; m++)
            for (int v = 0; v < 4; v++)
                store8(acc[m][v], y + (m0 + m) * N, tail[m], scale, bias, n0, 8 * v, whole,
                       I8);
    }
    if (!whole)
        for (int m = 0; m < MC; m++)
            store_row(y + (m0 + m) * N, tail[m], scale, bias, n0, N);
}
#else
static inline __attribute__((always_inline)) void panel_group(
        const float *xg, const void *pw, const float *scale, float *y, const float *bias,
        int64_t n0, int64_t N, int64_t K, int64_t m0, const int MC, const char *pf,
        int64_t share, const int I8) {
    (void)pf; (void)share;  /* no prefetch here (next_panel_share) */
    float acc[G][PANEL] = {{0}};
    const float *pf32 = (const float *)pw;
    const int8_t *pi8 = (const int8_t *)pw;
    for (int64_t k = 0; k < K; k++)
        for (int m = 0; m < MC; m++) {
            const float xv = xg[k * MC + m];
            if (I8) {
                #pragma omp simd
                for (int j = 0; j < PANEL; j++) acc[m][j] += (float)pi8[k * PANEL + j] * xv;
            } else {
                #pragma omp simd
                for (int j = 0; j < PANEL; j++) acc[m][j] += pf32[k * PANEL + j] * xv;
            }
        }
    for (int m = 0; m < MC; m++)
        store_row(y + (m0 + m) * N, acc[m], scale, bias, n0, N);
}
#endif

/* A decode step's few rows go over each panel in several passes (AVX2: two rows a pass, four
 * passes at 8 rows; more than 16 rows six a group, each group two passes over half panels): the
 * first streamed the panel from memory, the later ones read it from L2, and through those the
 * memory sat idle. So each pass also brings a share of the thread's next panel into L2
 * (software prefetches spread evenly over every step of every pass): bytes of it per step over
 * k, 0 for none. Only up to DECODE_ROWS rows, with two passes or more (one pass streams the
 * panel, and prefetching beside it was slower: 1.1-1.8x at one row), and only as much of the
 * next panel as fits in this core's L2 beside the current one and an eighth of L2 to spare (a
 * whole 256-384 KiB panel beside the current one on a 512 KiB L2 was 1.07-1.16x slower). A
 * Qwen3-0.6B decode step's linear layers on a Zen 3 EPYC: 0.76x their time at 8 rows, 0.73-0.88x
 * at 17-48 (ab_panel_linear.py --decode-step). The AVX-512 build takes up to 8 rows in one
 * pass and prefetches within that pass's own stream instead (`STREAM_AHEAD`). */
#if !defined(__AVX512F__)
static int64_t next_panel_share(int64_t M, int64_t passes, int64_t K, long l2,
                                int64_t elem) {
    const int64_t panel = K * PANEL * elem;
    const int64_t room = l2 > 0 ? (int64_t)l2 - panel - (int64_t)l2 / 8 : 0;
    if (passes < 2 || room <= 0 || M > DECODE_ROWS) return 0;
    return (room < panel ? room : panel) / (passes * K);
}
#endif

/* AVX-512: the first pass over a panel (the one that reads it from memory) prefetches the bytes
 * STREAM_AHEAD ahead of the row it reads, one panel row (128 bytes) a step over k, running on into
 * the thread's next panel (contiguous in memory). The hardware prefetchers stop at each 4 KiB
 * page, and a core streaming on its own kept too few reads in flight: a Qwen3-0.6B decode step's
 * four layers of weights at 8 rows took 0.70x their time (16.2 -> 11.4 ms, in turn with the LM
 * head, Intel Xeon with AVX-512, 2 cores), its LM head 0.67x (35.3 -> 23.6 ms, where oneDNN took
 * 28.3); at 1 row 0.88x, at 512 rows unchanged (bound by the arithmetic). 2-32 KiB ahead were
 * alike; a non-temporal hint was no faster than none. */
enum { STREAM_AHEAD = 4096 };

#if !defined(__AVX512F__)
/* this core's L2 in bytes where a build prefetches the next panel (AVX2 without AVX-512), else 0;
 * asked once (where the C library reads it with CPUID each time, that traps to the
 * hypervisor in a VM), concurrent first callers storing the same value */
static long prefetch_l2_bytes(void) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && defined(_SC_LEVEL2_CACHE_SIZE)
    static _Atomic long cached = -1;
    long l2 = atomic_load_explicit(&cached, memory_order_relaxed);
    if (l2 < 0) {
        l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = l2 > 0 ? l2 : 0;  /* unknown: no prefetch */
        atomic_store_explicit(&cached, l2, memory_order_relaxed);
    }
    return l2;
#else
    return 0;
#endif
}
#endif

/* An int8 panel that several groups of rows pass over is widened once into float32 (code x
 * scale, 128 KiB at 1,024 columns: it stays in L2) and the passes read that, as the float
 * kernel reads a float panel: the codes come from memory once either way, and each pass
 * widening them again made a 64-row product of the LM head 1.2x float32's time. Columns past
 * the last panel's N - n0 get scale 0. */
static void widen_panel(const int8_t *codes, const float *scale, int64_t cols, int64_t K,
                        float *dst) {
    float s[PANEL];
    for (int j = 0; j < PANEL; j++) s[j] = j < cols ? scale[j] : 0.f;
    for (int64_t k = 0; k < K; k++) {
        #pragma omp simd
        for (int j = 0; j < PANEL; j++) dst[k * PANEL + j] = (float)codes[k * PANEL + j] * s[j];
    }
}

/* The groups of rows [mt, m_end) of xg over panel p at pw (float32, or int8 codes with scale
 * where I8), each a pass, prefetching as described above where `prefetch` (the panel is the one
 * in memory, not a widened copy) */
static inline __attribute__((always_inline)) void panel_rows(
        const float *xg, const char *pw, const float *scale, float *y, const float *bias,
        int64_t p, int64_t P, int64_t N, int64_t K, int64_t M, int64_t mt, int64_t m_end,
        int64_t gr, int64_t share, int64_t halves, const int prefetch, const int I8) {
    (void)P; (void)halves;
    for (int64_t m0 = mt; m0 < m_end; m0 += gr) {
        const float *g = xg + m0 * K;
#if defined(__AVX512F__)
        /* the first group's pass reads the panel from memory (STREAM_AHEAD) */
        const char *pf = prefetch && m0 == mt ? pw + STREAM_AHEAD : NULL;
#else
        /* this group's shares of the next panel (its first pass: (m0 - mt) / gr times halves
         * of passes) */
        const char *pf = prefetch && share && p + 1 < P
            ? pw + K * PANEL * weight_bytes(I8) + (m0 - mt) / gr * halves * K * share
            : NULL;
#endif
        switch (M - m0 < gr ? M - m0 : gr) {  /* instances with MC constant */
#define GROUP(c) case c: panel_group(g, pw, scale, y, bias, p * PANEL, N, K, m0, c, pf, share, \
                                     I8); break;
        GROUP(1) GROUP(2) GROUP(3) GROUP(4) GROUP(5) GROUP(6)
#if G > 6
        GROUP(7) GROUP(8)
#endif
#undef GROUP
        }
    }
}

/* x [M, K] group-major for groups of gr rows: group g (rows g gr .. g gr + mc) at xg + g gr K,
 * as [K][mc]; NULL when it cannot be allocated */
static float *group_major(const float *x, int64_t M, int64_t K, int64_t gr) {
    float *xg = malloc(sizeof(float) * M * K);
    if (!xg) return NULL;
    #pragma omp parallel for schedule(static) if (M > 4 * gr)
    for (int64_t m0 = 0; m0 < M; m0 += gr) {
        const int64_t mc = M - m0 < gr ? M - m0 : gr;
        float *dst = xg + m0 * K;
        for (int64_t k = 0; k < K; k++)
            for (int64_t m = 0; m < mc; m++) dst[k * mc + m] = x[(m0 + m) * K + k];
    }
    return xg;
}

/* One thread's share of y = x @ w.T (+ bias) from w's panels (float32, or int8 codes with a
 * scale per column: I8), called inside a parallel region: every thread walks the tiles of rows
 * in step, the panels split among them. I8 must be a literal at the call, inside the region:
 * GCC outlines a parallel region before it inlines, so a region in an inlined function would
 * test I8 at run time in the hot loops (the float kernel ran 1.05-1.09x slower that way). Sets
 * *failed where an int8 thread cannot allocate its widened panel. */
static inline __attribute__((always_inline)) void panel_tiles(
        const float *xg, const void *panels, const float *scale, const float *bias, float *y,
        int64_t M, int64_t N, int64_t K, _Atomic int *failed, const int I8) {
    const int64_t gr = group_rows(M), m_tile = M_TILE_ROWS / gr * gr;
    const int64_t P = (N + PANEL - 1) / PANEL;
#if !defined(__AVX512F__)
    const long l2 = prefetch_l2_bytes();
#endif
    /* this thread's widened int8 panel, where several groups pass over one */
    float *wide = NULL;
    if (I8 && M > gr) {
        wide = malloc(sizeof(float) * K * PANEL);
        if (!wide) atomic_store(failed, 1);
        #pragma omp barrier  /* every thread sees any failure before the loops' barriers */
        if (atomic_load(failed)) {
            free(wide);
            return;
        }
    }
    for (int64_t mt = 0; mt < M; mt += m_tile) {  /* every thread walks the tiles in step */
        const int64_t m_end = mt + m_tile < M ? mt + m_tile : M;
        const int widen = I8 && m_end - mt > gr;
#if defined(__AVX512F__)
        const int64_t share = PANEL * weight_bytes(I8), halves = 1;  /* a panel row a step */
#else
        /* passes over a panel: groups of rows, each one pass (gr 2) or two halves (gr 6) */
        const int64_t halves = gr == 2 ? 1 : 2;
        const int64_t passes = (m_end - mt + gr - 1) / gr * halves;
        const int64_t share = next_panel_share(M, passes, K, l2, weight_bytes(I8));
#endif
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            const char *pw = (const char *)panels + p * K * PANEL * weight_bytes(I8);
            if (widen) {
                widen_panel((const int8_t *)pw, scale + p * PANEL, N - p * PANEL, K, wide);
                panel_rows(xg, (const char *)wide, NULL, y, bias, p, P, N, K, M, mt, m_end, gr,
                           share, halves, 0, 0);
            } else {
                panel_rows(xg, pw, scale, y, bias, p, P, N, K, M, mt, m_end, gr, share, halves,
                           1, I8);
            }
        }
    }
    free(wide);
}

/* y = x @ w.T (+ bias) from w's float32 panels; returns 0, or -1 when the scratch copy of x
 * cannot be allocated */
int panel_linear(const float *x, const float *panels, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K) {
    if (M < 1 || N < 1 || K < 1) return 0;
    float *xg = group_major(x, M, K, group_rows(M));
    if (!xg) return -1;
    #pragma omp parallel
    panel_tiles(xg, panels, NULL, bias, y, M, N, K, NULL, 0);
    free(xg);
    return 0;
}

/* int8 codes [P, K, 32] and scale [N]: y = (x @ code.T) * scale (+ bias); returns 0, or -1
 * when a scratch buffer (x's copy, a thread's widened panel) cannot be allocated */
int panel_linear_int8(const float *x, const int8_t *panels, const float *scale,
                      const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || N < 1 || K < 1) return 0;
    float *xg = group_major(x, M, K, group_rows(M));
    if (!xg) return -1;
    _Atomic int failed = 0;
    #pragma omp parallel
    panel_tiles(xg, panels, scale, bias, y, M, N, K, &failed, 1);
    free(xg);
    return atomic_load(&failed) ? -1 : 0;
}
