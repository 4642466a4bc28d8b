/* The decoder layer's element-wise work, fused: each reads its input once and writes its output
 * once, where PyTorch's composition makes 3-6 passes over the same activations.
 *
 *   rms_norm        out = x * rsqrt(mean(x^2) + eps) * w                      rows of [T, dim]
 *   add_rms_norm    res = x + res (in place); out = rms_norm(res)             the residual add
 *   head_norm_rope  per head of a strided [T, heads, D] view (q or k inside the qkv projection's
 *                   output): optional per-head RMSNorm (Qwen3's q_norm / k_norm), then the
 *                   rotate-half RoPE of the first rot_dim channels from cos / sin tables indexed
 *                   by position; the normed, unrotated head is written too when asked (a store
 *                   that keeps keys before RoPE)
 *   silu_mul        out = silu(gate) * up, gate_up = [T, 2 * inter] (gate first)
 *
 * float32 only, row-major, every row's last dimension contiguous. The reductions run in float32
 * in the compiler's vector lanes, so results differ from PyTorch's in the last bits only; the
 * references are the PyTorch modules (`RMSNorm.reference`, `apply_rotary`, `F.silu`), checked in
 * tests/unit/test_fused_elementwise.py. Rows are split over OpenMP threads when there are
 * enough of them (a prefill chunk); a decode step's few rows run on the calling thread. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* at least this many elements before the rows are spread over threads */
#define PARALLEL_MIN 32768

static inline float row_inv_rms(const float *x, int64_t dim, float eps) {
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

static inline void norm_row(const float *x, const float *w, float *out, int64_t dim, float eps) {
    const float r = row_inv_rms(x, dim, eps);
    #pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = (x[i] * r) * w[i];  /* HF's order: (x * r) * w */
}

int rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows,
             int64_t dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < rows; t++) norm_row(x + t * x_stride, w, out + t * dim, dim, eps);
    return 0;
}

int add_rms_norm(const float *x, float *res, const float *w, float *out, int64_t rows,
                 int64_t dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * dim;
        float *rr = res + t * dim;
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) rr[i] = xr[i] + rr[i];
        norm_row(rr, w, out + t * dim, dim, eps);
    }
    return 0;
}

/* src [T, heads, D] at row stride src_stride (heads contiguous within a row); norm_w [D] or
 * NULL; cos / sin [max_positions, rot_dim]; out_rot [T, heads, D] contiguous; out_pre the same
 * or NULL. Rotate-half: for i < h = rot_dim / 2, o[i] = x[i] c[i] - x[i + h] s[i] and
 * o[i + h] = x[i + h] c[i + h] + x[i] s[i + h]; channels >= rot_dim pass through. */
int head_norm_rope(const float *src, int64_t src_stride, int64_t rows, int64_t heads,
                   int64_t dim, const float *norm_w, float eps, const float *cos_table,
                   const float *sin_table, const int64_t *positions, int64_t rot_dim,
                   float *out_rot, float *out_pre) {
    if (rot_dim > dim || rot_dim % 2 || dim > 1024) return 1;
    const int64_t half = rot_dim / 2;
    #pragma omp parallel for schedule(static) if (rows * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_table + positions[t] * rot_dim;
        const float *s = sin_table + positions[t] * rot_dim;
        float normed[1024];
        for (int64_t h = 0; h < heads; h++) {
            const float *x = src + t * src_stride + h * dim;
            float *o = out_rot + (t * heads + h) * dim;
            if (norm_w != NULL) {
                norm_row(x, norm_w, normed, dim, eps);
                x = normed;
            }
            if (out_pre != NULL) memcpy(out_pre + (t * heads + h) * dim, x, dim * sizeof(float));
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o[i] = x[i] * c[i] - x[i + half] * s[i];
                o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
            }
            for (int64_t i = rot_dim; i < dim; i++) o[i] = x[i];
        }
    }
    return 0;
}

/* exp(x) in float32 for the vectoriser: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
 * for e^r (Cephes' expf coefficients, about 1 ulp) times 2^n built in the exponent bits. x is
 * clamped to [-87, 88], where the result stays a normal float. */
static inline float vexpf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest by the 1.5 * 2^23 trick (vectorises where rintf may not) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return y * scale.f;
}

int silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    #pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * inter;
        const float *u = g + inter;
        float *o = out + t * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + vexpf(-g[i])) * u[i];
    }
    return 0;
}
