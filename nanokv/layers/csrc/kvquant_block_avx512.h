/* The AVX-512 kernels of the KVQuant block path (kvquant_block.h): key dots by tiles of 16
 * slots (16 channels and their RoPE partners at a time), key outliers 16 entries at a time with
 * gathers where the layout allows, the block's online softmax, and values 32 channels at a time.
 * Included by quant_decode_attention.c after kvquant_block.h, on AVX-512F/BW/VL builds. */

/* are the layer's RoPE tables read by tiles (L->rope_tiles, switched on; halves that repeat) */
static inline int rope_tiles_on(const KVQuantLayer *L) {
    return L->rope_tiles && nanokv_rope_tiles && L->rope_halves_equal;
}

/* The prefetches of the key pass at tile t0 for KV head g: the next tile's key and value rows
 * of all heads and their RoPE rows (`rope`: once per tile), a share of its slots per KV head
 * (no burst), the next block's first rows past the block's end */
static inline void tile_prefetch(const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n,
                                 int64_t t0, int64_t g, int64_t share, int rope) {
    const KVQuantSide *K = &L->k, *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, R = L->rot_dim;
    const int64_t stride = Hkv * K->packed;
    const int64_t bytes = (L->rope_halves_equal ? R / 2 : R) * (int64_t)sizeof(float);
    for (int64_t t = t0 + 16 + g * share; t < t0 + 16 + (g + 1) * share && t < t0 + 32; t++) {
        const int64_t ahead = t < n ? blk * B + t : (next_blk >= 0 && t - n < B
                                                    ? next_blk * B + t - n : -1);
        if (ahead < 0) break;
        prefetch_rows(K->codes + ahead * stride, stride);
        prefetch_rows(V->codes + ahead * Hkv * V->packed, Hkv * V->packed);
        if (R && rope) {  /* the part of the RoPE rows that is read */
            int64_t pos = L->slot_positions[ahead];
            pos = pos < 0 ? 0 : pos;
            if (rope_tiles_on(L)) {  /* the slot's share of its tile: R floats */
                prefetch_rows((const uint8_t *)(L->rope_tiles + pos / 16 * R * 16 + pos % 16 * R),
                              R * (int64_t)sizeof(float));
            } else {
                prefetch_rows((const uint8_t *)(L->cos + pos * R), bytes);
                prefetch_rows((const uint8_t *)(L->sin + pos * R), bytes);
            }
        }
    }
}

/* a tile's per-slot dot vectors ([Hkv * nh, 16] of __m512) reduced into the scores of its nt
 * slots, query heads g * group + h0 + hh */
static inline void tile_scores(const KVQuantLayer *L, int64_t t0, int64_t nt, int64_t h0,
                               int nh, const __m512 *dots, BlockScratch *w) {
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, group = L->num_q_heads / Hkv;
    const __mmask16 live = nt == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nt) - 1u);
    for (int64_t g = 0; g < Hkv; g++)  /* (a masked store: no bounce through a buffer) */
        for (int hh = 0; hh < nh; hh++)
            _mm512_mask_storeu_ps(w->scores + (g * group + h0 + hh) * B + t0, live,
                                  sum16(dots + (g * nh + hh) * 16));
}

/* Planar order, for 2- and 4-bit codes: a row's 16 bytes widened to one per 32-bit lane hold
 * C = 16 k channels, k = 8 / bits codes a byte. The codes of a byte's s-th place are a shift
 * away (s * bits), and the table permute reads an index's low 4 bits only (the table repeats
 * a 2-bit codebook: lut16_repeated), so no mask: vector s of a chunk [c0, c0 + C) holds channel
 * c0 + k * l + s in lane l. One widening, k - 1 shifts and k permutes for C channels, where
 * codes16 takes 7 instructions for 16. A pass that looks codes up this way holds its
 * per-channel operands (queries, key statistics, RoPE rows, value accumulators) in the same
 * order, a chunk's natural floats permuted once (planar_in / planar_out). */
static inline int planar_k(int64_t bits) { return bits == 4 ? 2 : (bits == 2 ? 4 : 0); }

/* entry i of a 16-entry table: lut[i mod 2^bits] */
static inline __m512 lut16_repeated(const float *lut, int64_t bits) {
    float t16[16];
    for (int i = 0; i < 16; i++) t16[i] = lut[i & ((1 << bits) - 1)];
    return _mm512_loadu_ps(t16);
}

/* the k vectors of channels [c0, c0 + 16 k) of a packed row (c0 % (16 k) == 0), planar */
static inline __attribute__((always_inline)) void planar_lookup(
        const uint8_t *row, int64_t c0, const int k, __m512 lut, __m512 *out) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c0 / k)));
    const int bits = 8 / k;
    out[0] = _mm512_permutexvar_ps(x, lut);
    for (int s = 1; s < k; s++)
        out[s] = _mm512_permutexvar_ps(_mm512_srli_epi32(x, (unsigned)(s * bits)), lut);
}

/* two-source permutes: the evens / odds of 32 floats, and the interleave of two vectors' lower
 * / upper halves */
static const int32_t planar_idx[4][16] = {
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31},
    {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23},
    {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31},
};

/* 16 k natural floats -> k planar vectors (k = 2: evens and odds; k = 4: those twice) */
static inline __attribute__((always_inline)) void planar_in(const float *src, const int k,
                                                            __m512 *v) {
    const __m512i even = _mm512_loadu_si512(planar_idx[0]), odd = _mm512_loadu_si512(planar_idx[1]);
    const __m512 x0 = _mm512_loadu_ps(src), x1 = _mm512_loadu_ps(src + 16);
    const __m512 e01 = _mm512_permutex2var_ps(x0, even, x1);
    const __m512 o01 = _mm512_permutex2var_ps(x0, odd, x1);
    if (k == 2) {
        v[0] = e01;
        v[1] = o01;
        return;
    }
    const __m512 x2 = _mm512_loadu_ps(src + 32), x3 = _mm512_loadu_ps(src + 48);
    const __m512 e23 = _mm512_permutex2var_ps(x2, even, x3);
    const __m512 o23 = _mm512_permutex2var_ps(x2, odd, x3);
    v[0] = _mm512_permutex2var_ps(e01, even, e23);  /* channels 4l */
    v[1] = _mm512_permutex2var_ps(o01, even, o23);  /* 4l + 1 */
    v[2] = _mm512_permutex2var_ps(e01, odd, e23);   /* 4l + 2 */
    v[3] = _mm512_permutex2var_ps(o01, odd, o23);   /* 4l + 3 */
}

/* the inverse: k planar vectors -> 16 k natural floats */
static inline __attribute__((always_inline)) void planar_out(float *dst, const int k,
                                                             const __m512 *v) {
    const __m512i lo = _mm512_loadu_si512(planar_idx[2]), hi = _mm512_loadu_si512(planar_idx[3]);
    __m512 e01 = v[0], o01 = v[1], e23, o23;
    if (k == 4) {
        e01 = _mm512_permutex2var_ps(v[0], lo, v[2]);
        e23 = _mm512_permutex2var_ps(v[0], hi, v[2]);
        o01 = _mm512_permutex2var_ps(v[1], lo, v[3]);
        o23 = _mm512_permutex2var_ps(v[1], hi, v[3]);
        _mm512_storeu_ps(dst + 32, _mm512_permutex2var_ps(e23, lo, o23));
        _mm512_storeu_ps(dst + 48, _mm512_permutex2var_ps(e23, hi, o23));
    }
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(e01, lo, o01));
    _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(e01, hi, o01));
}

/* n natural floats (n % (16 k) == 0) -> planar order, in place of dst, each planar vector
 * times `scale` lane by lane when `scaled` (in registers: a vector stored and at once loaded
 * back to be scaled stalls, since its two 256-bit halves cannot forward to one 512-bit load) */
static inline __attribute__((always_inline)) void planar_copy_impl(
        float *restrict dst, const float *restrict src, int64_t n, const int k, const int scaled,
        const __m512 scale) {
    for (int64_t c = 0; c < n; c += 16 * k) {
        __m512 v[4];
        planar_in(src + c, k, v);
        for (int s = 0; s < k; s++)
            _mm512_storeu_ps(dst + c + 16 * s, scaled ? _mm512_mul_ps(v[s], scale) : v[s]);
    }
}

static inline __attribute__((always_inline)) void planar_copy(
        float *restrict dst, const float *restrict src, int64_t n, const int k) {
    planar_copy_impl(dst, src, n, k, 0, _mm512_setzero_ps());
}

/* does the planar key pass take this layer: chunks of C channels pair with their RoPE partners
 * D / 2 away (D / 2 a multiple of C), or a head is one chunk (D = C, "swap": a channel's
 * partner lies in its own vector, 8 lanes away) */
static inline int planar_keys_fit(const KVQuantLayer *L) {
    const int k = planar_k(L->k.bits);
    return k && ((L->head_dim / 2) % (16 * k) == 0 || L->head_dim == 16 * k);
}

/* ... and the planar value pass (D a multiple of C, k vectors of nh heads in registers) */
static inline int planar_values_fit(const KVQuantLayer *L, int nh) {
    const int k = planar_k(L->v.bits);
    return k && L->head_dim % (16 * k) == 0 && k * nh <= 16;
}

/* the chunks of C = 16 k channels one planar value pass holds: the whole head where it is 2
 * or 4 chunks and their accumulators of nh = 1, 2 or 4 heads fit in 16 registers (so a slot's
 * row is read once and its P broadcast once per head), else one */
static inline int value_chunks(const KVQuantLayer *L, int k, int nh) {
    const int64_t chunks = L->head_dim / (16 * k);
    return (chunks == 2 || chunks == 4) && (nh == 1 || nh == 2 || nh == 4)
           && chunks * k * nh <= 16 ? (int)chunks : 1;
}

/* block_key_dots in planar order (planar_keys_fit): the queries (w->pq), the block's key
 * statistics (w->pk_half, w->pk_off) and the tile's RoPE rows (w->pcos, w->psin, made here:
 * [16, D / 2 or D]) permuted; per slot, a chunk's codes widened once */
static inline __attribute__((always_inline)) void block_key_dots_planar(
        const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n, int64_t h0,
        const int nh, const int k, const int swap, BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t m = D / 2, group = L->num_q_heads / Hkv;
    const int C = 16 * k;
    const int64_t stride = Hkv * K->packed;
    const int64_t hi = L->rope_halves_equal ? 0 : m;  /* where a partner's cos / sin lie */
    /* a RoPE row's floats that are read: swap reads whole rows, the sines signed (-1 in the
     * first half: lanes 0-7 of every planar vector) */
    const int64_t rope_len = swap || hi ? D : m;
    const __m512 sign = _mm512_setr_ps(-1.f, -1.f, -1.f, -1.f, -1.f, -1.f, -1.f, -1.f, 1.f, 1.f,
                                       1.f, 1.f, 1.f, 1.f, 1.f, 1.f);
    enum { SL_MAX = 8 };
    const int SL = nh <= 2 ? 8 : (nh <= 4 ? 4 : 2);
    const __m512 lut = lut16_repeated(K->lut, K->bits);
    __m512 *dots = (__m512 *)w->dots;  /* [Hkv * nh, 16] */
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t nt = n - t0 < 16 ? n - t0 : 16;
        if (next_blk >= 0 && h0 == 0) prefetch_block_data(L, next_blk, t0 / 16, (n + 15) / 16);
        /* the tile's RoPE rows, planar (rows past n: position 0); made again for each run of
         * FAST_MAX_HEADS query heads when a GQA group has more (the scratch holds one tile) */
        if (R)
            for (int64_t u = 0; u < 16; u++) {
                int64_t pos = u < nt ? L->slot_positions[blk * B + t0 + u] : 0;
                pos = pos < 0 ? 0 : pos;
                planar_copy(w->pcos + u * D, L->cos + pos * R, rope_len, k);
                planar_copy_impl(w->psin + u * D, L->sin + pos * R, rope_len, k, swap, sign);
            }
        const int64_t share = (16 + Hkv - 1) / Hkv;
        for (int64_t g = 0; g < Hkv; g++) {
            tile_prefetch(L, blk, next_blk, n, t0, g, share, h0 == 0);
            const float *half = w->pk_half + g * D, *off = w->pk_off + g * D;
            const float *q0 = w->pq + (g * group + h0) * D;
            const uint8_t *rows = K->codes + ((blk * B + t0) * Hkv + g) * K->packed;
            for (int s0 = 0; s0 < 16; s0 += SL) {
                __m512 acc[SL_MAX][FAST_MAX_HEADS];
                for (int u = 0; u < SL; u++)
                    for (int hh = 0; hh < nh; hh++) acc[u][hh] = _mm512_setzero_ps();
                if (swap) {  /* one chunk: the whole head, partners 8 lanes away */
#pragma GCC unroll 8
                    for (int u = 0; u < SL; u++) {
                        __m512 cx[4];
                        planar_lookup(rows + (s0 + u) * stride, 0, k, lut, cx);
                        const float *c = w->pcos + (s0 + u) * D, *sv = w->psin + (s0 + u) * D;
                        for (int sub = 0; sub < k; sub++) {
                            __m512 x = _mm512_fmadd_ps(cx[sub], _mm512_loadu_ps(half + 16 * sub),
                                                       _mm512_loadu_ps(off + 16 * sub));
                            if (R)  /* rotate-half: x cos + (partner) (-+ sin) */
                                x = _mm512_fmadd_ps(
                                    _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)),
                                    _mm512_loadu_ps(sv + 16 * sub),
                                    _mm512_mul_ps(x, _mm512_loadu_ps(c + 16 * sub)));
                            for (int hh = 0; hh < nh; hh++)
                                acc[u][hh] = _mm512_fmadd_ps(
                                    _mm512_loadu_ps(q0 + hh * D + 16 * sub), x, acc[u][hh]);
                        }
                    }
                }
                for (int64_t j = 0; !swap && j < m; j += C) {
#pragma GCC unroll 8
                    for (int u = 0; u < SL; u++) {
                        const uint8_t *row = rows + (s0 + u) * stride;
                        __m512 ca[4], cb[4];
                        planar_lookup(row, j, k, lut, ca);
                        planar_lookup(row, j + m, k, lut, cb);
                        const float *c = w->pcos + (s0 + u) * D, *sv = w->psin + (s0 + u) * D;
                        for (int sub = 0; sub < k; sub++) {
                            const int64_t ja = j + 16 * sub, jb = ja + m;
                            __m512 a = _mm512_fmadd_ps(ca[sub], _mm512_loadu_ps(half + ja),
                                                       _mm512_loadu_ps(off + ja));
                            __m512 b = _mm512_fmadd_ps(cb[sub], _mm512_loadu_ps(half + jb),
                                                       _mm512_loadu_ps(off + jb));
                            if (R) {  /* rotate-half: (a, b) -> (a cos - b sin, b cos + a sin) */
                                const __m512 ra = _mm512_fnmadd_ps(
                                    b, _mm512_loadu_ps(sv + ja),
                                    _mm512_mul_ps(a, _mm512_loadu_ps(c + ja)));
                                b = _mm512_fmadd_ps(a, _mm512_loadu_ps(sv + ja + hi),
                                                    _mm512_mul_ps(b, _mm512_loadu_ps(c + ja + hi)));
                                a = ra;
                            }
                            for (int hh = 0; hh < nh; hh++) {
                                acc[u][hh] = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + hh * D + ja), a,
                                                             acc[u][hh]);
                                acc[u][hh] = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + hh * D + jb), b,
                                                             acc[u][hh]);
                            }
                        }
                    }
                }
                for (int u = 0; u < SL; u++)
                    for (int hh = 0; hh < nh; hh++)
                        dots[(g * nh + hh) * 16 + s0 + u] = acc[u][hh];
            }
        }
        tile_scores(L, t0, nt, h0, nh, dots, w);
    }
}

/* scores[h * B + t] = q_h . RoPE_pos(t)(lut[codes] * half + off) for the query heads
 * h = g * group + hh, hh in [h0, h0 + nh), of every KV head g and the block's first n slots.
 * By tiles of 16 slots; in a tile, per KV head, a few slots at a time (SL, so that their dot
 * accumulators stay in registers) go through the channel pairs (j, j + D/2), each pair's
 * statistics and query rows loaded once for those slots. The next tile's key and value rows
 * of all heads are prefetched. Always inlined with a constant nh at its call sites. */
static inline __attribute__((always_inline)) void block_key_dots(
        const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n, const float *qb,
        int64_t h0, const int nh, BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t m = D / 2, bits = K->bits, group = L->num_q_heads / Hkv;
    const int64_t stride = Hkv * K->packed;
    /* cos / sin rows of rotate-half tables repeat their first half: read that half only */
    const int64_t hi = L->rope_halves_equal ? 0 : m;
    enum { SL_MAX = 8 };
    const int SL = nh <= 2 ? 8 : (nh <= 4 ? 4 : 2);  /* slots whose accumulators are held */
    const __m512 lut = lut16(K->lut, bits);
    __m512 *dots = (__m512 *)w->dots;  /* [Hkv * nh, 16] */
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t nt = n - t0 < 16 ? n - t0 : 16;
        if (next_blk >= 0 && h0 == 0)  /* the next block's data, a share per tile */
            prefetch_block_data(L, next_blk, t0 / 16, (n + 15) / 16);
        /* the next tile's rows (all heads) and RoPE rows, a share of its slots per KV head */
        const int64_t share = (16 + Hkv - 1) / Hkv;
        const float *cs[16], *sn[16];  /* the tile's RoPE rows (rows past n: position 0) */
        for (int64_t u = 0; u < 16; u++) {
            int64_t pos = R && u < nt ? L->slot_positions[blk * B + t0 + u] : 0;
            pos = pos < 0 ? 0 : pos;
            cs[u] = L->cos + pos * R;
            sn[u] = L->sin + pos * R;
        }
        for (int64_t g = 0; g < Hkv; g++) {
            tile_prefetch(L, blk, next_blk, n, t0, g, share, h0 == 0);
            const float *half = w->k_half + g * D, *off = w->k_off + g * D;
            const float *q0 = qb + (g * group + h0) * D;
            const uint8_t *rows = K->codes + ((blk * B + t0) * Hkv + g) * K->packed;
            /* the tile's rows past n are read too (they lie in the block; B % 16 == 0) and
             * their dots dropped */
            for (int s0 = 0; s0 < 16; s0 += SL) {
                __m512 acc[SL_MAX][FAST_MAX_HEADS];
                for (int u = 0; u < SL; u++)
                    for (int hh = 0; hh < nh; hh++) acc[u][hh] = _mm512_setzero_ps();
                for (int64_t j = 0; j < m; j += 16) {
                    const __m512 ha = _mm512_loadu_ps(half + j), hb = _mm512_loadu_ps(half + j + m);
                    const __m512 oa = _mm512_loadu_ps(off + j), ob = _mm512_loadu_ps(off + j + m);
                    __m512 qa[FAST_MAX_HEADS], qz[FAST_MAX_HEADS];
                    for (int hh = 0; hh < nh; hh++) {
                        qa[hh] = _mm512_loadu_ps(q0 + hh * D + j);
                        qz[hh] = _mm512_loadu_ps(q0 + hh * D + j + m);
                    }
                    for (int u = 0; u < SL; u++) {
                        const uint8_t *row = rows + (s0 + u) * stride;
                        __m512 a = _mm512_fmadd_ps(
                            _mm512_permutexvar_ps(codes16(row, bits, j), lut), ha, oa);
                        __m512 b = _mm512_fmadd_ps(
                            _mm512_permutexvar_ps(codes16(row, bits, j + m), lut), hb, ob);
                        if (R) {  /* rotate-half: (a, b) -> (a cos - b sin, b cos + a sin) */
                            const float *c = cs[s0 + u], *sv = sn[s0 + u];
                            const __m512 ra = _mm512_fnmadd_ps(
                                b, _mm512_loadu_ps(sv + j),
                                _mm512_mul_ps(a, _mm512_loadu_ps(c + j)));
                            b = _mm512_fmadd_ps(a, _mm512_loadu_ps(sv + j + hi),
                                                _mm512_mul_ps(b, _mm512_loadu_ps(c + j + hi)));
                            a = ra;
                        }
                        for (int hh = 0; hh < nh; hh++) {
                            acc[u][hh] = _mm512_fmadd_ps(qa[hh], a, acc[u][hh]);
                            acc[u][hh] = _mm512_fmadd_ps(qz[hh], b, acc[u][hh]);
                        }
                    }
                }
                for (int u = 0; u < SL; u++)
                    for (int hh = 0; hh < nh; hh++)
                        dots[(g * nh + hh) * 16 + s0 + u] = acc[u][hh];
            }
        }
        tile_scores(L, t0, nt, h0, nh, dots, w);
    }
}

/* the group's query heads [h0, h0 + nh) of KV head g, nh <= FAST_MAX_HEADS, for the block's
 * first n slots: acc_h += sum_t pa[h, t] * lut[codes_t] + pb[h] (32 channels at a time) */
static inline __attribute__((always_inline)) void block_values(
        const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n, float *acc0, int64_t h0,
        const int nh, const float *pb, const BlockScratch *w, const int64_t patches) {
    const KVQuantSide *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, bits = V->bits;
    const __m512 lut = lut16(V->lut, bits);
    const uint8_t *rows = V->codes + ((blk * B) * Hkv + g) * V->packed;
    const int64_t stride = Hkv * V->packed;
    for (int64_t d = 0; d < D; d += 32) {
        __m512 a0[FAST_MAX_HEADS], a1[FAST_MAX_HEADS];
        for (int hh = 0; hh < nh; hh++) {
            const __m512 bias = _mm512_set1_ps(pb[h0 + hh]);
            a0[hh] = _mm512_add_ps(_mm512_loadu_ps(acc0 + hh * D + d), bias);
            a1[hh] = _mm512_add_ps(_mm512_loadu_ps(acc0 + hh * D + d + 16), bias);
        }
        const __m512i lane0 = _mm512_add_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32((int)d));
        const __m512i lane1 = _mm512_add_epi32(lane0, _mm512_set1_epi32(16));
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *row = rows + t * stride;
            __m512 v0 = _mm512_permutexvar_ps(codes16(row, bits, d), lut);
            __m512 v1 = _mm512_permutexvar_ps(codes16(row, bits, d + 16), lut);
            for (int64_t j = 0; j < patches; j++) {  /* the row's outliers' deltas, in centroid
                                                      * units, added at their channels */
                const __m512i ch = _mm512_set1_epi32(w->patch_ch[(t * Hkv + g) * patches + j]);
                const __m512 x = _mm512_set1_ps(w->patch_x[(t * Hkv + g) * patches + j]);
                v0 = _mm512_mask_add_ps(v0, _mm512_cmpeq_epi32_mask(lane0, ch), v0, x);
                v1 = _mm512_mask_add_ps(v1, _mm512_cmpeq_epi32_mask(lane1, ch), v1, x);
            }
            for (int hh = 0; hh < nh; hh++) {
                const __m512 p = _mm512_set1_ps(w->pa[(h0 + hh) * B + t]);
                a0[hh] = _mm512_fmadd_ps(p, v0, a0[hh]);
                a1[hh] = _mm512_fmadd_ps(p, v1, a1[hh]);
            }
        }
        for (int hh = 0; hh < nh; hh++) {
            _mm512_storeu_ps(acc0 + hh * D + d, a0[hh]);
            _mm512_storeu_ps(acc0 + hh * D + d + 16, a1[hh]);
        }
    }
}

/* block_values in planar order (planar_values_fit): the accumulators of cp chunks of C channels
 * at once (cp * k vectors a head: the whole head where they fit in registers, so a slot's row
 * is read once, its P broadcast once per head) permuted on load and back on store, a slot's
 * codes widened once per chunk; a patch's channel compared with each lane's (c0 + k * l + s) */
static inline __attribute__((always_inline)) void block_values_planar(
        const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n, float *acc0, int64_t h0,
        const int nh, const int k, const int cp, const float *pb, const BlockScratch *w,
        const int64_t patches) {
    const KVQuantSide *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const int C = 16 * k, S = cp * k;  /* channels a chunk; vectors a head in one pass */
    enum { S_MAX = 16 };
    const __m512 lut = lut16_repeated(V->lut, V->bits);
    const uint8_t *rows = V->codes + ((blk * B) * Hkv + g) * V->packed;
    const int64_t stride = Hkv * V->packed;
    const __m512i lanes = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(k));
    for (int64_t d = 0; d < D; d += C * cp) {
        __m512 a[FAST_MAX_HEADS][S_MAX];
        __m512i chan[S_MAX];
        for (int hh = 0; hh < nh; hh++) {
            const __m512 bias = _mm512_set1_ps(pb[h0 + hh]);
            for (int c = 0; c < cp; c++) planar_in(acc0 + hh * D + d + c * C, k, a[hh] + c * k);
            for (int sub = 0; sub < S; sub++) a[hh][sub] = _mm512_add_ps(a[hh][sub], bias);
        }
        for (int sub = 0; sub < S; sub++)  /* the channel of each lane (for the patches) */
            chan[sub] = _mm512_add_epi32(
                lanes, _mm512_set1_epi32((int)d + sub / k * C + sub % k));
        for (int64_t t = 0; t < n; t++) {
            __m512 v[S_MAX];
            for (int c = 0; c < cp; c++)
                planar_lookup(rows + t * stride, d + c * C, k, lut, v + c * k);
            for (int64_t j = 0; j < patches; j++) {  /* the row's outliers' deltas, in centroid
                                                      * units, added at their channels */
                const __m512i ch = _mm512_set1_epi32(w->patch_ch[(t * Hkv + g) * patches + j]);
                const __m512 x = _mm512_set1_ps(w->patch_x[(t * Hkv + g) * patches + j]);
                for (int sub = 0; sub < S; sub++)
                    v[sub] = _mm512_mask_add_ps(
                        v[sub], _mm512_cmpeq_epi32_mask(chan[sub], ch), v[sub], x);
            }
            for (int hh = 0; hh < nh; hh++) {
                const __m512 p = _mm512_set1_ps(w->pa[(h0 + hh) * B + t]);
                for (int sub = 0; sub < S; sub++)
                    a[hh][sub] = _mm512_fmadd_ps(p, v[sub], a[hh][sub]);
            }
        }
        for (int hh = 0; hh < nh; hh++)
            for (int c = 0; c < cp; c++) planar_out(acc0 + hh * D + d + c * C, k, a[hh] + c * k);
    }
}

static inline __m512 gather_ps(const float *base, __m512i idx, __mmask16 live) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, base, 4);
}

/* sparse values of 16 entries from p[i .. i + 16) (fewer where `have` says so), as float32 */
static inline __m512 elements16(const void *p, int64_t i, __mmask16 have, int64_t kind) {
    if (kind == 2) return _mm512_maskz_loadu_ps(have, (const float *)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(have, (const uint16_t *)p + i);
    if (kind == 0) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* sg[t[l]] += x[l] for the live lanes of 16 entries, where every query head's x shares t:
 * the lanes' runs of one slot, found once (scores_runs) for every head (runs_summed,
 * run_totals_add; scores_add_lanes out of order).
 * Where the live lanes' t never decrease (a list in index order, as the store writes it),
 * lanes of one slot lie next to each other: a segmented sum over each run of equal t (its
 * last lane ends with the run's total); then those lanes alone (their t differ, increasing)
 * are added to the scores: where they lie within 16 slots of the first, by one masked load and
 * store of that window, the totals expanded to their slots' lanes (`window`: the window's
 * lanes); else gathered, added and scattered back. Otherwise one lane at a time. (One lane at
 * a time after a vector store was slower: each lane's load waits on that store.) */
typedef struct {
    __m512i t;           /* each lane's slot */
    __mmask16 live;
    __mmask16 same[4];   /* lane l in the run of lane l - 1, 2, 4, 8 */
    __mmask16 ends;      /* the last lane of each run */
    __mmask16 window;    /* the runs' slots as lanes of [first, first + 16); 0: wider */
    int in_order;        /* the live lanes' slots never decrease */
    int32_t first;       /* the first run's slot */
} ScoreRuns;

/* the runs of t's live lanes into *r (filled whole, no early return: kept in registers once
 * inlined; a returned struct went through the stack, its masks reloaded for every head) */
static inline __attribute__((always_inline)) void scores_runs(__m512i t, __mmask16 live,
                                                              ScoreRuns *r) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i one = _mm512_set1_epi32(1);
    r->t = t;
    r->live = live;
    const __m512i prev = _mm512_permutexvar_epi32(
        _mm512_max_epi32(_mm512_sub_epi32(lane, one), _mm512_setzero_si512()), t);
    r->in_order = !_mm512_mask_cmplt_epi32_mask((__mmask16)(live & 0xFFFEu), t, prev);
    for (int i = 0, k = 1; k < 16; i++, k *= 2)  /* lane l and lane l - k in the same run */
        r->same[i] = _mm512_mask_cmpeq_epi32_mask(
            (__mmask16)(0xFFFFu << k), t,
            _mm512_permutexvar_epi32(_mm512_sub_epi32(lane, _mm512_set1_epi32(k)), t));
    const __m512i next = _mm512_permutexvar_epi32(
        _mm512_min_epi32(_mm512_add_epi32(lane, one), _mm512_set1_epi32(15)), t);
    const __mmask16 last = (__mmask16)(live & ~(live >> 1));  /* the last live lane */
    r->ends = r->in_order ? live & (_mm512_cmpneq_epi32_mask(t, next) | last) : 0;
    r->first = _mm512_cvtsi512_si32(_mm512_maskz_compress_epi32(r->ends, t));
    const __m512i off = _mm512_sub_epi32(t, _mm512_set1_epi32(r->first));
    const int wide = _mm512_mask_cmpge_epi32_mask(r->ends, off, _mm512_set1_epi32(16)) != 0;
    r->window = wide ? 0 : (__mmask16)_mm512_mask_reduce_or_epi32(r->ends,
                                                                  _mm512_sllv_epi32(one, off));
}

/* x summed over each run of r's lanes: its last lane holds the run's total (in-order lanes) */
static inline __attribute__((always_inline)) __m512 runs_summed(const ScoreRuns *r, __m512 x) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    x = _mm512_maskz_mov_ps(r->live, x);
    for (int i = 0, k = 1; k < 16; i++, k *= 2)  /* lane l += lane l - k while in the same run */
        x = _mm512_mask_add_ps(x, r->same[i], x, _mm512_permutexvar_ps(
            _mm512_sub_epi32(lane, _mm512_set1_epi32(k)), x));
    return x;
}

/* the runs' totals of x (runs_summed) added to their slots' scores sg[t] */
static inline __attribute__((always_inline)) void run_totals_add(float *sg, const ScoreRuns *r,
                                                                 __m512 x) {
    if (r->window) {  /* the runs' totals in order, to the lanes of their slots */
        float *at = sg + r->first;
        const __m512 totals = _mm512_maskz_expand_ps(r->window,
                                                     _mm512_maskz_compress_ps(r->ends, x));
        _mm512_mask_storeu_ps(at, r->window,
                              _mm512_add_ps(_mm512_maskz_loadu_ps(r->window, at), totals));
    } else if (r->ends) {
        _mm512_mask_i32scatter_ps(sg, r->ends, r->t,
                                  _mm512_add_ps(gather_ps(sg, r->t, r->ends), x), 4);
    }
}

/* sg[t[l]] += x[l] for r's live lanes, one lane at a time (lanes out of order) */
static inline void scores_add_lanes(float *sg, const ScoreRuns *r, __m512 x) {
    float xs[16];
    int32_t ts[16];
    _mm512_storeu_ps(xs, x);
    _mm512_storeu_si512(ts, r->t);
    for (unsigned m = r->live; m; m &= m - 1) sg[ts[__builtin_ctz(m)]] += xs[__builtin_ctz(m)];
}

#include "kvquant_slot_keys_avx512.h"

enum { SLOT_KEYS = 8 };

/* which key pass takes the layer: the slot-lanes pass (SLOT_KEYS, slot_keys_fit, unless
 * switched off: kvquant_set_slot_keys), the planar pass (its k, codes a byte) or the natural
 * one (0) */
static inline int key_pass_kind(const KVQuantLayer *L) {
    if (nanokv_slot_keys && slot_keys_fit(L)) return SLOT_KEYS;
    return planar_keys_fit(L) ? planar_k(L->k.bits) : 0;
}

/* are the positions of a block's first n slots consecutive (pos[t] = pos[0] + t, pos[0] >= 0),
 * as a request's tokens written in order leave them */
static inline int positions_consecutive(const int32_t *pos, int64_t n) {
    if (pos[0] < 0) return 0;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        const __m512i want = _mm512_add_epi32(_mm512_set1_epi32((int)(pos[0] + t)), lane);
        if (_mm512_mask_cmpneq_epi32_mask(live, _mm512_maskz_loadu_epi32(live, pos + t), want))
            return 0;
    }
    return 1;
}

/* q[ch] and q[ch ^ D / 2] (the rotate-half partner's) of 16 lanes, by two-table permutes of
 * the head's D floats (D = 32, 64 or 128: q_lookup_fits) instead of two gathers */
static inline int q_lookup_fits(int64_t D) { return D == 32 || D == 64 || D == 128; }

static inline __attribute__((always_inline)) void q_lookup(const float *qh, __m512i ch,
                                                           int64_t D, __m512 *qc, __m512 *qp) {
    if (D == 32) {
        const __m512 t0 = _mm512_loadu_ps(qh), t1 = _mm512_loadu_ps(qh + 16);
        *qc = _mm512_permutex2var_ps(t0, ch, t1);
        *qp = _mm512_permutex2var_ps(t1, ch, t0);
        return;
    }
    const __mmask16 m5 = _mm512_test_epi32_mask(ch, _mm512_set1_epi32(32));
    const __m512 a = _mm512_permutex2var_ps(_mm512_loadu_ps(qh), ch, _mm512_loadu_ps(qh + 16));
    const __m512 b = _mm512_permutex2var_ps(_mm512_loadu_ps(qh + 32), ch,
                                            _mm512_loadu_ps(qh + 48));
    if (D == 64) {
        *qc = _mm512_mask_blend_ps(m5, a, b);
        *qp = _mm512_mask_blend_ps(m5, b, a);
        return;
    }
    const __m512 c = _mm512_permutex2var_ps(_mm512_loadu_ps(qh + 64), ch,
                                            _mm512_loadu_ps(qh + 80));
    const __m512 d = _mm512_permutex2var_ps(_mm512_loadu_ps(qh + 96), ch,
                                            _mm512_loadu_ps(qh + 112));
    const __mmask16 m6 = _mm512_test_epi32_mask(ch, _mm512_set1_epi32(64));
    const __m512 lo = _mm512_mask_blend_ps(m5, a, b), hi = _mm512_mask_blend_ps(m5, c, d);
    *qc = _mm512_mask_blend_ps(m6, lo, hi);
    *qp = _mm512_mask_blend_ps(m6, hi, lo);
}

/* key_outliers, 16 entries at a time (head_dim a power of two, int16 / int32 indices); the
 * score corrections of a query head go in together (runs_summed, run_totals_add), two heads
 * at a time. An entry's delta is the store's (one load of 16, no code or statistic read), its
 * position its slot's offset from the block's first where they are consecutive
 * (w->first_position; no gather), its query channel and the RoPE partner's permuted from the
 * head's where it has at most 128 (q_lookup; else gathered), its cos and sin gathered. */
static void key_outliers16(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                           const float *restrict q0, int64_t group, float *restrict sg,
                           const BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t base = (blk * Hkv + g) * K->cap;
    const int32_t *positions = R ? L->slot_positions + blk * B : NULL;
    const __m512i zero = _mm512_setzero_si512(), limit = _mm512_set1_epi32((int)(n * D));
    const __m512i last_channel = _mm512_set1_epi32((int)(D - 1));
    const __m512i half_rot = _mm512_set1_epi32((int)(R / 2)), rot = _mm512_set1_epi32((int)R);
    const int d_shift = __builtin_ctzll((unsigned long long)D);
    const int consecutive = R && w->first_position >= 0;
    const __m512i pos0 = _mm512_set1_epi32(consecutive ? w->first_position : 0);
    /* the query's lookups by permutes: its rotate-half partner is ch ^ D / 2 (R == D) */
    const int qperm = (R == D || R == 0) && q_lookup_fits(D);
    for (int64_t j0 = 0; j0 < K->cap; j0 += 16) {
        const __mmask16 have = K->cap - j0 >= 16 ? (__mmask16)0xFFFF
                                                 : (__mmask16)((1u << (K->cap - j0)) - 1u);
        const __m512i idx = K->idx_bytes == 2
            ? _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(have, (const int16_t *)K->oidx
                                                                    + base + j0))
            : _mm512_maskz_loadu_epi32(have, (const int32_t *)K->oidx + base + j0);
        const __mmask16 live = have & _mm512_cmpge_epi32_mask(idx, zero)
                               & _mm512_cmplt_epi32_mask(idx, limit);
        if (!live) continue;
        const __m512i t = _mm512_srli_epi32(idx, d_shift);
        const __m512i ch = _mm512_and_si512(idx, last_channel);
        /* the stored delta, exact - decoded: no code or statistic gathered */
        const __m512 delta = _mm512_maskz_mov_ps(live, elements16(K->oval, base + j0, have,
                                                                  L->sparse_kind));
        __m512 cv = _mm512_set1_ps(1.f), sv = _mm512_setzero_ps();
        __m512i partner = ch;
        if (R) {  /* q[ch] cos[ch] +- q[partner] sin[partner] at the slot's position */
            const __m512i pos = consecutive ? _mm512_add_epi32(pos0, t) : _mm512_max_epi32(
                _mm512_mask_i32gather_epi32(zero, live, t, positions, 4), zero);
            const __mmask16 first = _mm512_cmplt_epi32_mask(ch, half_rot);
            partner = _mm512_mask_blend_epi32(first, _mm512_sub_epi32(ch, half_rot),
                                              _mm512_add_epi32(ch, half_rot));
            const __m512 sign = _mm512_mask_blend_ps(first, _mm512_set1_ps(-1.f),
                                                     _mm512_set1_ps(1.f));
            /* rotate-half tables repeat their first half: the pair's lower channel there (the
             * lines the key pass read) */
            const __m512i c_at = L->rope_halves_equal ? _mm512_min_epi32(ch, partner) : ch;
            const __m512i s_at = L->rope_halves_equal ? c_at : partner;
            if (rope_tiles_on(L)) {  /* tile pos / 16, [c_at, pos % 16] of its cos and sin */
                const __m512i tile = _mm512_mullo_epi32(_mm512_srli_epi32(pos, 4),
                                                        _mm512_set1_epi32((int)(R * 16)));
                const __m512i at = _mm512_add_epi32(
                    _mm512_add_epi32(tile, _mm512_slli_epi32(c_at, 4)),
                    _mm512_and_si512(pos, _mm512_set1_epi32(15)));
                cv = gather_ps(L->rope_tiles, at, live);
                sv = _mm512_mul_ps(sign, gather_ps(L->rope_tiles + R / 2 * 16, at, live));
            } else {
                const __m512i row = _mm512_mullo_epi32(pos, rot);
                cv = gather_ps(L->cos, _mm512_add_epi32(row, c_at), live);
                sv = _mm512_mul_ps(sign, gather_ps(L->sin, _mm512_add_epi32(row, s_at), live));
            }
        }
        ScoreRuns runs;
        scores_runs(t, live, &runs);
        /* two query heads at a time: their runs' sums are independent chains */
        for (int64_t hh = 0; hh < group; hh += 2) {
            const int64_t pair = hh + 1 < group ? 2 : 1;
            __m512 x[2];
            for (int64_t u = 0; u < pair; u++) {
                const float *qh = q0 + (hh + u) * D;
                __m512 qc, qp;
                if (qperm) {
                    q_lookup(qh, ch, D, &qc, &qp);
                } else {
                    qc = gather_ps(qh, ch, live);
                    qp = gather_ps(qh, partner, live);
                }
                x[u] = _mm512_mul_ps(delta, _mm512_fmadd_ps(qc, cv, _mm512_mul_ps(qp, sv)));
            }
            if (!runs.in_order) {
                for (int64_t u = 0; u < pair; u++)
                    scores_add_lanes(sg + (hh + u) * B, &runs, x[u]);
                continue;
            }
            for (int64_t u = 0; u < pair; u++) x[u] = runs_summed(&runs, x[u]);
            for (int64_t u = 0; u < pair; u++) run_totals_add(sg + (hh + u) * B, &runs, x[u]);
        }
    }
}

/* the block's key outliers of head g as score corrections: 16 at a time where the layout
 * allows (head_dim a power of two, int16 / int32 indices), else one by one */
static void block_key_outliers(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                               const float *q0, int64_t group, float *sg, const BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t D = L->head_dim;
    if ((D & (D - 1)) == 0 && (K->idx_bytes == 2 || K->idx_bytes == 4))
        key_outliers16(L, blk, g, n, q0, group, sg, w);
    else if (K->idx_bytes == 2 && L->sparse_kind == 0)  /* int16 indices, float16 values */
        key_outliers(L, blk, g, n, q0, group, sg, w, 2, 0);
    else
        key_outliers(L, blk, g, n, q0, group, sg, w, K->idx_bytes, L->sparse_kind);
}

/* value_patches of every KV head of the block at once, before the heads' value passes: the
 * block's lists ([n, Hkv, cap], contiguous) 16 entries at a time, each row's half-range (w->
 * v_stats, converted once a block) permuted to its entries, x = delta / half-range with one
 * vector division. A sink slot's patches are left in: the value pass weighs its row
 * by 0 (w->pa: P * live * half-range; its full-precision row is added apart). Returns whether
 * an outlier lies in a row without a centroid scale (half-range 0), which value_patches adds a
 * KV head at a time. */
static int block_value_patches(const KVQuantLayer *L, int64_t blk, int64_t n,
                               BlockScratch *w) {
    const KVQuantSide *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, cap = V->cap;
    const int64_t rows = n * Hkv, entries = rows * cap, first = blk * B * Hkv;
    const int c_shift = __builtin_ctzll((unsigned long long)cap);
    const float *vh = w->v_stats;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i row_of = _mm512_srli_epi32(lane, c_shift);  /* an entry's row, from e0's */
    const __m512i channels = _mm512_set1_epi32((int)D), unused = _mm512_set1_epi32(-1);
    __mmask16 unscaled = 0;
    for (int64_t e0 = 0; e0 < entries; e0 += 16) {
        const __mmask16 have = entries - e0 >= 16 ? (__mmask16)0xFFFF
                                                  : (__mmask16)((1u << (entries - e0)) - 1u);
        const int64_t r0 = e0 >> c_shift, left = rows - r0;
        const __mmask16 in_rows = left >= 16 ? (__mmask16)0xFFFF
                                             : (__mmask16)((1u << left) - 1u);
        const __m512 half = _mm512_permutexvar_ps(row_of, _mm512_maskz_loadu_ps(in_rows, vh + r0));
        const __m512i ch = _mm512_cvtepu8_epi32(
            _mm_maskz_loadu_epi8(have, (const uint8_t *)V->oidx + first * cap + e0));
        const __m512 delta = elements16(V->oval, first * cap + e0, have, L->sparse_kind);
        const __mmask16 valid = have & _mm512_cmplt_epi32_mask(ch, channels);
        const __mmask16 scaled = valid & _mm512_cmp_ps_mask(half, _mm512_setzero_ps(),
                                                            _CMP_NEQ_OQ);
        const __m512 inv = _mm512_maskz_div_ps(scaled, _mm512_set1_ps(1.f), half);
        _mm512_mask_storeu_epi32(w->patch_ch + e0, have,
                                 _mm512_mask_blend_epi32(scaled, unused, ch));
        _mm512_mask_storeu_ps(w->patch_x + e0, have, _mm512_mul_ps(delta, inv));
        unscaled |= valid & ~scaled;
    }
    return unscaled != 0;
}

/* acc[g * group + hh, ch] += corr[(g * D + ch) * group + hh]: 16 channels of a head at a time
 * (D % 16 == 0), the group's heads of those channels taken apart by permutes (group 2) or
 * gathered (wider groups) */
static void value_corrections_add(const float *corr, float *acc, int64_t Hkv, int64_t D,
                                  int64_t group) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i even = _mm512_slli_epi32(lane, 1), odd = _mm512_add_epi32(even,
                                                                             _mm512_set1_epi32(1));
    const __m512i strided = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)group));
    for (int64_t g = 0; g < Hkv; g++)
        for (int64_t c0 = 0; c0 < D; c0 += 16) {
            const float *src = corr + (g * D + c0) * group;
            float *dst = acc + g * group * D + c0;
            if (group == 2) {
                const __m512 x0 = _mm512_load_ps(src), x1 = _mm512_load_ps(src + 16);
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst),
                                                    _mm512_permutex2var_ps(x0, even, x1)));
                _mm512_storeu_ps(dst + D, _mm512_add_ps(_mm512_loadu_ps(dst + D),
                                                        _mm512_permutex2var_ps(x0, odd, x1)));
                continue;
            }
            for (int64_t hh = 0; hh < group; hh++)
                _mm512_storeu_ps(dst + hh * D, _mm512_add_ps(
                    _mm512_loadu_ps(dst + hh * D), _mm512_i32gather_ps(strided, src + hh, 4)));
        }
}

/* corr[at[l]] += p[l] * d[l] for the live ones of 8 entries, each a pair of floats (64-bit
 * lanes: two query heads of one channel), by one gather and one scatter of pairs */
static inline void pairs_fma8(double *corr, __mmask8 live, __m256i at, __m512d p, __m512 d) {
    if (!live) return;
    const __m512d c = _mm512_mask_i32gather_pd(_mm512_setzero_pd(), live, at, corr, 8);
    _mm512_mask_i32scatter_pd(corr, live, at, _mm512_castps_pd(_mm512_fmadd_ps(
        _mm512_castpd_ps(p), d, _mm512_castpd_ps(c))), 8);
}

/* does block_value_outliers16 take this layer: uint8 channels, at most 16 KV heads (a slot's
 * query heads' P one vector, or gathered) */
static inline int value_outliers16_fit(const KVQuantLayer *L) {
    return L->v.cap > 0 && L->v.idx_bytes == 1 && L->num_kv_heads <= 16;
}

/* The value outliers of the block's non-sink slots, every KV head at once, as corrections of
 * the accumulators: acc[h, ch] += P[h, t] * delta (the stored exact - decoded), after the
 * block's softmax of every head (P in w->scores). A slot's lists of all KV heads are contiguous
 * ([Hkv, cap]), so they go 16 entries at a time: the deltas loaded, P permuted to them
 * from the slot's row of every query head's P (w->p_slots: the block's P transposed once, up
 * to 16 query heads; else gathered per head), and the accumulators gathered and scattered
 * back (an entry's (head, channel) is listed once, so the 16 never collide). With P by slots
 * and an even group, two query heads of an entry's channel are one 64-bit lane of a buffer
 * laid out [Hkv, D, group] (w->v_corr, zeroed per block, added to acc at the end:
 * value_corrections_add): 8-lane gathers and scatters of pairs, half the elements of one
 * 16-lane gather and scatter per head. value_outliers does the same one entry at a time. */
static void block_value_outliers16(const KVQuantLayer *L, int64_t blk, int64_t n, float *acc,
                                   const BlockScratch *w) {
    const KVQuantSide *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const int64_t group = L->num_q_heads / Hkv, cap = V->cap, per = Hkv * cap;
    const __m512i channels = _mm512_set1_epi32((int)D);
    const int column = Hkv * group <= 16;  /* a slot's P of every query head: one vector */
    if (column)  /* P by slots: row t holds every query head's P at slot t */
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
            __m512 r[16];  /* the query heads' P of 16 slots, then transposed */
            for (int h = 0; h < 16; h++)
                r[h] = h < Hkv * group ? _mm512_loadu_ps(w->scores + h * B + t0)
                                       : _mm512_setzero_ps();
            transpose16(r);
            for (int u = 0; u < 16; u++) _mm512_store_ps(w->p_slots + (t0 + u) * 16, r[u]);
        }
    /* an even group with P by slots: the corrections of two heads of a channel as one 64-bit
     * lane (half the gathered and scattered elements), into w->v_corr, added to acc after */
    const int paired = column && group % 2 == 0;
    double *corr = (double *)w->v_corr;
    const __m512i dup_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
    if (paired)
        for (int64_t i = 0; i < Hkv * D * group; i += 16)
            _mm512_store_ps(w->v_corr + i, _mm512_setzero_ps());
    for (int64_t t = 0; t < n; t++) {
        if (w->sink_at[t] >= 0) continue;
        const int64_t i0 = (blk * B + t) * Hkv;  /* (block, slot, head 0) */
        /* P of every query head at slot t (at most 16 heads): one row, permuted per entry */
        const __m512 pt = column ? _mm512_load_ps(w->p_slots + t * 16) : _mm512_setzero_ps();
        for (int64_t e0 = 0; e0 < per; e0 += 16) {
            const __mmask16 have = per - e0 >= 16 ? (__mmask16)0xFFFF
                                                  : (__mmask16)((1u << (per - e0)) - 1u);
            const __m512i g = _mm512_maskz_loadu_epi32(have, w->v_head + e0);
            const __m512i ch = _mm512_cvtepu8_epi32(
                _mm_maskz_loadu_epi8(have, (const uint8_t *)V->oidx + i0 * cap + e0));
            const __mmask16 live = have & _mm512_cmplt_epi32_mask(ch, channels);
            if (!live) continue;
            /* the stored delta, exact - decoded: no code or statistic read */
            const __m512 delta = _mm512_maskz_mov_ps(
                live, elements16(V->oval, i0 * cap + e0, have, L->sparse_kind));
            if (paired) {  /* the group's heads two at a time: 64-bit lanes of P and v_corr */
                /* pair k of entry e's head: P at pair (g * group / 2 + k) of the slot's row,
                 * v_corr at pair ((g * D + ch) * group / 2 + k) */
                const __m512i pg = _mm512_mullo_epi32(g, _mm512_set1_epi32((int)(group / 2)));
                const __m512i pc = _mm512_mullo_epi32(
                    _mm512_add_epi32(_mm512_mullo_epi32(g, channels), ch),
                    _mm512_set1_epi32((int)(group / 2)));
                const __m512 d_lo = _mm512_permutexvar_ps(dup_lo, delta);  /* e0..7, twice */
                const __m512 d_hi = _mm512_permutexvar_ps(dup_hi, delta);
                const __mmask8 m_lo = (__mmask8)live, m_hi = (__mmask8)(live >> 8);
                for (int64_t k = 0; k < group / 2; k++) {
                    const __m512i kk = _mm512_set1_epi32((int)k);
                    const __m512i at = _mm512_add_epi32(pc, kk);
                    const __m512i ph = _mm512_add_epi32(pg, kk);
                    const __m512d p_lo = _mm512_permutexvar_pd(
                        _mm512_cvtepi32_epi64(_mm512_castsi512_si256(ph)), _mm512_castps_pd(pt));
                    const __m512d p_hi = _mm512_permutexvar_pd(
                        _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(ph, 1)),
                        _mm512_castps_pd(pt));
                    pairs_fma8(corr, m_lo, _mm512_castsi512_si256(at), p_lo, d_lo);
                    pairs_fma8(corr, m_hi, _mm512_extracti64x4_epi64(at, 1), p_hi, d_hi);
                }
                continue;
            }
            const __m512i first = _mm512_mullo_epi32(g, _mm512_set1_epi32((int)group));
            for (int64_t hh = 0; hh < group; hh++) {
                const __m512i h = _mm512_add_epi32(first, _mm512_set1_epi32((int)hh));
                const __m512 p = column ? _mm512_permutexvar_ps(h, pt)
                                        : _mm512_mask_i32gather_ps(
                    _mm512_setzero_ps(), live,
                    _mm512_add_epi32(_mm512_mullo_epi32(h, _mm512_set1_epi32((int)B)),
                                     _mm512_set1_epi32((int)t)), w->scores, 4);
                const __m512i at = _mm512_add_epi32(
                    _mm512_mullo_epi32(h, _mm512_set1_epi32((int)D)), ch);
                const __m512 a = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, acc, 4);
                _mm512_mask_i32scatter_ps(acc, live, at, _mm512_fmadd_ps(p, delta, a), 4);
            }
        }
    }
    if (paired) value_corrections_add(w->v_corr, acc, Hkv, D, group);
}

/* the online softmax of heads [h, h + group) over the block's n scores; scores become P */
static void block_softmax(Softmax *s, int64_t h, int64_t group, int64_t n, int64_t B,
                          int64_t D, float *sg) {
    for (int64_t hh = 0; hh < group; hh++) {
        float *sc = sg + hh * B;
        __m512 vmax = _mm512_set1_ps(s->m[h + hh]);
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 live = n - t >= 16 ? (__mmask16)0xFFFF
                                               : (__mmask16)((1u << (n - t)) - 1u);
            vmax = _mm512_mask_max_ps(vmax, live, vmax, _mm512_maskz_loadu_ps(live, sc + t));
        }
        const float mx = _mm512_reduce_max_ps(vmax);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 live = n - t >= 16 ? (__mmask16)0xFFFF
                                               : (__mmask16)((1u << (n - t)) - 1u);
            const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(live, sc + t), _mm512_set1_ps(mx))));
            _mm512_mask_storeu_ps(sc + t, live, p);
            vsum = _mm512_add_ps(vsum, p);
        }
        const float corr = expf(s->m[h + hh] - mx);
        s->l[h + hh] = s->l[h + hh] * corr + _mm512_reduce_add_ps(vsum);
        s->m[h + hh] = mx;
        if (corr != 1.f) {
            float *ah = s->acc + (h + hh) * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) ah[d] *= corr;
        }
    }
}


/* the block's key operands for its key pass: the per-channel tables (slot lanes) or the key
 * statistics in planar order, and where its first n slots' positions start if consecutive;
 * returns key_pass_kind */
static int block_key_operands(const KVQuantLayer *L, int64_t blk, int64_t n, BlockScratch *w) {
    const int kind = key_pass_kind(L);
    const int64_t channels = L->num_kv_heads * L->head_dim;
    /* the block's first position where its slots' are consecutive: the key outliers' positions
     * (key_outliers16) and the slot-lanes pass's RoPE tiles read in place */
    w->first_position = L->rot_dim
        && positions_consecutive(L->slot_positions + blk * L->block_size, n)
        ? L->slot_positions[blk * L->block_size] : -1;
    if (kind == SLOT_KEYS) {
        slot_key_tables(L, w);
    } else if (kind == 2) {
        planar_copy(w->pk_half, w->k_half, channels, 2);
        planar_copy(w->pk_off, w->k_off, channels, 2);
    } else if (kind == 4) {
        planar_copy(w->pk_half, w->k_half, channels, 4);
        planar_copy(w->pk_off, w->k_off, channels, 4);
    }
    return kind;
}

/* a request's queries in planar order (w->pq), where the planar key pass takes the layer:
 * once per request, before its blocks */
static void block_request_queries(const KVQuantLayer *L, const float *qb, BlockScratch *w) {
    const int kind = key_pass_kind(L);
    if (kind == 2) planar_copy(w->pq, qb, L->num_q_heads * L->head_dim, 2);
    else if (kind == 4) planar_copy(w->pq, qb, L->num_q_heads * L->head_dim, 4);
}

/* the key dots of query heads [h0, h0 + nh) of every KV head: instances with the pass, the
 * code width and the heads constant (planar: block_key_operands' kind, SLOT_KEYS or the planar
 * pass's k) */
static void block_key_heads(const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n,
                            const float *qb, int64_t h0, int nh, int planar, BlockScratch *w) {
#define KEY_DOTS(k) block_key_dots(L, blk, next_blk, n, qb, h0, k, w)
#define KEY_DOTS_2(k) block_key_dots_planar(L, blk, next_blk, n, h0, k, 2, 0, w)
#define KEY_DOTS_2_SWAP(k) block_key_dots_planar(L, blk, next_blk, n, h0, k, 2, 1, w)
#define KEY_DOTS_4(k) block_key_dots_planar(L, blk, next_blk, n, h0, k, 4, 0, w)
#define KEY_DOTS_4_SWAP(k) block_key_dots_planar(L, blk, next_blk, n, h0, k, 4, 1, w)
#define KEY_DOTS_SLOTS_2(k) block_key_dots_slots(L, blk, next_blk, n, qb, h0, k, 2, w)
#define KEY_DOTS_SLOTS_4(k) block_key_dots_slots(L, blk, next_blk, n, qb, h0, k, 4, w)
    const int swap = planar && L->head_dim == 16 * planar;
    if (planar == SLOT_KEYS && L->k.bits == 4) {
        BLOCK_HEADS_DISPATCH(KEY_DOTS_SLOTS_4, nh)
    } else if (planar == SLOT_KEYS) {
        BLOCK_HEADS_DISPATCH(KEY_DOTS_SLOTS_2, nh)
    } else if (planar == 2 && swap) {
        BLOCK_HEADS_DISPATCH(KEY_DOTS_2_SWAP, nh)
    } else if (planar == 4 && swap) {
        BLOCK_HEADS_DISPATCH(KEY_DOTS_4_SWAP, nh)
    } else if (planar == 2) {
        BLOCK_HEADS_DISPATCH(KEY_DOTS_2, nh)
    } else if (planar == 4) {
        BLOCK_HEADS_DISPATCH(KEY_DOTS_4, nh)
    } else {
        BLOCK_HEADS_DISPATCH(KEY_DOTS, nh)
    }
#undef KEY_DOTS
#undef KEY_DOTS_2
#undef KEY_DOTS_2_SWAP
#undef KEY_DOTS_4
#undef KEY_DOTS_4_SWAP
#undef KEY_DOTS_SLOTS_2
#undef KEY_DOTS_SLOTS_4
}

/* the value pass of query heads [h0, h0 + nh) of KV head g (acc0: head h0's accumulator) */
static void block_value_heads(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                              float *acc0, int64_t h0, int nh, const float *pb,
                              const BlockScratch *w, int64_t patches) {
#define VALUES(k) block_values(L, blk, g, n, acc0, h0, k, pb, w, patches)
#define VALUES_2(k) block_values_planar(L, blk, g, n, acc0, h0, k, 2, 1, pb, w, patches)
#define VALUES_4(k) block_values_planar(L, blk, g, n, acc0, h0, k, 4, 1, pb, w, patches)
#define VALUES_WIDE(k, cp, heads) block_values_planar(L, blk, g, n, acc0, h0, heads, k, cp, pb, \
                                                      w, patches)
    const int planar = planar_values_fit(L, nh) ? planar_k(L->v.bits) : 0;
    const int cp = planar ? value_chunks(L, planar, nh) : 1;
    if (cp > 1) {  /* the (k, cp, nh) that value_chunks allows */
        if (planar == 2 && cp == 2) {
            if (nh == 1) VALUES_WIDE(2, 2, 1); else if (nh == 2) VALUES_WIDE(2, 2, 2);
            else VALUES_WIDE(2, 2, 4);
        } else if (planar == 2) {
            if (nh == 1) VALUES_WIDE(2, 4, 1); else VALUES_WIDE(2, 4, 2);
        } else if (cp == 2) {
            if (nh == 1) VALUES_WIDE(4, 2, 1); else VALUES_WIDE(4, 2, 2);
        } else {
            VALUES_WIDE(4, 4, 1);
        }
    } else if (planar == 2) {
        BLOCK_HEADS_DISPATCH(VALUES_2, nh)
    } else if (planar == 4) {
        BLOCK_HEADS_DISPATCH(VALUES_4, nh)
    } else {
        BLOCK_HEADS_DISPATCH(VALUES, nh)
    }
#undef VALUES
#undef VALUES_2
#undef VALUES_4
#undef VALUES_WIDE
}
