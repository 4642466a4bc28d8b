/* int8 KV quantize-on-write: each token-head row of x is scaled by its max |x| / 127, rounded
 * and stored at its cache slot, with its scale (vLLM's symmetric int8 per token and head).
 *
 *   x [T, H, D] float32; slots [T] int64 (flat cache slots); codes [S, H, D] uint8 (int8 bits);
 *   scales [S, H] float32
 *
 * The same float operations as the PyTorch path (`nanokv.quant.int8.quantize_int8`, then
 * index_copy_ into the store): scale = amax / 127, code = round-half-even(x / max(scale,
 * FLT_MIN)) clamped to [-127, 127], so the bytes are identical
 * (tests/unit/test_int8_write.py). One pass over x instead of about eight PyTorch ops and two
 * scatters per layer and step. Rows split across threads when there are many (a prefill chunk). */
#include <float.h>
#include <math.h>
#include <stdint.h>

/* returns 0, or -1 when a slot lies outside [0, S) (nothing written then) */
int int8_quantize_write(const float *x, const int64_t *slots, int64_t T, int64_t H, int64_t D,
                        int64_t S, uint8_t *codes, float *scales) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= S) return -1;
    #pragma omp parallel for schedule(static) if (T * H * D >= (1 << 16))
    for (int64_t r = 0; r < T * H; r++) {
        const int64_t t = r / H, h = r % H;
        const float *row = x + r * D;
        float amax = 0.f;
        for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(row[d]));
        const float scale = amax / 127.f;
        const float divisor = scale > FLT_MIN ? scale : FLT_MIN;
        int8_t *dst = (int8_t *)codes + (slots[t] * H + h) * D;
        for (int64_t d = 0; d < D; d++) {
            float q = nearbyintf(row[d] / divisor);
            q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
            dst[d] = (int8_t)q;
        }
        scales[slots[t] * H + h] = scale;
    }
    return 0;
}
