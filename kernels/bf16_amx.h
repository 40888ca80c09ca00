/* The AMX build's tile loop, a template that kernels/bf16.h includes once per build (no
 * include guard) with
 *   BF_AMX_FN(f)            the build's name for f (f_amx, f_amxtwin),
 *   BF_AMX_ATTR             its target attribute,
 *   BF_AMX_STATE            the declarations its tile operations need (the twin's tiles),
 *   BF_TCFG() / BF_TREL()   load the tile configuration (eight 16 x 64-byte tiles) /
 *                           release the tiles,
 *   BF_TZERO(t), BF_TLOAD(t, p, stride), BF_TSTORE(t, p, stride), BF_TDP(c, a, b)
 *                           TILEZERO, TILELOADD, TILESTORED and TDPBF16PS (strides in
 *                           bytes),
 * all undefined again at its end.
 *
 * The tile of C is 32 x 32 (four accumulator tiles, two of A and two of B: each loaded
 * tile used twice); bf16.h's bf_sp_task hands them out over a task's block of C. */

/* The 32 x 32 tile of C at c, mr x nr of it in C, over kp depth pairs (a multiple of
   16): C = init + the products, init being C (where add) + bias[0:nr] (where not NULL).
   a: rows 0-15 of the A tile at a, rows 16-31 at a + 16 a_stride (bytes), each row's
   pairs in order; panel: a B panel, rows of 32 pairs (128 bytes).  A whole tile reads and
   writes C in place (its init from C, from rows of the bias, or zero); an edge tile
   goes through a buffer, the same sums in the same order. */
BF_AMX_ATTR static void BF_AMX_FN(bf_amx_tile)(ptrdiff_t kp, const char* a, ptrdiff_t a_stride,
                                               int ahead, const void* panel, ptrdiff_t b_rs,
                                               float* c, ptrdiff_t ldc, int add,
                                               const float* bias, ptrdiff_t mr, ptrdiff_t nr) {
    BF_AMX_STATE;
    const uint32_t* b = (const uint32_t*)panel;     /* packed: b_rs is 0 */
    (void)b_rs;
    (void)ahead;     /* the tile loads read A's rows whole */
    float t[BF_AMX_MR][BF_NR] __attribute__((aligned(64)));
    float* dst = c;
    ptrdiff_t ld = ldc;
    int whole = mr == BF_AMX_MR && nr == BF_NR && (bias == NULL || !add);
    if (!whole) {
        for (ptrdiff_t r = 0; r < BF_AMX_MR; r++)
            for (ptrdiff_t j = 0; j < BF_NR; j++)
                t[r][j] = r < mr && j < nr ? (add ? c[r * ldc + j] : 0.0f)
                                                 + (bias != NULL ? bias[j] : 0.0f)
                                           : 0.0f;
        dst = &t[0][0];
        ld = BF_NR;
        add = 1;
    }
    if (add) {
        BF_TLOAD(0, dst, ld * 4);
        BF_TLOAD(1, dst + 16, ld * 4);
        BF_TLOAD(2, dst + 16 * ld, ld * 4);
        BF_TLOAD(3, dst + 16 * ld + 16, ld * 4);
    } else if (bias != NULL) {
        for (int r = 0; r < 16; r++) memcpy(t[r], bias, sizeof t[r]);
        BF_TLOAD(0, &t[0][0], BF_NR * 4);
        BF_TLOAD(1, &t[0][16], BF_NR * 4);
        BF_TLOAD(2, &t[0][0], BF_NR * 4);
        BF_TLOAD(3, &t[0][16], BF_NR * 4);
    } else {
        BF_TZERO(0);
        BF_TZERO(1);
        BF_TZERO(2);
        BF_TZERO(3);
    }
    const char* a_lo = a;
    const char* a_hi = a + 16 * a_stride;
    for (ptrdiff_t p = 0; p < kp; p += BF_AMX_KP) {
        BF_TLOAD(4, a_lo + 4 * p, a_stride);
        BF_TLOAD(5, a_hi + 4 * p, a_stride);
        BF_TLOAD(6, b + p * BF_NR, BF_NR * 4);
        BF_TLOAD(7, b + p * BF_NR + 16, BF_NR * 4);
        BF_TDP(0, 4, 6);
        BF_TDP(1, 4, 7);
        BF_TDP(2, 5, 6);
        BF_TDP(3, 5, 7);
    }
    BF_TSTORE(0, dst, ld * 4);
    BF_TSTORE(1, dst + 16, ld * 4);
    BF_TSTORE(2, dst + 16 * ld, ld * 4);
    BF_TSTORE(3, dst + 16 * ld + 16, ld * 4);
    if (!whole)
        for (ptrdiff_t r = 0; r < mr; r++) memcpy(c + r * ldc, t[r], (size_t)nr * sizeof(float));
}

/* Task t of chunk `chunk` of p (bf_sp_task's loops on this build's tiles). */
BF_AMX_ATTR static void BF_AMX_FN(bf_amx_task)(const bf_sprod* p, ptrdiff_t chunk,
                                               ptrdiff_t t) {
    BF_TCFG();
    bf_sp_task(p, chunk, t, BF_AMX_FN(bf_amx_tile), NULL, BF_AMX_MR, p->kpad);
    BF_TREL();
}

#undef BF_AMX_FN
#undef BF_AMX_ATTR
#undef BF_AMX_STATE
#undef BF_TCFG
#undef BF_TREL
#undef BF_TZERO
#undef BF_TLOAD
#undef BF_TSTORE
#undef BF_TDP
