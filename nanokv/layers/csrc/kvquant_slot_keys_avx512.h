/* The KVQuant key pass with slots in lanes (AVX-512): a tile's 16 slots of one KV head are the
 * 16 lanes of every vector, so a slot's score is a lane of one accumulator and no horizontal
 * sum is left at the end (the planar pass, kvquant_block_avx512.h, holds channels in lanes and
 * reduces 16 dot vectors per slot tile: sum16). Per tile and KV head:
 *   - the codes of the 16 rows, transposed: vector j holds 32-bit word j of every row, i.e. the
 *     32 / bits codes of channels [j * 32 / bits, (j + 1) * 32 / bits), one row per lane: a
 *     16 x 16 transpose where a KV head's row is 16 words (head_dim 128 at 4 bits) or a slot's
 *     row of every KV head is (the shipped model's 4 heads of 32), else gathers;
 *   - channel c of all 16 slots is one table permute: the block's mapped centroids of that
 *     channel, lut[i] * half[c] + off[c] (16 floats, made once a block: w->ktab), read by the
 *     permute from memory at the word's code shifted into the low bits (the permute reads an
 *     index's low 4 bits only; a 2-bit table repeats its 4 entries);
 *   - rotate-half with the tile's RoPE rows transposed once per tile (w->pcos / psin: [channel,
 *     16 slots], shared by every KV head), the pair (c, c + D/2) at a time; where the layer has
 *     its tables by transposed tiles (L->rope_tiles: halves that repeat) and the tile's positions
 *     are 16 consecutive ones from a multiple of 16, that tile is read in place instead
 *     (slot_rope_in_place);
 *   - the group's query channels broadcast from memory into nh accumulators (two per head:
 *     the pair's two halves, so that the FMA chains are not one long dependency).
 * The reference is the planar pass and, under both, the row path (`kvquant_row_block`). */

/* does the slot-lanes key pass take this layer: 2 or 4-bit codes, rows of whole 32-bit words,
 * RoPE over the whole head (its pairs a whole number of words apart) or none */
static inline int slot_keys_fit(const KVQuantLayer *L) {
    const int64_t bits = L->k.bits, D = L->head_dim, R = L->rot_dim;
    if (bits != 2 && bits != 4) return 0;
    const int64_t per_word = 32 / bits;
    if (D % per_word != 0) return 0;
    return R == 0 || (R == D && (D / 2) % per_word == 0);
}

/* rows r[0..15] of 16 floats -> columns: r[i] lane u = the input r[u] lane i */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]),
                                                   _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]),
                                                       _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]),
                                                       _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]),
                                                       _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
            t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
    }
}

/* the block's per-channel tables of every KV head: ktab[(g * D + c) * 16 + i] = lut[i mod
 * 2^bits] * half[g, c] + off[g, c] */
static void slot_key_tables(const KVQuantLayer *L, BlockScratch *w) {
    const __m512 lut = lut16_repeated(L->k.lut, L->k.bits);
    const int64_t n = L->num_kv_heads * L->head_dim;
    for (int64_t c = 0; c < n; c++)
        _mm512_storeu_ps(w->ktab + c * 16, _mm512_fmadd_ps(lut, _mm512_set1_ps(w->k_half[c]),
                                                           _mm512_set1_ps(w->k_off[c])));
}

/* the tile's RoPE rows transposed: dst[c * 16 + u] = table[pos(u) * R + c], c < len, for the
 * tile's 16 slots (rows past nt: position 0); len is D / 2 or D, a multiple of 16 on the block
 * path (head_dim % 32 == 0) */
static inline void slot_rope_tile(float *restrict dst, const float *restrict table,
                                  const int64_t *pos, int64_t R, int64_t len) {
    for (int64_t c0 = 0; c0 < len; c0 += 16) {
        __m512 r[16];
        for (int u = 0; u < 16; u++) r[u] = _mm512_loadu_ps(table + pos[u] * R + c0);
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + (c0 + i) * 16, r[i]);
    }
}

/* the RoPE tile of 16 slots from t0 read in place from L->rope_tiles, or NULL: where the layer
 * has them (and they are switched on), the block's positions are consecutive (w->first_position)
 * and the tile's first is a multiple of 16 (a block of a multiple of 16 slots from position 0 on,
 * as a request's blocks are, has every tile so) */
static inline const float *slot_rope_in_place(const KVQuantLayer *L, const BlockScratch *w,
                                              int64_t t0) {
    if (!rope_tiles_on(L) || w->first_position < 0) return NULL;
    const int64_t p0 = w->first_position + t0;
    return p0 % 16 ? NULL : L->rope_tiles + p0 / 16 * L->rot_dim * 16;
}

/* the tile's 16 rows of 16 words (row u at rows + u * stride bytes) transposed: out[j] holds
 * word j of every row, one row per lane */
static inline __attribute__((always_inline)) void slot_rows16(const uint8_t *rows,
                                                              int64_t stride, __m512i out[16]) {
    __m512 r[16];
    for (int u = 0; u < 16; u++) r[u] = _mm512_loadu_ps(rows + u * stride);
    transpose16(r);
    for (int j = 0; j < 16; j++) out[j] = _mm512_castps_si512(r[j]);
}

/* word j of the tile's 16 rows (row u at rows + u * stride bytes), one row per lane */
static inline __m512i slot_words(const uint8_t *rows, int64_t stride, int64_t j) {
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
    return _mm512_i32gather_epi32(at, (const void *)(rows + 4 * j), 1);
}

/* the key dots of query heads [h0, h0 + nh) of every KV head, slots in lanes (slot_keys_fit):
 * scores into w->scores. Always inlined with a constant nh and code width. */
static inline __attribute__((always_inline)) void block_key_dots_slots(
        const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n, const float *qb,
        int64_t h0, const int nh, const int bits, BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t group = L->num_q_heads / Hkv, stride = Hkv * K->packed;
    const int per_word = 32 / bits;
    const int64_t words = D / per_word, m = D / 2;
    const int64_t hi = L->rope_halves_equal ? 0 : m;  /* where a partner's cos / sin lie */
    const int64_t rope_len = hi ? R : m;                /* the RoPE rows' floats that are read */
    /* a slot's row of one KV head (or of all: `whole`) is one vector: transpose16 per tile */
    const int transposed = words == 16, whole = !transposed && stride == 64;
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t nt = n - t0 < 16 ? n - t0 : 16;
        const __mmask16 live = nt == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nt) - 1u);
        if (next_blk >= 0 && h0 == 0) prefetch_block_data(L, next_blk, t0 / 16, (n + 15) / 16);
        /* the tile's RoPE rows [channel, 16 slots]: cos at pc, sin at ps */
        const float *pc = R ? slot_rope_in_place(L, w, t0) : NULL;
        const float *ps = pc ? pc + m * 16 : NULL;
        if (R && !pc) {
            int64_t pos[16];
            for (int64_t u = 0; u < 16; u++) {
                const int64_t p = u < nt ? L->slot_positions[blk * B + t0 + u] : 0;
                pos[u] = p < 0 ? 0 : p;
            }
            slot_rope_tile(w->pcos, L->cos, pos, R, rope_len);
            slot_rope_tile(w->psin, L->sin, pos, R, rope_len);
            pc = w->pcos, ps = w->psin;
        }
        __m512i all[16];  /* whole: word w of every KV head's rows of the tile's slots */
        if (whole) slot_rows16(K->codes + (blk * B + t0) * stride, stride, all);
        const int64_t share = (16 + Hkv - 1) / Hkv;
        for (int64_t g = 0; g < Hkv; g++) {
            tile_prefetch(L, blk, next_blk, n, t0, g, share, h0 == 0);
            const uint8_t *rows = K->codes + ((blk * B + t0) * Hkv + g) * K->packed;
            const float *tab = w->ktab + g * D * 16;
            const float *q0 = qb + (g * group + h0) * D;
            /* the tile's words of this KV head, transposed in registers (else gathered) */
            __m512i word[16];
            if (transposed) slot_rows16(rows, stride, word);
            const __m512i *held = transposed ? word : whole ? all + g * words : NULL;
            __m512 acc[FAST_MAX_HEADS][2];
            for (int hh = 0; hh < nh; hh++) acc[hh][0] = acc[hh][1] = _mm512_setzero_ps();
            if (!R) {
                for (int64_t j = 0; j < words; j++) {
                    const __m512i x = held ? held[j] : slot_words(rows, stride, j);
#pragma GCC unroll 16
                    for (int i = 0; i < per_word; i++) {
                        const int64_t c = j * per_word + i;
                        const __m512 k = _mm512_permutexvar_ps(
                            _mm512_srli_epi32(x, (unsigned)(i * bits)),
                            _mm512_loadu_ps(tab + c * 16));
                        for (int hh = 0; hh < nh; hh++)
                            acc[hh][i & 1] = _mm512_fmadd_ps(
                                _mm512_set1_ps(q0[hh * D + c]), k, acc[hh][i & 1]);
                    }
                }
            }
            for (int64_t j = 0; R && j < words / 2; j++) {
                const __m512i xa = held ? held[j] : slot_words(rows, stride, j);
                const __m512i xb = held ? held[j + words / 2]
                                        : slot_words(rows, stride, j + words / 2);
#pragma GCC unroll 16
                for (int i = 0; i < per_word; i++) {
                    const int64_t c = j * per_word + i;  /* the pair (c, c + m) */
                    const __m512 a = _mm512_permutexvar_ps(
                        _mm512_srli_epi32(xa, (unsigned)(i * bits)), _mm512_loadu_ps(tab + c * 16));
                    const __m512 b = _mm512_permutexvar_ps(
                        _mm512_srli_epi32(xb, (unsigned)(i * bits)),
                        _mm512_loadu_ps(tab + (c + m) * 16));
                    /* rotate-half: (a, b) -> (a cos - b sin, b cos' + a sin') */
                    const __m512 ra = _mm512_fnmadd_ps(
                        b, _mm512_loadu_ps(ps + c * 16),
                        _mm512_mul_ps(a, _mm512_loadu_ps(pc + c * 16)));
                    const __m512 rb = _mm512_fmadd_ps(
                        a, _mm512_loadu_ps(ps + (c + hi) * 16),
                        _mm512_mul_ps(b, _mm512_loadu_ps(pc + (c + hi) * 16)));
                    for (int hh = 0; hh < nh; hh++) {
                        acc[hh][0] = _mm512_fmadd_ps(_mm512_set1_ps(q0[hh * D + c]), ra,
                                                     acc[hh][0]);
                        acc[hh][1] = _mm512_fmadd_ps(_mm512_set1_ps(q0[hh * D + c + m]), rb,
                                                     acc[hh][1]);
                    }
                }
            }
            for (int hh = 0; hh < nh; hh++)
                _mm512_mask_storeu_ps(w->scores + (g * group + h0 + hh) * B + t0, live,
                                      _mm512_add_ps(acc[hh][0], acc[hh][1]));
        }
    }
}
