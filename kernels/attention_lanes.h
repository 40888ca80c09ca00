/* The per-head attention kernels of kernels/attention.pyx, a template over the vector
 * width: attention.pyx includes it once per width after defining ADT_W (see the end
 * of kernels/simd.h), giving attn_head_forward_v8 and _v16, and so on.  The register
 * tile is ATTN_MR rows by ATTN_NR = two vectors of columns.
 */
#define ATTN_NR (2 * ADT_W)

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

/* C tile (mr, nr) (+)= alpha * A tile (mr, kc) @ packed B sliver (kc, NR);
   A element (i, p) at a[i*rs + p*cs], read in place (no packing: with
   hs = 64 columns there is too little reuse to repay it). */
ADT_LANES_INLINE void ADT_LANES_FN(attn_ukernel)(ptrdiff_t kc, const float* a, ptrdiff_t rs,
                                                 ptrdiff_t cs, const float* restrict b,
                                                 float* c, ptrdiff_t ldc, ptrdiff_t mr,
                                                 ptrdiff_t nr, float alpha, int accumulate) {
    /* rows past mr repeat the last valid row: computed, never stored */
    const float* a0 = a;
    const float* a1 = a + (mr > 1 ? 1 : 0) * rs;
    const float* a2 = a + (mr > 2 ? 2 : mr - 1) * rs;
    const float* a3 = a + (mr > 3 ? 3 : mr - 1) * rs;
    ADT_VT c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0};
    ADT_VT c20 = {0}, c21 = {0}, c30 = {0}, c31 = {0};
    for (ptrdiff_t p = 0; p < kc; p++) {
        ADT_VT b0 = ADT_V(load)(b + p * ATTN_NR);
        ADT_VT b1 = ADT_V(load)(b + p * ATTN_NR + ADT_W);
        ptrdiff_t o = p * cs;
        c00 += a0[o] * b0; c01 += a0[o] * b1;
        c10 += a1[o] * b0; c11 += a1[o] * b1;
        c20 += a2[o] * b0; c21 += a2[o] * b1;
        c30 += a3[o] * b0; c31 += a3[o] * b1;
    }
    ADT_VT acc[ATTN_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    if (mr == ATTN_MR && nr == ATTN_NR) {
        for (int i = 0; i < ATTN_MR; i++) {
            float* row = c + i * ldc;
            for (int v = 0; v < 2; v++)
                ADT_V(store)(row + v * ADT_W, accumulate
                             ? ADT_V(load)(row + v * ADT_W) + alpha * acc[i][v]
                             : alpha * acc[i][v]);
        }
        return;
    }
    for (ptrdiff_t i = 0; i < mr; i++) {
        float tile[ATTN_NR];
        memcpy(tile, &acc[i][0], sizeof(tile));
        for (ptrdiff_t j = 0; j < nr; j++)
            c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0.0f) + alpha * tile[j];
    }
}

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

/* Softmax of row[0..n) in place; the tail goes through a vector padded with -inf,
   whose exponentials are 0. */
ADT_LANES_INLINE void ADT_LANES_FN(attn_softmax_row)(float* row, ptrdiff_t n) {
    ADT_VT mv = ADT_V(splat)(row[0]);
    ptrdiff_t j = 0;
    for (; j + ADT_W <= n; j += ADT_W) mv = ADT_V(max)(mv, ADT_V(load)(row + j));
    float mx = mv[0];
    for (int l = 1; l < ADT_W; l++) mx = mv[l] > mx ? mv[l] : mx;
    for (ptrdiff_t t = j; t < n; t++) mx = row[t] > mx ? row[t] : mx;
    ADT_VT m = ADT_V(splat)(mx), sum = {0};
    for (j = 0; j + ADT_W <= n; j += ADT_W) {
        ADT_VT e = ADT_V(exp)(ADT_V(load)(row + j) - m);
        ADT_V(store)(row + j, e);
        sum += e;
    }
    if (j < n) {
        float tail[ADT_W];
        for (int l = 0; l < ADT_W; l++) tail[l] = j + l < n ? row[j + l] : -INFINITY;
        ADT_VT e = ADT_V(exp)(ADT_V(load)(tail) - m);
        ADT_V(store)(tail, e);
        memcpy(row + j, tail, (n - j) * sizeof(float));
        sum += e;
    }
    ADT_VT inv = ADT_V(splat)(1.0f / ADT_V(hsum)(sum));
    for (j = 0; j + ADT_W <= n; j += ADT_W) ADT_V(store)(row + j, ADT_V(load)(row + j) * inv);
    for (; j < n; j++) row[j] *= inv[0];
}

/* One (batch, head): qkv and out point at this batch's (T, 3C) / (T, C) rows,
   att at this head's (T, T) matrix; pk, pv are attn_pack_floats scratch. */
ADT_LANES_ATTR
static void ADT_LANES_FN(attn_head_forward)(float* out, float* att, const float* qkv,
                                            ptrdiff_t T, ptrdiff_t C, ptrdiff_t hs,
                                            ptrdiff_t h, float scale, float* pk, float* pv) {
    ptrdiff_t C3 = 3 * C;
    const float* q = qkv + h * hs;
    ADT_LANES_FN(attn_pack_b)(pk, qkv + C + h * hs, C3, 1, hs, T);      /* K^T (hs, T) */
    ADT_LANES_FN(attn_pack_b)(pv, qkv + 2 * C + h * hs, C3, 0, T, hs);  /* V (T, hs) */
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
        ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ;
        ptrdiff_t kend = i0 + rows;
        ADT_LANES_FN(attn_gemm)(rows, kend, hs, scale, q + i0 * C3, C3, 1, pk, attn_kcs(hs),
                                ADT_LANES_FN(attn_npad)(T), 0, att + i0 * T, T);
        for (ptrdiff_t i = i0; i < kend; i++) {
            float* row = att + i * T;
            ADT_LANES_FN(attn_softmax_row)(row, i + 1);
            memset(row + i + 1, 0, (size_t)(T - i - 1) * sizeof(float));
        }
        ADT_LANES_FN(attn_gemm)(rows, hs, kend, 1.0f, att + i0 * T, T, 1, pv, attn_kcs(T),
                                ADT_LANES_FN(attn_npad)(hs), 0, out + i0 * C + h * hs, C);
    }
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
