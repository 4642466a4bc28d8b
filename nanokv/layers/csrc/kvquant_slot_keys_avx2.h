/* The AVX2 KVQuant key pass with slots in lanes (the AVX-512 slot-lanes pass's design,
 * kvquant_slot_keys_avx512.h, 8 lanes wide): a tile's 8 slots of one KV head are the 8 lanes of
 * every vector, so a slot's score is a lane of one accumulator and no horizontal sum is left
 * (the channel-lanes pass, key_tile_dots, reduces 8 dot vectors per tile: sum8). Per tile:
 *   - the tile's RoPE rows transposed once ([channel, 8 slots], shared by every KV head; the
 *     first halves of rotate-half tables, whose halves repeat);
 *   - the next tile's code rows of every KV head (contiguous in the pool) and its RoPE rows
 *     prefetched, a share per KV head: this pass reads a KV head's 8 rows Hkv * packed bytes
 *     apart and the RoPE rows across positions, orders the hardware prefetchers do not follow
 *     (without: 1.06-1.19x the channel-lanes pass's time where the rows come from memory);
 * per KV head:
 *   - the 8 rows' 32-bit words transposed: word j of every row, one row per lane (the codes
 *     of channels [j * 32 / bits, (j + 1) * 32 / bits));
 *   - channel c of the 8 slots is one look-up in its own 16-entry table of mapped centroids,
 *     lut[i] * half[c] + off[c] (w->ktab, made once a block): slot_lookup8;
 *   - rotate-half with the transposed RoPE rows, the pair (c, c + D/2) at a time, and the
 *     group's query channels broadcast into two accumulators per head.
 * Copying a tile's rows in address order into a buffer first, as int8's tile copy does, gained
 * nothing over the prefetches (0.93-0.98x against 0.95-0.96x). Taken where slot_keys_avx2_fit;
 * the reference is the channel-lanes pass and, under both, the row path. */

/* does the slot-lanes pass take this layer: 2- or 4-bit keys, a row whole groups of 8 32-bit
 * words (head_dim a multiple of 64 at 4 bits, of 128 at 2: transposed 8 at a time), RoPE
 * over the whole head with repeating halves (rotate-half tables: the first halves read, from
 * rope_rows where the layer has it), blocks of whole tiles (a tile's 8 rows lie in its block).
 * Heads of 32 never get here: they keep their fixed instances (heads_of_32_fit, checked first) */
static inline int slot_keys_avx2_fit(const KVQuantLayer *L) {
    const int64_t bits = L->k.bits, D = L->head_dim, R = L->rot_dim;
    if (!nanokv_slot_keys || (bits != 4 && bits != 2)) return 0;
    return (D * bits) % 256 == 0 && R == D && L->rope_halves_equal && L->block_size % 8 == 0;
}

#include "transpose8_avx2.h"  /* transpose8 */

/* the block's per-channel tables of every KV head: ktab[(g * D + c) * 16 + i] = lut[i mod
 * 2^bits] * half[g, c] + off[g, c] (a 2-bit table repeats its 4 entries) */
static void slot_key_tables_avx2(const KVQuantLayer *L, BlockScratch *w) {
    float lut[16];
    for (int i = 0; i < 16; i++) lut[i] = L->k.lut[i & ((1 << L->k.bits) - 1)];
    const __m256 lo = _mm256_loadu_ps(lut), hi = _mm256_loadu_ps(lut + 8);
    const int64_t n = L->num_kv_heads * L->head_dim;
    for (int64_t c = 0; c < n; c++) {
        const __m256 h = _mm256_set1_ps(w->k_half[c]), o = _mm256_set1_ps(w->k_off[c]);
        _mm256_store_ps(w->ktab + c * 16, _mm256_fmadd_ps(lo, h, o));
        _mm256_store_ps(w->ktab + c * 16 + 8, _mm256_fmadd_ps(hi, h, o));
    }
}

/* channel s of a word of 32 / bits codes, in the 8 slots' lanes, from the channel's table t:
 * 4-bit, two permutes of its halves and a blend on the code's high bit; 2-bit, one permute
 * (the permute reads an index's low 3 bits: the next code's low bit picks a repeated entry) */
static inline __attribute__((always_inline)) __m256 slot_lookup8(__m256i word, int s,
                                                                 const float *t, const int bits) {
    const __m256i idx = _mm256_srli_epi32(word, bits * s);
    if (bits == 2) return _mm256_permutevar8x32_ps(_mm256_load_ps(t), idx);
    const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(word, 28 - 4 * s));  /* bit 3 */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(t), idx),
                            _mm256_permutevar8x32_ps(_mm256_load_ps(t + 8), idx), upper);
}

/* the tile's key outlier corrections (w->k_corr, tile_key_outliers) added to its nt scores of
 * the query heads [h0, h0 + nh) of every KV head, and cleared for the next tile */
static inline void slot_scores_corrected(const KVQuantLayer *L, int64_t t0, int64_t nt,
                                         int64_t h0, int64_t nh, BlockScratch *w) {
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, group = L->num_q_heads / Hkv;
    for (int64_t g = 0; g < Hkv; g++)
        for (int64_t hh = 0; hh < nh; hh++) {
            float *corr = w->k_corr + (g * nh + hh) * 8;
            float *sc = w->scores + (g * group + h0 + hh) * B + t0;
            for (int64_t u = 0; u < nt; u++) sc[u] += corr[u];
            memset(corr, 0, sizeof(float) * 8);
        }
}

/* the scores of tile [t0, t0 + 8) (rows past n read, their scores not stored) for the query
 * heads [h0, h0 + nh) of every KV head, into w->scores. Always inlined with a constant nh and
 * code width. */
static inline __attribute__((always_inline)) void key_tile_slots(
        const KVQuantLayer *L, int64_t blk, int64_t t0, int64_t n, const float *qb, int64_t h0,
        const int nh, const int bits, BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const int64_t m = D / 2, group = L->num_q_heads / Hkv, stride = Hkv * K->packed;
    const int per_word = 32 / bits;
    const int64_t words = D / per_word, nt = n - t0 < 8 ? n - t0 : 8;
    float *pcos = w->pcos, *psin = w->psin;  /* [m, 8] */
    /* the tile's rows of every KV head, in address order (8 slots: within the block) */
    const uint8_t *rows = K->codes + (blk * B + t0) * stride;
    /* the tile's RoPE rows, transposed: pcos[c * 8 + u] = cos at slot t0 + u, channel c */
    const float *cs[8], *sn[8];  /* the first halves of the slots' cos and sin rows */
    for (int u = 0; u < 8; u++) {
        const int64_t pos = t0 + u < n ? L->slot_positions[blk * B + t0 + u] : 0;
        rope_rows_at(L, pos < 0 ? 0 : pos, cs + u, sn + u);
    }
    for (int64_t c0 = 0; c0 < m; c0 += 8) {
        __m256 c[8], s[8];
        for (int u = 0; u < 8; u++) {
            c[u] = _mm256_loadu_ps(cs[u] + c0);
            s[u] = _mm256_loadu_ps(sn[u] + c0);
        }
        transpose8(c);
        transpose8(s);
        for (int i = 0; i < 8; i++) {
            _mm256_store_ps(pcos + (c0 + i) * 8, c[i]);
            _mm256_store_ps(psin + (c0 + i) * 8, s[i]);
        }
    }
    /* the next tile's rows and RoPE rows, in address order, a share per KV head: read a
     * tile at a time, they are not streamed in by the hardware as the channel-lanes pass's
     * steady reads are (the block's last tile: block_key_dots prefetches the next block's) */
    const int64_t ahead = t0 + 16 <= n ? 8 : t0 + 8 < n ? n - t0 - 8 : 0;
    const uint8_t *next_rows = K->codes + (blk * B + t0 + 8) * stride;
    const int64_t row_share = (ahead * stride + Hkv - 1) / Hkv;
    __m256i *word = (__m256i *)w->k_words;  /* [words]: word j of the 8 rows */
    for (int64_t g = 0; g < Hkv; g++) {
        if (ahead) {
            prefetch_rows(next_rows + g * row_share, row_share);
            for (int64_t u = g; u < ahead; u += Hkv) {
                const int64_t pos = L->slot_positions[blk * B + t0 + 8 + u];
                const float *c, *s;
                rope_rows_at(L, pos < 0 ? 0 : pos, &c, &s);
                prefetch_rows((const uint8_t *)c, m * (int64_t)sizeof(float));
                prefetch_rows((const uint8_t *)s, m * (int64_t)sizeof(float));
            }
        }
        for (int64_t j0 = 0; j0 < words; j0 += 8) {
            __m256 r[8];
            for (int u = 0; u < 8; u++)
                r[u] = _mm256_loadu_ps((const float *)(rows + u * stride + g * K->packed
                                                       + 4 * j0));
            transpose8(r);
            for (int i = 0; i < 8; i++)
                _mm256_store_si256(word + j0 + i, _mm256_castps_si256(r[i]));
        }
        const float *tab = w->ktab + g * D * 16;
        const float *q0 = qb + (g * group + h0) * D;
        __m256 acc[FAST_MAX_HEADS][2];
        for (int hh = 0; hh < nh; hh++) acc[hh][0] = acc[hh][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < words / 2; j++) {
            const __m256i xa = _mm256_load_si256(word + j);
            const __m256i xb = _mm256_load_si256(word + j + words / 2);
#pragma GCC unroll 16
            for (int s = 0; s < per_word; s++) {
                const int64_t c = j * per_word + s;  /* the pair (c, c + m) */
                const __m256 a = slot_lookup8(xa, s, tab + c * 16, bits);
                const __m256 b = slot_lookup8(xb, s, tab + (c + m) * 16, bits);
                const __m256 cv = _mm256_load_ps(pcos + c * 8), sv = _mm256_load_ps(psin + c * 8);
                /* rotate-half: (a, b) -> (a cos - b sin, b cos + a sin) */
                const __m256 ra = _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv));
                const __m256 rb = _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv));
                for (int hh = 0; hh < nh; hh++) {
                    acc[hh][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + hh * D + c), ra,
                                                 acc[hh][0]);
                    acc[hh][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + hh * D + c + m), rb,
                                                 acc[hh][1]);
                }
            }
        }
        for (int hh = 0; hh < nh; hh++) {
            const __m256 sums = _mm256_add_ps(acc[hh][0], acc[hh][1]);
            tile_scores_store(w->scores + (g * group + h0 + hh) * B + t0, sums, nt);
        }
    }
}
