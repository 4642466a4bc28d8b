/* KVQuant decode attention a whole block at a time, the codes decoded in registers: the fast
 * path of `kvquant_decode_attention`. This file holds what every vector width shares (the
 * scratch, the layout it takes, prefetches, the scalar corrections); the vector kernels (key
 * dots, softmax, values) are in kvquant_block_avx512.h (AVX-512F/BW/VL) and
 * kvquant_block_avx2.h (AVX2 + FMA + F16C), and the driver, `kvquant_block_fast`, in
 * quant_decode_attention.c, which includes them after its Softmax, sum16 / sum8, exp512 /
 * exp256, the lookups, the scalar decodes and loads, KVQuantLayer, load_head and rope_head. The
 * reference for every result is that file's row path (`kvquant_row_block`), itself checked
 * against dequantize-then-dense.
 *
 * The case it takes: per-channel keys (per-block statistics) rotated over the whole head or not
 * at all, per-token values with one statistic per (slot, head), codes of 2, 3 or 4 bits, head_dim
 * a multiple of 32, block_size a multiple of 16, a block whose keys are not staged. Per block:
 *   1. keys, all KV heads, by tiles of slots: a slot's row is looked up, mapped by the block's
 *      per-channel statistics and rotated (a vector of channels and their RoPE partners at a
 *      time) in registers and dotted with its group's queries; the dot products of a tile's
 *      slots are reduced together (sum16 / sum8). On AVX-512 with 2 or 4-bit keys, the tile's
 *      16 slots are the lanes instead (kvquant_slot_keys_avx512.h: a channel of 16 slots per
 *      table permute, no reduction). Then per KV head:
 *   2. key outliers enter as corrections of the scores they touch, the stored delta (exact -
 *      decoded, `nanokv.quant.kvquant`: no code or statistic of the outlier's element is read)
 *      times that channel's coefficient in q . RoPE(k) (RoPE is linear): on AVX-512 16 at a
 *      time per KV head after the key pass, on AVX2 a tile at a time inside it (while the
 *      tile's rows are in L1); a sink slot's score is recomputed from its full-precision row;
 *   3. the online softmax over the block's scores at once;
 *   4. values: P @ (lut[codes] * half_t + off_t) = (P * half_t) @ lut[codes] + P . off_t, a few
 *      vectors of channels of up to 8 query heads held in registers across the block's slots;
 *   5. value outliers and sink rows as corrections of the accumulators (heads of at most 64
 *      channels: the outliers patched into the value pass in centroid units instead; on
 *      AVX-512 a slot's outliers of every KV head 16 at a time after the last value pass).
 * No decoded row goes to memory. */

#define FAST_MAX_HEADS 8 /* query heads whose accumulators are held in registers at once */

typedef struct {
    float *scores;         /* [Hq, B]: a head's scores of the block's slots, then its P */
    float *pa;             /* [group, B]: P * the slot's value half-range (0 at a sink slot) */
    float *k_off, *k_half; /* [Hkv, D]: the block's key statistics */
    float *row;            /* [D]: a sink's full-precision row */
    float *v_half, *v_off; /* [B]: the value statistics of the KV head's slots */
    float *live;           /* [B]: 0 at a sink slot (its row is added apart), else 1 */
    float *pb;             /* [group]: P . the slots' value offsets, per query head */
    int32_t *patch_ch;     /* [B, Hkv, value cap]: a value outlier's channel, -1 none (small
                              heads; the store's order of a block's lists) */
    float *patch_x;        /* [B, Hkv, value cap]: its delta in centroid units (delta / half),
                              added to the looked-up centroid */
    float *v_stats;        /* [2, B, Hkv]: the block's value half-ranges and offsets, float32
                              (converted once a block, for every KV head) */
    float *dots;           /* [Hkv * FAST_MAX_HEADS, 16, 16]: one tile's per-slot dot vectors
                              (16 x __m512, or 8 x __m256 on AVX2) */
    int16_t *sink_at;      /* [B]: the sink entry of each slot, -1 none */
    int32_t *v_head;       /* [Hkv * value cap]: the KV head of each entry of a slot's value
                              outlier lists, [Hkv, cap] (entry e: head e / cap) */
    int32_t *k_cursor;     /* [Hkv]: the AVX2 key pass's place in each KV head's key outlier
                              list */
    int k_sorted;          /* are the block's key outlier lists in index order (AVX2) */
    float *k_corr;         /* [Hkv, FAST_MAX_HEADS, 8]: the key outliers' corrections of a tile's
                              scores (AVX2), zero but while in use */
    int k_rotated;         /* are the block's key outliers corrected from ko_* (AVX2) */
    int64_t ko_count;      /* the block's key outliers taken so far by tile_key_rotated (AVX2) */
    int32_t *ko_score, *ko_q, *ko_qp; /* [Hkv * key cap + 8]: where they go for their KV
                              head's first query head h = g * group: its score of their slot
                              (h * B + slot) and its query's channel and RoPE partner channel
                              (h * D + channel, h * D + partner) */
    float *ko_a, *ko_b;    /* [Hkv * key cap + 8]: their delta * cos and +-delta * sin */
    int32_t *st_idx, *st_g; /* [Hkv * key cap + 8]: a tile's entries staged: indices, KV heads */
    float *st_val;         /* [Hkv * key cap + 8]: and deltas */
    float *unit;           /* [2, D]: cos 1 and sin 0, the AVX2 key pass's rows without RoPE */
    /* the AVX-512 planar key pass's operands in its channel order: the request's queries
     * (block_request_queries), the block's key statistics, a tile's RoPE rows */
    float *pq;             /* [Hq, D] */
    float *pk_half, *pk_off; /* [Hkv, D] */
    float *pcos, *psin;    /* [16, D] (the slot-lanes passes: transposed, [D, 16] on AVX-512,
                              [D / 2, 8] on AVX2) */
    float *ktab;           /* [Hkv, D, 16]: the slot-lanes key pass's per-channel tables */
    uint8_t *k_words;      /* [words of a row, rounded up to 8, 32 bytes]: the AVX2 slot-lanes
                              key pass's transposed words of a tile's rows of one KV head */
    int32_t first_position; /* the block's first slot's, where its slots' are consecutive
                              (the AVX-512 key outliers and RoPE tiles), else -1 */
    float *p_slots;        /* [B, 16]: the block's P by slots, of up to 16 query heads (the
                              AVX-512 value outliers) */
    float *v_corr;         /* [Hkv, D, group]: the block's value-outlier corrections, the group's
                              heads of a channel side by side (the AVX-512 value outliers'
                              pairs of heads: one 64-bit lane) */
} BlockScratch;

static int block_scratch_alloc(BlockScratch *w, int64_t Hkv, int64_t group, int64_t B,
                               int64_t D, int64_t key_cap, int64_t value_cap) {
    w->scores = malloc(sizeof(float) * Hkv * group * B);
    w->pa = malloc(sizeof(float) * group * B);
    w->k_off = malloc(sizeof(float) * Hkv * D);
    w->k_half = malloc(sizeof(float) * Hkv * D);
    w->row = malloc(sizeof(float) * D);
    w->v_half = malloc(sizeof(float) * B);
    w->v_off = malloc(sizeof(float) * B);
    w->live = malloc(sizeof(float) * B);
    w->pb = malloc(sizeof(float) * group);
    /* 8 spare entries: the AVX2 value_patches8 writes and reads whole vectors */
    w->patch_ch = malloc(sizeof(int32_t) * (B * Hkv * value_cap + 8));
    w->patch_x = malloc(sizeof(float) * (B * Hkv * value_cap + 8));
    w->v_stats = calloc(2 * B * Hkv + 8, sizeof(float));
    w->dots = aligned_alloc(64, sizeof(float) * Hkv * FAST_MAX_HEADS * 16 * 16);
    w->sink_at = malloc(sizeof(int16_t) * B);
    if (w->sink_at) for (int64_t t = 0; t < B; t++) w->sink_at[t] = -1;
    w->v_head = malloc(sizeof(int32_t) * (Hkv * value_cap + 1));
    if (w->v_head)
        for (int64_t e = 0; e < Hkv * value_cap; e++) w->v_head[e] = (int32_t)(e / value_cap);
    w->k_cursor = malloc(sizeof(int32_t) * Hkv);
    w->k_sorted = 0;
    w->k_corr = aligned_alloc(32, sizeof(float) * Hkv * FAST_MAX_HEADS * 8);
    if (w->k_corr) memset(w->k_corr, 0, sizeof(float) * Hkv * FAST_MAX_HEADS * 8);
    w->k_rotated = 0;  /* 8 spare entries: written 8 at a time */
    w->ko_count = 0;
    w->ko_score = malloc(sizeof(int32_t) * (Hkv * key_cap + 8));
    w->st_idx = malloc(sizeof(int32_t) * (Hkv * key_cap + 8));
    w->st_g = malloc(sizeof(int32_t) * (Hkv * key_cap + 8));
    w->st_val = malloc(sizeof(float) * (Hkv * key_cap + 8));
    w->ko_q = malloc(sizeof(int32_t) * (Hkv * key_cap + 8));
    w->ko_qp = malloc(sizeof(int32_t) * (Hkv * key_cap + 8));
    w->ko_a = malloc(sizeof(float) * (Hkv * key_cap + 8));
    w->ko_b = malloc(sizeof(float) * (Hkv * key_cap + 8));
    w->unit = calloc(2 * D, sizeof(float));
    if (w->unit) for (int64_t d = 0; d < D; d++) w->unit[d] = 1.f;
    w->pq = malloc(sizeof(float) * Hkv * group * D);
    w->pk_half = malloc(sizeof(float) * Hkv * D);
    w->pk_off = malloc(sizeof(float) * Hkv * D);
    w->pcos = aligned_alloc(64, sizeof(float) * 16 * D);
    w->psin = aligned_alloc(64, sizeof(float) * 16 * D);
    /* a 4-bit row's D / 8 words (the most), in whole 8s */
    w->k_words = aligned_alloc(64, (size_t)((D / 8 + 7) / 8 * 8 * 32 + 64));
    w->ktab = aligned_alloc(64, sizeof(float) * Hkv * D * 16);
    w->first_position = -1;
    w->p_slots = aligned_alloc(64, sizeof(float) * 16 * B);
    w->v_corr = aligned_alloc(64, sizeof(float) * ((Hkv * D * group + 15) / 16 * 16));
    return w->scores && w->pa && w->k_off && w->k_half && w->row && w->v_half && w->v_off
           && w->live && w->pb && w->patch_ch && w->patch_x && w->v_stats && w->dots && w->sink_at
           && w->v_head && w->k_cursor && w->k_corr && w->unit && w->pq
           && w->pk_half && w->pk_off && w->pcos && w->psin && w->k_words && w->ktab && w->p_slots
           && w->v_corr && w->ko_score && w->ko_q && w->ko_qp && w->ko_a && w->ko_b
           && w->st_idx && w->st_g && w->st_val;
}

static void block_scratch_free(BlockScratch *w) {
    free(w->scores); free(w->pa); free(w->k_off); free(w->k_half); free(w->row); free(w->v_half);
    free(w->v_off); free(w->live); free(w->pb); free(w->patch_ch); free(w->patch_x);
    free(w->v_stats); free(w->dots);
    free(w->sink_at); free(w->v_head); free(w->k_cursor); free(w->k_corr);
    free(w->unit); free(w->pq); free(w->pk_half); free(w->pk_off);
    free(w->pcos); free(w->psin); free(w->k_words); free(w->ktab); free(w->p_slots);
    free(w->v_corr); free(w->ko_score); free(w->ko_q); free(w->ko_qp); free(w->ko_a);
    free(w->ko_b); free(w->st_idx); free(w->st_g); free(w->st_val);
}

/* is the block path valid for this layer (the staging of a block is checked per block) */
static int block_path_fits(const KVQuantLayer *L) {
    const KVQuantSide *K = &L->k, *V = &L->v;
    const int64_t D = L->head_dim, R = L->rot_dim;
    return K->per_channel && !V->per_channel && V->groups == 1 && K->bits >= 2 && K->bits <= 4
           && V->bits >= 2 && V->bits <= 4 && D % 32 == 0 && (R == D || R == 0)
           && L->block_size % 16 == 0  /* a tile of 16 slots never leaves its block */
           && L->staging_v == NULL && L->num_q_heads % L->num_kv_heads == 0;
}

/* part `part` of `parts` of a block's per-block data (statistics, outlier lists, positions),
 * prefetched into L2 while the block before it is read: the rows are prefetched tile by tile
 * (prefetch_rows, in quant_decode_attention.c), and these arrays are read a head at a time
 * from the block's start */

static void prefetch_block_data(const KVQuantLayer *L, int64_t blk, int64_t part, int64_t parts) {
    const KVQuantSide *K = &L->k, *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim;
    const int64_t sparse = L->sparse_kind == 2 ? 4 : 2;
    const struct { const void *base; int64_t bytes; } region[] = {
        {K->offset + blk * Hkv * D, Hkv * D * 2},
        {K->half + blk * Hkv * D, Hkv * D * 2},
        {(const uint8_t *)K->oidx + blk * Hkv * K->cap * K->idx_bytes, Hkv * K->cap * K->idx_bytes},
        {(const uint8_t *)K->oval + blk * Hkv * K->cap * sparse, Hkv * K->cap * sparse},
        {V->offset + blk * B * Hkv, B * Hkv * 2},
        {V->half + blk * B * Hkv, B * Hkv * 2},
        {(const uint8_t *)V->oidx + blk * B * Hkv * V->cap * V->idx_bytes,
         B * Hkv * V->cap * V->idx_bytes},
        {(const uint8_t *)V->oval + blk * B * Hkv * V->cap * sparse, B * Hkv * V->cap * sparse},
        {L->slot_positions ? (const void *)(L->slot_positions + blk * B) : NULL, B * 4},
    };
    for (size_t r = 0; r < sizeof region / sizeof region[0]; r++) {
        if (!region[r].base || region[r].bytes <= 0) continue;
        const int64_t lines = (region[r].bytes + 63) / 64;
        const int64_t first = lines * part / parts, last = lines * (part + 1) / parts;
        prefetch_rows((const uint8_t *)region[r].base + first * 64, (last - first) * 64);
    }
}

#define BLOCK_HEADS_DISPATCH(call, nh) \
    switch (nh) {                      \
    case 1: call(1); break;            \
    case 2: call(2); break;            \
    case 4: call(4); break;            \
    case 8: call(8); break;            \
    default: call(nh); break;          \
    }

/* the coefficient of pre-RoPE key channel ch in q . RoPE(k) (rotate-half over R channels):
 * q[ch] cos[ch] + q[ch + m] sin[ch + m] in the first half, q[ch] cos[ch] - q[ch - m] sin[ch - m]
 * in the second; the half picked by arithmetic, not a branch (which half an outlier falls in is
 * a coin toss: a branch would be mispredicted every other entry) */
static inline float rope_coefficient(const float *qh, const float *cs, const float *sn,
                                     int64_t ch, int64_t R, int64_t halves_equal) {
    if (!R) return qh[ch];
    const int64_t m = R / 2, second = ch >= m;      /* 0 or 1 */
    const int64_t partner = ch + m - 2 * m * second; /* its RoPE partner, ch + m or ch - m */
    /* halves that repeat: read the tables' first half only (the lines the key pass read) */
    const int64_t at_cos = halves_equal ? ch - m * second : ch;
    const int64_t at_sin = halves_equal ? ch - m * second : partner;
    const float sign = 1.f - 2.f * (float)second;
    return qh[ch] * cs[at_cos] + sign * (qh[partner] * sn[at_sin]);
}

/* The store lists every outlier once (`nanokv.quant.kvquant._select_outliers`), so each entry's
 * correction is added as it comes. */

/* one key outlier of KV head g in the block: its slot and channel (index t * D + ch) and its
 * stored delta, exact - decoded */
typedef struct {
    int64_t t, ch;
    float delta;
} KeyOutlier;

/* entry `at` of the store's lists (an index idx of the block) as a KeyOutlier (always inlined
 * with constant value kind and bits) */
static inline __attribute__((always_inline)) KeyOutlier key_outlier_entry(
        const KVQuantLayer *L, int64_t at, int64_t idx, const int64_t kind) {
    const int64_t D = L->head_dim;
    const int64_t t = (D & (D - 1)) == 0 ? idx >> __builtin_ctzll((unsigned long long)D)
                                         : idx / D;  /* a shift where D is a power of two */
    const KeyOutlier e = {t, idx - t * D, load_any(L->k.oval, at, kind)};
    return e;
}

/* the RoPE position of slot t of the block (0 without rotation or for a negative entry) */
static inline int64_t slot_rope_position(const KVQuantLayer *L, int64_t blk, int64_t t) {
    if (!L->rot_dim) return 0;
    const int64_t pos = L->slot_positions[blk * L->block_size + t];
    return pos < 0 ? 0 : pos;
}

/* the block's key outliers of head g as score corrections */
static inline __attribute__((always_inline)) void key_outliers(
        const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n, const float *restrict q0,
        int64_t group, float *restrict sg, const BlockScratch *w, const int64_t idx_bytes,
        const int64_t kind) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    const int64_t base = (blk * Hkv + g) * K->cap, limit = n * D;
    for (int64_t j = 0; j < K->cap; j++) {
        const int64_t idx = load_index(K->oidx, base + j, idx_bytes);
        if (idx < 0 || idx >= limit) continue;
        const KeyOutlier e = key_outlier_entry(L, base + j, idx, kind);
        const int64_t pos = slot_rope_position(L, blk, e.t);
        const float *cs = L->cos + pos * R, *sn = L->sin + pos * R;
        for (int64_t hh = 0; hh < group; hh++)
            sg[hh * B + e.t] += e.delta * rope_coefficient(q0 + hh * D, cs, sn, e.ch, R,
                                                          L->rope_halves_equal);
    }
}

/* the value outliers of non-sink slots as corrections of the accumulators: P times the stored
 * delta */
static inline __attribute__((always_inline)) void value_outliers(
        const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n, float *restrict acc0,
        int64_t group, const float *restrict sg, const BlockScratch *w, const int64_t idx_bytes,
        const int64_t kind) {
    const KVQuantSide *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, cap = V->cap;
    for (int64_t t = 0; t < n; t++) {
        if (w->sink_at[t] >= 0) continue;
        const int64_t i = (blk * B + t) * Hkv + g;  /* (block, slot, head) */
        for (int64_t j = 0; j < cap; j++) {
            const int64_t ch = load_index(V->oidx, i * cap + j, idx_bytes);
            if (ch < 0 || ch >= D) continue;
            const float delta = load_any(V->oval, i * cap + j, kind);
            for (int64_t hh = 0; hh < group; hh++) acc0[hh * D + ch] += sg[hh * B + t] * delta;
        }
    }
}

/* does block_value_patches take this layer: value patches (heads of at most 64 channels),
 * uint8 channels, a power-of-two capacity (an entry's row of the lists: its index >> log2 cap) */
static inline int block_value_patches_fit(const KVQuantLayer *L) {
    const int64_t cap = L->v.cap;
    return cap > 0 && (cap & (cap - 1)) == 0 && L->v.idx_bytes == 1 && L->head_dim <= 64;
}

/* Small heads (head_dim <= 64: one or two chunks of 32 channels), where value outliers are a
 * large share (the per-token capacity rounds up: 2 of 32 channels at 1%): each outlier of a live
 * slot becomes a patch of its row in centroid units, x = delta / half-range, added to the
 * looked-up centroid inside the value pass (then P * half * (c + x) + P * offset = P * (decoded
 * + delta), within float rounding: x uses the row's reciprocal half-range). A row whose
 * half-range is 0 has no centroid scale: its outliers are added here, as value_outliers does.
 * KV head g's
 * patches, at [t, g, j] of w->patch_ch / patch_x (`write`; else, block_value_patches having
 * written every head's, only the rows without a centroid scale are added). */
static inline __attribute__((always_inline)) void value_patches_impl(
        const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n, float *restrict acc0,
        int64_t group, const float *restrict sg, BlockScratch *w, const int write,
        const int64_t idx_bytes, const int64_t kind) {
    const KVQuantSide *V = &L->v;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, cap = V->cap;
    int32_t *restrict patch_ch = w->patch_ch;
    float *restrict patch_x = w->patch_x;
    for (int64_t t = 0; t < n; t++) {
        const int64_t i = (blk * B + t) * Hkv + g;  /* (block, slot, head) */
        const float half = w->v_half[t];
        if (!write && half != 0.f) continue;
        const float inv = half != 0.f ? 1.f / half : 0.f;
        const int live = w->sink_at[t] < 0;
        for (int64_t j = 0; j < cap; j++) {
            const int64_t ch = load_index(V->oidx, i * cap + j, idx_bytes);
            const float delta = load_any(V->oval, i * cap + j, kind);
            const int valid = live && ch >= 0 && ch < D;
            if (write) {
                patch_ch[(t * Hkv + g) * cap + j] = valid && half != 0.f ? (int32_t)ch : -1;
                patch_x[(t * Hkv + g) * cap + j] = delta * inv;
            }
            if (valid && half == 0.f)  /* no centroid scale: added here */
                for (int64_t hh = 0; hh < group; hh++)
                    acc0[hh * D + ch] += sg[hh * B + t] * delta;
        }
    }
}

static void value_patches(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                          float *acc0, int64_t group, const float *sg, BlockScratch *w,
                          int write) {
    if (L->v.idx_bytes == 1 && L->sparse_kind == 0)  /* uint8 channels, float16 values */
        value_patches_impl(L, blk, g, n, acc0, group, sg, w, write, 1, 0);
    else
        value_patches_impl(L, blk, g, n, acc0, group, sg, w, write, L->v.idx_bytes,
                           L->sparse_kind);
}

/* value outliers of non-sink slots and the sink slots' full-precision rows, added to the
 * accumulators of heads [h, h + group) */
static void block_value_fixes(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                              float *acc0, int64_t group, const float *sg, BlockScratch *w,
                              int elsewhere) {
    const KVQuantSide *V = &L->v;
    const int64_t Hkv = L->num_kv_heads, D = L->head_dim;
    if (elsewhere) {
        /* the outliers went into the value pass (value_patches) or come after every head's
         * value pass (block_value_outliers16) */
    } else if (V->cap && V->idx_bytes == 1 && L->sparse_kind == 0) {
        /* uint8 channels, float16 deltas: constant sizes, and a constant group of 1, 2 or 4
         * (the inner loop unrolled) */
        switch (group) {
        case 1: value_outliers(L, blk, g, n, acc0, 1, sg, w, 1, 0); break;
        case 2: value_outliers(L, blk, g, n, acc0, 2, sg, w, 1, 0); break;
        case 4: value_outliers(L, blk, g, n, acc0, 4, sg, w, 1, 0); break;
        default: value_outliers(L, blk, g, n, acc0, group, sg, w, 1, 0); break;
        }
    } else if (V->cap)
        value_outliers(L, blk, g, n, acc0, group, sg, w, V->idx_bytes, L->sparse_kind);
    for (int64_t p = 0; p < L->num_sinks; p++) {
        const int64_t t = L->sink_slot[blk * L->num_sinks + p];
        if (t < 0 || t >= n) continue;
        load_head(w->row, V->sink, ((blk * L->num_sinks + p) * Hkv + g) * D, D, L->sparse_kind);
        for (int64_t hh = 0; hh < group; hh++) {
            const float pt = sg[hh * L->block_size + t];
            float *ah = acc0 + hh * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) ah[d] += pt * w->row[d];
        }
    }
}

/* a block's statistics (per-channel keys, per-token values), float16 -> float32 (n % 8 == 0) */
static void block_stats_f32(float *restrict dst, const uint16_t *restrict src, int64_t n) {
#if defined(__F16C__)
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#else
    for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(src[i]);
#endif
}

/* the block's sink slots of head g: their exact scores from the full-precision rows */
static void block_key_sinks(const KVQuantLayer *L, int64_t blk, int64_t g, int64_t n,
                            const float *q0, int64_t group, float *sg, BlockScratch *w) {
    const KVQuantSide *K = &L->k;
    const int64_t B = L->block_size, Hkv = L->num_kv_heads, D = L->head_dim, R = L->rot_dim;
    for (int64_t p = 0; p < L->num_sinks; p++) {
        const int64_t t = L->sink_slot[blk * L->num_sinks + p];
        if (t < 0 || t >= n) continue;
        load_head(w->row, K->sink, ((blk * L->num_sinks + p) * Hkv + g) * D, D, L->sparse_kind);
        if (R) {
            const int64_t pos = slot_rope_position(L, blk, t);
            rope_head(w->row, L->cos + pos * R, L->sin + pos * R, R);
        }
        for (int64_t hh = 0; hh < group; hh++)
            sg[hh * B + t] = dot(q0 + hh * D, w->row, D);
    }
}
