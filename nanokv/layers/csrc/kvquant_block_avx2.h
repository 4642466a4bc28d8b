/* The AVX2 kernels of the KVQuant block path (kvquant_block.h), for CPUs without AVX-512: key
 * dots by tiles of 8 slots (8 channels and their RoPE partners at a time; where the layer fits,
 * the tile's 8 slots in the lanes instead: kvquant_slot_keys_avx2.h), the block's online
 * softmax, and values up to 32 channels at a time; key outliers corrected a tile at a time
 * inside the key pass; the RoPE rows read from the layer's compact copy (rope_rows). Included
 * by quant_decode_attention.c after kvquant_block.h, on AVX2 + FMA + F16C builds without
 * AVX-512.
 *
 * The key pass reads a tile's rows slot by slot, every KV head of a slot before the next slot:
 * the codes are [B, Hkv, packed] per block, so this is address order, a stream this class of
 * CPU's prefetchers follows (a row apart per KV head, as the AVX-512 pass reads, they did
 * not). */

/* the cos and sin rows of position pos: rope_rows' where the layer has them (the halves
 * repeat: first halves only, side by side; switched on), else the tables' */
static inline void rope_rows_at(const KVQuantLayer *L, int64_t pos, const float **cs,
                                const float **sn) {
    const int64_t R = L->rot_dim;
    if (L->rope_rows && L->rope_halves_equal && nanokv_rope_tiles) {
        *cs = L->rope_rows + pos * R;
        *sn = *cs + R / 2;
    } else {
        *cs = L->cos + pos * R;
        *sn = L->sin + pos * R;
    }
}

/* a tile's nt (<= 8) scores of one query head stored at sc */
static inline void tile_scores_store(float *sc, __m256 sums, int64_t nt) {
    if (nt == 8) {
        _mm256_storeu_ps(sc, sums);
    } else {
        float part[8];
        _mm256_storeu_ps(part, sums);
        memcpy(sc, part, sizeof(float) * nt);
    }
}

#include "kvquant_slot_keys_avx2.h"

/* Where key_rotated_fit does not (head_dim not a power of two, uint8 indices: below), key
 * outliers enter as score corrections one at a time, a tile's right after the tile's key pass
 * (its rows and RoPE rows still in L1): the stored delta times the channel's coefficient in
 * q . RoPE(k) (RoPE is linear). The store keeps each KV head's per-channel list in index order
 * (slot-major), its unused entries last, so a tile's entries of a head follow the last tile's:
 * one cursor per KV head walks the lists (key_lists_sorted checks the order once per block;
 * a block out of order takes key_outliers, a KV head at a time after the key pass). */

/* are the key outlier lists of every KV head of the block in index order, unused entries last */
static int key_lists_sorted(const KVQuantLayer *L, int64_t blk) {
    const KVQuantSide *K = &L->k;
    const int64_t Hkv = L->num_kv_heads;
    for (int64_t g = 0; g < Hkv; g++) {
        int64_t prev = -1, ended = 0;
        for (int64_t j = 0; j < K->cap; j++) {
            const int64_t idx = load_index(K->oidx, (blk * Hkv + g) * K->cap + j, K->idx_bytes);
            if (idx < 0) ended = 1;
            else if (ended || idx <= prev) return 0;
            else prev = idx;
        }
    }
    return 1;
}

/* the corrections of the entries of tile [t0, t0 + nt) (t0 + nt <= n) for the query heads
 * [h0, h0 + nh) of every KV head, from each head's cursor (w->k_cursor[g]) on, into w->k_corr
 * (always inlined with constant index and value sizes) */
static inline __attribute__((always_inline)) void tile_key_outliers_impl(
        const KVQuantLayer *L, int64_t blk, int64_t t0, int64_t nt, const float *qb, int64_t h0,
        int64_t nh, BlockScratch *w, const int64_t idx_bytes, const int64_t kind) {
    const KVQuantSide *K = &L->k;
    const int64_t Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t group = L->num_q_heads / Hkv, end = (t0 + nt) * D;
    for (int64_t g = 0; g < Hkv; g++) {
        const int64_t base = (blk * Hkv + g) * K->cap;
        const float *q0 = qb + (g * group + h0) * D;
        float *corr = w->k_corr + g * nh * 8 - t0;  /* [nh, 8] of the tile's slots */
        int64_t j = w->k_cursor[g];
        for (; j < K->cap; j++) {
            const int64_t idx = load_index(K->oidx, base + j, idx_bytes);
            if (idx < 0 || idx >= end) break;
            const KeyOutlier e = key_outlier_entry(L, base + j, idx, kind);
            const float *cs, *sn;
            rope_rows_at(L, slot_rope_position(L, blk, e.t), &cs, &sn);
            for (int64_t hh = 0; hh < nh; hh++)
                corr[hh * 8 + e.t] += e.delta * rope_coefficient(q0 + hh * D, cs, sn, e.ch, R,
                                                                 L->rope_halves_equal);
        }
        w->k_cursor[g] = (int32_t)j;
    }
}

static inline __attribute__((always_inline)) void tile_key_outliers(
        const KVQuantLayer *L, int64_t blk, int64_t t0, int64_t nt, const float *qb, int64_t h0,
        int64_t nh, BlockScratch *w) {
    if (L->k.idx_bytes == 2 && L->sparse_kind == 0)  /* int16 indices, float16 deltas */
        tile_key_outliers_impl(L, blk, t0, nt, qb, h0, nh, w, 2, 0);
    else
        tile_key_outliers_impl(L, blk, t0, nt, qb, h0, nh, w, L->k.idx_bytes, L->sparse_kind);
}

/* the 8 channel pairs (j, j + m) of one key row: centroids ca (channels j..j+7) and cb
 * (j+m..j+m+7) mapped, rotated, dotted with the nh query rows into the a and b accumulators */
static inline __attribute__((always_inline)) void key_pairs8(
        __m256 ca, __m256 cb, int64_t j, int64_t m, int64_t hi, const float *half,
        const float *off, const float *cs, const float *sn, const float *q0, int64_t D,
        const int nh, __m256 *acc_a, __m256 *acc_b) {
    const __m256 a = _mm256_fmadd_ps(ca, _mm256_loadu_ps(half + j), _mm256_loadu_ps(off + j));
    const __m256 b = _mm256_fmadd_ps(cb, _mm256_loadu_ps(half + j + m),
                                     _mm256_loadu_ps(off + j + m));
    /* rotate-half: (a, b) -> (a cos - b sin, b cos + a sin) */
    const __m256 ra = _mm256_fmsub_ps(a, _mm256_loadu_ps(cs + j),
                                      _mm256_mul_ps(b, _mm256_loadu_ps(sn + j)));
    const __m256 rb = _mm256_fmadd_ps(b, _mm256_loadu_ps(cs + j + hi),
                                      _mm256_mul_ps(a, _mm256_loadu_ps(sn + j + hi)));
    for (int hh = 0; hh < nh; hh++) {
        acc_a[hh] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + hh * D + j), ra, acc_a[hh]);
        acc_b[hh] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + hh * D + j + m), rb, acc_b[hh]);
    }
}

/* the dots of one tile's slots [t0, t0 + 8) (rows past n read, their dots dropped later) with
 * the query heads [h0, h0 + nh) of every KV head: slot by slot and KV head by KV head (address
 * order), the channel pairs (j, j + D/2) of a row looked up (4-bit: 32 channels at a time,
 * centroids32 with the codebook's byte planes; a head of 32 channels in one), mapped, rotated
 * and dotted with the nh query rows, two accumulators per head (the a and b halves: shorter
 * dependency chains). Without RoPE the rows "rotate" by cos 1, sin 0 (exact). Always inlined
 * with constant nh and bits, and head_dim (0: L->head_dim, read at run time). */
static inline __attribute__((always_inline)) void key_tile_dots(
        const KVQuantLayer *L, int64_t blk, int64_t t0, int64_t n, const float *qb, int64_t h0,
        const int nh, const int bits, __m256 tlo, __m256 thi, const __m256i *planes,
        const BlockScratch *w, __m256 *dots, const int64_t head_dim) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, R = L->rot_dim;
    const int64_t D = head_dim ? head_dim : L->head_dim;
    const int64_t m = D / 2, group = L->num_q_heads / Hkv;
    const int64_t stride = Hkv * K->packed;
    /* cos / sin rows of rotate-half tables repeat their first half: read that half only */
    const int64_t hi = L->rope_halves_equal || !R ? 0 : m;
    for (int64_t u = 0; u < 8; u++) {
        const int64_t s = t0 + u;
        int64_t pos = R && s < n ? L->slot_positions[blk * B + s] : 0;
        pos = pos < 0 ? 0 : pos;
        const float *cs = w->unit, *sn = w->unit + D;
        if (R) rope_rows_at(L, pos, &cs, &sn);
        const uint8_t *slot_rows = K->codes + (blk * B + s) * stride;
        for (int64_t g = 0; g < Hkv; g++) {
            const uint8_t *row = slot_rows + g * K->packed;
            const float *half = w->k_half + g * D, *off = w->k_off + g * D;
            const float *q0 = qb + (g * group + h0) * D;
            __m256 acc_a[FAST_MAX_HEADS], acc_b[FAST_MAX_HEADS];
            for (int hh = 0; hh < nh; hh++) {
                acc_a[hh] = _mm256_setzero_ps();
                acc_b[hh] = _mm256_setzero_ps();
            }
            int64_t j = 0;
            if (bits == 4 && head_dim == 32) {  /* the fixed heads of 32: one look-up a row */
                __m256 c[4];
                centroids32(row, 0, planes, 1, c);
                key_pairs8(c[0], c[2], 0, m, hi, half, off, cs, sn, q0, D, nh, acc_a, acc_b);
                key_pairs8(c[1], c[3], 8, m, hi, half, off, cs, sn, q0, D, nh, acc_a, acc_b);
                j = m;
            }
            if (bits == 4)
                for (; j + 32 <= m; j += 32) {
                    __m256 ca[4], cb[4];
                    centroids32(row, j, planes, 1, ca);
                    centroids32(row, j + m, planes, 1, cb);
                    for (int c = 0; c < 4; c++)
                        key_pairs8(ca[c], cb[c], j + 8 * c, m, hi, half, off, cs, sn, q0, D, nh,
                                   acc_a, acc_b);
                }
            for (; j < m; j += 8)
                key_pairs8(centroids8(row, bits, j, tlo, thi),
                           centroids8(row, bits, j + m, tlo, thi), j, m, hi, half, off, cs, sn,
                           q0, D, nh, acc_a, acc_b);
            for (int hh = 0; hh < nh; hh++)
                dots[(g * nh + hh) * 8 + u] = _mm256_add_ps(acc_a[hh], acc_b[hh]);
        }
    }
}

/* sparse values of the 8 entries at p, as float32 (kinds as load_any) */
static inline __m256 elements8(const void *p, int64_t kind) {
    if (kind == 2) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == 0) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Where the store's layout fits (key_rotated_fit) and the lists are in index order, the key
 * outliers are corrected after the key pass from operands made during it for every query
 * head: an entry's correction of the score of query head h is its stored delta (exact -
 * decoded) times h's coefficient in q . RoPE(k) (rope_coefficient), = q_h[ch] * A +
 * q_h[partner] * B with A = delta * cos and B = +-delta * sin at the slot's position, neither
 * depending on the query. The operands of a tile's entries are made right after its key pass
 * (its RoPE rows still in L1; made from the whole block at once after the pass, those rows came
 * back from memory), every KV head's entries staged side by side and taken 8 at a time (a
 * head's alone filled a third of the lanes), the RoPE rows gathered; the corrections are
 * then four loads and two FMAs per entry and query head (key_rotated_fixes). Other layouts
 * correct a tile's entries one at a time (tile_key_outliers). */

/* does the layout fit: head_dim a power of two, int16 / int32 indices (no code is read: the
 * entries hold their deltas) */
static inline int key_rotated_fit(const KVQuantLayer *L) {
    const int64_t D = L->head_dim;
    return (D & (D - 1)) == 0 && (L->k.idx_bytes == 2 || L->k.idx_bytes == 4);
}

/* the operands of the entries of tile [t0, t0 + nt) of every KV head, appended to w->ko_*
 * (w->ko_count so far this block): each head's entries from its cursor (w->k_cursor) on
 * staged side by side first (indices, KV heads, deltas), then 8 at a time across heads
 * (always inlined with constant index and value sizes) */
static inline __attribute__((always_inline)) void tile_key_rotated_impl(
        const KVQuantLayer *L, int64_t blk, int64_t t0, int64_t nt, BlockScratch *w,
        const int64_t idx_bytes, const int64_t kind) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t cap = K->cap, elem = kind == 2 ? 4 : 2;
    const int d_shift = __builtin_ctzll((unsigned long long)D);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i end = _mm256_set1_epi32((int)((t0 + nt) * D));
    int32_t *st_idx = w->st_idx, *st_g = w->st_g;
    float *st_val = w->st_val;
    int64_t staged = 0;
    for (int64_t g = 0; g < Hkv; g++) {
        const int64_t base = (blk * Hkv + g) * cap;
        int64_t j = w->k_cursor[g];
        while (j < cap) {
            const int64_t have = cap - j < 8 ? cap - j : 8;
            const uint8_t *ip = (const uint8_t *)K->oidx + (base + j) * idx_bytes;
            const uint8_t *vp = (const uint8_t *)K->oval + (base + j) * elem;
            uint8_t idx_tail[32], val_tail[32];
            if (have < 8) {  /* the last entries, from a padded copy: unused (-1), value 0 */
                memset(idx_tail, 0xff, sizeof idx_tail);
                memset(val_tail, 0, sizeof val_tail);
                memcpy(idx_tail, ip, (size_t)(have * idx_bytes));
                memcpy(val_tail, vp, (size_t)(have * elem));
                ip = idx_tail;
                vp = val_tail;
            }
            const __m256i idx = idx_bytes == 2
                ? _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)ip))
                : _mm256_loadu_si256((const __m256i *)ip);
            const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(-1)),
                                                _mm256_cmpgt_epi32(end, idx));
            const unsigned taken = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(in));
            const int count = __builtin_ctz(~taken);  /* the tile's entries: a prefix */
            /* all 8 lanes staged, the next entries written over the ones past count */
            _mm256_storeu_si256((__m256i *)(st_idx + staged), idx);
            _mm256_storeu_si256((__m256i *)(st_g + staged), _mm256_set1_epi32((int)g));
            _mm256_storeu_ps(st_val + staged, elements8(vp, kind));
            staged += count;
            j += count;
            if (count < have || count == 0) break;
        }
        w->k_cursor[g] = (int32_t)j;
    }
    /* the tile's slot positions (t0 + 8 <= B: within the block's row; negative entries 0;
     * none without RoPE) */
    const __m256i pos8 = R ? _mm256_max_epi32(
        _mm256_loadu_si256((const __m256i *)(L->slot_positions + blk * B + t0)),
        _mm256_setzero_si256()) : _mm256_setzero_si256();
    /* the cos and sin bases: rope_rows' halves side by side, or the tables (the first half
     * only where the halves repeat) */
    const int rows = L->rope_rows && L->rope_halves_equal && nanokv_rope_tiles;
    const float *cos_base = rows ? L->rope_rows : L->cos;
    const float *sin_base = rows ? L->rope_rows + R / 2 : L->sin;
    const int folded = rows || L->rope_halves_equal;  /* both at the channel's first-half index */
    const __m256i half_rot = _mm256_set1_epi32((int)(R / 2)), rot = _mm256_set1_epi32((int)R);
    const __m256i d_mask = _mm256_set1_epi32((int)D - 1);
    const int64_t group = L->num_q_heads / Hkv;  /* a KV head's first query head: g * group */
    const __m256i heads_d = _mm256_set1_epi32((int)(group * D));
    const __m256i heads_b = _mm256_set1_epi32((int)(group * B));
    const int64_t out = w->ko_count;
    for (int64_t e = 0; e < staged; e += 8) {
        const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(staged - e)), lane);
        const __m256i at = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(st_idx + e)),
                                            valid);  /* lanes past staged: entry 0 of head 0 */
        const __m256i g = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(st_g + e)), valid);
        const __m256i t = _mm256_srli_epi32(at, d_shift), ch = _mm256_and_si256(at, d_mask);
        const __m256i tt = _mm256_sub_epi32(t, _mm256_and_si256(_mm256_set1_epi32((int)t0),
                                                                valid));
        /* the stored delta, exact - decoded: no code or statistic gathered */
        const __m256 delta = _mm256_and_ps(_mm256_castsi256_ps(valid),
                                           _mm256_loadu_ps(st_val + e));
        __m256 a = delta, b = _mm256_setzero_ps();
        __m256i partner = ch;
        if (R) {  /* cos and +-sin of the channel's pair at the slot's position */
            const __m256i second = _mm256_cmpgt_epi32(
                ch, _mm256_sub_epi32(half_rot, _mm256_set1_epi32(1)));
            const __m256i first = _mm256_sub_epi32(ch, _mm256_and_si256(second, half_rot));
            partner = _mm256_sub_epi32(_mm256_add_epi32(ch, half_rot),
                                       _mm256_and_si256(second, rot));
            const __m256i row0 = _mm256_mullo_epi32(_mm256_permutevar8x32_epi32(pos8, tt), rot);
            const __m256 cs = _mm256_i32gather_ps(
                cos_base, _mm256_add_epi32(row0, folded ? first : ch), 4);
            const __m256 sn = _mm256_i32gather_ps(
                sin_base, _mm256_add_epi32(row0, folded ? first : partner), 4);
            a = _mm256_mul_ps(delta, cs);
            b = _mm256_xor_ps(_mm256_mul_ps(delta, sn),
                              _mm256_castsi256_ps(_mm256_slli_epi32(second, 31)));
        }
        /* lanes past staged: written over by the next tile's or never read (8 spare entries) */
        const __m256i hq = _mm256_mullo_epi32(g, heads_d), hs = _mm256_mullo_epi32(g, heads_b);
        _mm256_storeu_si256((__m256i *)(w->ko_score + out + e), _mm256_add_epi32(hs, t));
        _mm256_storeu_si256((__m256i *)(w->ko_q + out + e), _mm256_add_epi32(hq, ch));
        _mm256_storeu_si256((__m256i *)(w->ko_qp + out + e), _mm256_add_epi32(hq, partner));
        _mm256_storeu_ps(w->ko_a + out + e, a);
        _mm256_storeu_ps(w->ko_b + out + e, b);
    }
    w->ko_count = out + staged;
}

static inline __attribute__((always_inline)) void tile_key_rotated(
        const KVQuantLayer *L, int64_t blk, int64_t t0, int64_t nt, BlockScratch *w) {
#define ROTATED(ib, kd) tile_key_rotated_impl(L, blk, t0, nt, w, ib, kd)
    if (L->k.idx_bytes == 2 && L->sparse_kind == 0) ROTATED(2, 0);  /* int16, float16 */
    else if (L->k.idx_bytes == 4 && L->sparse_kind == 0) ROTATED(4, 0);
    else ROTATED(L->k.idx_bytes, L->sparse_kind);
#undef ROTATED
}

/* the corrections of every entry the key pass took (the operands above) added to the scores
 * of the query heads of its KV head (qb: the request's queries), from the flat places of its
 * head's first query head the operands hold (an entry's KV head, slot and channels combined
 * there, a vector at a time: 0.98x the kernel's time against combining them here); always
 * inlined with the group a constant where BLOCK_HEADS_DISPATCH has an instance */
static inline __attribute__((always_inline)) void key_rotated_fixes_impl(
        const KVQuantLayer *L, const float *restrict qb, const BlockScratch *w,
        const int64_t group) {
    const int64_t B = L->block_size, D = L->head_dim;
    float *restrict scores = w->scores;
    for (int64_t e = 0; e < w->ko_count; e++) {
        const int64_t at = w->ko_score[e], qc = w->ko_q[e], qp = w->ko_qp[e];
        const float a = w->ko_a[e], b = w->ko_b[e];
        for (int64_t hh = 0; hh < group; hh++)
            scores[at + hh * B] += qb[qc + hh * D] * a + qb[qp + hh * D] * b;
    }
}

static void key_rotated_fixes(const KVQuantLayer *L, const float *restrict qb,
                              const BlockScratch *w) {
    const int64_t group = L->num_q_heads / L->num_kv_heads;
#define FIXES(k) key_rotated_fixes_impl(L, qb, w, k)
    BLOCK_HEADS_DISPATCH(FIXES, group)
#undef FIXES
}

/* scores[h * B + t] = q_h . RoPE_pos(t)(lut[codes] * half + off) for the query heads
 * h = g * group + hh, hh in [h0, h0 + nh), of every KV head g and the block's first n slots, by
 * tiles of 8 slots (key_tile_dots, or key_tile_slots where `slots`: 0.89-0.96x the kernel's
 * time at 4 bits, 0.87-0.91x at 2, Qwen3-0.6B's shape), each tile's key outliers added as
 * corrections (tile_key_outliers); the next block's data prefetched a share per tile, and its
 * first tile's rows and RoPE rows during this block's last (within a block the hardware
 * prefetchers follow the rows: prefetching them too was slower). Always inlined with a
 * constant nh, head_dim as key_tile_dots takes it, and `slots`: 0, or the code width of the
 * slot-lanes pass. */
static inline __attribute__((always_inline)) void block_key_dots(
        const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n, const float *qb,
        int64_t h0, const int nh, BlockScratch *w, const int64_t head_dim, const int slots) {
    const KVQuantSide *K = &L->k, *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, R = L->rot_dim;
    const int64_t group = L->num_q_heads / Hkv, stride = Hkv * K->packed;
    const int64_t rope_bytes = (L->rope_halves_equal ? R / 2 : R) * (int64_t)sizeof(float);
    __m256 *dots = (__m256 *)w->dots;  /* [Hkv * nh, 8] */
    const int64_t tiles = (n + 7) / 8;
    /* the key outliers a tile at a time (tile_key_outliers), where the lists are in order */
    const int outliers = K->cap > 0 && w->k_sorted && !w->k_rotated;
    const int rotated = w->k_rotated && h0 == 0;  /* the operands: with the first heads */
    __m256 tlo, thi;  /* the key codebook (key_tile_dots: tlo / thi, 4-bit also planes) */
    __m256i planes[4];
    lut_halves8(K->lut, K->bits, &tlo, &thi);
    lut_planes4(K->lut, K->bits, planes);
    for (int64_t g = 0; g < Hkv; g++) w->k_cursor[g] = 0;
    if (slots && h0 == 0) slot_key_tables_avx2(L, w);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const int64_t nt = n - t0 < 8 ? n - t0 : 8;
        if (next_blk >= 0 && h0 == 0)  /* the next block's data, a share per tile */
            prefetch_block_data(L, next_blk, t0 / 8, tiles);
        /* the next tile's rows (every head: in address order), its RoPE rows */
        for (int64_t t = t0 + 8 > n ? t0 + 8 : n; t < t0 + 16; t++) {
            const int64_t ahead = t < n ? blk * B + t : (next_blk >= 0 && t - n < B
                                                        ? next_blk * B + t - n : -1);
            if (ahead < 0) break;
            prefetch_rows(K->codes + ahead * stride, stride);
            if (h0 > 0) continue;
            prefetch_rows(V->codes + ahead * Hkv * V->packed, Hkv * V->packed);
            if (R) {
                int64_t pos = L->slot_positions[ahead];
                pos = pos < 0 ? 0 : pos;
                const float *cs, *sn;
                rope_rows_at(L, pos, &cs, &sn);
                prefetch_rows((const uint8_t *)cs, rope_bytes);
                prefetch_rows((const uint8_t *)sn, rope_bytes);
            }
        }
#define TILE_DOTS(b) key_tile_dots(L, blk, t0, n, qb, h0, nh, b, tlo, thi, planes, w, dots, \
                                  head_dim)
        if (slots)  /* the scores, stored; corrections added below */
            key_tile_slots(L, blk, t0, n, qb, h0, nh, slots, w);
        else switch (K->bits) {
        case 4: TILE_DOTS(4); break;
        case 3: if (!head_dim) TILE_DOTS(3); break;  /* never fixed: heads_of_32_fit */
        default: TILE_DOTS(2); break;
        }
#undef TILE_DOTS
        if (rotated) tile_key_rotated(L, blk, t0, nt, w);  /* the tile's key outlier operands */
        if (outliers) tile_key_outliers(L, blk, t0, nt, qb, h0, nh, w);  /* into w->k_corr */
        if (slots) {
            if (outliers) slot_scores_corrected(L, t0, nt, h0, nh, w);
            continue;
        }
        for (int64_t g = 0; g < Hkv; g++)
            for (int hh = 0; hh < nh; hh++) {
                __m256 sums = sum8(dots + (g * nh + hh) * 8);
                if (outliers) {  /* the corrections added, and cleared for the next tile */
                    float *corr = w->k_corr + (g * nh + hh) * 8;
                    sums = _mm256_add_ps(sums, _mm256_load_ps(corr));
                    _mm256_store_ps(corr, _mm256_setzero_ps());
                }
                tile_scores_store(w->scores + (g * group + h0 + hh) * B + t0, sums, nt);
            }
    }
}

/* Where a head takes more than one value pass (32 channels for up to 2 heads), the first pass
 * prefetches the row VALUE_AHEAD slots on into L1 and the second the next KV head's row of the
 * same slot (its pass comes next) into L2: the key pass prefetches only the next block's first
 * rows, and a KV head's value rows are Hkv * packed bytes apart (512 at 8 heads of 128 4-bit
 * channels), which left the value pass waiting on its rows at 16 requests or 16k tokens (there
 * 3-6% of the kernel, the next head's rows 3-5% more; 8 and 24 slots on gained less; heads of
 * 32, one pass over rows 64 bytes apart, gained nothing) */
enum { VALUE_AHEAD = 64 };

/* the group's query heads [h0, h0 + nh) of KV head g, nh <= FAST_MAX_HEADS, for the block's
 * first n slots: acc_h += sum_t pa[h, t] * lut[codes_t] + pb[h], CV vectors of 8 channels per
 * head held in registers (32 channels for up to 2 heads, 16 for up to 4, else 8). Always
 * inlined with constant nh, code width (`cbits`: 4, or 0 for V->bits read at run time) and
 * whether rows carry patches: the loop over a block's slots is then the look-up and the FMAs
 * alone (with the code width and the patch count read at run time, the compiler kept both
 * look-ups and the patch loop's test in it and spilled an accumulator: the value pass took a
 * third longer at the Qwen3-0.6B shape). */
static inline __attribute__((always_inline)) void block_values(
        const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n, float *acc0, int64_t h0,
        const int nh, const float *pb, const BlockScratch *w, const int64_t patches,
        const int cbits, const int patched) {
    enum { CV_MAX = 4 };
    const int CV = nh <= 2 ? 4 : (nh <= 4 ? 2 : 1);
    const KVQuantSide *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const int64_t bits = cbits ? cbits : V->bits;
    /* 4-bit, 32 channels: centroids32 without its permutes, the accumulators held in its
     * channel order (permuted on load, back on store) */
    const int planar = cbits == 4 && CV == 4;
    __m256 tlo, thi;
    __m256i planes[4];
    if (planar) lut_planes4(V->lut, bits, planes);
    else lut_halves8(V->lut, bits, &tlo, &thi);
    const __m256i order = planar ? _mm256_setr_epi32(CENTROIDS32_ORDER)
                                 : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i natural = planar ? _mm256_setr_epi32(CENTROIDS32_NATURAL) : order;
    const uint8_t *rows = V->codes + ((blk * B) * Hkv + g) * V->packed;
    const int64_t stride = Hkv * V->packed;
    const int ahead = D > 8 * CV;  /* more than one pass over the rows: see VALUE_AHEAD */
    for (int64_t d = 0; d < D; d += 8 * CV) {
        __m256 a[FAST_MAX_HEADS][CV_MAX];
        for (int hh = 0; hh < nh; hh++) {
            const __m256 bias = _mm256_set1_ps(pb[h0 + hh]);
            for (int c = 0; c < CV; c++) {
                a[hh][c] = _mm256_add_ps(_mm256_loadu_ps(acc0 + hh * D + d + 8 * c), bias);
                if (planar) a[hh][c] = _mm256_permutevar8x32_ps(a[hh][c], order);
            }
        }
        /* the channel of each lane (for the outlier patches) */
        const __m256i lane0 = _mm256_add_epi32(order, _mm256_set1_epi32((int)d));
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *row = rows + t * stride;
            if (ahead && d == 0 && t + VALUE_AHEAD < n)  /* the first pass: later rows */
                _mm_prefetch((const char *)(row + VALUE_AHEAD * stride), _MM_HINT_T0);
            if (ahead && d == 8 * CV && g + 1 < Hkv)  /* the second: the next KV head's row */
                prefetch_rows(row + V->packed, V->packed);
            __m256 v[CV_MAX];
            if (planar)
                centroids32(row, d, planes, 0, v);
            else
                for (int c = 0; c < CV; c++) v[c] = centroids8(row, bits, d + 8 * c, tlo, thi);
            for (int64_t j = 0; patched && j < patches; j++) {  /* the row's outliers' deltas,
                                                                 * in centroid units */
                const __m256i ch = _mm256_set1_epi32(w->patch_ch[(t * Hkv + g) * patches + j]);
                const __m256 x = _mm256_set1_ps(w->patch_x[(t * Hkv + g) * patches + j]);
                for (int c = 0; c < CV; c++) {
                    const __m256i lane = _mm256_add_epi32(lane0, _mm256_set1_epi32(8 * c));
                    v[c] = _mm256_add_ps(v[c], _mm256_and_ps(
                        x, _mm256_castsi256_ps(_mm256_cmpeq_epi32(lane, ch))));
                }
            }
            for (int hh = 0; hh < nh; hh++) {
                const __m256 p = _mm256_broadcast_ss(w->pa + (h0 + hh) * B + t);
                for (int c = 0; c < CV; c++) a[hh][c] = _mm256_fmadd_ps(p, v[c], a[hh][c]);
            }
        }
        for (int hh = 0; hh < nh; hh++)
            for (int c = 0; c < CV; c++)
                _mm256_storeu_ps(acc0 + hh * D + d + 8 * c,
                                 planar ? _mm256_permutevar8x32_ps(a[hh][c], natural) : a[hh][c]);
    }
}

/* the block's key outliers of head g as score corrections where the key pass did not take them
 * (lists out of order: key_lists_sorted) */
static void block_key_outliers(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                               const float *q0, int64_t group, float *sg, BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    if (w->k_rotated) {  /* every KV head's, with the first's (q0, sg: the block's first) */
        if (g == 0) key_rotated_fixes(L, q0, w);
        return;
    }
    if (!K->cap || w->k_sorted) return;  /* none, or corrected in the key pass */
    if (K->idx_bytes == 2 && L->sparse_kind == 0)  /* int16 indices, float16 values */
        key_outliers(L, blk, g, n, q0, group, sg, w, 2, 0);
    else
        key_outliers(L, blk, g, n, q0, group, sg, w, K->idx_bytes, L->sparse_kind);
}

/* the online softmax of heads [h, h + group) over the block's n scores; scores become P */
static void block_softmax(Softmax *s, int64_t h, int64_t group, int64_t n, int64_t B,
                          int64_t D, float *sg) {
    const int64_t n8 = n / 8 * 8;
    for (int64_t hh = 0; hh < group; hh++) {
        float *sc = sg + hh * B;
        __m256 vmax = _mm256_set1_ps(s->m[h + hh]);
        for (int64_t t = 0; t < n8; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sc + t));
        float mx = hmax256(vmax);
        for (int64_t t = n8; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t t = 0; t < n8; t += 8) {
            const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vmx));
            _mm256_storeu_ps(sc + t, p);
            vsum = _mm256_add_ps(vsum, p);
        }
        float sum = hsum256(vsum);
        for (int64_t t = n8; t < n; t++) {
            sc[t] = expf(sc[t] - mx);
            sum += sc[t];
        }
        const float corr = expf(s->m[h + hh] - mx);
        s->l[h + hh] = s->l[h + hh] * corr + sum;
        s->m[h + hh] = mx;
        if (corr != 1.f) {
            float *ah = s->acc + (h + hh) * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) ah[d] *= corr;
        }
    }
}

/* entries [e0, e0 + 8) of the block's value lists as patches, written with plain stores (the
 * scratch has 8 spare entries: lanes past `have`, read from the caller's zero-padded ch8 / val,
 * are written but never read; masked stores are microcoded on some AVX2 CPUs); the statistics
 * read past the block's rows likewise (v_stats has 8 spare floats). Returns the lanes of
 * outliers in rows without a centroid scale (always inlined with a constant kind). */
static inline __attribute__((always_inline)) int value_patches8(
        const float *vh, int64_t e0, int c_shift, const uint8_t *ch8,
        const uint8_t *val, int64_t have, int64_t D, const int64_t kind, BlockScratch *w) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i row_of = _mm256_srli_epi32(lane, c_shift);  /* an entry's row, from e0's */
    const __m256i have_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)have), lane);
    const int64_t r0 = e0 >> c_shift;
    const __m256 half = _mm256_permutevar8x32_ps(_mm256_loadu_ps(vh + r0), row_of);
    const __m256i ch = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ch8));
    const __m256 delta = elements8(val, kind);
    /* valid: an entry in range with a channel < D (unused entries hold 255) */
    const __m256i valid = _mm256_and_si256(have_mask,
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32((int)D), ch));
    const __m256i scaled = _mm256_and_si256(
        valid, _mm256_castps_si256(_mm256_cmp_ps(half, _mm256_setzero_ps(), _CMP_NEQ_OQ)));
    const __m256 inv = _mm256_and_ps(_mm256_castsi256_ps(scaled),
                                     _mm256_div_ps(_mm256_set1_ps(1.f), half));
    _mm256_storeu_si256((__m256i *)(w->patch_ch + e0),
                        _mm256_blendv_epi8(_mm256_set1_epi32(-1), ch, scaled));
    _mm256_storeu_ps(w->patch_x + e0, _mm256_mul_ps(delta, inv));
    return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_andnot_si256(scaled, valid)));
}

/* value_patches of every KV head of the block at once, before the heads' value passes, as the
 * AVX-512 header's: the block's lists ([n, Hkv, cap], contiguous) 8 entries at a time (the last
 * from a zero-padded copy), each row's half-range permuted to its entries, x = delta /
 * half-range. A sink slot's patches are left in (the value pass weighs its row by 0).
 * Returns whether an outlier lies in a row without a centroid scale (half-range 0), which
 * value_patches adds a KV head at a time. */
static int block_value_patches(const KVQuantLayer *L, int64_t blk, int64_t n,
                               BlockScratch *w) {
    const KVQuantSide *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, cap = V->cap;
    const int64_t rows = n * Hkv, entries = rows * cap, first = blk * B * Hkv * cap;
    const int64_t kind = L->sparse_kind, elem = kind == 2 ? 4 : 2;
    const int c_shift = __builtin_ctzll((unsigned long long)cap);
    const float *vh = w->v_stats;
    const uint8_t *ch8 = (const uint8_t *)V->oidx + first;
    const uint8_t *val = (const uint8_t *)V->oval + first * elem;
    int unscaled = 0;
    int64_t e0 = 0;
#define PATCHES8(k)                                                                            \
    for (; e0 + 8 <= entries; e0 += 8)                                                         \
        unscaled |= value_patches8(vh, e0, c_shift, ch8 + e0, val + e0 * elem, 8, D, k, w)
    switch (kind) {
    case 0: PATCHES8(0); break;
    case 1: PATCHES8(1); break;
    default: PATCHES8(2); break;
    }
#undef PATCHES8
    if (e0 < entries) {  /* the last entries, from a zero-padded copy (no read past the lists) */
        const int64_t have = entries - e0;
        uint8_t ch_tail[8] = {0}, val_tail[32] = {0};
        memcpy(ch_tail, ch8 + e0, (size_t)have);
        memcpy(val_tail, val + e0 * elem, (size_t)(have * elem));
        unscaled |= value_patches8(vh, e0, c_shift, ch_tail, val_tail, have, D, kind, w);
    }
    return unscaled != 0;
}

static inline int value_outliers16_fit(const KVQuantLayer *L) {
    (void)L;
    return 0;
}

static void block_value_outliers16(const KVQuantLayer *L, int64_t blk, int64_t n, float *acc,
                                   const BlockScratch *w) {
    (void)L; (void)blk; (void)n; (void)acc; (void)w;
}

/* the AVX-512 header's planar operands have no AVX2 counterpart: none */
static void block_request_queries(const KVQuantLayer *L, const float *qb, BlockScratch *w) {
    (void)L; (void)qb; (void)w;
}

static int block_key_operands(const KVQuantLayer *L, int64_t blk, int64_t n, BlockScratch *w) {
    (void)n;
    w->k_sorted = L->k.cap > 0 && key_lists_sorted(L, blk);
    w->k_rotated = w->k_sorted && key_rotated_fit(L);
    w->ko_count = 0;
    return 0;
}

/* does the key pass of query heads [h0, h0 + nh) take block_key_heads_32: heads of 32
 * channels, 2- or 4-bit codes (its instances have no 3-bit code), nh one of its instances' */
static inline int heads_of_32_fit(const KVQuantLayer *L, int nh) {
    return nanokv_fixed_head_dims && L->head_dim == 32 && (L->k.bits == 4 || L->k.bits == 2)
           && (nh == 1 || nh == 2 || nh == 4 || nh == 8);
}

/* Heads of 32 channels (heads_of_32_fit) go through key pass instances with head_dim a
 * constant as well: a row is then one or two look-ups and two channel
 * pairs of 8, its loops gone (with head_dim read at run time their bookkeeping was a large
 * share of such short rows; longer heads gained nothing from it). A function of their own:
 * the run-time instances' code stays as it was. */
static __attribute__((noinline)) void block_key_heads_32(
        const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n, const float *qb,
        int64_t h0, int nh, BlockScratch *w) {
    switch (nh) {
    case 1: block_key_dots(L, blk, next_blk, n, qb, h0, 1, w, 32, 0); break;
    case 2: block_key_dots(L, blk, next_blk, n, qb, h0, 2, w, 32, 0); break;
    case 4: block_key_dots(L, blk, next_blk, n, qb, h0, 4, w, 32, 0); break;
    default: block_key_dots(L, blk, next_blk, n, qb, h0, 8, w, 32, 0); break;
    }
}

/* the slot-lanes key pass (slot_keys_avx2_fit): instances of block_key_dots of their own
 * (built into the channel-lanes instances, its branches had left those 4-5% slower) */
static __attribute__((noinline)) void block_key_slots(
        const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n, const float *qb,
        int64_t h0, int nh, BlockScratch *w) {
#define SLOT_DOTS(k) block_key_dots(L, blk, next_blk, n, qb, h0, k, w, 0, bits)
    if (L->k.bits == 4) {
        const int bits = 4;
        BLOCK_HEADS_DISPATCH(SLOT_DOTS, nh)
    } else {
        const int bits = 2;
        BLOCK_HEADS_DISPATCH(SLOT_DOTS, nh)
    }
#undef SLOT_DOTS
}

/* the key dots of query heads [h0, h0 + nh) of every KV head (instances with nh constant) */
static void block_key_heads(const KVQuantLayer *L, int64_t blk, int64_t next_blk, int64_t n,
                            const float *qb, int64_t h0, int nh, int planar, BlockScratch *w) {
    (void)planar;
    if (heads_of_32_fit(L, nh)) {
        block_key_heads_32(L, blk, next_blk, n, qb, h0, nh, w);
        return;
    }
    if (slot_keys_avx2_fit(L)) {  /* the slot-lanes pass, instanced per code width */
        block_key_slots(L, blk, next_blk, n, qb, h0, nh, w);
        return;
    }
#define KEY_DOTS(k) block_key_dots(L, blk, next_blk, n, qb, h0, k, w, 0, 0)
    BLOCK_HEADS_DISPATCH(KEY_DOTS, nh)
#undef KEY_DOTS
}

/* the value pass of query heads [h0, h0 + nh) of KV head g (acc0: head h0's accumulator) */
static void block_value_heads(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                              float *acc0, int64_t h0, int nh, const float *pb,
                              const BlockScratch *w, int64_t patches) {
#define VALUES(k) block_values(L, blk, g, n, acc0, h0, k, pb, w, patches, cbits, patched)
#define VALUES_OF(b, p)                        \
    {                                           \
        const int cbits = b, patched = p;       \
        BLOCK_HEADS_DISPATCH(VALUES, nh)        \
    }
    if (L->v.bits == 4 && patches == 0) VALUES_OF(4, 0)
    else if (L->v.bits == 4) VALUES_OF(4, 1)
    else if (patches == 0) VALUES_OF(0, 0)
    else VALUES_OF(0, 1)
#undef VALUES_OF
#undef VALUES
}
