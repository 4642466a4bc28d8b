/* The AVX-512 kernels of the KVQuant block path (kvquant_block.h): key dots by tiles of 16
 * slots (16 channels and their RoPE partners at a time), key outliers 16 entries at a time with
 * gathers where the layout allows, the block's online softmax, and values 32 channels at a time.
 * Included by quant_decode_attention.c after kvquant_block.h, on AVX-512F/BW/VL builds. */

/* scores[h * B + t] = q_h . RoPE_pos(t)(lut[codes] * half + off) for the query heads
 * h = g * group + hh, hh in [h0, h0 + nh), of every KV head g and the block's first n slots.
 * By tiles of 16 slots; in a tile, per KV head, a few slots at a time (SL, so that their dot
 * accumulators stay in registers) go through the channel pairs (j, j + D/2), each pair's
 * statistics and query rows loaded once for those slots. The next tile's key and value rows
 * of all heads are prefetched. Always inlined with a constant nh at its call sites. */
static inline __attribute__((always_inline)) void block_key_dots(
        const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n, const float *qb,
        int64_t h0, const int nh, BlockScratch *w) {
    const KVQuantSide *K = &L->k, *V = &L->v;
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
            for (int64_t t = t0 + 16 + g * share; t < t0 + 16 + (g + 1) * share && t < t0 + 32;
                 t++) {
                const int64_t ahead = t < n ? blk * B + t : (next_blk >= 0 && t - n < B
                                                            ? next_blk * B + t - n : -1);
                if (ahead < 0) break;
                prefetch_rows(K->codes + ahead * stride, stride);
                prefetch_rows(V->codes + ahead * Hkv * V->packed, Hkv * V->packed);
                if (R && h0 == 0) {  /* the part of the RoPE rows that is read */
                    int64_t pos = L->slot_positions[ahead];
                    pos = pos < 0 ? 0 : pos;
                    const int64_t bytes = (hi ? R : R / 2) * (int64_t)sizeof(float);
                    prefetch_rows((const uint8_t *)(L->cos + pos * R), bytes);
                    prefetch_rows((const uint8_t *)(L->sin + pos * R), bytes);
                }
            }
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
        for (int64_t g = 0; g < Hkv; g++)
            for (int hh = 0; hh < nh; hh++) {
                float sums[16];
                _mm512_storeu_ps(sums, sum16(dots + (g * nh + hh) * 16));
                memcpy(w->scores + (g * group + h0 + hh) * B + t0, sums, sizeof(float) * nt);
            }
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
            for (int64_t j = 0; j < patches; j++) {  /* the row's outliers, in centroid units */
                const __m512i ch = _mm512_set1_epi32(w->patch_ch[t * patches + j]);
                const __m512 x = _mm512_set1_ps(w->patch_x[t * patches + j]);
                v0 = _mm512_mask_mov_ps(v0, _mm512_cmpeq_epi32_mask(lane0, ch), x);
                v1 = _mm512_mask_mov_ps(v1, _mm512_cmpeq_epi32_mask(lane1, ch), x);
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

/* the coefficient of pre-RoPE key channel ch in q . RoPE(k) (rotate-half over R channels):
 * q[ch] cos[ch] + q[ch + m] sin[ch + m] in the first half, q[ch] cos[ch] - q[ch - m] sin[ch - m]
 * in the second; without a branch (which half an outlier falls in is a coin toss) */
static inline float rope_coefficient(const float *qh, const float *cs, const float *sn,
                                     int64_t ch, int64_t R, int64_t halves_equal) {
    if (!R) return qh[ch];
    const int64_t m = R / 2;
    if (halves_equal) {  /* read the tables' first half only (the lines the key pass read) */
        return ch < m ? qh[ch] * cs[ch] + qh[ch + m] * sn[ch]
                      : qh[ch] * cs[ch - m] - qh[ch - m] * sn[ch - m];
    }
    return ch < m ? qh[ch] * cs[ch] + qh[ch + m] * sn[ch + m]
                  : qh[ch] * cs[ch] - qh[ch - m] * sn[ch - m];
}

/* The store lists every outlier once (`nanokv.quant.kvquant._select_outliers`), so each entry's
 * correction is added as it comes. */

/* the block's key outliers of head g as score corrections */
static inline __attribute__((always_inline)) void key_outliers(
        const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n, const float *restrict q0,
        int64_t group, float *restrict sg, const BlockScratch *w, const int64_t idx_bytes,
        const int64_t kind) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t base = (blk * Hkv + g) * K->cap, limit = n * D;
    const int d_shift = __builtin_ctzll((unsigned long long)D);
    const int d_pow2 = (D & (D - 1)) == 0;  /* slot and channel of an index by a shift */
    const float *half = w->k_half + g * D, *off = w->k_off + g * D;
    const uint8_t *rows = K->codes + (blk * B * Hkv + g) * K->packed;
    const int64_t stride = Hkv * K->packed;
    for (int64_t j = 0; j < K->cap; j++) {
        const int64_t idx = load_index(K->oidx, base + j, idx_bytes);
        if (idx < 0 || idx >= limit) continue;
        const int64_t t = d_pow2 ? idx >> d_shift : idx / D;
        const int64_t ch = idx - t * D;
        const float decoded = fmaf(K->lut[code_at(rows + t * stride, K->bits, ch)], half[ch],
                                   off[ch]);
        const float delta = load_any(K->oval, base + j, kind) - decoded;
        int64_t pos = R ? L->slot_positions[blk * B + t] : 0;
        pos = pos < 0 ? 0 : pos;
        const float *cs = L->cos + pos * R, *sn = L->sin + pos * R;
        for (int64_t hh = 0; hh < group; hh++)
            sg[hh * B + t] += delta * rope_coefficient(q0 + hh * D, cs, sn, ch, R,
                                                      L->rope_halves_equal);
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

/* key_outliers, 16 entries at a time with gathers (head_dim a power of two, 2 or 4-bit codes,
 * int16 / int32 indices): a code is read as the aligned 32-bit word that holds it (rows are
 * whole words: packed = bits * D / 8 with D % 32 == 0); the score corrections go in one by one,
 * since two entries may share a slot */
static void key_outliers16(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                           const float *restrict q0, int64_t group, float *restrict sg,
                           const BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t base = (blk * Hkv + g) * K->cap;
    const float *half = w->k_half + g * D, *off = w->k_off + g * D;
    const uint8_t *rows = K->codes + (blk * B * Hkv + g) * K->packed;
    const int32_t *positions = R ? L->slot_positions + blk * B : NULL;
    const __m512 lut = lut16(K->lut, K->bits);
    const __m512i zero = _mm512_setzero_si512(), limit = _mm512_set1_epi32((int)(n * D));
    const __m512i last_channel = _mm512_set1_epi32((int)(D - 1));
    const __m512i stride = _mm512_set1_epi32((int)(Hkv * K->packed));
    const __m512i code_mask = _mm512_set1_epi32((1 << K->bits) - 1);
    const __m512i half_rot = _mm512_set1_epi32((int)(R / 2)), rot = _mm512_set1_epi32((int)R);
    const int d_shift = __builtin_ctzll((unsigned long long)D), b_shift = K->bits == 4 ? 2 : 1;
    float contrib[16];
    int32_t slot[16];
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
        const __m512i bit = _mm512_slli_epi32(ch, b_shift);  /* the code's bit in its row */
        const __m512i byte = _mm512_add_epi32(_mm512_mullo_epi32(t, stride),
                                              _mm512_slli_epi32(_mm512_srli_epi32(bit, 5), 2));
        const __m512i word = _mm512_mask_i32gather_epi32(zero, live, byte, rows, 1);
        const __m512i code = _mm512_and_si512(
            _mm512_srlv_epi32(word, _mm512_and_si512(bit, _mm512_set1_epi32(31))), code_mask);
        const __m512 decoded = _mm512_fmadd_ps(_mm512_permutexvar_ps(code, lut),
                                               gather_ps(half, ch, live), gather_ps(off, ch, live));
        const __m512 delta = _mm512_maskz_sub_ps(live, elements16(K->oval, base + j0, have,
                                                                  L->sparse_kind), decoded);
        __m512 cv = _mm512_set1_ps(1.f), sv = _mm512_setzero_ps();
        __m512i partner = ch;
        if (R) {  /* q[ch] cos[ch] +- q[partner] sin[partner] at the slot's position */
            const __m512i pos = _mm512_max_epi32(
                _mm512_mask_i32gather_epi32(zero, live, t, positions, 4), zero);
            const __mmask16 first = _mm512_cmplt_epi32_mask(ch, half_rot);
            partner = _mm512_mask_blend_epi32(first, _mm512_sub_epi32(ch, half_rot),
                                              _mm512_add_epi32(ch, half_rot));
            const __m512 sign = _mm512_mask_blend_ps(first, _mm512_set1_ps(-1.f),
                                                     _mm512_set1_ps(1.f));
            const __m512i row = _mm512_mullo_epi32(pos, rot);
            /* rotate-half tables repeat their first half: the pair's lower channel there (the
             * lines the key pass read) */
            const __m512i c_at = L->rope_halves_equal ? _mm512_min_epi32(ch, partner) : ch;
            const __m512i s_at = L->rope_halves_equal ? c_at : partner;
            cv = gather_ps(L->cos, _mm512_add_epi32(row, c_at), live);
            sv = _mm512_mul_ps(sign, gather_ps(L->sin, _mm512_add_epi32(row, s_at), live));
        }
        _mm512_storeu_si512(slot, t);
        for (int64_t hh = 0; hh < group; hh++) {
            const float *qh = q0 + hh * D;
            const __m512 coef = _mm512_fmadd_ps(gather_ps(qh, ch, live), cv,
                                                _mm512_mul_ps(gather_ps(qh, partner, live), sv));
            _mm512_storeu_ps(contrib, _mm512_mul_ps(delta, coef));
            float *sh = sg + hh * B;
            for (unsigned m = live; m; m &= m - 1) {
                const int l = __builtin_ctz(m);
                sh[slot[l]] += contrib[l];
            }
        }
    }
}

/* the block's key outliers of head g as score corrections: 16 at a time where the layout
 * allows (head_dim a power of two, 2 or 4-bit codes, int16 / int32 indices), else one by one */
static void block_key_outliers(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                               const float *q0, int64_t group, float *sg, const BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t D = L->head_dim;
    if ((D & (D - 1)) == 0 && (K->bits == 2 || K->bits == 4)
            && (K->idx_bytes == 2 || K->idx_bytes == 4))
        key_outliers16(L, blk, g, n, q0, group, sg, w);
    else if (K->idx_bytes == 2 && L->sparse_kind == 0)  /* int16 indices, float16 values */
        key_outliers(L, blk, g, n, q0, group, sg, w, 2, 0);
    else
        key_outliers(L, blk, g, n, q0, group, sg, w, K->idx_bytes, L->sparse_kind);
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
