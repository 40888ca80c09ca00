/* The VDPBF16PS build's micro-kernel and tile loop, a template that kernels/bf16.h
 * includes once per build (no include guard) with
 *   BF_FN(f)          the build's name for f (f_nat, f_twin),
 *   BF_ATTR           its target attribute,
 *   BF_INLINE_ATTR    the same for an inlined function (no target clones),
 *   BF_DOT(acc, a, b) acc + the products of the pair a (broadcast) and the sixteen
 *                     pairs of b, summed per lane as VDPBF16PS does,
 *   BF_STREAM(p, v)   a store of v to 64-byte-aligned p past the caches (or a plain one),
 *   BF_INTERLEAVE(b0, b1, lo, hi)  b0, b1 = the pairs of two rows of 32 bf16 (a depth
 *                     and the next), in an order of columns the build chooses,
 *   BF_UNPERMUTE(acc0, acc1)  sums over BF_INTERLEAVE's pairs put in the columns' order,
 * all undefined again at its end.
 *
 * The tile of C is 8 x 32, in sixteen accumulators; bf16.h's bf_sp_task hands them
 * out over a task's block of C. */

/* Depth pairs ahead of the tile that bf_micro_ahead fetches A's rows (4 lines) */
#ifndef BF_AHEAD
#define BF_AHEAD 64
#endif

/* The BF_MR x BF_NR tile over kp depth pairs: C = acc + bias[0:BF_NR] (on every row,
   where bias is not NULL) (+ C where add is 1; past the caches where it is 2: C 64-byte
   aligned, bf_sp_stream_c).  A's rows at a, a stride of a_stride pairs, each row's
   pairs in order; B a panel, rows of BF_NR pairs (direct 0), or B's bf16 read in place
   (direct 1: each pair's two depths b_rs elements apart, interleaved in registers).
   Whole tiles only (the edges go through BF_FN(bf_edge)'s buffer), so that the
   accumulators stay in registers. */
BF_INLINE_ATTR ADT_INLINE
void BF_FN(bf_micro_body)(ptrdiff_t kp, const bf_u32* restrict a, ptrdiff_t a_stride,
                          const void* restrict b, ptrdiff_t b_rs, float* c, ptrdiff_t ldc,
                          int add, const float* bias, const int direct, const int ahead,
                          const float* resume, float* spill, ptrdiff_t sub) {
    adt_v16 acc[BF_MR][2];
    const bf_u32* row[BF_MR];
    const uint32_t* pb = (const uint32_t*)b;
    const uint16_t* pw = (const uint16_t*)b;
#pragma GCC unroll 16
    for (int r = 0; r < BF_MR; r++) {
        acc[r][0] = resume != NULL ? adt_load16(resume + r * BF_NR) : (adt_v16){0};
        acc[r][1] = resume != NULL ? adt_load16(resume + r * BF_NR + 16) : (adt_v16){0};
        row[r] = a + r * a_stride;
    }
    for (ptrdiff_t p = 0; p < kp; p++) {
        bf_pairs b0, b1;
        if (direct) {
            BF_INTERLEAVE(b0, b1, pw, pw + b_rs);
            if (sub > 0) {
                /* the next sub-block's rows (bf_sp_task's b_sub), into L2: rows 4 KiB
                   apart, which no prefetcher follows */
                __builtin_prefetch(pw + 2 * sub * b_rs, 0, 2);
                __builtin_prefetch(pw + (2 * sub + 1) * b_rs, 0, 2);
            } else {
                __builtin_prefetch(pw + BF_NR, 0, 3);
                __builtin_prefetch(pw + b_rs + BF_NR, 0, 3);
            }
            pw += 2 * b_rs;
        } else {
            b0 = *(const bf_pairs*)pb, b1 = *(const bf_pairs*)(pb + 16);
            pb += BF_NR;
        }
        if (ahead && (p & 15) == 0) {
            /* A's rows BF_AHEAD pairs on (past the block's end, the next tile's) */
#pragma GCC unroll 16
            for (int r = 0; r < BF_MR; r++)
                __builtin_prefetch(p + BF_AHEAD < kp ? row[r] + p + BF_AHEAD
                                   : row[r] + BF_MR * a_stride + (p + BF_AHEAD - kp), 0, 3);
        }
#pragma GCC unroll 16
        for (int r = 0; r < BF_MR; r++) {
            acc[r][0] = BF_DOT(acc[r][0], row[r][p], b0);
            acc[r][1] = BF_DOT(acc[r][1], row[r][p], b1);
        }
    }
    if (spill != NULL) {
        /* the sums so far, as they are (a sub-block of bf_sp_task's b_sub) */
#pragma GCC unroll 16
        for (int r = 0; r < BF_MR; r++) {
            adt_store16(spill + r * BF_NR, acc[r][0]);
            adt_store16(spill + r * BF_NR + 16, acc[r][1]);
        }
        return;
    }
    if (direct) {
#pragma GCC unroll 16
        for (int r = 0; r < BF_MR; r++) BF_UNPERMUTE(acc[r][0], acc[r][1]);
    }
    if (bias != NULL) {
        adt_v16 b0 = adt_load16(bias), b1 = adt_load16(bias + 16);
#pragma GCC unroll 16
        for (int r = 0; r < BF_MR; r++) { acc[r][0] += b0; acc[r][1] += b1; }
    }
#pragma GCC unroll 16
    for (int r = 0; r < BF_MR; r++) {
        float* out = c + r * ldc;
        if (add == 1) {
            adt_store16(out, adt_load16(out) + acc[r][0]);
            adt_store16(out + 16, adt_load16(out + 16) + acc[r][1]);
        } else if (add == 2) {
            BF_STREAM(out, acc[r][0]);
            BF_STREAM(out + 16, acc[r][1]);
        } else {
            adt_store16(out, acc[r][0]);
            adt_store16(out + 16, acc[r][1]);
        }
    }
}

/* The micro-kernel on a packed panel; on B read in place (b_rs > 0); on a packed panel
   with A's rows fetched ahead (the forward's weight rows, read from memory) */
BF_ATTR static __attribute__((noinline))
void BF_FN(bf_micro)(ptrdiff_t kp, const bf_u32* restrict a, ptrdiff_t a_stride,
                     const void* restrict b, ptrdiff_t b_rs, float* c, ptrdiff_t ldc, int add,
                     const float* bias) {
    BF_FN(bf_micro_body)(kp, a, a_stride, b, 0, c, ldc, add, bias, 0, 0, NULL, NULL, 0);
}
BF_ATTR static __attribute__((noinline))
void BF_FN(bf_micro_direct)(ptrdiff_t kp, const bf_u32* restrict a, ptrdiff_t a_stride,
                            const void* restrict b, ptrdiff_t b_rs, float* c, ptrdiff_t ldc,
                            int add, const float* bias) {
    BF_FN(bf_micro_body)(kp, a, a_stride, b, b_rs, c, ldc, add, bias, 1, 0, NULL, NULL, 0);
}
/* bf_micro_direct over a sub-block: from the spilled sums at part (unless first), to
   them (unless last) */
BF_ATTR static __attribute__((noinline))
void BF_FN(bf_micro_direct_part)(ptrdiff_t kp, const bf_u32* restrict a, ptrdiff_t a_stride,
                                 const void* restrict b, ptrdiff_t b_rs, ptrdiff_t sub,
                                 float* part, int first, int last, float* c, ptrdiff_t ldc,
                                 int add, const float* bias) {
    BF_FN(bf_micro_body)(kp, a, a_stride, b, b_rs, c, ldc, add, bias, 1, 0,
                         first ? NULL : part, last ? NULL : part, sub);
}
BF_ATTR static __attribute__((noinline))
void BF_FN(bf_micro_ahead)(ptrdiff_t kp, const bf_u32* restrict a, ptrdiff_t a_stride,
                           const void* restrict b, ptrdiff_t b_rs, float* c, ptrdiff_t ldc,
                           int add, const float* bias) {
    BF_FN(bf_micro_body)(kp, a, a_stride, b, 0, c, ldc, add, bias, 0, 1, NULL, NULL, 0);
}

/* A tile at the edge of C, mr x nr: the micro-kernel into a buffer, then
   C[0:mr, 0:nr] = that (+ bias[0:nr]) (+ C where add is 1; plain stores where it is
   2), in the micro-kernel's order. */
BF_ATTR static void BF_FN(bf_edge)(ptrdiff_t kp, const bf_u32* a, ptrdiff_t a_stride,
                                   const void* b, ptrdiff_t b_rs, float* c, ptrdiff_t ldc,
                                   int add, const float* bias, ptrdiff_t mr, ptrdiff_t nr) {
    float t[BF_MR][BF_NR] __attribute__((aligned(64)));
    if (b_rs > 0)
        BF_FN(bf_micro_direct)(kp, a, a_stride, b, b_rs, &t[0][0], BF_NR, 0, NULL);
    else
        BF_FN(bf_micro)(kp, a, a_stride, b, 0, &t[0][0], BF_NR, 0, NULL);
    for (ptrdiff_t r = 0; r < mr; r++)
        for (ptrdiff_t j = 0; j < nr; j++) {
            float v = bias != NULL ? t[r][j] + bias[j] : t[r][j];
            c[r * ldc + j] = add == 1 ? c[r * ldc + j] + v : v;
        }
}

/* bf_sp_task's tile: BF_MR rows of A (each row's pairs in order) at a, a_stride bytes
   apart, fetched ahead where `ahead` (and the next tile's past the block's end); B's
   panel, or B in place (b_rs > 0: whole panels only, bf_sp_direct_b). */
BF_ATTR static void BF_FN(bf_tile)(ptrdiff_t kp, const char* a, ptrdiff_t a_stride,
                                   int ahead, const void* b, ptrdiff_t b_rs, float* c,
                                   ptrdiff_t ldc, int add, const float* bias, ptrdiff_t mr,
                                   ptrdiff_t nr) {
    const bf_u32* rows = (const bf_u32*)a;
    ptrdiff_t stride = a_stride / (ptrdiff_t)sizeof(uint32_t);
    if (mr == BF_MR && nr == BF_NR && b_rs > 0)
        BF_FN(bf_micro_direct)(kp, rows, stride, b, b_rs, c, ldc, add, bias);
    else if (mr == BF_MR && nr == BF_NR && ahead)
        BF_FN(bf_micro_ahead)(kp, rows, stride, b, 0, c, ldc, add, bias);
    else if (mr == BF_MR && nr == BF_NR)
        BF_FN(bf_micro)(kp, rows, stride, b, 0, c, ldc, add, bias);
    else
        BF_FN(bf_edge)(kp, rows, stride, b, b_rs, c, ldc, add, bias, mr, nr);
}

/* bf_sp_task's whole tile over a sub-block of B read in place (bf_part_fn) */
BF_ATTR static void BF_FN(bf_tile_part)(ptrdiff_t kp, const char* a, ptrdiff_t a_stride,
                                        const void* b, ptrdiff_t b_rs, ptrdiff_t sub,
                                        float* part, int first, int last, float* c,
                                        ptrdiff_t ldc, int add, const float* bias) {
    BF_FN(bf_micro_direct_part)(kp, (const bf_u32*)a, a_stride / (ptrdiff_t)sizeof(uint32_t),
                                b, b_rs, sub, part, first, last, c, ldc, add, bias);
}

/* Task t of chunk `chunk` of p (bf_sp_task's loops on this build's tiles, over the
   depth's pairs without the padding, the sums the per-tile packing made). */
BF_ATTR static void BF_FN(bf_task)(const bf_sprod* p, ptrdiff_t chunk, ptrdiff_t t) {
    bf_sp_task(p, chunk, t, BF_FN(bf_tile), BF_FN(bf_tile_part), BF_MR, (p->K + 1) / 2);
}

#undef BF_FN
#undef BF_ATTR
#undef BF_INLINE_ATTR
#undef BF_DOT
#undef BF_STREAM
#undef BF_INTERLEAVE
#undef BF_UNPERMUTE
