/* The per-head attention kernels of kernels/attention.pyx, a template over the vector
 * width: attention.pyx includes it once per width after defining ADT_W (see the end
 * of kernels/simd.h), giving attn_head_forward_v8 and _v16, and so on.  The register
 * tile is ATTN_MR rows by ATTN_NR = two vectors of columns: 8 x 32 in sixteen lanes
 * (16 of AVX-512's 32 registers hold the accumulators), 4 x 16 in eight (8 of AVX2's
 * 16).  The accumulators are named variables, spelled out by ATTN_ROWS: GCC keeps
 * those in registers, but spills an array of them to the stack.
 */
#define ATTN_NR (2 * ADT_W)
#if ADT_W == 16
#define ATTN_MR 8
#define ATTN_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#else
#define ATTN_MR 4
#define ATTN_ROWS(X) X(0) X(1) X(2) X(3)
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
                for (ptrdiff_t j = 0; j < ATTN_NR; j++) {
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
   packed by attn_pack_b with (kcs, npad); op(A)(i, p) at a[i*rs + p*cs]. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                                              float alpha, const float* A, ptrdiff_t rs,
                                              ptrdiff_t cs, const float* pb, ptrdiff_t kcs,
                                              ptrdiff_t npad, int accumulate, float* Cm,
                                              ptrdiff_t ldc) {
    for (ptrdiff_t k0 = 0; k0 < K; k0 += kcs) {
        ptrdiff_t kc = K - k0 < kcs ? K - k0 : kcs;
        const float* blk = pb + (k0 / kcs) * kcs * npad;
        int acc = accumulate || k0 > 0;
        for (ptrdiff_t j0 = 0; j0 < N; j0 += ATTN_NR)
            for (ptrdiff_t i0 = 0; i0 < M; i0 += ATTN_MR)
                ADT_LANES_FN(attn_ukernel)(kc, A + i0 * rs + k0 * cs, rs, cs, blk + j0 * kcs,
                                           Cm + i0 * ldc + j0, ldc,
                                           M - i0 < ATTN_MR ? M - i0 : ATTN_MR,
                                           N - j0 < ATTN_NR ? N - j0 : ATTN_NR, alpha, acc);
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

/* dst[j] = src[j] for j < kpad, 0 for kpad <= j < T, written past the caches
   (non-temporal stores): att is far larger than them and is not read again until
   the backward, so a plain store would first fetch each line it overwrites.  src
   holds kpad + ADT_W floats. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_stream_row)(float* dst, const float* src,
                                                    ptrdiff_t kpad, ptrdiff_t T) {
    ptrdiff_t j = 0;
    ptrdiff_t lead = (ptrdiff_t)((-(uintptr_t)dst & (ADT_W * sizeof(float) - 1)) / sizeof(float));
    for (; j < lead && j < T; j++) dst[j] = src[j];   /* lead < ADT_W <= kpad */
    ADT_VT zero = {0};
    for (; j + ADT_W <= T; j += ADT_W) {
        ADT_VT v = j < kpad ? ADT_V(load)(src + j) : zero;
#if ADT_W == 16 && ADT_HAVE_V4
        _mm512_stream_ps(dst + j, (__m512)v);
#elif defined(__SSE__)
        _mm_stream_ps(dst + j, (__m128)__builtin_shufflevector(v, v, 0, 1, 2, 3));
        _mm_stream_ps(dst + j + 4, (__m128)__builtin_shufflevector(v, v, 4, 5, 6, 7));
#else
        ADT_V(store)(dst + j, v);
#endif
    }
    for (; j < T; j++) dst[j] = j < kpad ? src[j] : 0.0f;
}

/* Softmax of the scores s[0..n) in place, s[n..kpad + ADT_W) set to 0 (kpad, a
   multiple of ADT_W, at least n), and the row also streamed to att_row[0..T). */
ADT_LANES_INLINE void ADT_LANES_FN(attn_softmax_row)(float* s, ptrdiff_t n, ptrdiff_t kpad,
                                                     float* att_row, ptrdiff_t T) {
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
    for (; j < kpad + ADT_W; j += ADT_W) ADT_V(store)(s + j, zero);
    ADT_VT inv = ADT_V(splat)(1.0f / ADT_V(hsum)(sum));
    for (j = 0; j < n; j += ADT_W) ADT_V(store)(s + j, ADT_V(load)(s + j) * inv);
    ADT_LANES_FN(attn_stream_row)(att_row, s, kpad, T);
}

/* One (batch, head): qkv and out point at this batch's (T, 3C) / (T, C) rows,
   att at this head's (T, T) matrix; pk, pv are attn_pack_floats scratch and
   scores (BQ, attn_score_ld(T)) holds a query block's scores, then its
   probabilities, which the product with V reads there, in cache, rather than
   back from att. */
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_head_forward)(float* out, float* att, const float* qkv,
                                            ptrdiff_t T, ptrdiff_t C, ptrdiff_t hs,
                                            ptrdiff_t h, float scale, float* pk, float* pv,
                                            float* scores) {
    ptrdiff_t C3 = 3 * C, lds = attn_score_ld(T);
    const float* q = qkv + h * hs;
    ADT_LANES_FN(attn_pack_b)(pk, qkv + C + h * hs, C3, 1, hs, T);      /* K^T (hs, T) */
    ADT_LANES_FN(attn_pack_b)(pv, qkv + 2 * C + h * hs, C3, 0, T, hs);  /* V (T, hs) */
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
        ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ;
        ptrdiff_t kend = i0 + rows;
        /* whole slivers: K^T's zero padding gives the columns past T, and those
           past the diagonal are masked by the softmax */
        ptrdiff_t kpad = ADT_LANES_FN(attn_npad)(kend);
        ADT_LANES_FN(attn_gemm)(rows, kpad, hs, scale, q + i0 * C3, C3, 1, pk, attn_kcs(hs),
                                ADT_LANES_FN(attn_npad)(T), 0, scores, lds);
        for (ptrdiff_t r = 0; r < rows; r++)
            ADT_LANES_FN(attn_softmax_row)(scores + r * lds, i0 + r + 1, kpad,
                                           att + (i0 + r) * T, T);
        ADT_LANES_FN(attn_gemm)(rows, hs, kend, 1.0f, scores, lds, 1, pv, attn_kcs(T),
                                ADT_LANES_FN(attn_npad)(hs), 0, out + i0 * C + h * hs, C);
    }
#if defined(__SSE__)
    _mm_sfence();   /* order the streamed att before whatever this thread stores next */
#endif
}

/* One (batch, head), accumulating into dqkv; pvt, pk, psmall are attn_pack_floats
   scratch, dscore is (BQ, T). */
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_head_backward)(float* dqkv, const float* dout, const float* qkv,
                                             const float* att, ptrdiff_t T, ptrdiff_t C,
                                             ptrdiff_t hs, ptrdiff_t h, float scale,
                                             float* pvt, float* pk, float* psmall,
                                             float* dscore) {
    ptrdiff_t C3 = 3 * C;
    const float* q = qkv + h * hs;
    float* dq = dqkv + h * hs;
    float* dk = dqkv + C + h * hs;
    float* dv = dqkv + 2 * C + h * hs;
    const float* dO = dout + h * hs;
    ptrdiff_t ks = attn_kcs(hs), npad_hs = ADT_LANES_FN(attn_npad)(hs);
    ADT_LANES_FN(attn_pack_b)(pvt, qkv + 2 * C + h * hs, C3, 1, hs, T);  /* V^T (hs, T) */
    ADT_LANES_FN(attn_pack_b)(pk, qkv + C + h * hs, C3, 0, T, hs);       /* K (T, hs) */
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
        ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ;
        ptrdiff_t kend = i0 + rows;
        const float* p_blk = att + i0 * T;
        /* dP = dO V^T ; dV += P^T dO */
        ADT_LANES_FN(attn_gemm)(rows, kend, hs, 1.0f, dO + i0 * C, C, 1, pvt, ks,
                                ADT_LANES_FN(attn_npad)(T), 0, dscore, kend);
        ADT_LANES_FN(attn_pack_b)(psmall, dO + i0 * C, C, 0, rows, hs);
        ADT_LANES_FN(attn_gemm)(kend, hs, rows, 1.0f, p_blk, 1, T, psmall, attn_kcs(rows),
                                npad_hs, 1, dv, C3);
        /* dS = P * (dP - sum_j P dP) * scale, zero above the diagonal */
        for (ptrdiff_t i = 0; i < rows; i++) {
            const float* p = p_blk + i * T;
            float* ds = dscore + i * kend;
            ptrdiff_t n = i0 + i + 1, j = 0;
            ADT_VT dot = ADT_V(splat)(ADT_LANES_FN(attn_dot)(p, ds, n));
            for (; j + ADT_W <= n; j += ADT_W)
                ADT_V(store)(ds + j, ADT_V(load)(p + j) * (ADT_V(load)(ds + j) - dot) * scale);
            for (; j < n; j++) ds[j] = p[j] * (ds[j] - dot[0]) * scale;
            memset(ds + n, 0, (size_t)(kend - n) * sizeof(float));
        }
        /* dQ += dS K ; dK += dS^T Q */
        ADT_LANES_FN(attn_gemm)(rows, hs, kend, 1.0f, dscore, kend, 1, pk, attn_kcs(T),
                                npad_hs, 1, dq + i0 * C3, C3);
        ADT_LANES_FN(attn_pack_b)(psmall, q + i0 * C3, C3, 0, rows, hs);
        ADT_LANES_FN(attn_gemm)(kend, hs, rows, 1.0f, dscore, 1, kend, psmall, attn_kcs(rows),
                                npad_hs, 1, dk, C3);
    }
}

#undef ATTN_NR
#undef ATTN_MR
#undef ATTN_ROWS
