/* The VDPBF16PS build's micro-kernel and tile loop, a template that kernels/bf16.h
 * includes once per build (no include guard) with
 *   BF_FN(f)          the build's name for f (f_nat, f_twin),
 *   BF_ATTR           its target attribute,
 *   BF_DOT(acc, a, b) acc + the products of the pair a (broadcast) and the sixteen
 *                     pairs of b, summed per lane as VDPBF16PS does.
 *
 * One task of a product (bf16.h's bf_sprod, its operands laid out by the pack phase):
 * a tile_m x tile_n block of C over all its depth.  For each block of BF_KC depths (in
 * order), each 32-column panel of B (its pairs stay in L1), each 8 rows of A: the
 * micro-kernel, an 8 x 32 tile of C in sixteen accumulators. */

/* The BF_MR x BF_NR tile over kp depth pairs: C = acc + bias[0:BF_NR] (on every row,
   where bias is not NULL) (+ C where add).  A's rows at a, a stride of a_stride pairs,
   each row's pairs in order; pb a B panel, rows of BF_NR pairs.  Whole tiles only (the
   edges go through BF_FN(bf_edge)'s buffer), so that the accumulators stay in
   registers. */
BF_ATTR static __attribute__((noinline))
void BF_FN(bf_micro)(ptrdiff_t kp, const bf_u32* restrict a, ptrdiff_t a_stride,
                     const uint32_t* restrict pb, float* c, ptrdiff_t ldc, int add,
                     const float* bias) {
    adt_v16 acc[BF_MR][2];
    const bf_u32* row[BF_MR];
#pragma GCC unroll 16
    for (int r = 0; r < BF_MR; r++) {
        acc[r][0] = (adt_v16){0};
        acc[r][1] = (adt_v16){0};
        row[r] = a + r * a_stride;
    }
    for (ptrdiff_t p = 0; p < kp; p++) {
        bf_pairs b0 = *(const bf_pairs*)pb, b1 = *(const bf_pairs*)(pb + 16);
#pragma GCC unroll 16
        for (int r = 0; r < BF_MR; r++) {
            acc[r][0] = BF_DOT(acc[r][0], row[r][p], b0);
            acc[r][1] = BF_DOT(acc[r][1], row[r][p], b1);
        }
        pb += BF_NR;
    }
    if (bias != NULL) {
        adt_v16 b0 = adt_load16(bias), b1 = adt_load16(bias + 16);
#pragma GCC unroll 16
        for (int r = 0; r < BF_MR; r++) { acc[r][0] += b0; acc[r][1] += b1; }
    }
#pragma GCC unroll 16
    for (int r = 0; r < BF_MR; r++) {
        float* out = c + r * ldc;
        if (add) {
            adt_store16(out, adt_load16(out) + acc[r][0]);
            adt_store16(out + 16, adt_load16(out + 16) + acc[r][1]);
        } else {
            adt_store16(out, acc[r][0]);
            adt_store16(out + 16, acc[r][1]);
        }
    }
}

/* A tile at the edge of C, mr x nr: the micro-kernel into a buffer, then
   C[0:mr, 0:nr] = that (+ bias[0:nr]) (+ C where add), in the micro-kernel's order. */
BF_ATTR static void BF_FN(bf_edge)(ptrdiff_t kp, const bf_u32* a, ptrdiff_t a_stride,
                                   const uint32_t* pb, float* c, ptrdiff_t ldc, int add,
                                   const float* bias, ptrdiff_t mr, ptrdiff_t nr) {
    float t[BF_MR][BF_NR] __attribute__((aligned(64)));
    BF_FN(bf_micro)(kp, a, a_stride, pb, &t[0][0], BF_NR, 0, NULL);
    for (ptrdiff_t r = 0; r < mr; r++)
        for (ptrdiff_t j = 0; j < nr; j++) {
            float v = bias != NULL ? t[r][j] + bias[j] : t[r][j];
            c[r * ldc + j] = add ? c[r * ldc + j] + v : v;
        }
}

/* Task t of chunk `chunk` of p: its block of C over all depths. */
BF_ATTR static void BF_FN(bf_task)(const bf_sprod* p, ptrdiff_t chunk, ptrdiff_t t) {
    bf_sp_span s = bf_sp_chunk_span(p, chunk);
    ptrdiff_t tiles_n = (s.j1 - s.j0 + p->tile_n - 1) / p->tile_n;
    ptrdiff_t r0 = s.i0 + t / tiles_n * p->tile_m, c0 = s.j0 + t % tiles_n * p->tile_n;
    ptrdiff_t r1 = r0 + p->tile_m < s.i1 ? r0 + p->tile_m : s.i1;
    ptrdiff_t c1 = c0 + p->tile_n < s.j1 ? c0 + p->tile_n : s.j1;
    ptrdiff_t pairs = (p->K + 1) / 2;
    for (ptrdiff_t k0 = 0; k0 < pairs; k0 += BF_KC / 2) {
        ptrdiff_t kp = pairs - k0 < BF_KC / 2 ? pairs - k0 : BF_KC / 2;
        int add = p->accumulate || k0 > 0;
        for (ptrdiff_t j = c0; j < c1; j += BF_NR) {
            const uint32_t* panel = p->pb + ((j - s.j0) / BF_NR * p->kpad + k0) * BF_NR;
            const float* bias = k0 == 0 && p->bias != NULL ? p->bias + j : NULL;
            ptrdiff_t nr = c1 - j < BF_NR ? c1 - j : BF_NR;
            for (ptrdiff_t i = r0; i < r1; i += BF_MR) {
                ptrdiff_t stride;
                const bf_u32* a = (const bf_u32*)bf_sp_a_rows(p, s.i0, i, &stride) + k0;
                ptrdiff_t mr = r1 - i < BF_MR ? r1 - i : BF_MR;
                float* cij = p->C + i * p->ldc + j;
                stride /= (ptrdiff_t)sizeof(uint32_t);
                if (mr == BF_MR && nr == BF_NR)
                    BF_FN(bf_micro)(kp, a, stride, panel, cij, p->ldc, add, bias);
                else
                    BF_FN(bf_edge)(kp, a, stride, panel, cij, p->ldc, add, bias, mr, nr);
            }
        }
    }
}
