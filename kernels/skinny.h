/* The skinny products, a template over the vector width (kernels/simd.h): gemm.pyx
 * includes it once per width with ADT_W defined to 8 or 16 (no include guard; it
 * undefines its own macros at its end), like layers_lanes.h and the other lane
 * templates.
 *
 * Products with few rows (M <= SKINNY_MAX_M = 64: a forward, input-gradient or
 * weight-gradient product at small B*T) stream the weight matrix once without
 * packing it.  BLAS packs both operands first, and at 16 rows every packed weight
 * element is used only 16 times, so packing costs about as much as the
 * arithmetic (OpenBLAS reached a third of the sgemm peak there); for the weight
 * gradient at beta 0 it also writes C with zeros before the product.
 */
#define SK_COLS (3 * ADT_W)
#ifndef SKINNY_NN_KC
#define SKINNY_NN_KC 128
#endif
/* Floats from one strip of skinny_nn's panel to the next: one cache line more than
   the strip, so the strips do not all map to the same L1 sets. */
#define SK_STRIP (SK_COLS * SKINNY_NN_KC + 16)

/* In sixteen lanes:
   SK_IN_REGISTER(v) keeps v in a register: GCC otherwise folds its load into each
   of the three FMAs that use it, three loads instead of one (the load ports, not
   the FMAs, then set the pace).
   SK_STREAM(p, v) stores a whole vector to 64-byte-aligned p past the caches, and
   SK_FENCE() orders such stores (SK_STREAMS: they exist). */
#if ADT_W == 16
#include <immintrin.h>
#define SK_IN_REGISTER(v) __asm__("" : "+v"(v))
#define SK_STREAMS 1
#define SK_STREAM(p, v) _mm512_stream_ps((p), (__m512)(v))
#define SK_FENCE() _mm_sfence()
#else
#define SK_IN_REGISTER(v) ((void)0)
#define SK_STREAMS 0
#define SK_STREAM(p, v) ADT_V(store)(p, v)
#define SK_FENCE() ((void)0)
#endif

/* The 4 x 3-vector tile of skinny_nn and skinny_tn: twelve accumulators cRV
   (row R, vector V), updated with one scalar per row against b0, b1, b2. */
#define SK_TILE_ZERO \
    ADT_VT c00 = {0}, c01 = {0}, c02 = {0}, c10 = {0}, c11 = {0}, c12 = {0}; \
    ADT_VT c20 = {0}, c21 = {0}, c22 = {0}, c30 = {0}, c31 = {0}, c32 = {0}
#define SK_TILE_FMA(x0, x1, x2, x3) do { \
    float x_ = (x0); c00 += x_ * b0; c01 += x_ * b1; c02 += x_ * b2; \
    x_ = (x1); c10 += x_ * b0; c11 += x_ * b1; c12 += x_ * b2; \
    x_ = (x2); c20 += x_ * b0; c21 += x_ * b1; c22 += x_ * b2; \
    x_ = (x3); c30 += x_ * b0; c31 += x_ * b1; c32 += x_ * b2; } while (0)
/* C[r, 0:SK_COLS] (+)= alpha * tile row r, for the first mr rows from c. */
#define SK_TILE_STORE(c, ldc, mr, acc, alpha) do { \
    ADT_VT t_[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}}; \
    for (ptrdiff_t r_ = 0; r_ < (mr); r_++) { \
        float* row_ = (c) + r_ * (ldc); \
        for (int v_ = 0; v_ < 3; v_++) \
            ADT_V(store)(row_ + ADT_W * v_, (acc) ? ADT_V(load)(row_ + ADT_W * v_) + (alpha) * t_[r_][v_] \
                                             : (alpha) * t_[r_][v_]); \
    } } while (0)

/* C[i, j] (+)= alpha * sum_p A[i, p] B[j, p]  for i < M, j0 <= j < j1:
   4 rows of A against SK_NT_NR rows of B, ADT_W lanes along p, a horizontal sum
   per output at the end.  Rows past the edge repeat the last valid row:
   computed, never stored.  Sixteen lanes take 6 rows of B (24 accumulators of
   32 registers; eight lanes have 16 registers and take 3): each pass over the
   rows of A (48 KiB at 16 rows and K = 768, more than L1) then serves twice as
   many outputs.  Measured on a 2-core Xeon, 12 weights from memory at 16 x 2304
   x 768: 144 -> 174 GFLOP/s against 4 x 3. */
#if ADT_W == 16
#define SK_NT_NR 6
#else
#define SK_NT_NR 3
#endif
ADT_LANES_ATTR
static void ADT_LANES_FN(skinny_nt)(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K, float alpha,
                      const float* A, ptrdiff_t lda, const float* B, ptrdiff_t ldb,
                      int accumulate, float* C, ptrdiff_t ldc) {
    const int NR = SK_NT_NR;
    ptrdiff_t K8 = K & ~(ptrdiff_t)(ADT_W - 1);
    for (ptrdiff_t j = j0; j < j1; j += NR) {
        ptrdiff_t nr = j1 - j < NR ? j1 - j : NR;
        const float* b[SK_NT_NR];
        for (int c = 0; c < NR; c++) b[c] = B + (j + (c < nr ? c : nr - 1)) * ldb;
        for (ptrdiff_t i = 0; i < M; i += 4) {
            ptrdiff_t mr = M - i < 4 ? M - i : 4;
            const float* a[4] = {A + i * lda, A + (i + (mr > 1)) * lda,
                                 A + (i + (mr > 2 ? 2 : mr - 1)) * lda,
                                 A + (i + (mr > 3 ? 3 : mr - 1)) * lda};
            /* While the 4-row blocks of A run over these rows of B (from L1), fetch
               the next rows of B into L2, two per block, ahead of the streamer. */
            ptrdiff_t next = j + NR, q = (2 * (i / 4)) % NR;
            const float* pf0 = next + q + 1 < j1 ? B + (next + q) * ldb : b[0];
            const float* pf1 = next + q + 1 < j1 ? B + (next + q + 1) * ldb : b[0];
            ADT_VT acc[4][SK_NT_NR];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < NR; c++) acc[r][c] = (ADT_VT){0};
            for (ptrdiff_t p = 0; p < K8; p += ADT_W) {
                __builtin_prefetch(pf0 + p, 0, 2);
                __builtin_prefetch(pf1 + p, 0, 2);
                ADT_VT x0 = ADT_V(load)(a[0] + p), x1 = ADT_V(load)(a[1] + p);
                ADT_VT x2 = ADT_V(load)(a[2] + p), x3 = ADT_V(load)(a[3] + p);
                SK_IN_REGISTER(x0); SK_IN_REGISTER(x1); SK_IN_REGISTER(x2); SK_IN_REGISTER(x3);
                for (int c = 0; c < NR; c++) {
                    ADT_VT y = ADT_V(load)(b[c] + p);
                    acc[0][c] += x0 * y; acc[1][c] += x1 * y;
                    acc[2][c] += x2 * y; acc[3][c] += x3 * y;
                }
            }
            float s[4][SK_NT_NR];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < NR; c++) s[r][c] = ADT_V(hsum)(acc[r][c]);
            for (ptrdiff_t p = K8; p < K; p++)
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < NR; c++)
                        s[r][c] += a[r][p] * b[c][p];
            for (ptrdiff_t r = 0; r < mr; r++) {
                float* row = C + (i + r) * ldc + j;
                for (ptrdiff_t c = 0; c < nr; c++)
                    row[c] = accumulate ? row[c] + alpha * s[r][c] : alpha * s[r][c];
            }
        }
    }
}


/* C[i, j] (+)= alpha * sum_p A[i, p] B[p, j]  for i < M, j0 <= j < j1:
   4 rows of C by SK_COLS = 3 ADT_W columns (three vectors) held in registers while p
   runs over a depth block of SKINNY_NN_KC rows of B (12 or 24 KiB of a strip,
   reused from L1 by every row block).  Columns past the last full strip
   take a scalar loop. */
ADT_LANES_ATTR
static void ADT_LANES_FN(skinny_nn)(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K, float alpha,
                      const float* A, ptrdiff_t lda, const float* B, ptrdiff_t ldb,
                      int accumulate, float* C, ptrdiff_t ldc, float* panel) {
    ptrdiff_t nfull = (j1 - j0) / SK_COLS * SK_COLS, jfull = j0 + nfull;
    for (ptrdiff_t p0 = 0; p0 < K; p0 += SKINNY_NN_KC) {
        ptrdiff_t kc = K - p0 < SKINNY_NN_KC ? K - p0 : SKINNY_NN_KC;
        int acc = accumulate || p0 > 0;
        /* Copy the depth block, row by row (sequential reads the prefetchers
           follow), into SK_COLS-column strips, each contiguous: read in place, a
           strip's rows (a multiple of 1 KiB apart in GPT-2's weights) would
           fall into a few L1 sets and evict each other between row blocks. */
        for (ptrdiff_t p = 0; p < kc; p++) {
            const float* src = B + (p0 + p) * ldb + j0;
            for (ptrdiff_t s = 0; s < nfull; s += SK_COLS) {
                float* dst = panel + s / SK_COLS * SK_STRIP + SK_COLS * p;
                ADT_V(store)(dst, ADT_V(load)(src + s));
                ADT_V(store)(dst + ADT_W, ADT_V(load)(src + s + ADT_W));
                ADT_V(store)(dst + 2 * ADT_W, ADT_V(load)(src + s + 2 * ADT_W));
            }
        }
        for (ptrdiff_t j = j0; j < jfull; j += SK_COLS) {
            for (ptrdiff_t i = 0; i < M; i += 4) {
                ptrdiff_t mr = M - i < 4 ? M - i : 4;
                const float* a0 = A + i * lda + p0;
                const float* a1 = A + (i + (mr > 1)) * lda + p0;
                const float* a2 = A + (i + (mr > 2 ? 2 : mr - 1)) * lda + p0;
                const float* a3 = A + (i + (mr > 3 ? 3 : mr - 1)) * lda + p0;
                const float* bp = panel + (j - j0) / SK_COLS * SK_STRIP;
                /* The first row block also fetches this strip's rows of the next
                   depth block, so the copy above finds them in cache (the others
                   prefetch their own panel rows: harmless, and no branch). */
                int ahead = i == 0 && p0 + kc < K;
                const float* pf = ahead ? B + (p0 + kc) * ldb + j : bp;
                ptrdiff_t pf_step = ahead ? ldb : SK_COLS;
                SK_TILE_ZERO;
                for (ptrdiff_t p = 0; p < kc; p++, bp += SK_COLS, pf += pf_step) {
                    __builtin_prefetch(pf);
                    __builtin_prefetch(pf + SK_COLS / 2);
                    __builtin_prefetch(pf + SK_COLS - 1);
                    ADT_VT b0 = ADT_V(load)(bp), b1 = ADT_V(load)(bp + ADT_W), b2 = ADT_V(load)(bp + 2 * ADT_W);
                    /* scalar * vector: gcc broadcasts with one vbroadcastss */
                    SK_TILE_FMA(a0[p], a1[p], a2[p], a3[p]);
                }
                SK_TILE_STORE(C + i * ldc + j, ldc, mr, acc, alpha);
            }
        }
        for (ptrdiff_t i = 0; i < M; i++)
            for (ptrdiff_t j = jfull; j < j1; j++) {
                float s = 0.0f;
                for (ptrdiff_t p = p0; p < p0 + kc; p++) s += A[i * lda + p] * B[p * ldb + j];
                C[i * ldc + j] = acc ? C[i * ldc + j] + alpha * s : alpha * s;
            }
    }
}


/* P[i, j] = sum_{k0 <= p < k1} A[i, p] B[p, j]  for i < M, j < N: one thread's share
   of the depth of a product with few rows (the input gradient dout x W at few
   tokens), whose partial sums the caller adds up (kernels/gemm.pyx).  Split by
   columns, each thread would read a strip of every row of B; split by depth, each
   reads its own rows of B once, in order, so their next block can be fetched into
   L2 while this one is worked on.  4 rows of P by SK_NK_NV vectors in registers
   over SKINNY_NK_KC rows of B at a time (96 KiB of GPT-2's weights at 16 lanes,
   from L2); columns past the last full tile take one vector, then a scalar loop.
   Measured on a 2-core Xeon, 12 weights from memory: 128 -> 168 GFLOP/s at 16 x 768
   x 2304 against the packed GEMM split by columns, 110 -> 143 for the lm_head's
   (16 x 768 x 50304), 228 -> 237 at 64 rows. */
#if ADT_W == 16
#define SK_NK_NV 6
#else
#define SK_NK_NV 3
#endif
#define SKINNY_NK_KC 64
ADT_LANES_ATTR
static void ADT_LANES_FN(skinny_nn_depth)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t k0, ptrdiff_t k1,
                                          const float* A, ptrdiff_t lda, const float* B,
                                          ptrdiff_t ldb, float* P, ptrdiff_t ldp) {
    const ptrdiff_t NC = SK_NK_NV * ADT_W;
    ptrdiff_t nfull = N / NC * NC, nvec = N / ADT_W * ADT_W;
    if (k1 <= k0) {
        for (ptrdiff_t i = 0; i < M; i++) memset(P + i * ldp, 0, (size_t)N * sizeof(float));
        return;
    }
    for (ptrdiff_t p0 = k0; p0 < k1; p0 += SKINNY_NK_KC) {
        ptrdiff_t p1 = p0 + SKINNY_NK_KC < k1 ? p0 + SKINNY_NK_KC : k1;
        int acc = p0 > k0;
        /* The next block's rows (the span from its first to its last row), spread
           evenly over this block's full tiles: ppi lines per depth step. */
        ptrdiff_t next_rows = k1 - p1 < SKINNY_NK_KC ? k1 - p1 : SKINNY_NK_KC;
        const char* nb = (const char*)(B + p1 * ldb);
        ptrdiff_t nlines = next_rows > 0 ? ((next_rows - 1) * ldb + N) * (ptrdiff_t)sizeof(float) / 64 + 1 : 0;
        ptrdiff_t steps = (M + 3) / 4 * (nfull / NC) * (p1 - p0);
        ptrdiff_t ppi = steps > 0 ? (nlines + steps - 1) / steps : 0, pl = 0;
        for (ptrdiff_t j = 0; j < nfull; j += NC) {
            for (ptrdiff_t i = 0; i < M; i += 4) {
                ptrdiff_t mr = M - i < 4 ? M - i : 4;
                const float* a0 = A + i * lda;
                const float* a1 = A + (i + (mr > 1)) * lda;
                const float* a2 = A + (i + (mr > 2 ? 2 : mr - 1)) * lda;
                const float* a3 = A + (i + (mr > 3 ? 3 : mr - 1)) * lda;
                ADT_VT c[4][SK_NK_NV];
                for (int r = 0; r < 4; r++)
                    for (int v = 0; v < SK_NK_NV; v++) c[r][v] = (ADT_VT){0};
                const float* bp = B + p0 * ldb + j;
                for (ptrdiff_t p = p0; p < p1; p++, bp += ldb) {
                    for (ptrdiff_t q = 0; q < ppi; q++, pl++)
                        __builtin_prefetch(nb + 64 * (pl < nlines ? pl : 0), 0, 2);
                    float x0 = a0[p], x1 = a1[p], x2 = a2[p], x3 = a3[p];
                    for (int v = 0; v < SK_NK_NV; v++) {
                        ADT_VT b = ADT_V(load)(bp + ADT_W * v);
                        c[0][v] += x0 * b; c[1][v] += x1 * b; c[2][v] += x2 * b; c[3][v] += x3 * b;
                    }
                }
                for (ptrdiff_t r = 0; r < mr; r++) {
                    float* row = P + (i + r) * ldp + j;
                    for (int v = 0; v < SK_NK_NV; v++)
                        ADT_V(store)(row + ADT_W * v, acc ? ADT_V(load)(row + ADT_W * v) + c[r][v] : c[r][v]);
                }
            }
        }
        for (ptrdiff_t j = nfull; j < nvec; j += ADT_W) {
            for (ptrdiff_t i = 0; i < M; i += 4) {
                ptrdiff_t mr = M - i < 4 ? M - i : 4;
                ADT_VT c[4] = {{0}, {0}, {0}, {0}};
                const float* bp = B + p0 * ldb + j;
                for (ptrdiff_t p = p0; p < p1; p++, bp += ldb) {
                    ADT_VT b = ADT_V(load)(bp);
                    for (ptrdiff_t r = 0; r < 4; r++) c[r] += A[(i + (r < mr ? r : mr - 1)) * lda + p] * b;
                }
                for (ptrdiff_t r = 0; r < mr; r++) {
                    float* row = P + (i + r) * ldp + j;
                    ADT_V(store)(row, acc ? ADT_V(load)(row) + c[r] : c[r]);
                }
            }
        }
        for (ptrdiff_t i = 0; i < M; i++)
            for (ptrdiff_t j = nvec; j < N; j++) {
                float s = 0.0f;
                for (ptrdiff_t p = p0; p < p1; p++) s += A[i * lda + p] * B[p * ldb + j];
                P[i * ldp + j] = acc ? P[i * ldp + j] + s : s;
            }
    }
}


/* dst[0:ADT_W] = alpha v, or += with accumulate.  A weight gradient written afresh
   is far larger than the caches and next read by the optimizer: a whole vector at a
   64-byte address is streamed past them (SK_STREAM), which costs no read of the old
   line first (a third of its traffic). */
ADT_LANES_INLINE void ADT_LANES_FN(sk_put)(float* dst, ADT_VT v, float alpha, int accumulate) {
    if (accumulate)
        ADT_V(store)(dst, ADT_V(load)(dst) + alpha * v);
    else if (SK_STREAMS && ((uintptr_t)dst & 63) == 0)
        SK_STREAM(dst, alpha * v);
    else
        ADT_V(store)(dst, alpha * v);
}

/* C[i, j] (+)= alpha * sum_p A[p, i] B[p, j]  for i0 <= i < i1, j0 <= j < j1: a
   transposed-A product of small depth K (the weight gradient dW = dout^T x at few
   tokens).  Each block of 4 rows of C is written once, 3 vectors wide at a time,
   from 12 accumulators over p; the K rows of B stay in L2, A's 4 columns in L1.
   Rows past the edge repeat the last valid row: computed, never stored. */
ADT_LANES_ATTR
static void ADT_LANES_FN(skinny_tn)(ptrdiff_t i0, ptrdiff_t i1, ptrdiff_t j0, ptrdiff_t j1,
                               ptrdiff_t K, float alpha, const float* A, ptrdiff_t lda,
                               const float* B, ptrdiff_t ldb, int accumulate, float* C,
                               ptrdiff_t ldc) {
    const ptrdiff_t W = ADT_W;
    ptrdiff_t j3 = j0 + (j1 - j0) / (3 * W) * (3 * W);
    ptrdiff_t j1v = j0 + (j1 - j0) / W * W;
    for (ptrdiff_t i = i0; i < i1; i += 4) {
        ptrdiff_t mr = i1 - i < 4 ? i1 - i : 4;
        const float* a0 = A + i;
        const float* a1 = A + i + (mr > 1);
        const float* a2 = A + i + (mr > 2 ? 2 : mr - 1);
        const float* a3 = A + i + (mr > 3 ? 3 : mr - 1);
#if ADT_W == 16
        /* From 40 tokens on, 4 x 6 vectors: 24 accumulators, 6 loads of B and 4
           broadcasts per 24 FMAs (measured on a 2-core Xeon, 12 weight gradients
           written afresh: 207 -> 227 GFLOP/s at 64 tokens x 2304 x 768, 229 -> 238 at
           48; at 16 and 32 tokens 4 x 3 stays 3-10% faster). */
        ptrdiff_t j6 = K >= 40 ? j0 + (j1 - j0) / (6 * W) * (6 * W) : j0;
        for (ptrdiff_t j = j0; j < j6; j += 6 * W) {
            ADT_VT c[4][6];
            for (int r = 0; r < 4; r++)
                for (int v = 0; v < 6; v++) c[r][v] = (ADT_VT){0};
            const float* bp = B + j;
            for (ptrdiff_t p = 0; p < K; p++, bp += ldb) {
                ptrdiff_t o = p * lda;
                float x0 = a0[o], x1 = a1[o], x2 = a2[o], x3 = a3[o];
                for (int v = 0; v < 6; v++) {
                    ADT_VT b = ADT_V(load)(bp + W * v);
                    c[0][v] += x0 * b; c[1][v] += x1 * b; c[2][v] += x2 * b; c[3][v] += x3 * b;
                }
            }
            for (ptrdiff_t r = 0; r < mr; r++)
                for (int v = 0; v < 6; v++)
                    ADT_LANES_FN(sk_put)(C + (i + r) * ldc + j + W * v, c[r][v], alpha,
                                         accumulate);
        }
#else
        ptrdiff_t j6 = j0;
#endif
        for (ptrdiff_t j = j6; j < j3; j += 3 * W) {
            SK_TILE_ZERO;
            const float* bp = B + j;
            for (ptrdiff_t p = 0; p < K; p++, bp += ldb) {
                ADT_VT b0 = ADT_V(load)(bp), b1 = ADT_V(load)(bp + W), b2 = ADT_V(load)(bp + 2 * W);
                ptrdiff_t o = p * lda;
                SK_TILE_FMA(a0[o], a1[o], a2[o], a3[o]);
            }
            ADT_VT t[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22},
                              {c30, c31, c32}};
            for (ptrdiff_t r = 0; r < mr; r++)
                for (int v = 0; v < 3; v++)
                    ADT_LANES_FN(sk_put)(C + (i + r) * ldc + j + W * v, t[r][v], alpha,
                                         accumulate);
        }
        for (ptrdiff_t j = j3; j < j1v; j += W) {
            ADT_VT c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            const float* bp = B + j;
            for (ptrdiff_t p = 0; p < K; p++, bp += ldb) {
                ADT_VT b0 = ADT_V(load)(bp);
                ptrdiff_t o = p * lda;
                c0 += a0[o] * b0; c1 += a1[o] * b0; c2 += a2[o] * b0; c3 += a3[o] * b0;
            }
            ADT_VT t[4] = {c0, c1, c2, c3};
            for (ptrdiff_t r = 0; r < mr; r++) {
                float* row = C + (i + r) * ldc + j;
                ADT_V(store)(row, accumulate ? ADT_V(load)(row) + alpha * t[r] : alpha * t[r]);
            }
        }
        for (ptrdiff_t r = 0; r < mr; r++) {
            float* row = C + (i + r) * ldc;
            for (ptrdiff_t j = j1v; j < j1; j++) {
                float s = 0.0f;
                for (ptrdiff_t p = 0; p < K; p++) s += A[p * lda + i + r] * B[p * ldb + j];
                row[j] = accumulate ? row[j] + alpha * s : alpha * s;
            }
        }
    }
    if (!accumulate && SK_STREAMS) SK_FENCE();   /* the streamed stores, before anyone reads */
}

/* C[i, j] = sum_p A[i, p] W[j, p]  for i < M, j0 <= j < j1, with W in bf16 (uint16, the
   top halves of float32s), for the few rows of a decoding step (gemm_w16): W read once
   from memory at two bytes an element and widened in registers (exact), the products
   and sums float32.  SK_W16_NR rows of W against two rows of A at a time (M = 3 or 4
   goes over W's rows twice, from L1), or twice as many rows of W against one row of
   A; ADT_W lanes along p, a horizontal sum per output at the end. */
#define SK_W16_NR 4
typedef uint16_t ADT_CAT(ADT_VT, h) __attribute__((vector_size(2 * ADT_W), aligned(2)));
ADT_LANES_INLINE ADT_VT ADT_LANES_FN(sk_widen)(const uint16_t* p) {
    ADT_CAT(ADT_VT, h) h;
    memcpy(&h, p, sizeof h);
    ADT_VI bits = __builtin_convertvector(h, ADT_VI) << 16;
    return (ADT_VT)bits;
}
ADT_LANES_INLINE float ADT_LANES_FN(sk_widen1)(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float y;
    memcpy(&y, &bits, sizeof y);
    return y;
}
ADT_LANES_ATTR
static void ADT_LANES_FN(skinny_nt_w16)(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K,
                                          const float* A, ptrdiff_t lda, const uint16_t* W,
                                          ptrdiff_t ldw, float* C, ptrdiff_t ldc) {
    ptrdiff_t K8 = K & ~(ptrdiff_t)(ADT_W - 1);
    if (M == 1) {
        /* One row of A (a decoding step): twice the rows of W, half the FMAs a widened
           vector of W. */
        for (ptrdiff_t j = j0; j < j1; j += 2 * SK_W16_NR) {
            ptrdiff_t nr = j1 - j < 2 * SK_W16_NR ? j1 - j : 2 * SK_W16_NR;
            const uint16_t* w[2 * SK_W16_NR];
            for (int c = 0; c < 2 * SK_W16_NR; c++) w[c] = W + (j + (c < nr ? c : nr - 1)) * ldw;
            ADT_VT acc[2 * SK_W16_NR];
            for (int c = 0; c < 2 * SK_W16_NR; c++) acc[c] = (ADT_VT){0};
            for (ptrdiff_t p = 0; p < K8; p += ADT_W) {
                ADT_VT x = ADT_V(load)(A + p);
                for (int c = 0; c < 2 * SK_W16_NR; c++)
                    acc[c] += x * ADT_LANES_FN(sk_widen)(w[c] + p);
            }
            for (int c = 0; c < nr; c++) {
                float s = ADT_V(hsum)(acc[c]);
                for (ptrdiff_t p = K8; p < K; p++) s += A[p] * ADT_LANES_FN(sk_widen1)(w[c][p]);
                C[j + c] = s;
            }
        }
        return;
    }
    for (ptrdiff_t j = j0; j < j1; j += SK_W16_NR) {
        ptrdiff_t nr = j1 - j < SK_W16_NR ? j1 - j : SK_W16_NR;
        const uint16_t* w[SK_W16_NR];
        for (int c = 0; c < SK_W16_NR; c++) w[c] = W + (j + (c < nr ? c : nr - 1)) * ldw;
        for (ptrdiff_t i = 0; i < M; i += 2) {
            ptrdiff_t mr = M - i < 2 ? M - i : 2;
            const float* a0 = A + i * lda;
            const float* a1 = A + (i + mr - 1) * lda;
            ADT_VT acc0[SK_W16_NR], acc1[SK_W16_NR];
            for (int c = 0; c < SK_W16_NR; c++) acc0[c] = acc1[c] = (ADT_VT){0};
            for (ptrdiff_t p = 0; p < K8; p += ADT_W) {
                ADT_VT x0 = ADT_V(load)(a0 + p), x1 = ADT_V(load)(a1 + p);
                for (int c = 0; c < SK_W16_NR; c++) {
                    ADT_VT y = ADT_LANES_FN(sk_widen)(w[c] + p);
                    acc0[c] += x0 * y;
                    acc1[c] += x1 * y;
                }
            }
            for (int c = 0; c < nr; c++) {
                float s0 = ADT_V(hsum)(acc0[c]), s1 = ADT_V(hsum)(acc1[c]);
                for (ptrdiff_t p = K8; p < K; p++) {
                    float y = ADT_LANES_FN(sk_widen1)(w[c][p]);
                    s0 += a0[p] * y;
                    s1 += a1[p] * y;
                }
                C[i * ldc + j + c] = s0;
                if (mr > 1) C[(i + 1) * ldc + j + c] = s1;
            }
        }
    }
}
#undef SK_W16_NR

#undef SK_COLS
#undef SK_NT_NR
#undef SK_NK_NV
#undef SKINNY_NK_KC
#undef SK_STRIP
#undef SK_TILE_ZERO
#undef SK_TILE_FMA
#undef SK_TILE_STORE
#undef SK_IN_REGISTER
#undef SK_STREAMS
#undef SK_STREAM
#undef SK_FENCE
