/* The per-head attention kernels of kernels/attention.pyx, a template over the vector
 * width: attention.pyx includes it once per width after defining ADT_W (see the end
 * of kernels/simd.h), giving attn_head_forward_v8 and _v16, and so on.  The register
 * tile is ATTN_MR rows by ATTN_NR = two vectors of columns: 8 x 32 in sixteen lanes
 * (16 of AVX-512's 32 registers hold the accumulators), 6 x 16 in eight (12 of AVX2's
 * 16: two FMA pipes of latency 4 need 8 in flight, and 8 left no slack).  The
 * accumulators are named variables, spelled out by ATTN_ROWS: GCC keeps those in
 * registers, but spills an array of them to the stack.
 */
#define ATTN_NR (2 * ADT_W)
#if ADT_W == 16
#define ATTN_GEMM_ATTR static __attribute__((noinline)) ADT_TARGET_V4
#else
#define ATTN_GEMM_ATTR static __attribute__((noinline)) ADT_MULTIVERSION
#endif
#if ADT_W == 16
#define ATTN_MR 8
#define ATTN_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#else
#define ATTN_MR 6
#define ATTN_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#endif

/* Packed B: op(B) (K, N) cut into depth blocks of kcs = min(KC, K) rows and
   NR-column slivers, zero-padded; element (p, j) of block kb, sliver s lives at
   kb*kcs*npad + s*NR*kcs + (p % kcs)*NR + j % NR, npad = N rounded up to NR.
   Any leading (K', N') corner of a packed matrix is itself a valid packed
   operand with the same kcs and npad, so K and V are packed once per head and
   reused by every causal block. */
ADT_LANES_INLINE ptrdiff_t ADT_LANES_FN(attn_npad)(ptrdiff_t N) {
    return (N + ATTN_NR - 1) / ATTN_NR * ATTN_NR;
}

/* dst[k * ldd + i] = src[i * lds + k] for an 8 x 8 block, in registers: 24 shuffles
   where element by element it is 64 loads and 64 stores. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_transpose8)(float* dst, ptrdiff_t ldd,
                                                     const float* src, ptrdiff_t lds) {
    adt_v8 r0 = adt_load(src), r1 = adt_load(src + lds), r2 = adt_load(src + 2 * lds),
           r3 = adt_load(src + 3 * lds), r4 = adt_load(src + 4 * lds),
           r5 = adt_load(src + 5 * lds), r6 = adt_load(src + 6 * lds),
           r7 = adt_load(src + 7 * lds);
    adt_v8 t0 = __builtin_shufflevector(r0, r1, 0, 8, 1, 9, 4, 12, 5, 13);
    adt_v8 t1 = __builtin_shufflevector(r0, r1, 2, 10, 3, 11, 6, 14, 7, 15);
    adt_v8 t2 = __builtin_shufflevector(r2, r3, 0, 8, 1, 9, 4, 12, 5, 13);
    adt_v8 t3 = __builtin_shufflevector(r2, r3, 2, 10, 3, 11, 6, 14, 7, 15);
    adt_v8 t4 = __builtin_shufflevector(r4, r5, 0, 8, 1, 9, 4, 12, 5, 13);
    adt_v8 t5 = __builtin_shufflevector(r4, r5, 2, 10, 3, 11, 6, 14, 7, 15);
    adt_v8 t6 = __builtin_shufflevector(r6, r7, 0, 8, 1, 9, 4, 12, 5, 13);
    adt_v8 t7 = __builtin_shufflevector(r6, r7, 2, 10, 3, 11, 6, 14, 7, 15);
    adt_v8 u0 = __builtin_shufflevector(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13);
    adt_v8 u1 = __builtin_shufflevector(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    adt_v8 u2 = __builtin_shufflevector(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13);
    adt_v8 u3 = __builtin_shufflevector(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    adt_v8 u4 = __builtin_shufflevector(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13);
    adt_v8 u5 = __builtin_shufflevector(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    adt_v8 u6 = __builtin_shufflevector(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13);
    adt_v8 u7 = __builtin_shufflevector(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    adt_store(dst, __builtin_shufflevector(u0, u4, 0, 1, 2, 3, 8, 9, 10, 11));
    adt_store(dst + ldd, __builtin_shufflevector(u1, u5, 0, 1, 2, 3, 8, 9, 10, 11));
    adt_store(dst + 2 * ldd, __builtin_shufflevector(u2, u6, 0, 1, 2, 3, 8, 9, 10, 11));
    adt_store(dst + 3 * ldd, __builtin_shufflevector(u3, u7, 0, 1, 2, 3, 8, 9, 10, 11));
    adt_store(dst + 4 * ldd, __builtin_shufflevector(u0, u4, 4, 5, 6, 7, 12, 13, 14, 15));
    adt_store(dst + 5 * ldd, __builtin_shufflevector(u1, u5, 4, 5, 6, 7, 12, 13, 14, 15));
    adt_store(dst + 6 * ldd, __builtin_shufflevector(u2, u6, 4, 5, 6, 7, 12, 13, 14, 15));
    adt_store(dst + 7 * ldd, __builtin_shufflevector(u3, u7, 4, 5, 6, 7, 12, 13, 14, 15));
}

ADT_LANES_INLINE void ADT_LANES_FN(attn_pack_b)(float* restrict pb, const float* B,
                                                ptrdiff_t ldb, int tb, ptrdiff_t K,
                                                ptrdiff_t N) {
    ptrdiff_t kcs = attn_kcs(K), npad = ADT_LANES_FN(attn_npad)(N);
    for (ptrdiff_t k0 = 0; k0 < K; k0 += kcs) {
        ptrdiff_t kc = K - k0 < kcs ? K - k0 : kcs;
        float* blk = pb + (k0 / kcs) * kcs * npad;
        for (ptrdiff_t j0 = 0; j0 < npad; j0 += ATTN_NR) {
            float* dst = blk + j0 * kcs;
            ptrdiff_t nr = N - j0 < ATTN_NR ? N - j0 : ATTN_NR;
            if (tb) {
                /* eight rows at a time by 8 x 8 blocks, the rest (a depth not a
                   multiple of 8, T's last rows, the zero padding) one by one */
                ptrdiff_t j = 0, kc8 = kc / 8 * 8;
                for (; j + 8 <= nr; j += 8) {
                    const float* src = B + (j0 + j) * ldb + k0;
                    /* the rows are a head's slice of qkv, a row of qkv apart, read
                       from memory (each head's first touch): fetch ahead */
                    for (ptrdiff_t i = 0; i < 8; i++)
                        for (ptrdiff_t p = 0; p < kc; p += 16)
                            __builtin_prefetch(src + (ATTN_PACK_AHEAD + i) * ldb + p, 0, 3);
                    for (ptrdiff_t p = 0; p < kc8; p += 8)
                        ADT_LANES_FN(attn_transpose8)(dst + p * ATTN_NR + j, ATTN_NR, src + p,
                                                      ldb);
                    for (ptrdiff_t p = kc8; p < kc; p++)
                        for (ptrdiff_t i = 0; i < 8; i++)
                            dst[p * ATTN_NR + j + i] = src[i * ldb + p];
                }
                for (; j < ATTN_NR; j++) {
                    const float* src = B + (j0 + j) * ldb + k0;
                    if (j < nr)
                        for (ptrdiff_t p = 0; p < kc; p++) dst[p * ATTN_NR + j] = src[p];
                    else
                        for (ptrdiff_t p = 0; p < kc; p++) dst[p * ATTN_NR + j] = 0.0f;
                }
            } else if (nr == ATTN_NR) {
                for (ptrdiff_t p = 0; p < kc; p++)
                    memcpy(dst + p * ATTN_NR, B + (k0 + p) * ldb + j0, ATTN_NR * sizeof(float));
            } else {
                for (ptrdiff_t p = 0; p < kc; p++) {
                    const float* src = B + (k0 + p) * ldb + j0;
                    for (ptrdiff_t j = 0; j < ATTN_NR; j++)
                        dst[p * ATTN_NR + j] = j < nr ? src[j] : 0.0f;
                }
            }
        }
    }
}

/* Row r of the C tile (+)= alpha * (acc0 | acc1), its first nr columns. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_store_tile_row)(float* row, ADT_VT acc0, ADT_VT acc1,
                                                        ptrdiff_t nr, float alpha,
                                                        int accumulate) {
    if (nr == ATTN_NR) {
        ADT_V(store)(row, accumulate ? ADT_V(load)(row) + alpha * acc0 : alpha * acc0);
        ADT_V(store)(row + ADT_W, accumulate ? ADT_V(load)(row + ADT_W) + alpha * acc1
                                             : alpha * acc1);
        return;
    }
    float tile[ATTN_NR];
    ADT_V(store)(tile, acc0);
    ADT_V(store)(tile + ADT_W, acc1);
    for (ptrdiff_t j = 0; j < nr; j++)
        row[j] = (accumulate ? row[j] : 0.0f) + alpha * tile[j];
}

/* C tile (mr, nr) (+)= alpha * A tile (mr, kc) @ packed B sliver (kc, NR);
   A element (i, p) at a[i*rs + p*cs], read in place (no packing: with
   hs = 64 columns there is too little reuse to repay it).  Rows past mr repeat
   the last valid row: computed, never stored. */
#define ATTN_TILE_ROW(r) const float* a##r = a + (r < mr ? r : mr - 1) * rs;
#define ATTN_TILE_ZERO(r) ADT_VT c##r##0 = {0}, c##r##1 = {0};
#define ATTN_TILE_FMA(r) { float ar = a##r[o]; c##r##0 += ar * b0; c##r##1 += ar * b1; }
#define ATTN_TILE_STORE(r) \
    if (r < mr) ADT_LANES_FN(attn_store_tile_row)(c + r * ldc, c##r##0, c##r##1, nr, alpha, \
                                                  accumulate);
ADT_LANES_INLINE void ADT_LANES_FN(attn_ukernel)(ptrdiff_t kc, const float* a, ptrdiff_t rs,
                                                 ptrdiff_t cs, const float* restrict b,
                                                 float* c, ptrdiff_t ldc, ptrdiff_t mr,
                                                 ptrdiff_t nr, float alpha, int accumulate) {
    ATTN_ROWS(ATTN_TILE_ROW)
    ATTN_ROWS(ATTN_TILE_ZERO)
    for (ptrdiff_t p = 0; p < kc; p++) {
        ADT_VT b0 = ADT_V(load)(b + p * ATTN_NR);
        ADT_VT b1 = ADT_V(load)(b + p * ATTN_NR + ADT_W);
        ptrdiff_t o = p * cs;
        ATTN_ROWS(ATTN_TILE_FMA)
    }
    ATTN_ROWS(ATTN_TILE_STORE)
}
#undef ATTN_TILE_ROW
#undef ATTN_TILE_ZERO
#undef ATTN_TILE_FMA
#undef ATTN_TILE_STORE

/* Single-threaded row-major C (M, N) (+)= alpha op(A) (M, K) @ B (K, N), B
   packed by attn_pack_b with (kcs, npad); op(A)(i, p) at a[i*rs + p*cs].
   tri skips the work that causal masking makes zero, by register tiles (the
   diagonal blocks, where it is a quarter of the work at T = 64):
     ATTN_TRI_C     C(i, j) is wanted only for j <= i + diag: tiles wholly past that
                    are not computed and C keeps whatever it held there;
     ATTN_TRI_UPTO  op(A)(i, p) = 0 for p > i + diag: each row tile's depth ends there;
     ATTN_TRI_FROM  op(A)(i, p) = 0 for p < i - diag: each row tile's depth starts there.
   Not inlined: inlined into the per-head kernels, the micro-kernel's loop was
   compiled with its B vectors spilled to the stack, and which of the copies was
   hit changed with unrelated edits (the forward 7-30% slower). */
ATTN_GEMM_ATTR void ADT_LANES_FN(attn_gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                                              float alpha, const float* A, ptrdiff_t rs,
                                              ptrdiff_t cs, const float* pb, ptrdiff_t kcs,
                                              ptrdiff_t npad, int accumulate, float* Cm,
                                              ptrdiff_t ldc, int tri, ptrdiff_t diag) {
    for (ptrdiff_t k0 = 0; k0 < K; k0 += kcs) {
        ptrdiff_t kc = K - k0 < kcs ? K - k0 : kcs;
        const float* blk = pb + (k0 / kcs) * kcs * npad;
        int acc = accumulate || k0 > 0;
        for (ptrdiff_t j0 = 0; j0 < N; j0 += ATTN_NR)
            for (ptrdiff_t i0 = 0; i0 < M; i0 += ATTN_MR) {
                ptrdiff_t mr = M - i0 < ATTN_MR ? M - i0 : ATTN_MR, lo = 0, hi = kc;
                if (tri == ATTN_TRI_C && j0 > i0 + mr - 1 + diag) continue;
                if (tri == ATTN_TRI_UPTO) {
                    hi = i0 + mr + diag - k0;
                    hi = hi < 0 ? 0 : hi > kc ? kc : hi;
                }
                if (tri == ATTN_TRI_FROM) {
                    lo = i0 - diag - k0;
                    lo = lo < 0 ? 0 : lo > kc ? kc : lo;
                }
                if (lo >= hi && acc) continue;   /* nothing to add */
                ADT_LANES_FN(attn_ukernel)(hi > lo ? hi - lo : 0,
                                           A + i0 * rs + (k0 + lo) * cs, rs, cs,
                                           blk + j0 * kcs + lo * ATTN_NR, Cm + i0 * ldc + j0,
                                           ldc, mr, N - j0 < ATTN_NR ? N - j0 : ATTN_NR,
                                           alpha, acc);
            }
    }
}

/* Sum of x[j] y[j] in vector lanes: without -ffast-math GCC may not reorder a float
   reduction, so a plain loop would stay scalar. */
ADT_LANES_INLINE float ADT_LANES_FN(attn_dot)(const float* x, const float* y, ptrdiff_t n) {
    ADT_VT acc = {0};
    ptrdiff_t j = 0;
    for (; j + ADT_W <= n; j += ADT_W) acc += ADT_V(load)(x + j) * ADT_V(load)(y + j);
    float s = 0.0f;
    for (; j < n; j++) s += x[j] * y[j];
    return ADT_V(hsum)(acc) + s;
}

/* Softmax of the scores s[0..n) in place and s[n..kpad) set to 0 (kpad, a multiple
   of ADT_W, at least n); returns the row's log-sum-exp, log(sum_j exp(s[j])), from
   which the backward recomputes the probabilities. */
ADT_LANES_INLINE float ADT_LANES_FN(attn_softmax_row)(float* s, ptrdiff_t n, ptrdiff_t kpad) {
    ADT_VI lane;
    for (int l = 0; l < ADT_W; l++) lane[l] = l;
    ADT_VT neg_inf = ADT_V(splat)(-INFINITY), zero = {0};
    ptrdiff_t full = n / ADT_W * ADT_W, j = 0;
    /* the vector that holds s[n - 1] and later lanes, which do not count */
    ADT_VI valid = lane < (ADT_VI){0} + (int)(n - full);
    ADT_VT mv = neg_inf;
    for (; j < full; j += ADT_W) mv = ADT_V(max)(mv, ADT_V(load)(s + j));
    if (full < n) mv = ADT_V(max)(mv, ADT_V(select)(valid, ADT_V(load)(s + full), neg_inf));
    float mx = mv[0];
    for (int l = 1; l < ADT_W; l++) mx = mv[l] > mx ? mv[l] : mx;
    ADT_VT m = ADT_V(splat)(mx), sum = {0};
    /* exp_bits, not exp: with sixteen lanes the scalef exp (kernels/simd.h) made
       this forward 20% slower (75 -> 92 ms at B=8, T=1024), though it is faster in
       the loss and GELU loops; the code around it in attn_head_forward is compiled
       worse. */
    for (j = 0; j < full; j += ADT_W) {
        ADT_VT e = ADT_V(exp_bits)(ADT_V(load)(s + j) - m);
        ADT_V(store)(s + j, e);
        sum += e;
    }
    if (full < n) {
        ADT_VT e = ADT_V(select)(valid, ADT_V(exp_bits)(ADT_V(load)(s + full) - m), zero);
        ADT_V(store)(s + full, e);
        sum += e;
        j += ADT_W;
    }
    for (; j < kpad; j += ADT_W) ADT_V(store)(s + j, zero);
    float total = ADT_V(hsum)(sum);
    ADT_VT inv = ADT_V(splat)(1.0f / total);
    for (j = 0; j < n; j += ADT_W) ADT_V(store)(s + j, ADT_V(load)(s + j) * inv);
    return mx + logf(total);
}

/* x[0..n) rounded to bf16 values in place (bf16.h's rounding): the emulated bf16
   attention (attention.pyx's BF_EMULATED) rounds the probabilities and dS so, the
   operands its float32 products then take. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_round_bf16)(float* x, ptrdiff_t n) {
    for (ptrdiff_t j = 0; j < n; j++)
        x[j] = bf16_bits_f32((uint32_t)bf16_from_bits(bf16_f32_bits(x[j])) << 16);
}

/* One (batch, query head): q, k and v point at the first column of this head's q and
   its kv head's k and v in the batch's qkv rows (ldq floats apart), out at the head's
   first column of the batch's out rows (ldo apart), lse at the head's T log-sum-exps.
   pk, pv are attn_pack_floats scratch, packed with K^T and V unless pack_kv is 0 (they
   hold this kv head's already: the thread's previous task was another query head of
   its group); scores (BQ, attn_score_ld(T)) holds a query block's scores, then its
   probabilities, which the product with V reads there, in cache.  Only the block's BQ
   rows of probabilities ever exist: nothing T x T is stored. */
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_head_forward)(float* out, float* lse, const float* q,
                                            const float* k, const float* v, ptrdiff_t T,
                                            ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs,
                                            float scale, int pack_kv, float* pk, float* pv,
                                            float* scores, int round_bf) {
    ptrdiff_t lds = attn_score_ld(T);
    if (pack_kv) {
        ADT_LANES_FN(attn_pack_b)(pk, k, ldq, 1, hs, T);   /* K^T (hs, T) */
        ADT_LANES_FN(attn_pack_b)(pv, v, ldq, 0, T, hs);   /* V (T, hs) */
    }
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
        ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ;
        ptrdiff_t kend = i0 + rows;
        /* whole slivers: K^T's zero padding gives the columns past T, and those
           past the diagonal are masked by the softmax */
        ptrdiff_t kpad = ADT_LANES_FN(attn_npad)(kend);
        ADT_LANES_FN(attn_gemm)(rows, kpad, hs, scale, q + i0 * ldq, ldq, 1, pk, attn_kcs(hs),
                                ADT_LANES_FN(attn_npad)(T), 0, scores, lds, ATTN_TRI_C, i0);
        for (ptrdiff_t r = 0; r < rows; r++)
            lse[i0 + r] = ADT_LANES_FN(attn_softmax_row)(scores + r * lds, i0 + r + 1, kpad);
        if (round_bf)
            for (ptrdiff_t r = 0; r < rows; r++)
                ADT_LANES_FN(attn_round_bf16)(scores + r * lds, kpad);
        ADT_LANES_FN(attn_gemm)(rows, hs, kend, 1.0f, scores, lds, 1, pv, attn_kcs(T),
                                ADT_LANES_FN(attn_npad)(hs), 0, out + i0 * ldo, ldo,
                                ATTN_TRI_UPTO, i0);
    }
}

/* FlashAttention-2's backward on (BQ, BK) tiles: for each block of queries i and each
   key block j up to the diagonal, the probabilities are recomputed from the scores and
   the saved log-sum-exps, P = exp(S - lse), and
     dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = P * (dP - D_i) * scale,
     dQ_i += dS K_j,    dK_j += dS^T Q_i,
   with D_i = rowsum(dO_i * O_i) (= sum_j P dP, the softmax's correction).  q, k, v
   and dq, dk, dv point at the first column of this head's q and its kv head's k and
   v in the batch's rows of qkv and dqkv (ldq floats apart), o and dO at the head's
   first column of the batch's out and dout rows (ldo apart), lse at its T
   log-sum-exps.  Packed operands: pkt, pvt and pk (attn_pack_floats) hold the kv
   head's K^T, V^T and K; pq and pdo (attn_panel_floats) a query block's Q and dO.

   attn_bwd_tile: P (in ptile) and dS (in dstile) of query block i0 (rows) and key
   block j0 (cols), from S = scale Q_i K_j^T and dP = dO_i V_j^T; drow holds the
   block's D_i.  Every entry of the (rows, cpad) tiles is written: keys past the query
   (in the diagonal tile) and the padding columns past kend get 0 in both, selected,
   since the register tiles that ATTN_TRI_C skipped hold whatever the scratch held
   (NaN, say) and 0 * NaN is NaN; so the products that read the tiles need no
   alignment of their row tiles to the diagonal. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_bwd_tile)(const float* q, const float* dO,
                                                  const float* pkt, const float* pvt,
                                                  const float* lse, const float* drow,
                                                  ptrdiff_t T, ptrdiff_t ldq, ptrdiff_t ldo,
                                                  ptrdiff_t hs, float scale, ptrdiff_t i0,
                                                  ptrdiff_t rows, ptrdiff_t j0,
                                                  ptrdiff_t cpad, float* ptile,
                                                  float* dstile, int round_bf) {
    ptrdiff_t ks_hs = attn_kcs(hs), npad_T = ADT_LANES_FN(attn_npad)(T);
    ADT_VI lane;
    for (int l = 0; l < ADT_W; l++) lane[l] = l;
    ADT_VT zero = {0}, vscale = ADT_V(splat)(scale);
    /* a column slice of a packed operand starts j0 columns in, each depth block
       keeping its stride */
    ADT_LANES_FN(attn_gemm)(rows, cpad, hs, scale, q + i0 * ldq, ldq, 1,
                            pkt + j0 * ks_hs, ks_hs, npad_T, 0, ptile, ATTN_BK,
                            ATTN_TRI_C, i0 - j0);
    ADT_LANES_FN(attn_gemm)(rows, cpad, hs, 1.0f, dO + i0 * ldo, ldo, 1,
                            pvt + j0 * ks_hs, ks_hs, npad_T, 0, dstile, ATTN_BK,
                            ATTN_TRI_C, i0 - j0);
    for (ptrdiff_t r = 0; r < rows; r++) {
        float* p = ptile + r * ATTN_BK;
        float* ds = dstile + r * ATTN_BK;
        ADT_VI nvalid = (ADT_VI){0} + (int)(i0 + r + 1 - j0);
        ADT_VT l = ADT_V(splat)(lse[i0 + r]), d = ADT_V(splat)(drow[r]);
        for (ptrdiff_t c = 0; c < cpad; c += ADT_W) {
            ADT_VI valid = lane + (int)c < nvalid;
            ADT_VT e = ADT_V(select)(valid, ADT_V(exp_bits)(ADT_V(load)(p + c) - l), zero);
            ADT_V(store)(p + c, e);
            ADT_V(store)(ds + c, ADT_V(select)(valid, e * (ADT_V(load)(ds + c) - d) * vscale,
                                               zero));
        }
        if (round_bf) {   /* dS from the float32 P; then both rounded for the products */
            ADT_LANES_FN(attn_round_bf16)(p, cpad);
            ADT_LANES_FN(attn_round_bf16)(ds, cpad);
        }
    }
}

/* D_i of query block i0's rows: drow[r] = dO[i0 + r] . o[i0 + r]. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_drow)(float* drow, const float* dO, const float* o,
                                              ptrdiff_t ldo, ptrdiff_t hs, ptrdiff_t i0,
                                              ptrdiff_t rows) {
    for (ptrdiff_t r = 0; r < rows; r++)
        drow[r] = ADT_LANES_FN(attn_dot)(dO + (i0 + r) * ldo, o + (i0 + r) * ldo, hs);
}

/* dV_j += P^T dO_i and dK_j += dS^T Q_i (the tiles read transposed); with add_kv 0
   they write instead. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_bwd_kv)(float* dk, float* dv, const float* pq,
                                                const float* pdo, const float* ptile,
                                                const float* dstile, ptrdiff_t ldq,
                                                ptrdiff_t hs, ptrdiff_t i0, ptrdiff_t rows,
                                                ptrdiff_t j0, ptrdiff_t cols, int add_kv) {
    ptrdiff_t ks_rows = attn_kcs(rows), npad_hs = ADT_LANES_FN(attn_npad)(hs);
    ADT_LANES_FN(attn_gemm)(cols, hs, rows, 1.0f, ptile, 1, ATTN_BK, pdo, ks_rows,
                            npad_hs, add_kv, dv + j0 * ldq, ldq, ATTN_TRI_FROM, i0 - j0);
    ADT_LANES_FN(attn_gemm)(cols, hs, rows, 1.0f, dstile, 1, ATTN_BK, pq, ks_rows,
                            npad_hs, add_kv, dk + j0 * ldq, ldq, ATTN_TRI_FROM, i0 - j0);
}

/* dQ_i += dS K_j (writes with add_q 0): rows j0.. of packed K, inside one of its depth
   blocks (BK divides ATTN_KC, and T < ATTN_KC is a single block). */
ADT_LANES_INLINE void ADT_LANES_FN(attn_bwd_q)(float* dq, const float* pk,
                                               const float* dstile, ptrdiff_t T,
                                               ptrdiff_t ldq, ptrdiff_t hs, ptrdiff_t i0,
                                               ptrdiff_t rows, ptrdiff_t j0, ptrdiff_t cols,
                                               int add_q) {
    ptrdiff_t ks_T = attn_kcs(T), npad_hs = ADT_LANES_FN(attn_npad)(hs);
    ADT_LANES_FN(attn_gemm)(rows, hs, cols, 1.0f, dstile, ATTN_BK, 1,
                            pk + j0 / ks_T * ks_T * npad_hs + j0 % ks_T * ATTN_NR, ks_T,
                            npad_hs, add_q, dq + i0 * ldq, ldq, ATTN_TRI_UPTO, i0 - j0);
}

/* The kv head's K^T, V^T and K packed for the backward. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_pack_kv_backward)(float* pkt, float* pvt, float* pk,
                                                          const float* k, const float* v,
                                                          ptrdiff_t T, ptrdiff_t ldq,
                                                          ptrdiff_t hs) {
    ADT_LANES_FN(attn_pack_b)(pkt, k, ldq, 1, hs, T);  /* K^T (hs, T) */
    ADT_LANES_FN(attn_pack_b)(pvt, v, ldq, 1, hs, T);  /* V^T (hs, T) */
    ADT_LANES_FN(attn_pack_b)(pk, k, ldq, 0, T, hs);   /* K (T, hs) */
}

/* Query block i0's operands of the backward: its D_i (drow), and its Q and dO packed
   (pq, pdo). */
ADT_LANES_INLINE void ADT_LANES_FN(attn_prepare_query)(float* pq, float* pdo, float* drow,
                                                       const float* q, const float* dO,
                                                       const float* o, ptrdiff_t T,
                                                       ptrdiff_t ldq, ptrdiff_t ldo,
                                                       ptrdiff_t hs, ptrdiff_t i0) {
    ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ;
    ADT_LANES_FN(attn_drow)(drow, dO, o, ldo, hs, i0, rows);
    ADT_LANES_FN(attn_pack_b)(pq, q + i0 * ldq, ldq, 0, rows, hs);
    ADT_LANES_FN(attn_pack_b)(pdo, dO + i0 * ldo, ldo, 0, rows, hs);
}

/* The two-pass backward's shared operands, as tasks of their own: a kv head's K^T, V^T
   and K, and a query block's Q and dO panels and D_i. */
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_prepare_kv_task)(float* pkt, float* pvt, float* pk,
                                               const float* k, const float* v, ptrdiff_t T,
                                               ptrdiff_t ldq, ptrdiff_t hs) {
    ADT_LANES_FN(attn_pack_kv_backward)(pkt, pvt, pk, k, v, T, ldq, hs);
}
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_prepare_query_task)(float* pq, float* pdo, float* drow,
                                                  const float* q, const float* dO,
                                                  const float* o, ptrdiff_t T, ptrdiff_t ldq,
                                                  ptrdiff_t ldo, ptrdiff_t hs, ptrdiff_t i0) {
    ADT_LANES_FN(attn_prepare_query)(pq, pdo, drow, q, dO, o, T, ldq, ldo, hs, i0);
}

/* One (batch, query head), all of it: for each query block i and key block j <= i,
   the tile, then dV_j, dK_j and dQ_i.  The caller's task owns the head's dq and its
   kv head's dk and dv (attn_kv_backward), so no two threads write one row.  With
   overwrite_q, dq_i's first product (at key block 0) writes it instead of adding;
   with overwrite_kv, so do dk_j's and dv_j's (at the diagonal tile, where query
   blocks reach key block j first: BK divides BQ, so that tile covers the whole key
   block).  pkt, pvt, pk are packed unless pack_kv is 0 (they hold this kv head's
   already); pq and pdo take the query block's panels, ptile and dstile (BQ, BK) tiles,
   drow BQ floats. */
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_head_backward)(float* dq, float* dk, float* dv, const float* dO,
                                             const float* q, const float* k, const float* v,
                                             const float* o, const float* lse, ptrdiff_t T,
                                             ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs,
                                             float scale, int overwrite_q, int overwrite_kv,
                                             int pack_kv, float* pkt, float* pvt, float* pk,
                                             float* pq, float* pdo, float* ptile,
                                             float* dstile, float* drow, int round_bf) {
    if (pack_kv) ADT_LANES_FN(attn_pack_kv_backward)(pkt, pvt, pk, k, v, T, ldq, hs);
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
        ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ, kend = i0 + rows;
        ADT_LANES_FN(attn_prepare_query)(pq, pdo, drow, q, dO, o, T, ldq, ldo, hs, i0);
        for (ptrdiff_t j0 = 0; j0 < kend; j0 += ATTN_BK) {
            ptrdiff_t cols = kend - j0 < ATTN_BK ? kend - j0 : ATTN_BK;
            ADT_LANES_FN(attn_bwd_tile)(q, dO, pkt, pvt, lse, drow, T, ldq, ldo, hs, scale, i0,
                                        rows, j0, ADT_LANES_FN(attn_npad)(cols), ptile, dstile,
                                        round_bf);
            ADT_LANES_FN(attn_bwd_kv)(dk, dv, pq, pdo, ptile, dstile, ldq, hs, i0, rows, j0,
                                      cols, !(overwrite_kv && j0 >= i0));
            ADT_LANES_FN(attn_bwd_q)(dq, pk, dstile, T, ldq, hs, i0, rows, j0, cols,
                                     !(overwrite_q && j0 == 0));
        }
    }
}

/* The two-pass backward's parts, for more tasks than (batch, kv head) when threads
   outnumber those (kernels/attention.pyx): the same tiles and products in the same
   order per output element as attn_head_backward, so the same bits, with the tiles
   that dQ and dK|dV share computed twice (7 products instead of 5).  Shared packed
   operands, read-only: pkt, pvt, pk as above, pq and pdo a panel per query block of
   each head (``panel`` floats apart, ``nblk`` blocks a head), drows each head's D (T
   floats a head).

   attn_key_backward: key block j0's dk and dv (the caller's task owns them) over the
   group's query heads h0 .. h0 + rep - 1 (q, dO, lse, pq, pdo and drows point at
   h0's) and every query block from the diagonal on; with
   overwrite_kv the first (head h0's diagonal tile) writes. */
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_key_backward)(float* dk, float* dv, const float* dO,
                                            const float* q, const float* lse, ptrdiff_t T,
                                            ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs,
                                            float scale, ptrdiff_t rep, int overwrite_kv,
                                            ptrdiff_t j0, const float* pkt, const float* pvt,
                                            const float* pq, const float* pdo,
                                            ptrdiff_t panel, ptrdiff_t nblk,
                                            const float* drows, float* ptile,
                                            float* dstile, int round_bf) {
    ptrdiff_t cols = T - j0 < ATTN_BK ? T - j0 : ATTN_BK;
    for (ptrdiff_t h = 0; h < rep; h++)
        for (ptrdiff_t i0 = j0 / ATTN_BQ * ATTN_BQ; i0 < T; i0 += ATTN_BQ) {
            ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ, kend = i0 + rows;
            ptrdiff_t c = kend - j0 < cols ? kend - j0 : cols, blk = i0 / ATTN_BQ;
            ADT_LANES_FN(attn_bwd_tile)(q + h * hs, dO + h * hs, pkt, pvt, lse + h * T,
                                        drows + h * T + i0, T, ldq, ldo, hs, scale, i0, rows,
                                        j0, ADT_LANES_FN(attn_npad)(c), ptile, dstile,
                                        round_bf);
            ADT_LANES_FN(attn_bwd_kv)(dk, dv, pq + (h * nblk + blk) * panel,
                                      pdo + (h * nblk + blk) * panel, ptile,
                                      dstile, ldq, hs, i0, rows, j0, c,
                                      !(overwrite_kv && h == 0 && j0 >= i0));
        }
}

/* attn_query_backward: query block i0 of one head: its dq (the caller's task owns it)
   over key blocks 0 .. the diagonal; with overwrite_q the first writes. */
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_query_backward)(float* dq, const float* dO, const float* q,
                                              const float* lse, ptrdiff_t T, ptrdiff_t ldq,
                                              ptrdiff_t ldo, ptrdiff_t hs, float scale,
                                              int overwrite_q, ptrdiff_t i0,
                                              const float* pkt, const float* pvt,
                                              const float* pk, const float* drow,
                                              float* ptile, float* dstile, int round_bf) {
    ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ, kend = i0 + rows;
    for (ptrdiff_t j0 = 0; j0 < kend; j0 += ATTN_BK) {
        ptrdiff_t cols = kend - j0 < ATTN_BK ? kend - j0 : ATTN_BK;
        ADT_LANES_FN(attn_bwd_tile)(q, dO, pkt, pvt, lse, drow, T, ldq, ldo, hs, scale, i0,
                                    rows, j0, ADT_LANES_FN(attn_npad)(cols), ptile, dstile,
                                    round_bf);
        ADT_LANES_FN(attn_bwd_q)(dq, pk, dstile, T, ldq, hs, i0, rows, j0, cols,
                                 !(overwrite_q && j0 == 0));
    }
}

#undef ATTN_NR
#undef ATTN_GEMM_ATTR
#undef ATTN_MR
#undef ATTN_ROWS
