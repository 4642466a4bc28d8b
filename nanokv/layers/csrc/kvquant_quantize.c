/* KVQuant's per-token quantize-on-write (values, and keys without per-channel statistics): each
 * of a step's T tokens and each KV head is one group of D channels, quantized straight into the
 * store's buffers at the token's flat slot. The reference is `quantize_blocks` with groups of
 * one slot (nanokv/quant/kvquant.py) followed by the store's `_put`; per token-head:
 *
 *   outliers  the `side` = cap / 2 largest and `side` smallest channels (per-token z-scores
 *             rank channels as their values do), largest first / smallest first; an entry
 *             picked from both ends is listed once (the bottom one marked unused); none for a
 *             sink token (valid 0). Unused entries: index -1 (255 in a uint8 index), value 0.
 *   offset, half   (max + min) / 2 and (max - min) / 2 over the other channels, clamped to
 *             +-65504 and rounded to fp16 (0 when every channel is an outlier)
 *   codes     xn = clamp((x - offset) / max(half, FLT_MIN), -1, 1), then the nearest of the
 *             2^bits centroids: bucketize on the midpoints (the count of midpoints < xn), or
 *             round-half-even of (xn + 1) * (2^bits - 1) / 2 on the uniform grid; packed as
 *             `nanokv.quant.packing.pack` (low bits first; 3-bit codes in 24-bit groups)
 *
 * Buffers, flat over the pool's slots (block * B + slot): codes [slots, H, P] uint8; offset,
 * half [slots, H] fp16; oidx [slots, H, cap] (idx_bytes 1 or 2); oval [slots, H, cap] (sparse
 * kind 0 fp16, 1 bf16, 2 fp32). x [T, H, D] float32. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
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
        const float scaled = bits_float(a) * 16777216.0f;
        return sign | (uint16_t)nearbyintf(scaled);
    }
    /* normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even */
    uint32_t h = ((a >> 13) - ((127 - 15) << 10));
    const uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return bits_float(sign) + (sign ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-8f;
    if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
    return bits_float(sign | ((e + 112) << 23) | (m << 13));
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
    else ((int16_t *)oidx)[i] = (int16_t)v;
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

/* the n-th extreme channel of x not yet taken: largest (dir > 0) or smallest; ties go to the
 * lower channel */
static int64_t next_extreme(const float *x, const uint8_t *taken, int64_t D, int dir) {
    int64_t best = -1;
    for (int64_t i = 0; i < D; i++) {
        if (taken[i]) continue;
        if (best < 0 || (dir > 0 ? x[i] > x[best] : x[i] < x[best])) best = i;
    }
    return best;
}

#define MAX_D 1024
#define MAX_CAP 256

int kvquant_quantize_tokens(const float *x, const uint8_t *valid, const int64_t *slots,
                            int64_t T, int64_t H, int64_t D, int64_t bits,
                            const float *codebook, int64_t cap, uint8_t *codes,
                            uint16_t *offset, uint16_t *half, void *oidx, int64_t idx_bytes,
                            void *oval, int64_t sparse_kind) {
    if (D > MAX_D || cap > MAX_CAP || cap % 2 || (bits != 2 && bits != 3 && bits != 4 && bits != 8)
        || (idx_bytes != 1 && idx_bytes != 2))
        return 1;
    const int64_t levels = ((int64_t)1 << bits) - 1;
    const int64_t packed = bits == 3 ? (D + 7) / 8 * 3 : (D * bits + 7) / 8;
    const int64_t side = cap / 2;
    float mids[255];
    if (codebook != NULL)
        for (int64_t j = 0; j < levels; j++) mids[j] = (codebook[j + 1] + codebook[j]) / 2.0f;
    #pragma omp parallel for schedule(static) if (T * H * D >= 65536)
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
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t i = 0; i < D; i++) {
            if (taken[i]) continue;
            lo = row[i] < lo ? row[i] : lo;
            hi = row[i] > hi ? row[i] : hi;
        }
        if (isinf(lo)) lo = hi = 0.0f; /* every channel an outlier */
        uint16_t off_bits, half_bits;
        const float off = fp16_clamped((hi + lo) / 2.0f, &off_bits);
        const float hr = fp16_clamped((hi - lo) / 2.0f, &half_bits);
        const float denom = hr > FLT_MIN ? hr : FLT_MIN;
        for (int64_t i = 0; i < D; i++) {
            float xn = (row[i] - off) / denom;
            xn = xn < -1.0f ? -1.0f : (xn > 1.0f ? 1.0f : xn);
            if (codebook == NULL) {
                float r = nearbyintf((xn + 1.0f) * ((float)levels / 2.0f));
                r = r < 0.0f ? 0.0f : (r > (float)levels ? (float)levels : r);
                c[i] = (uint8_t)r;
            } else {
                int64_t n = 0;
                while (n < levels && mids[n] < xn) n++;
                c[i] = (uint8_t)n;
            }
        }
        pack_codes(c, D, bits, codes + g * packed);
        offset[g] = off_bits;
        half[g] = half_bits;
        /* entries: the top side (largest first), then the bottom side (smallest first) */
        for (int64_t j = 0; j < side; j++) {
            const int64_t i = j < n_top ? top[j] : -1;
            store_index(oidx, g * cap + j, i, idx_bytes);
            store_sparse(oval, g * cap + j, i >= 0 ? row[i] : 0.0f, sparse_kind);
            const int64_t b = j < n_bottom ? bottom[j] : -1;
            store_index(oidx, g * cap + side + j, b, idx_bytes);
            store_sparse(oval, g * cap + side + j, b >= 0 ? row[b] : 0.0f, sparse_kind);
        }
    }
    return 0;
}
