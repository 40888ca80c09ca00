/* Causal attention with bf16 operands and float32 sums (kernels/attention.pyx's
 * precision="bf16"), the bf16 twin of attention_lanes.h: the same tasks, blocks and
 * recomputation (FlashAttention-2's backward), its five products taking bf16 operands
 * as the linear layers' do under --precision bf16 (kernels/bf16.h): Q, K, V, dO and the
 * probabilities P and dS rounded to bf16 (nearest even), each product summed in float32
 * over pairs of depths by VDPBF16PS.  The softmax, the log-sum-exps, D_i = dO_i . O_i
 * (of the rounded dO) and dS = P (dP - D) scale stay float32, as PyTorch's bf16 flash
 * attention keeps them.
 *
 * Operands are words of two bf16 (the even depth in the low half), laid out as
 * VDPBF16PS reads them:
 *   B, packed: slivers of 32 columns, each kp rows of 32 words (depth pairs in order,
 *      zero past the depth and past the columns);
 *   A, in place: pair (i, q) at a[i rs + q cs]: rs = the row's words, cs = 1 for an
 *      operand whose rows run along the depth (abf_rows: Q, dO, P, dS), rs = 1 and
 *      cs = the row length for a transposed one (abf_rowpairs: P^T and dS^T, two rows
 *      of the tile interleaved).
 * The register tile is 8 x 32 in sixteen accumulators (bf16_gemm.h's).  No product is
 * cut along its depth: each element is one float32 sum over its pairs in order, so the
 * results do not depend on the thread count nor on which of the two backwards runs.
 *
 * A template included twice by attention.pyx (no include guard past the helpers), with
 *   ABF_FN(f)          the build's name for f (f_nat, f_twin),
 *   ABF_ATTR           its functions' target (AVX512_BF16, or target clones),
 *   ABF_INL            its inline helpers' (AVX512_BF16, or none),
 *   ABF_DOT(acc, a, b) bf16.h's VDPBF16PS (bf_dot_nat) or its float32 twin.
 */
#ifndef ADTAPE_KERNELS_ATTENTION_BF16_HELPERS
#define ADTAPE_KERNELS_ATTENTION_BF16_HELPERS
#include "bf16.h"

#define ABF_NR 32
#define ABF_MR 8
static inline ptrdiff_t abf_pairs(ptrdiff_t k) { return (k + 1) / 2; }
static inline ptrdiff_t abf_npad(ptrdiff_t n) { return (n + ABF_NR - 1) / ABF_NR * ABF_NR; }

ADT_INLINE uint32_t abf_pair(float lo, float hi) {
    return (uint32_t)bf16_from_bits(bf16_f32_bits(lo))
           | ((uint32_t)bf16_from_bits(bf16_f32_bits(hi)) << 16);
}

/* Words of a packed (K, N) operand. */
static inline ptrdiff_t abf_packed_words(ptrdiff_t K, ptrdiff_t N) {
    return abf_pairs(K) * abf_npad(N);
}

/* The n floats from x of rows ABF_AHEAD to ABF_AHEAD + rows - 1 ahead of x's (ldx
   apart) fetched: the operands' rows are a head's slice of qkv rows, a row of qkv
   apart in memory, which the hardware prefetchers do not follow (attention_lanes.h's
   packing does the same). */
#define ABF_AHEAD 8
ADT_INLINE void abf_fetch_ahead(const void* x, int x16, ptrdiff_t ldx, ptrdiff_t rows,
                                ptrdiff_t n) {
    ptrdiff_t size = x16 ? 2 : 4;
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t p = 0; p < n * size; p += 64)
            __builtin_prefetch((const char*)x + (ABF_AHEAD + r) * ldx * size + p, 0, 3);
}

/* Element n of an operand held in float32 or (x16) in bf16. */
ADT_INLINE const void* abf_at(const void* x, int x16, ptrdiff_t n) {
    return (const char*)x + n * (x16 ? 2 : 4);
}

/* aw[i ldw + q] = (X[i][2q], X[i][2q+1]) for i < M, q < ceil(K/2) (zero past K): an A
   operand whose rows run along the depth (Q, dO, P, dS), each row X's rounded to bf16
   (the pairs are a bf16 row read as words). */
static void abf_rows(uint32_t* restrict aw, ptrdiff_t ldw, const void* X, int x16,
                     ptrdiff_t ldx, ptrdiff_t M, ptrdiff_t K) {
    for (ptrdiff_t i = 0; i < M; i++) {
        uint16_t* dst = (uint16_t*)(aw + i * ldw);
        const void* x = abf_at(X, x16, i * ldx);
        abf_fetch_ahead(x, x16, ldx, 1, K);
        if (x16)
            memcpy(dst, x, (size_t)K * sizeof(uint16_t));
        else
            bf16_round_span(dst, (const float*)x, K);
        if (K % 2) dst[K] = 0;
    }
}

/* B(k, j) = X[j ldx + k] (K^T, V^T: X's N rows of K along the depth), packed: sixteen
   rows at a time rounded into bf16 rows, then transposed as words in 16 x 16 blocks
   (bf16.h's bf_tr16). */
static void abf_pack_t(uint32_t* restrict pb, const void* X, int x16, ptrdiff_t ldx,
                       ptrdiff_t N, ptrdiff_t K) {
    ptrdiff_t kp = abf_pairs(K), kp16 = kp / 16 * 16, npad = abf_npad(N);
    uint32_t rows[16 * kp];
    for (ptrdiff_t j0 = 0; j0 < npad; j0 += 16) {
        ptrdiff_t n = N - j0 < 16 ? (N - j0 > 0 ? N - j0 : 0) : 16;
        abf_rows(rows, kp, abf_at(X, x16, j0 * ldx), x16, ldx, n, K);
        memset(rows + n * kp, 0, (size_t)(16 - n) * (size_t)kp * sizeof(uint32_t));
        uint32_t* dst = pb + j0 / ABF_NR * kp * ABF_NR + j0 % ABF_NR;
        for (ptrdiff_t q = 0; q < kp16; q += 16)
            bf_tr16(rows + q, kp, dst + q * ABF_NR, ABF_NR);
        for (ptrdiff_t q = kp16; q < kp; q++)
            for (ptrdiff_t j = 0; j < 16; j++) dst[q * ABF_NR + j] = rows[j * kp + q];
    }
}

/* aw[q ldw + j] = (X[2q][j], X[2q+1][j]) for q < ceil(M/2), j < N, zero for j from N
   to npad: X's rows (ldx apart) taken in pairs.  An A operand read transposed (P^T,
   dS^T: rs = 1, cs = ldw), and, sliver by sliver, a B operand whose rows run along the
   depth (abf_pack_n). */
ADT_MULTIVERSION_WIDE
static void abf_rowpairs(uint32_t* restrict aw, ptrdiff_t ldw, const void* X, int x16,
                         ptrdiff_t ldx, ptrdiff_t M, ptrdiff_t N, ptrdiff_t npad) {
    for (ptrdiff_t q = 0; q < abf_pairs(M); q++) {
        uint32_t* dst = aw + q * ldw;
        abf_fetch_ahead(abf_at(X, x16, 2 * q * ldx), x16, ldx, 2, N);
        if (x16) {
            const uint16_t* h0 = (const uint16_t*)X + 2 * q * ldx;
            const uint16_t* h1 = h0 + ldx;
            if (2 * q + 1 < M)
                for (ptrdiff_t j = 0; j < N; j++) dst[j] = h0[j] | ((uint32_t)h1[j] << 16);
            else
                for (ptrdiff_t j = 0; j < N; j++) dst[j] = h0[j];
            for (ptrdiff_t j = N; j < npad; j++) dst[j] = 0;
            continue;
        }
        const float* r0 = (const float*)X + 2 * q * ldx;
        const float* r1 = r0 + ldx;
        if (2 * q + 1 < M)
            for (ptrdiff_t j = 0; j < N; j++) dst[j] = abf_pair(r0[j], r1[j]);
        else
            for (ptrdiff_t j = 0; j < N; j++) dst[j] = abf_pair(r0[j], 0.0f);
        for (ptrdiff_t j = N; j < npad; j++) dst[j] = 0;
    }
}

/* B(k, j) = X[k ldx + j] (V, K, a query block's Q or dO: X's K rows along the depth),
   packed. */
static void abf_pack_n(uint32_t* restrict pb, const void* X, int x16, ptrdiff_t ldx,
                       ptrdiff_t K, ptrdiff_t N) {
    ptrdiff_t kp = abf_pairs(K);
    for (ptrdiff_t j0 = 0; j0 < N; j0 += ABF_NR)
        abf_rowpairs(pb + j0 * kp, ABF_NR, abf_at(X, x16, j0), x16, ldx, K,
                     N - j0 < ABF_NR ? N - j0 : ABF_NR, ABF_NR);
}

/* Words of each operand a query block needs (its Q and dO as rows and packed), and of
   a (BQ, BK) tile's P^T, dS^T and dS. */
static inline ptrdiff_t abf_panel_words(ptrdiff_t bq, ptrdiff_t hs) {
    ptrdiff_t rows = bq * abf_pairs(hs), packed = abf_packed_words(bq, hs);
    return ((rows > packed ? rows : packed) + 15) / 16 * 16;
}
/* The backward's per-thread and shared operands (words; the tiles in floats): the kv
   head's K^T, V^T (pkt, pvt) and K (pk), packed; a query block's Q and dO as rows
   (qw, dow) and packed (pq, pdo), its D_i (drow); the (BQ, BK) tiles P and dS in
   float32 (ptile, dstile) and in bf16: P^T, dS^T as pairs of rows (pt, dst), dS as
   rows (dsw). */
typedef struct {
    uint32_t *pkt, *pvt, *pk;
    uint32_t *qw, *dow, *pq, *pdo;
    const float* drow;
    float *ptile, *dstile;
    uint32_t *pt, *dst, *dsw;
} abf_bwd_ops;
#endif /* ADTAPE_KERNELS_ATTENTION_BF16_HELPERS */

/* ---- the template: one build's products and per-head kernels ---- */

/* C tile (mr, nr) (+)= alpha A (mr, kp pairs) B (a sliver, kp rows of 32 words); rows
   past mr repeat the last valid row: computed, never stored. */
ABF_INL static inline __attribute__((always_inline))
void ABF_FN(abf_ukernel)(ptrdiff_t kp, const uint32_t* a, ptrdiff_t rs, ptrdiff_t cs,
                         const uint32_t* restrict b, float* c, ptrdiff_t ldc, ptrdiff_t mr,
                         ptrdiff_t nr, float alpha, int accumulate) {
    adt_v16 acc[ABF_MR][2];
    const uint32_t* row[ABF_MR];
#pragma GCC unroll 16
    for (int r = 0; r < ABF_MR; r++) {
        acc[r][0] = (adt_v16){0};
        acc[r][1] = (adt_v16){0};
        row[r] = a + (r < mr ? r : mr - 1) * rs;
    }
    for (ptrdiff_t q = 0; q < kp; q++) {
        bf_pairs b0 = *(const bf_pairs*)(b + q * ABF_NR);
        bf_pairs b1 = *(const bf_pairs*)(b + q * ABF_NR + 16);
        ptrdiff_t o = q * cs;
#pragma GCC unroll 16
        for (int r = 0; r < ABF_MR; r++) {
            acc[r][0] = ABF_DOT(acc[r][0], row[r][o], b0);
            acc[r][1] = ABF_DOT(acc[r][1], row[r][o], b1);
        }
    }
    if (nr == ABF_NR) {
#pragma GCC unroll 16
        for (int r = 0; r < ABF_MR; r++) {
            if (r >= mr) break;
            float* out = c + r * ldc;
            adt_v16 v0 = alpha * acc[r][0], v1 = alpha * acc[r][1];
            if (accumulate) {
                v0 += adt_load16(out);
                v1 += adt_load16(out + 16);
            }
            adt_store16(out, v0);
            adt_store16(out + 16, v1);
        }
        return;
    }
    for (ptrdiff_t r = 0; r < mr; r++) {
        float t[ABF_NR] __attribute__((aligned(64)));
        adt_store16(t, acc[r][0]);
        adt_store16(t + 16, acc[r][1]);
        float* out = c + r * ldc;
        for (ptrdiff_t j = 0; j < nr; j++)
            out[j] = (accumulate ? out[j] : 0.0f) + alpha * t[j];
    }
}

/* Row-major C (M, N) (+)= alpha op(A) (M, K) B (K, N): A's pair (i, q) at a[i rs + q cs],
   B packed (slivers `sliver` words apart), K in depths; tri as attn_gemm's
   (attention_lanes.h), to the pair: where a tile's depth ends or starts mid-pair, the
   pair's other depth is one that the causal mask makes 0 in A. */
ABF_ATTR static __attribute__((noinline))
void ABF_FN(abf_gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, float alpha, const uint32_t* A,
                      ptrdiff_t rs, ptrdiff_t cs, const uint32_t* pb, ptrdiff_t sliver,
                      int accumulate, float* Cm, ptrdiff_t ldc, int tri, ptrdiff_t diag) {
    for (ptrdiff_t j0 = 0; j0 < N; j0 += ABF_NR) {
        const uint32_t* b = pb + j0 / ABF_NR * sliver;
        for (ptrdiff_t i0 = 0; i0 < M; i0 += ABF_MR) {
            ptrdiff_t mr = M - i0 < ABF_MR ? M - i0 : ABF_MR, lo = 0, hi = K;
            if (tri == ATTN_TRI_C && j0 > i0 + mr - 1 + diag) continue;
            if (tri == ATTN_TRI_UPTO) {
                hi = i0 + mr + diag;
                hi = hi < 0 ? 0 : hi > K ? K : hi;
            }
            if (tri == ATTN_TRI_FROM) {
                lo = i0 - diag;
                lo = lo < 0 ? 0 : lo > K ? K : lo;
            }
            ptrdiff_t qlo = lo / 2, qhi = (hi + 1) / 2;
            if (qlo >= qhi && accumulate) continue;   /* nothing to add */
            ABF_FN(abf_ukernel)(qhi > qlo ? qhi - qlo : 0, A + i0 * rs + qlo * cs, rs, cs,
                                b + qlo * ABF_NR, Cm + i0 * ldc + j0, ldc, mr,
                                N - j0 < ABF_NR ? N - j0 : ABF_NR, alpha, accumulate);
        }
    }
}

/* Softmax of the scores s[0..n) into p[0..kpad) in bf16 (zero from n; kpad a
   multiple of 16, at least n), s left holding the exponentials; returns
   log(sum_j exp(s[j])).  attn_softmax_row in sixteen lanes, its last pass rounding
   (bf16_round16) where a pass of abf_rows over the float32 probabilities did (same
   bits; that pass was 9% of the forward at T = 1024 on Zen 4). */
ABF_INL static inline __attribute__((always_inline))
float ABF_FN(abf_softmax_row)(float* s, uint16_t* p, ptrdiff_t n, ptrdiff_t kpad) {
    adt_v16i lane;
    for (int l = 0; l < 16; l++) lane[l] = l;
    adt_v16 neg_inf = adt_splat16(-INFINITY), zero = {0};
    ptrdiff_t full = n / 16 * 16, j = 0;
    adt_v16i valid = lane < (adt_v16i){0} + (int)(n - full);
    adt_v16 mv = neg_inf;
    for (; j < full; j += 16) mv = adt_max16(mv, adt_load16(s + j));
    if (full < n) mv = adt_max16(mv, adt_select16(valid, adt_load16(s + full), neg_inf));
    float mx = mv[0];
    for (int l = 1; l < 16; l++) mx = mv[l] > mx ? mv[l] : mx;
    adt_v16 m = adt_splat16(mx), sum = {0};
    for (j = 0; j < full; j += 16) {
        adt_v16 e = adt_exp_bits16(adt_load16(s + j) - m);
        adt_store16(s + j, e);
        sum += e;
    }
    if (full < n) {
        adt_v16 e = adt_select16(valid, adt_exp_bits16(adt_load16(s + full) - m), zero);
        adt_store16(s + full, e);
        sum += e;
        j += 16;
    }
    float total = adt_hsum16(sum);
    adt_v16 inv = adt_splat16(1.0f / total);
    for (j = 0; j < n; j += 16) {
        bf16_h16 h = bf16_round16(adt_load16(s + j) * inv);
        memcpy(p + j, &h, sizeof h);
    }
    for (; j < kpad; j += 16) {
        bf16_h16 h = {0};
        memcpy(p + j, &h, sizeof h);
    }
    return mx + logf(total);
}

/* One (batch, query head), as attn_head_forward: q, k, v, out, lse and the strides
   likewise; pk (K^T) and pv (V) are packed unless pack_kv is 0; scores (BQ rows of
   attn_score_ld(T) floats) a query block's scores and probabilities in float32, qw its
   Q in bf16 rows, pw its P. */
ABF_ATTR static void ABF_FN(abf_head_forward)(float* out, float* lse, const void* q,
                                              const void* k, const void* v, int qkv16,
                                              ptrdiff_t T, ptrdiff_t ldq, ptrdiff_t ldo,
                                              ptrdiff_t hs, float scale, int pack_kv,
                                              uint32_t* pk,
                                              uint32_t* pv, float* scores, uint32_t* qw,
                                              uint32_t* pw) {
    ptrdiff_t lds = attn_score_ld(T), hp = abf_pairs(hs), ldp = lds / 2;
    if (pack_kv) {
        abf_pack_t(pk, k, qkv16, ldq, T, hs);   /* K^T (hs, T) */
        abf_pack_n(pv, v, qkv16, ldq, T, hs);   /* V (T, hs) */
    }
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
        ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ, kend = i0 + rows;
        ptrdiff_t kpad = abf_npad(kend);
        abf_rows(qw, hp, abf_at(q, qkv16, i0 * ldq), qkv16, ldq, rows, hs);
        ABF_FN(abf_gemm)(rows, kpad, hs, scale, qw, hp, 1, pk, hp * ABF_NR, 0, scores, lds,
                         ATTN_TRI_C, i0);
        for (ptrdiff_t r = 0; r < rows; r++)
            lse[i0 + r] = ABF_FN(abf_softmax_row)(scores + r * lds, (uint16_t*)(pw + r * ldp),
                                                  i0 + r + 1, kpad);
        ABF_FN(abf_gemm)(rows, hs, kend, 1.0f, pw, ldp, 1, pv, abf_pairs(T) * ABF_NR, 0,
                         out + i0 * ldo, ldo, ATTN_TRI_UPTO, i0);
    }
}


/* P and dS of query block i0 (rows) and key block j0 (cpad columns, as attn_bwd_tile),
   in float32 and in the three bf16 layouts the products read. */
ABF_INL static inline __attribute__((always_inline))
void ABF_FN(abf_bwd_tile)(const abf_bwd_ops* o, const float* lse, ptrdiff_t hs,
                          float scale, ptrdiff_t i0, ptrdiff_t rows, ptrdiff_t j0,
                          ptrdiff_t cpad) {
    ptrdiff_t hp = abf_pairs(hs);
    adt_v16i lane;
    for (int l = 0; l < 16; l++) lane[l] = l;
    adt_v16 zero = {0}, vscale = adt_splat16(scale);
    ABF_FN(abf_gemm)(rows, cpad, hs, scale, o->qw, hp, 1, o->pkt + j0 / ABF_NR * hp * ABF_NR,
                     hp * ABF_NR, 0, o->ptile, ATTN_BK, ATTN_TRI_C, i0 - j0);
    ABF_FN(abf_gemm)(rows, cpad, hs, 1.0f, o->dow, hp, 1, o->pvt + j0 / ABF_NR * hp * ABF_NR,
                     hp * ABF_NR, 0, o->dstile, ATTN_BK, ATTN_TRI_C, i0 - j0);
    for (ptrdiff_t r = 0; r < rows; r++) {
        float* p = o->ptile + r * ATTN_BK;
        float* ds = o->dstile + r * ATTN_BK;
        adt_v16i nvalid = (adt_v16i){0} + (int)(i0 + r + 1 - j0);
        adt_v16 l = adt_splat16(lse[i0 + r]), d = adt_splat16(o->drow[r]);
        for (ptrdiff_t c = 0; c < cpad; c += 16) {
            adt_v16i valid = lane + (int)c < nvalid;
            adt_v16 e = adt_select16(valid, adt_exp_bits16(adt_load16(p + c) - l), zero);
            adt_store16(p + c, e);
            adt_store16(ds + c, adt_select16(valid, e * (adt_load16(ds + c) - d) * vscale,
                                             zero));
        }
    }
    abf_rowpairs(o->pt, ATTN_BK, o->ptile, 0, ATTN_BK, rows, cpad, cpad);
    abf_rowpairs(o->dst, ATTN_BK, o->dstile, 0, ATTN_BK, rows, cpad, cpad);
    abf_rows(o->dsw, ATTN_BK / 2, o->dstile, 0, ATTN_BK, rows, cpad);
}

/* dV_j += P^T dO_i, dK_j += dS^T Q_i (write with add_kv 0). */
ABF_INL static inline __attribute__((always_inline))
void ABF_FN(abf_bwd_kv)(const abf_bwd_ops* o, float* dk, float* dv, ptrdiff_t ldq,
                        ptrdiff_t hs, ptrdiff_t i0, ptrdiff_t rows, ptrdiff_t j0,
                        ptrdiff_t cols, int add_kv) {
    ptrdiff_t sliver = abf_pairs(rows) * ABF_NR;
    ABF_FN(abf_gemm)(cols, hs, rows, 1.0f, o->pt, 1, ATTN_BK, o->pdo, sliver, add_kv,
                     dv + j0 * ldq, ldq, ATTN_TRI_FROM, i0 - j0);
    ABF_FN(abf_gemm)(cols, hs, rows, 1.0f, o->dst, 1, ATTN_BK, o->pq, sliver, add_kv,
                     dk + j0 * ldq, ldq, ATTN_TRI_FROM, i0 - j0);
}

/* dQ_i += dS K_j (write with add_q 0): K packed along all T keys, from pair j0 / 2. */
ABF_INL static inline __attribute__((always_inline))
void ABF_FN(abf_bwd_q)(const abf_bwd_ops* o, float* dq, ptrdiff_t T, ptrdiff_t ldq,
                       ptrdiff_t hs, ptrdiff_t i0, ptrdiff_t rows, ptrdiff_t j0,
                       ptrdiff_t cols, int add_q) {
    ABF_FN(abf_gemm)(rows, hs, cols, 1.0f, o->dsw, ATTN_BK / 2, 1, o->pk + j0 / 2 * ABF_NR,
                     abf_pairs(T) * ABF_NR, add_q, dq + i0 * ldq, ldq, ATTN_TRI_UPTO,
                     i0 - j0);
}

/* The kv head's K^T, V^T and K packed (pkt, pvt, pk). */
ABF_ATTR static void ABF_FN(abf_prepare_kv)(uint32_t* pkt, uint32_t* pvt, uint32_t* pk,
                                            const void* k, const void* v, int qkv16,
                                            ptrdiff_t T, ptrdiff_t ldq, ptrdiff_t hs) {
    abf_pack_t(pkt, k, qkv16, ldq, T, hs);
    abf_pack_t(pvt, v, qkv16, ldq, T, hs);
    abf_pack_n(pk, k, qkv16, ldq, T, hs);
}

/* Query block i0's Q and dO as rows and packed, and its D_i (drow: the rounded dO's
   rows . O's, in float32). */
ABF_ATTR static void ABF_FN(abf_prepare_query)(uint32_t* qw, uint32_t* dow, uint32_t* pq,
                                               uint32_t* pdo, float* drow, const void* q,
                                               int qkv16, const float* dO, const float* o,
                                               ptrdiff_t T, ptrdiff_t ldq, ptrdiff_t ldo,
                                               ptrdiff_t hs, ptrdiff_t i0) {
    ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ, hp = abf_pairs(hs);
    /* O's rows (a row of C floats apart, which the prefetchers do not follow) on their
       way while Q and dO are laid out */
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t j = 0; j < hs; j += 16) __builtin_prefetch(o + (i0 + r) * ldo + j, 0, 3);
    abf_rows(qw, hp, abf_at(q, qkv16, i0 * ldq), qkv16, ldq, rows, hs);
    abf_rows(dow, hp, dO + i0 * ldo, 0, ldo, rows, hs);
    /* D_i from the rounded dO (the products' operand), in float32: sixteen lanes of
       partial sums, then their sum and the tail's (as attn_dot; one serial sum of hs
       terms was 6.8% of the backward at T = 1024 on Zen 4) */
    for (ptrdiff_t r = 0; r < rows; r++) {
        const uint16_t* x = (const uint16_t*)(dow + r * hp);
        const float* y = o + (i0 + r) * ldo;
        adt_v16 acc = {0};
        ptrdiff_t j = 0;
        for (; j + 16 <= hs; j += 16) {
            bf16_h16 h;
            memcpy(&h, x + j, sizeof h);
            acc += (adt_v16)(__builtin_convertvector(h, bf16_w16) << 16) * adt_load16(y + j);
        }
        float s = 0.0f;
        for (; j < hs; j++) s += bf16_bits_f32((uint32_t)x[j] << 16) * y[j];
        drow[r] = adt_hsum16(acc) + s;
    }
    abf_pack_n(pq, abf_at(q, qkv16, i0 * ldq), qkv16, ldq, rows, hs);
    abf_pack_n(pdo, dO + i0 * ldo, 0, ldo, rows, hs);
}

/* One (batch, query head), as attn_head_backward; the operands in o (its pkt, pvt and
   pk packed here unless pack_kv is 0, its query block's in place for each block). */
ABF_ATTR static void ABF_FN(abf_head_backward)(float* dq, float* dk, float* dv,
                                               const float* dO, const void* q,
                                               const void* k, const void* v, int qkv16,
                                               const float* o, const float* lse, ptrdiff_t T,
                                               ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs,
                                               float scale, int overwrite_q,
                                               int overwrite_kv, int pack_kv,
                                               const abf_bwd_ops* ops, float* drow) {
    if (pack_kv) ABF_FN(abf_prepare_kv)(ops->pkt, ops->pvt, ops->pk, k, v, qkv16, T, ldq, hs);
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
        ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ, kend = i0 + rows;
        ABF_FN(abf_prepare_query)(ops->qw, ops->dow, ops->pq, ops->pdo, drow, q, qkv16, dO,
                                  o, T, ldq, ldo, hs, i0);
        for (ptrdiff_t j0 = 0; j0 < kend; j0 += ATTN_BK) {
            ptrdiff_t cols = kend - j0 < ATTN_BK ? kend - j0 : ATTN_BK;
            ABF_FN(abf_bwd_tile)(ops, lse, hs, scale, i0, rows, j0, abf_npad(cols));
            ABF_FN(abf_bwd_kv)(ops, dk, dv, ldq, hs, i0, rows, j0, cols,
                               !(overwrite_kv && j0 >= i0));
            ABF_FN(abf_bwd_q)(ops, dq, T, ldq, hs, i0, rows, j0, cols,
                              !(overwrite_q && j0 == 0));
        }
    }
}

/* The two-pass backward's parts, as attn_key_backward and attn_query_backward: shared
   operands in sh (pkt, pvt, pk of the kv head; qw, dow, pq, pdo of the group's first
   head's first query block, a panel of ``panel`` words per block, ``nblk`` blocks a
   head), drows each head's D (T floats a head); per-thread tiles in tl. */
ABF_ATTR static void ABF_FN(abf_key_backward)(float* dk, float* dv, const float* lse,
                                              ptrdiff_t T, ptrdiff_t ldq, ptrdiff_t hs,
                                              float scale, ptrdiff_t rep, int overwrite_kv,
                                              ptrdiff_t j0, const abf_bwd_ops* sh,
                                              ptrdiff_t panel, ptrdiff_t nblk,
                                              const float* drows,
                                              const abf_bwd_ops* tl) {
    ptrdiff_t cols = T - j0 < ATTN_BK ? T - j0 : ATTN_BK;
    abf_bwd_ops o = *tl;
    o.pkt = sh->pkt, o.pvt = sh->pvt, o.pk = sh->pk;
    for (ptrdiff_t h = 0; h < rep; h++)
        for (ptrdiff_t i0 = j0 / ATTN_BQ * ATTN_BQ; i0 < T; i0 += ATTN_BQ) {
            ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ, kend = i0 + rows;
            ptrdiff_t c = kend - j0 < cols ? kend - j0 : cols;
            ptrdiff_t at = (h * nblk + i0 / ATTN_BQ) * panel;
            o.qw = sh->qw + at, o.dow = sh->dow + at, o.pq = sh->pq + at, o.pdo = sh->pdo + at;
            o.drow = drows + h * T + i0;
            ABF_FN(abf_bwd_tile)(&o, lse + h * T, hs, scale, i0, rows, j0, abf_npad(c));
            ABF_FN(abf_bwd_kv)(&o, dk, dv, ldq, hs, i0, rows, j0, c,
                               !(overwrite_kv && h == 0 && j0 >= i0));
        }
}

ABF_ATTR static void ABF_FN(abf_query_backward)(float* dq, const float* lse, ptrdiff_t T,
                                                ptrdiff_t ldq, ptrdiff_t hs, float scale,
                                                int overwrite_q, ptrdiff_t i0,
                                                const abf_bwd_ops* sh,
                                                const float* drow,
                                                const abf_bwd_ops* tl) {
    ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ, kend = i0 + rows;
    abf_bwd_ops o = *tl;
    o.pkt = sh->pkt, o.pvt = sh->pvt, o.pk = sh->pk, o.qw = sh->qw, o.dow = sh->dow;
    o.drow = drow;
    for (ptrdiff_t j0 = 0; j0 < kend; j0 += ATTN_BK) {
        ptrdiff_t cols = kend - j0 < ATTN_BK ? kend - j0 : ATTN_BK;
        ABF_FN(abf_bwd_tile)(&o, lse, hs, scale, i0, rows, j0, abf_npad(cols));
        ABF_FN(abf_bwd_q)(&o, dq, T, ldq, hs, i0, rows, j0, cols, !(overwrite_q && j0 == 0));
    }
}

#undef ABF_FN
#undef ABF_ATTR
#undef ABF_INL
#undef ABF_DOT
