/* The packed bf16 GEMM's micro-kernel and loops, a template that kernels/bf16.h
 * includes once per build (no include guard) with
 *   BF_FN(f)          the build's name for f (f_nat, f_twin),
 *   BF_ATTR           its target attribute,
 *   BF_DOT(acc, a, b) acc + the products of the pair a (broadcast) and the sixteen
 *                     pairs of b, summed per lane as VDPBF16PS does.
 *
 * Row-major C (M x N) (+)= op(A) op(B) (+ bias), one thread, A and B bf16, op(A)[i, k] =
 * A[i a_rs + k a_cs] and op(B)[k, j] = B[k b_rs + j b_cs], so that one routine serves
 * x W^T, dout W and dout^T x (Goto/BLIS loops, as kernels/sgemm.h):
 *
 *   for each block of BF_NC columns:
 *     for each block of BF_KC depths:    pack op(B)[depths, columns] as pairs
 *       for each block of BF_MC rows:    pack op(A)[rows, depths] as pairs
 *         for each BF_NR-column panel:   (its BF_KC / 2 x BF_NR pairs stay in L1)
 *           for each BF_MR-row panel:    the micro-kernel, a BF_MR x BF_NR tile of C
 */

/* The BF_MR x BF_NR tile over kp depth pairs: C = acc (+ C where add) (+ bias[0:BF_NR]
   on every row where bias is not NULL).  Whole tiles only, as in sgemm.h (the edges go
   through BF_FN(bf_edge)'s buffer), so that the accumulators stay in registers. */
BF_ATTR static __attribute__((noinline))
void BF_FN(bf_micro)(ptrdiff_t kp, const uint32_t* restrict pa, const uint32_t* restrict pb,
                     float* c, ptrdiff_t ldc, int add, const float* bias) {
    adt_v16 acc[BF_MR][2];
#pragma GCC unroll 16
    for (int r = 0; r < BF_MR; r++) { acc[r][0] = (adt_v16){0}; acc[r][1] = (adt_v16){0}; }
    for (ptrdiff_t p = 0; p < kp; p++) {
        bf_pairs b0 = *(const bf_pairs*)pb, b1 = *(const bf_pairs*)(pb + 16);
#pragma GCC unroll 16
        for (int r = 0; r < BF_MR; r++) {
            acc[r][0] = BF_DOT(acc[r][0], pa[r], b0);
            acc[r][1] = BF_DOT(acc[r][1], pa[r], b1);
        }
        pa += BF_MR;
        pb += BF_NR;
    }
    if (bias != NULL) {
        adt_v16 b0 = adt_load16(bias), b1 = adt_load16(bias + 16);
#pragma GCC unroll 16
        for (int r = 0; r < BF_MR; r++) { acc[r][0] += b0; acc[r][1] += b1; }
    }
#pragma GCC unroll 16
    for (int r = 0; r < BF_MR; r++) {
        float* row = c + r * ldc;
        if (add) {
            adt_store16(row, adt_load16(row) + acc[r][0]);
            adt_store16(row + 16, adt_load16(row + 16) + acc[r][1]);
        } else {
            adt_store16(row, acc[r][0]);
            adt_store16(row + 16, acc[r][1]);
        }
    }
}

/* A tile at the edge of C, mr x nr: the micro-kernel into a buffer, then
   C[0:mr, 0:nr] = that (+ C where add) (+ bias[0:nr]), in the micro-kernel's order. */
BF_ATTR static void BF_FN(bf_edge)(ptrdiff_t kp, const uint32_t* pa, const uint32_t* pb,
                                   float* c, ptrdiff_t ldc, int add, const float* bias,
                                   ptrdiff_t mr, ptrdiff_t nr) {
    float t[BF_MR][BF_NR] __attribute__((aligned(64)));
    BF_FN(bf_micro)(kp, pa, pb, &t[0][0], BF_NR, 0, NULL);
    for (ptrdiff_t r = 0; r < mr; r++)
        for (ptrdiff_t j = 0; j < nr; j++) {
            float v = bias != NULL ? t[r][j] + bias[j] : t[r][j];
            c[r * ldc + j] = add ? c[r * ldc + j] + v : v;
        }
}

/* C (+= where accumulate) op(A) op(B) (+ bias[j] in every column j where bias is not
   NULL) over M x N x K (K > 0), packing into buf (bf_buffer_pairs(M, N, K) pairs,
   64-byte aligned). */
BF_ATTR static void BF_FN(bf_gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, const uint16_t* A,
                                   ptrdiff_t a_rs, ptrdiff_t a_cs, const uint16_t* B,
                                   ptrdiff_t b_rs, ptrdiff_t b_cs, int accumulate, float* C,
                                   ptrdiff_t ldc, const float* bias, uint32_t* buf) {
    uint32_t* pb = buf;
    uint32_t* pa = buf + bf_buffer_b_pairs(N, K);
    for (ptrdiff_t j0 = 0; j0 < N; j0 += BF_NC) {
        ptrdiff_t nc = N - j0 < BF_NC ? N - j0 : BF_NC;
        for (ptrdiff_t k0 = 0; k0 < K; k0 += BF_KC) {
            ptrdiff_t kc = K - k0 < BF_KC ? K - k0 : BF_KC;
            ptrdiff_t kp = (kc + 1) / 2;
            int add = accumulate || k0 > 0;
            bf_pack_b(kc, nc, B + k0 * b_rs + j0 * b_cs, b_rs, b_cs, pb);
            for (ptrdiff_t i0 = 0; i0 < M; i0 += BF_MC) {
                ptrdiff_t mc = M - i0 < BF_MC ? M - i0 : BF_MC;
                bf_pack_a(mc, kc, A + i0 * a_rs + k0 * a_cs, a_rs, a_cs, pa);
                for (ptrdiff_t j = 0; j < nc; j += BF_NR) {
                    ptrdiff_t nr = nc - j < BF_NR ? nc - j : BF_NR;
                    const uint32_t* pbj = pb + j * kp;
                    const float* bj = k0 == 0 && bias != NULL ? bias + j0 + j : NULL;
                    for (ptrdiff_t i = 0; i < mc; i += BF_MR) {
                        ptrdiff_t mr = mc - i < BF_MR ? mc - i : BF_MR;
                        float* cij = C + (i0 + i) * ldc + j0 + j;
                        if (mr == BF_MR && nr == BF_NR)
                            BF_FN(bf_micro)(kp, pa + i * kp, pbj, cij, ldc, add, bj);
                        else
                            BF_FN(bf_edge)(kp, pa + i * kp, pbj, cij, ldc, add, bj, mr, nr);
                    }
                }
            }
        }
    }
}
