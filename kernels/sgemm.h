/* A packed single-precision GEMM, a template over the vector width (kernels/simd.h),
 * for the products where OpenBLAS is weakest.  gemm.pyx includes it once per width
 * with ADT_W defined to 8 or 16, like kernels/skinny.h; the part that does not
 * depend on the width (the prefetch plan, the packing buffer, the transposes) is
 * compiled once.
 *
 * Row-major C (M x N) = alpha op(A) op(B) + beta C, one thread; kernels/gemm.pyx
 * splits the output between threads and routes here only what was measured faster
 * (see its _use_packed).  SciPy's OpenBLAS (0.3.30, SkylakeX kernels) reaches about
 * 110 GFLOP/s per core on the input gradient dout @ W at GPT-2 shapes, where it
 * reaches 140 on the forward x @ W^T; this one packs both operands in the usual way
 * (Goto, BLIS):
 *
 *   for each block of SG_NC columns:
 *     for each block of SG_KC depths:    pack op(B)[depths, columns] into panels
 *       for each block of SG_MC rows:    pack op(A)[rows, depths] into panels
 *         for each SG_NR-column panel:   (its SG_KC x SG_NR floats stay in L1)
 *           for each SG_MR-row panel:    the micro-kernel, an SG_MR x SG_NR tile of C
 *
 * An A panel holds SG_MR floats per depth, a B panel SG_NR floats (two vectors) per
 * depth; the micro-kernel keeps its SG_MR x 2 vector accumulators in registers and
 * does one broadcast of A and two FMAs per row and depth: 8 x 32 in sixteen lanes
 * (about 175 GFLOP/s per core on a Xeon with its operands in L1), 6 x 16 in eight
 * (twelve of AVX2's sixteen registers).  Panels past the edges of A and B are padded
 * with zeros, and the tiles there go through a small buffer.
 *
 * op(A)[i, k] = A[i * a_rs + k * a_cs] and op(B)[k, j] = B[k * b_rs + j * b_cs], so
 * one routine serves every transposition.
 */
#ifndef ADTAPE_KERNELS_SGEMM_H
#define ADTAPE_KERNELS_SGEMM_H

#include <pthread.h>
#include "simd.h"

/* The blocks, the same in both widths (on the Zen 3 machine, 512 KiB of L2 per core,
   256 or 384 columns per block made no measurable difference): SG_NC columns by SG_KC
   depths of B, SG_MC rows of A (a multiple of either width's tile).  Each may be
   defined before this header, as a standalone timing harness does to compare sizes. */
#ifndef SG_KC
#define SG_KC 256
#endif
#ifndef SG_NC
#define SG_NC 512
#endif
/* Tall products (more than SG_TALL_M rows, e.g. a weight gradient dout^T x split by
   rows) take blocks of up to SG_NC_TALL columns: op(A) is then packed once per
   SG_KC depths instead of once per 512 columns, whose second read from memory cost
   the eight-lane weight gradient at 8192 tokens 4-7% (single products, 2 threads on
   the Zen 3 VM: 3072 x 768 x 8192 from 231 to 217 ms, 2304 x 768 x 8192 from 186 to
   158; the B block then lives in L3, as in BLIS). */
#ifndef SG_NC_TALL
#define SG_NC_TALL 1024
#endif
#ifndef SG_TALL_M
#define SG_TALL_M 512
#endif
#ifndef SG_MC
#define SG_MC 96
#endif
/* Depths ahead whose row of a transposed A sg_pack_a fetches. */
#define SG_PACK_AHEAD 8

#define SG_ARGS(...) __VA_ARGS__
/* v[0..n) <- its transpose (v[r][l] becomes v[l][r]) for n x n lanes: rounds that
   swap the off-diagonal blocks of 8, 4, 2 and 1 lanes between rows r and r + d. */
#define SG_SWAP(n, d, LO, HI) \
    for (int r = 0; r < (n); r++) \
        if (!(r & (d))) { \
            __typeof__(v[0]) a_ = v[r], b_ = v[r + (d)]; \
            v[r] = __builtin_shufflevector(a_, b_, LO); \
            v[r + (d)] = __builtin_shufflevector(a_, b_, HI); \
        }
#if ADT_HAVE_V4
#define SG_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define SG_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define SG_LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define SG_HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define SG_LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define SG_HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define SG_LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define SG_HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
ADT_TARGET_V4 static inline __attribute__((always_inline)) void sg_transpose16(adt_v16 v[16]) {
#pragma GCC unroll 16
    SG_SWAP(16, 8, SG_LO8, SG_HI8)
#pragma GCC unroll 16
    SG_SWAP(16, 4, SG_LO4, SG_HI4)
#pragma GCC unroll 16
    SG_SWAP(16, 2, SG_LO2, SG_HI2)
#pragma GCC unroll 16
    SG_SWAP(16, 1, SG_LO1, SG_HI1)
}
#undef SG_LO8
#undef SG_HI8
#undef SG_LO4
#undef SG_HI4
#undef SG_LO2
#undef SG_HI2
#undef SG_LO1
#undef SG_HI1
#endif
ADT_INLINE void sg_transpose8(adt_v8 v[8]) {
#pragma GCC unroll 8
    SG_SWAP(8, 4, SG_ARGS(0, 1, 2, 3, 8, 9, 10, 11), SG_ARGS(4, 5, 6, 7, 12, 13, 14, 15))
#pragma GCC unroll 8
    SG_SWAP(8, 2, SG_ARGS(0, 1, 8, 9, 4, 5, 12, 13), SG_ARGS(2, 3, 10, 11, 6, 7, 14, 15))
#pragma GCC unroll 8
    SG_SWAP(8, 1, SG_ARGS(0, 8, 2, 10, 4, 12, 6, 14), SG_ARGS(1, 9, 3, 11, 5, 13, 7, 15))
}
#undef SG_SWAP
#undef SG_ARGS

/* Prefetching the next block of op(B) into L2 while this one is computed: at few
   rows each weight is used by few micro-kernels, and packing it straight from
   memory left the cores waiting (12 layers' qkv weights at 64 x 2304 x 768: about
   half the time went to packing them, at 11 GB/s).  The block is a set of
   contiguous runs (columns of a transposed B, else rows); the micro-kernels walk
   through their cache lines, one line every `mask + 1` depths, so that the block
   is in L2 by the time the current one is done.  With blocks of 512 columns
   (1024 before; the current block and the next one then fit in L2 together), 24
   weights from memory on 2 threads: 182 -> 207 GFLOP/s at 64 x 2304 x 768 (x @
   W^T), 195 -> 214 (dout @ W), 138 -> 151 at 32 rows, 235 -> 248 at 128. */
typedef struct {
    const char* base;
    ptrdiff_t stride, nruns, lines, run, line, mask;
} sg_prefetch;

static void sg_prefetch_plan(sg_prefetch* p, const float* B, ptrdiff_t b_rs, ptrdiff_t b_cs,
                             ptrdiff_t k0, ptrdiff_t kc, ptrdiff_t j0, ptrdiff_t nc,
                             ptrdiff_t calls, ptrdiff_t depth) {
    p->run = p->line = 0;
    p->nruns = 0;
    p->mask = 0;
    if (kc <= 0 || nc <= 0) return;
    if (b_rs == 1) {            /* each column's depths are contiguous */
        p->base = (const char*)(B + k0 + j0 * b_cs);
        p->stride = b_cs * (ptrdiff_t)sizeof(float);
        p->nruns = nc;
        p->lines = (kc * (ptrdiff_t)sizeof(float) + 63) / 64 + 1;
    } else if (b_cs == 1) {     /* each depth's columns are contiguous */
        p->base = (const char*)(B + k0 * b_rs + j0);
        p->stride = b_rs * (ptrdiff_t)sizeof(float);
        p->nruns = kc;
        p->lines = (nc * (ptrdiff_t)sizeof(float) + 63) / 64 + 1;
    } else {
        return;
    }
    /* the largest power of two of depths per line that still covers the block */
    ptrdiff_t every = calls * depth / (p->nruns * p->lines);
    while ((p->mask + 1) * 2 <= every && p->mask < 63) p->mask = p->mask * 2 + 1;
}


/* Up to SG_DIRECT_MAX_M rows, sixteen lanes' sg_gemm reads a B whose rows run along
   the columns (dout @ W's weight) where it lies, panel by panel, instead of packing
   it: at few rows each packed float served few micro-kernels, and packing W from
   memory was 17% of a 64-row dout @ W (perf, Zen 4, 768 x 768).  The micro-kernel then
   takes its two vectors a depth from W's rows (one line each, from L2: the panel's
   rows share few L1 sets), the next block still fetched into L2 by the prefetch plan;
   the same FMAs in the same order, so the same bits.  Zen 4, one thread, 12 weights
   from memory, dout @ W of GPT-2's five layers, direct vs packed in alternating
   processes (medians, GFLOP/s of 117): 64 rows 84-103 vs 67-89, 128 rows 84-92 vs
   80-86, 256 rows 84-101 vs 92-100 (W rows 12 KiB apart lose there), 512 rows even.
   Prefetching B 4 or 8 depths ahead in the micro-kernel gained nothing.  Eight lanes
   (one line a depth for 12 FMAs) were mixed on Zen 4 and not measured where they run
   (Zen 3): packed there unless sg_set_direct_max_m says otherwise. */
#define SG_DIRECT_MAX_M 128
static ptrdiff_t sg_direct_max_m = -1;      /* < 0: the width's default */
static ptrdiff_t sg_set_direct_max_m(ptrdiff_t m) {
    ptrdiff_t old = sg_direct_max_m; sg_direct_max_m = m; return old;
}

/* Packing space: SG_NC_TALL x SG_KC floats of B panels, then SG_MC x SG_KC of A
   panels (1.1 MiB) and 16 floats that sg_pack_a's whole-vector stores may run into,
   one buffer per thread, allocated on its first product and kept until the thread
   exits. */
#define SG_B_FLOATS ((size_t)SG_NC_TALL * SG_KC)
#define SG_BUF_FLOATS (SG_B_FLOATS + (size_t)SG_MC * SG_KC + 16)
static __thread float* sg_buf = NULL;
static pthread_key_t sg_buf_key;
static pthread_once_t sg_buf_once = PTHREAD_ONCE_INIT;
static int sg_buf_key_ok = 0;

static void sg_buf_key_create(void) { sg_buf_key_ok = pthread_key_create(&sg_buf_key, free) == 0; }

/* This thread's packing buffer, or NULL when it cannot be allocated. */
static float* sg_thread_buffer(void) {
    if (sg_buf == NULL) {
        pthread_once(&sg_buf_once, sg_buf_key_create);
        if (!sg_buf_key_ok) return NULL;
        float* buf = (float*)aligned_alloc(64, SG_BUF_FLOATS * sizeof(float));
        if (buf == NULL) return NULL;
        if (pthread_setspecific(sg_buf_key, buf) != 0) {   /* frees it at thread exit */
            free(buf);
            return NULL;
        }
        sg_buf = buf;
    }
    return sg_buf;
}

#endif /* ADTAPE_KERNELS_SGEMM_H */


/* ---- the width-dependent part, once per ADT_W ---- */
#if ADT_W == 8 || ADT_HAVE_V4

#define SG_MR (ADT_W == 16 ? 8 : 6)
#define SG_NR (2 * ADT_W)
_Static_assert(SG_MC % SG_MR == 0 && SG_NC % SG_NR == 0 && SG_NC_TALL % SG_NR == 0
               && SG_NC_TALL >= SG_NC,
               "sgemm.h: the blocks must hold whole tiles (the packing buffer's size)");
_Static_assert(SG_MR <= ADT_W, "sgemm.h: sg_pack_a transposes SG_MR rows in one W x W block");

/* Pack op(A)[i0:i0+mc, k0:k0+kc] (times alpha) as panels of SG_MR rows: for each
   depth the panel's SG_MR values; rows past mc are zero.  Where sums is not NULL,
   sums[i] += op(A)[i0 + i, k] for each depth k in turn (in float64, not times
   alpha): the bias gradient of a weight gradient dout^T x, taken while dout passes
   through the cores anyway. */
ADT_LANES_ATTR
static void ADT_LANES_FN(sg_pack_a)(ptrdiff_t mc, ptrdiff_t kc, float alpha, const float* A,
                                    ptrdiff_t a_rs, ptrdiff_t a_cs, float* restrict pa,
                                    double* restrict sums) {
    if (a_rs == 1 && a_cs != 1) {
        /* A transposed (the weight gradient's dout^T): each depth's mc rows are
           contiguous, in a row of A that the panels take SG_MR floats each of.  One
           pass per depth, fetching the row SG_PACK_AHEAD depths on from memory. */
        ptrdiff_t full = mc / SG_MR, tail = mc - full * SG_MR;
        for (ptrdiff_t k = 0; k < kc; k++) {
            const float* ak = A + k * a_cs;
            if (k + SG_PACK_AHEAD < kc)
                for (ptrdiff_t i = 0; i < mc; i += 16)
                    __builtin_prefetch(ak + SG_PACK_AHEAD * a_cs + i, 0, 3);
            if (sums != NULL)
                for (ptrdiff_t i = 0; i < mc; i++) sums[i] += (double)ak[i];
            float* d = pa + k * SG_MR;
            for (ptrdiff_t p = 0; p < full; p++, d += kc * SG_MR, ak += SG_MR)
#pragma GCC unroll 8
                for (int r = 0; r < SG_MR; r++) d[r] = alpha * ak[r];
            if (tail) {
                for (ptrdiff_t r = 0; r < tail; r++) d[r] = alpha * ak[r];
                for (ptrdiff_t r = tail; r < SG_MR; r++) d[r] = 0.0f;
            }
        }
        return;
    }
    if (sums != NULL)
        for (ptrdiff_t i = 0; i < mc; i++)
            for (ptrdiff_t k = 0; k < kc; k++) sums[i] += (double)A[i * a_rs + k * a_cs];
    for (ptrdiff_t i = 0; i < mc; i += SG_MR) {
        ptrdiff_t mr = mc - i < SG_MR ? mc - i : SG_MR;
        const float* a = A + i * a_rs;
#if ADT_W == 16
        if (a_cs == 1 && mc - i >= 2 * SG_MR) {
            /* two panels' rows contiguous along the depth: 16 rows by 16 depths at a
               time, transposed in registers, the low half of each depth to the first
               panel and the high half to the second */
            float* pa2 = pa + kc * SG_MR;
            adt_v16 va = adt_splat16(alpha);
            ptrdiff_t k = 0;
            for (; k + 16 <= kc; k += 16) {
                adt_v16 v[16];
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) v[r] = adt_load16(a + r * a_rs + k);
                sg_transpose16(v);
#pragma GCC unroll 16
                for (int t = 0; t < 16; t++) {
                    adt_v16 x = alpha == 1.0f ? v[t] : va * v[t];
                    adt_store(pa + (k + t) * SG_MR, __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
                    adt_store(pa2 + (k + t) * SG_MR, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
                }
            }
            for (; k < kc; k++)
                for (int r = 0; r < 2 * SG_MR; r++)
                    (r < SG_MR ? pa : pa2 - SG_MR)[k * SG_MR + r] = alpha * a[r * a_rs + k];
            pa += 2 * kc * SG_MR;
            i += SG_MR;
            continue;
        }
#endif
        if (a_cs == 1 && mr == SG_MR) {
            /* rows contiguous along the depth: SG_MR rows by W depths at a time,
               padded to W rows and transposed in registers; each depth's vector
               is stored whole, its lanes past SG_MR running into the next depth's
               (rewritten by the next store) or past the panel (the buffer has
               room) */
            ptrdiff_t k = 0;
            for (; k + ADT_W <= kc; k += ADT_W) {
                ADT_VT v[ADT_W];
#pragma GCC unroll 16
                for (int r = 0; r < ADT_W; r++)
                    v[r] = r < SG_MR ? alpha * ADT_V(load)(a + r * a_rs + k) : (ADT_VT){0};
                ADT_CAT(sg_transpose, ADT_W)(v);
#pragma GCC unroll 16
                for (int t = 0; t < ADT_W; t++) ADT_V(store)(pa + (k + t) * SG_MR, v[t]);
            }
            for (; k < kc; k++)
                for (int r = 0; r < SG_MR; r++) pa[k * SG_MR + r] = alpha * a[r * a_rs + k];
        } else if (a_cs == 1) {
            /* rows contiguous along the depth: read each row in turn */
            for (ptrdiff_t r = 0; r < mr; r++) {
                const float* ar = a + r * a_rs;
                for (ptrdiff_t k = 0; k < kc; k++) pa[k * SG_MR + r] = alpha * ar[k];
            }
        } else {
            for (ptrdiff_t k = 0; k < kc; k++)
                for (ptrdiff_t r = 0; r < mr; r++) pa[k * SG_MR + r] = alpha * a[k * a_cs + r * a_rs];
        }
        for (ptrdiff_t r = mr; r < SG_MR; r++)
            for (ptrdiff_t k = 0; k < kc; k++) pa[k * SG_MR + r] = 0.0f;
        pa += kc * SG_MR;
    }
}


/* Pack op(B)[k0:k0+kc, 0:n] as panels of SG_NR columns: for each depth the panel's
   SG_NR values; columns past n are zero. */
ADT_LANES_ATTR
static void ADT_LANES_FN(sg_pack_b)(ptrdiff_t kc, ptrdiff_t n, const float* B, ptrdiff_t b_rs,
                                    ptrdiff_t b_cs, float* restrict pb) {
    ptrdiff_t j = 0;
    if (b_cs == 1 && n >= SG_NR) {
        /* rows along the columns: a panel at a time, its SG_NR floats of each depth's
           row in turn, so the stores run in order (row by row across all panels, every
           store went to another panel: Zen 3, in cache, 0.64-0.70 -> 0.41-0.46 cycles a
           float at 384-512 columns; whole products, one process, medians of 15: dout @ W
           and dout^T x at 64 to 1024 rows 2-10% faster on 2 threads, 22 of 24 cases) */
        ptrdiff_t nf = n / SG_NR * SG_NR;
        for (ptrdiff_t jj = 0; jj < nf; jj += SG_NR) {
            float* d = pb + jj * kc;
            const float* b = B + jj;
            for (ptrdiff_t k = 0; k < kc; k++, d += SG_NR, b += b_rs) {
                ADT_V(store)(d, ADT_V(load)(b));
                ADT_V(store)(d + ADT_W, ADT_V(load)(b + ADT_W));
            }
        }
        pb += nf * kc;
        j = nf;
    }
    for (; j < n; j += SG_NR) {
        ptrdiff_t nr = n - j < SG_NR ? n - j : SG_NR;
        const float* b = B + j * b_cs;
        if (b_cs == 1) {
            for (ptrdiff_t k = 0; k < kc; k++) {
                for (ptrdiff_t c = 0; c < nr; c++) pb[k * SG_NR + c] = b[k * b_rs + c];
                for (ptrdiff_t c = nr; c < SG_NR; c++) pb[k * SG_NR + c] = 0.0f;
            }
        } else if (nr == SG_NR && b_rs == 1) {
            /* columns contiguous along the depth (a transposed weight): W columns
               by W depths at a time, transposed in registers */
            ptrdiff_t k = 0;
            for (; k + ADT_W <= kc; k += ADT_W)
                for (int g = 0; g < SG_NR; g += ADT_W) {
                    ADT_VT v[ADT_W];
#pragma GCC unroll 16
                    for (int c = 0; c < ADT_W; c++) v[c] = ADT_V(load)(b + (g + c) * b_cs + k);
                    ADT_CAT(sg_transpose, ADT_W)(v);
#pragma GCC unroll 16
                    for (int t = 0; t < ADT_W; t++) ADT_V(store)(pb + (k + t) * SG_NR + g, v[t]);
                }
            for (; k < kc; k++)
                for (ptrdiff_t c = 0; c < SG_NR; c++) pb[k * SG_NR + c] = b[c * b_cs + k];
        } else {
            /* columns contiguous along the depth: read each column in turn */
            for (ptrdiff_t c = 0; c < nr; c++) {
                const float* bc = b + c * b_cs;
                for (ptrdiff_t k = 0; k < kc; k++) pb[k * SG_NR + c] = bc[k * b_rs];
            }
            for (ptrdiff_t c = nr; c < SG_NR; c++)
                for (ptrdiff_t k = 0; k < kc; k++) pb[k * SG_NR + c] = 0.0f;
        }
        pb += kc * SG_NR;
    }
}

/* The SG_MR x SG_NR tile: C = acc + beta C (beta 0: C not read), plus bias[0:SG_NR]
   on every row where bias is not NULL; the tiles at the edges of C go through
   sg_edge's buffer instead.  Whole tiles only: with the edges' partial stores
   in here too, GCC spilled the twelve accumulators to the stack after the loop
   and loaded them back.  Not inlined: inside sg_gemm's loops GCC kept a B vector
   on the stack (a load more per FMA pair) and ran 30% slower. */
ADT_LANES_ATTR
static __attribute__((noinline))
void ADT_LANES_FN(sg_micro)(ptrdiff_t kc, const float* restrict pa, const float* restrict pb,
                            ptrdiff_t pb_step, float* c, ptrdiff_t ldc, float beta,
                            const float* bias, sg_prefetch* pf) {
    ADT_VT acc[SG_MR][2];
    /* the prefetch plan's position in registers, written back after the loop: read
       and written through pf in the loop, each depth's check waited on the last
       depth's store (a 6 x 16 tile with a B panel in L1, one Zen 3 core, best of
       25: 76 -> 93 GFLOP/s where a line is due every depth, the same elsewhere) */
    const ptrdiff_t pf_mask = pf->mask, pf_lines = pf->lines, pf_nruns = pf->nruns,
                   pf_stride = pf->stride;
    ptrdiff_t pf_run = pf->run, pf_line = pf->line;
    const char* pf_at = pf_run < pf_nruns ? pf->base + pf_run * pf_stride : NULL;
    /* the tile's rows, for writing, while the loop runs: from L3 or memory they
       came late (Zen 3 VM, 2 threads, fetched vs not in one process: the weight
       gradient 2304 x 768 x 8192 0.5-1.5% faster when calm, up to 8% in noisy
       stretches; 1-4% on the packed products at 64 to 256 rows) */
#pragma GCC unroll 16
    for (int r = 0; r < SG_MR; r++) __builtin_prefetch(c + r * ldc, 1, 3);
#pragma GCC unroll 16
    for (int r = 0; r < SG_MR; r++) { acc[r][0] = (ADT_VT){0}; acc[r][1] = (ADT_VT){0}; }
    for (ptrdiff_t k = 0; k < kc; k++) {
        /* unaligned loads: direct panels lie where W does */
        ADT_VT b0 = ADT_V(load)(pb), b1 = ADT_V(load)(pb + ADT_W);
#pragma GCC unroll 16
        for (int r = 0; r < SG_MR; r++) {
            float x = pa[r];
            acc[r][0] += x * b0;
            acc[r][1] += x * b1;
        }
        pa += SG_MR;
        pb += pb_step;
        if ((k & pf_mask) == 0 && pf_run < pf_nruns) {
            __builtin_prefetch((const void*)((size_t)(pf_at + pf_line * 64) & ~(size_t)63), 0, 2);
            if (++pf_line == pf_lines) {
                pf_line = 0;
                pf_run++;
                pf_at += pf_stride;
            }
        }
    }
    pf->run = pf_run;
    pf->line = pf_line;
    if (bias != NULL) {
        ADT_VT b0 = ADT_V(load)(bias), b1 = ADT_V(load)(bias + ADT_W);
#pragma GCC unroll 16
        for (int r = 0; r < SG_MR; r++) { acc[r][0] += b0; acc[r][1] += b1; }
    }
#pragma GCC unroll 16
    for (int r = 0; r < SG_MR; r++) {
        float* row = c + r * ldc;
        if (beta == 0.0f) {
            ADT_V(store)(row, acc[r][0]);
            ADT_V(store)(row + ADT_W, acc[r][1]);
        } else if (beta == 1.0f) {
            ADT_V(store)(row, ADT_V(load)(row) + acc[r][0]);
            ADT_V(store)(row + ADT_W, ADT_V(load)(row + ADT_W) + acc[r][1]);
        } else {
            ADT_V(store)(row, beta * ADT_V(load)(row) + acc[r][0]);
            ADT_V(store)(row + ADT_W, beta * ADT_V(load)(row + ADT_W) + acc[r][1]);
        }
    }
}

/* A tile at the edge of C, mr x nr (at most SG_MR x SG_NR): the micro-kernel into
   a buffer, then C[0:mr, 0:nr] = that + beta C (+ bias[0:nr]). */
ADT_LANES_ATTR
static void ADT_LANES_FN(sg_edge)(ptrdiff_t kc, const float* pa, const float* pb,
                                  ptrdiff_t pb_step, float* c, ptrdiff_t ldc, float beta,
                                  const float* bias, ptrdiff_t mr, ptrdiff_t nr,
                                  sg_prefetch* pf) {
    float t[SG_MR][SG_NR] __attribute__((aligned(64)));
    ADT_LANES_FN(sg_micro)(kc, pa, pb, pb_step, &t[0][0], SG_NR, 0.0f, NULL, pf);
    for (ptrdiff_t r = 0; r < mr; r++)
        for (ptrdiff_t j = 0; j < nr; j++)
            c[r * ldc + j] = (beta == 0.0f ? t[r][j] : t[r][j] + beta * c[r * ldc + j])
                             + (bias != NULL ? bias[j] : 0.0f);
}

/* C = alpha op(A) op(B) + beta C (+ bias[j] in every column j where bias is not
   NULL, added to the first block of depths in the micro-kernel, so that C is not
   read again for it) over M x N x K (K > 0); and where a_sums is not NULL,
   a_sums[i] += the sum of op(A)'s row i (see sg_pack_a).  Returns -1, having
   written nothing, when the packing buffer cannot be allocated. */
ADT_LANES_ATTR
static int ADT_LANES_FN(sg_gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, float alpha,
                                 const float* A, ptrdiff_t a_rs, ptrdiff_t a_cs,
                                 const float* B, ptrdiff_t b_rs, ptrdiff_t b_cs,
                                 float beta, float* C, ptrdiff_t ldc, const float* bias,
                                 double* a_sums) {
    float* pb = sg_thread_buffer();
    if (pb == NULL) return -1;
    float* pa = pb + SG_B_FLOATS;
    sg_prefetch pf;
    ptrdiff_t ncb = M > SG_TALL_M ? SG_NC_TALL : SG_NC;
    int direct = b_cs == 1
                 && M <= (sg_direct_max_m >= 0 ? sg_direct_max_m
                                               : ADT_W == 16 ? SG_DIRECT_MAX_M : 0);
    for (ptrdiff_t j0 = 0; j0 < N; j0 += ncb) {
        ptrdiff_t nc = N - j0 < ncb ? N - j0 : ncb;
        for (ptrdiff_t k0 = 0; k0 < K; k0 += SG_KC) {
            ptrdiff_t kc = K - k0 < SG_KC ? K - k0 : SG_KC;
            float bt = k0 == 0 ? beta : 1.0f;
            /* whole panels read where they lie (direct), the rest packed */
            ptrdiff_t nd = direct ? nc / SG_NR * SG_NR : 0;
            if (nd < nc)
                ADT_LANES_FN(sg_pack_b)(kc, nc - nd, B + k0 * b_rs + (j0 + nd) * b_cs, b_rs,
                                        b_cs, pb);
            {
                ptrdiff_t k1 = k0 + SG_KC < K ? k0 + SG_KC : 0;
                ptrdiff_t j1 = k0 + SG_KC < K ? j0 : j0 + ncb;
                ptrdiff_t kc1 = K - k1 < SG_KC ? K - k1 : SG_KC;
                ptrdiff_t nc1 = j1 >= N ? 0 : (N - j1 < ncb ? N - j1 : ncb);
                sg_prefetch_plan(&pf, B, b_rs, b_cs, k1, kc1, j1, nc1,
                                 ((M + SG_MR - 1) / SG_MR) * ((nc + SG_NR - 1) / SG_NR), kc);
            }
            for (ptrdiff_t i0 = 0; i0 < M; i0 += SG_MC) {
                ptrdiff_t mc = M - i0 < SG_MC ? M - i0 : SG_MC;
                ADT_LANES_FN(sg_pack_a)(mc, kc, alpha, A + i0 * a_rs + k0 * a_cs, a_rs, a_cs, pa,
                                        j0 == 0 && a_sums != NULL ? a_sums + i0 : NULL);
                for (ptrdiff_t j = 0; j < nc; j += SG_NR) {
                    ptrdiff_t nr = nc - j < SG_NR ? nc - j : SG_NR;
                    const float* pbj = j < nd ? B + k0 * b_rs + j0 + j
                                              : pb + ((j - nd) / SG_NR) * SG_NR * kc;
                    ptrdiff_t step = j < nd ? b_rs : SG_NR;
                    const float* bj = k0 == 0 && bias != NULL ? bias + j0 + j : NULL;
                    for (ptrdiff_t i = 0; i < mc; i += SG_MR) {
                        ptrdiff_t mr = mc - i < SG_MR ? mc - i : SG_MR;
                        if (mr == SG_MR && nr == SG_NR)
                            ADT_LANES_FN(sg_micro)(kc, pa + (i / SG_MR) * SG_MR * kc, pbj, step,
                                                   C + (i0 + i) * ldc + j0 + j, ldc, bt, bj, &pf);
                        else
                            ADT_LANES_FN(sg_edge)(kc, pa + (i / SG_MR) * SG_MR * kc, pbj, step,
                                                  C + (i0 + i) * ldc + j0 + j, ldc, bt, bj, mr, nr,
                                                  &pf);
                    }
                }
            }
        }
    }
    return 0;
}

#if ADT_W == 8
/* The forward x @ W^T at few rows in eight lanes, with W read where it lies: a tile of
   6 rows of W (6 columns of C) by 16 rows of x (two vectors), each depth broadcasting
   one float of each W row against the two vectors of x.  Only x is packed (16 rows a
   depth, once per depth block for every row), and each W row is a stream in order, so
   the weight is neither copied nor transposed: the packed GEMM's B packing and the
   stalls of its stream from memory were 15-20% of a 64-row forward on the Zen 3.  The
   depth block is as deep as lets x's panels stay in L2 (256 KiB: all of K = 768 at 64
   rows, where C is then written once, not read back per block of 256).  The tile's
   accumulators hold C transposed; two 8 x 8 register transposes turn them into rows.
   Zen 3 VM, one core, 12 weights from memory, W broadcast against the packed GEMM in
   one process, best (median) of 31: 64 x 2304 x 768 79.6 (63.6) vs 70.5 (48.1) GFLOP/s,
   78.3 (65.0) vs 63.7 (51.5); on 2 threads 136.6 (101.0) vs 118.0 (93.7), at 128 rows
   152.9 (132.2) vs 140.0 (124.9). */
#define SG_BC_MAX_M 128
#define SG_BC_X_FLOATS 65536

/* The 16 x 6 tile: C[0:mr, 0:nr] = alpha acc + beta C (+ bias[0:nr]), from the W rows
   w[r] (rows past nr repeat the last) and xp's 16 floats a depth; pf (NULL: none) the
   next tile's first W row, whose 6 rows ldw apart are fetched as this one runs.
   `whole`: C's row has 8 floats from c on in this block, so each row goes through one
   load and one store (its lanes 6 and 7, the next tile's, stored as they were). */
ADT_LANES_ATTR
static __attribute__((noinline))
void ADT_LANES_FN(sg_bcast_micro)(ptrdiff_t kc, const float* const* w, const float* restrict xp,
                                  float* c, ptrdiff_t ldc, ptrdiff_t mr, ptrdiff_t nr, float alpha,
                                  float beta, const float* bias, const float* pf, ptrdiff_t ldw,
                                  int whole) {
    adt_v8 lo[8], hi[8];
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3], *w4 = w[4], *w5 = w[5];
    adt_v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0};
    adt_v8 a30 = {0}, a31 = {0}, a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0};
    for (ptrdiff_t k = 0; k < kc; k++, xp += 16) {
        adt_v8 x0 = *(const adt_v8*)xp, x1 = *(const adt_v8*)(xp + 8);
        float s;
        s = w0[k]; a00 += s * x0; a01 += s * x1;
        s = w1[k]; a10 += s * x0; a11 += s * x1;
        s = w2[k]; a20 += s * x0; a21 += s * x1;
        s = w3[k]; a30 += s * x0; a31 += s * x1;
        s = w4[k]; a40 += s * x0; a41 += s * x1;
        s = w5[k]; a50 += s * x0; a51 += s * x1;
        if (pf != NULL && (k & 15) == 0)
#pragma GCC unroll 6
            for (int r = 0; r < 6; r++) __builtin_prefetch(pf + r * ldw + k, 0, 3);
    }
    adt_v8 z = {0};
    lo[0] = a00; lo[1] = a10; lo[2] = a20; lo[3] = a30; lo[4] = a40; lo[5] = a50; lo[6] = z; lo[7] = z;
    hi[0] = a01; hi[1] = a11; hi[2] = a21; hi[3] = a31; hi[4] = a41; hi[5] = a51; hi[6] = z; hi[7] = z;
    sg_transpose8(lo);
    sg_transpose8(hi);
    if (whole && nr == 6) {
        adt_v8i keep = {0, 0, 0, 0, 0, 0, -1, -1};
        adt_v8 bv = bias != NULL ? adt_load(bias) : z;
        for (ptrdiff_t m = 0; m < mr; m++) {
            float* row = c + m * ldc;
            adt_v8 old = adt_load(row), t = alpha * (m < 8 ? lo[m] : hi[m - 8]) + bv;
            if (beta != 0.0f) t += beta * old;
            adt_store(row, adt_select(keep, old, t));
        }
        return;
    }
    float t[16][8] __attribute__((aligned(32)));
    for (int m = 0; m < 8; m++) { adt_store(t[m], lo[m]); adt_store(t[8 + m], hi[m]); }
    for (ptrdiff_t m = 0; m < mr; m++)
        for (ptrdiff_t n = 0; n < nr; n++) {
            float v = alpha * t[m][n] + (bias != NULL ? bias[n] : 0.0f);
            c[m * ldc + n] = beta == 0.0f ? v : v + beta * c[m * ldc + n];
        }
}

#endif /* ADT_W == 8 */

#if ADT_W == 16
/* The same in sixteen lanes: a tile of 8 rows of W by 32 rows of x (two vectors), 16
   accumulators, each depth broadcasting one float of each W row against x's two
   vectors (10 loads for 16 FMAs; the packed GEMM's 8 x 32 tile, with B packed from W
   transposed, paid that packing and its stall on every weight at few rows).  x is
   packed 32 rows a depth; the depth block holds x's panels within 256 KiB of L2 and
   at most 512 depths, so that a tile's 8 W rows (16 KiB) stay in L1 (32 KiB on Zen 4)
   while the next panels of x take them again.  The accumulators hold C transposed;
   one 16 x 16 register transpose per half (the W rows' vectors and 8 zeros) makes
   rows of 8.  A last panel of at most 16 rows runs one vector of x (8 accumulators)
   instead of padding it to 32. */

/* The 32 x 8 tile: C[0:mr, 0:nr] = alpha acc + beta C (+ bias[0:nr]), from the W rows
   w[r] (rows past nr repeat the last) and xp's 32 floats a depth; pf (NULL: none) the
   next tile's first W row, whose 8 rows ldw apart are fetched as this one runs. */
ADT_LANES_ATTR
static __attribute__((noinline))
void ADT_LANES_FN(sg_bcast_micro)(ptrdiff_t kc, const float* const* w, const float* restrict xp,
                                  float* c, ptrdiff_t ldc, ptrdiff_t mr, ptrdiff_t nr, float alpha,
                                  float beta, const float* bias, const float* pf, ptrdiff_t ldw,
                                  int whole) {
    (void)whole;
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const float *w4 = w[4], *w5 = w[5], *w6 = w[6], *w7 = w[7];
    adt_v16 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
    adt_v16 a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0}, a60 = {0}, a61 = {0}, a70 = {0}, a71 = {0};
    if (mr > 16) {
        for (ptrdiff_t k = 0; k < kc; k++, xp += 32) {
            adt_v16 x0 = *(const adt_v16*)xp, x1 = *(const adt_v16*)(xp + 16);
            float s;
            s = w0[k]; a00 += s * x0; a01 += s * x1;
            s = w1[k]; a10 += s * x0; a11 += s * x1;
            s = w2[k]; a20 += s * x0; a21 += s * x1;
            s = w3[k]; a30 += s * x0; a31 += s * x1;
            s = w4[k]; a40 += s * x0; a41 += s * x1;
            s = w5[k]; a50 += s * x0; a51 += s * x1;
            s = w6[k]; a60 += s * x0; a61 += s * x1;
            s = w7[k]; a70 += s * x0; a71 += s * x1;
            if (pf != NULL && (k & 15) == 0)
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) __builtin_prefetch(pf + r * ldw + k, 0, 3);
        }
    } else {
        /* a last panel of at most 16 rows, packed 16 floats a depth: its half alone */
        for (ptrdiff_t k = 0; k < kc; k++, xp += 16) {
            adt_v16 x0 = *(const adt_v16*)xp;
            a00 += w0[k] * x0; a10 += w1[k] * x0; a20 += w2[k] * x0; a30 += w3[k] * x0;
            a40 += w4[k] * x0; a50 += w5[k] * x0; a60 += w6[k] * x0; a70 += w7[k] * x0;
            if (pf != NULL && (k & 15) == 0)
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) __builtin_prefetch(pf + r * ldw + k, 0, 3);
        }
    }
    adt_v16 v[16], z = {0};
    adt_v8 bv = {0};
    if (bias != NULL)
        for (ptrdiff_t n = 0; n < nr; n++) bv[n] = bias[n];
    for (int h = 0; h < 2 && 16 * h < mr; h++) {
        v[0] = h ? a01 : a00; v[1] = h ? a11 : a10; v[2] = h ? a21 : a20; v[3] = h ? a31 : a30;
        v[4] = h ? a41 : a40; v[5] = h ? a51 : a50; v[6] = h ? a61 : a60; v[7] = h ? a71 : a70;
#pragma GCC unroll 8
        for (int r = 8; r < 16; r++) v[r] = z;
        sg_transpose16(v);
        ptrdiff_t rows = mr - 16 * h < 16 ? mr - 16 * h : 16;
        for (ptrdiff_t i = 0; i < rows; i++) {
            float* row = c + (16 * h + i) * ldc;
            adt_v8 t = alpha * __builtin_shufflevector(v[i], v[i], 0, 1, 2, 3, 4, 5, 6, 7) + bv;
            if (nr == 8 && beta == 0.0f) {
                adt_store(row, t);
            } else if (nr == 8) {
                adt_store(row, t + beta * adt_load(row));
            } else {
                for (ptrdiff_t n = 0; n < nr; n++)
                    row[n] = beta == 0.0f ? t[n] : t[n] + beta * row[n];
            }
        }
    }
}

#endif /* ADT_W == 16 */

/* The W-broadcast tile of this width: SG_BC_ROWS rows of x (two vectors) by SG_BC_WROWS
   rows of W, depth blocks of at most SG_BC_MAX_KC that keep x's panels within
   SG_BC_X_FLOATS floats (256 KiB of L2). */
#define SG_BC_ROWS (2 * ADT_W)
#define SG_BC_WROWS (ADT_W == 16 ? 8 : 6)
#define SG_BC_MAX_KC (ADT_W == 16 ? 512 : 1024)

/* C = alpha x W^T + beta C (+ bias[j] in every column j where bias is not NULL) for x
   (M x K, rows lda apart) and W (N x K, rows ldw apart), M <= SG_BC_MAX_M.  Returns -1,
   having written nothing, when the packing buffer cannot be allocated. */
ADT_LANES_ATTR
static int ADT_LANES_FN(sg_bcast)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, float alpha,
                                  const float* x, ptrdiff_t lda, const float* W, ptrdiff_t ldw,
                                  float beta, float* C, ptrdiff_t ldc, const float* bias) {
    ptrdiff_t panels = (M + SG_BC_ROWS - 1) / SG_BC_ROWS;
    ptrdiff_t kcb = SG_BC_X_FLOATS / (SG_BC_ROWS * panels) / ADT_W * ADT_W;
    if (kcb > SG_BC_MAX_KC) kcb = SG_BC_MAX_KC;
    if (kcb < ADT_W) kcb = ADT_W;               /* more rows than it is meant for */
    if ((size_t)(SG_BC_ROWS * panels * kcb) > SG_B_FLOATS) return -1;
    float* xb = sg_thread_buffer();
    if (xb == NULL) return -1;
    for (ptrdiff_t k0 = 0; k0 < K; k0 += kcb) {
        ptrdiff_t kc = K - k0 < kcb ? K - k0 : kcb;
        /* x[:, k0:k0+kc] as panels of SG_BC_ROWS rows, as many floats a depth (in
           sixteen lanes a last panel of at most 16 rows: 16); rows past M zero */
        for (ptrdiff_t p = 0; p < panels; p++) {
            float* d = xb + p * SG_BC_ROWS * kc;
            ptrdiff_t width = ADT_W == 16 && M - p * SG_BC_ROWS <= 16 ? 16 : SG_BC_ROWS;
            /* ADT_W rows by ADT_W depths at a time, transposed in registers (a float
               a store, ADT_W floats apart, was 7% of a 64-row forward's time) */
            ptrdiff_t kv = kc / ADT_W * ADT_W;
            for (ptrdiff_t i0 = 0; i0 < width; i0 += ADT_W)
                for (ptrdiff_t k = 0; k < kv; k += ADT_W) {
                    ADT_VT v[ADT_W];
#pragma GCC unroll 16
                    for (int r = 0; r < ADT_W; r++) {
                        ptrdiff_t m = p * SG_BC_ROWS + i0 + r;
                        v[r] = m < M ? ADT_V(load)(x + m * lda + k0 + k) : (ADT_VT){0};
                    }
                    ADT_CAT(sg_transpose, ADT_W)(v);
#pragma GCC unroll 16
                    for (int t = 0; t < ADT_W; t++) ADT_V(store)(d + (k + t) * width + i0, v[t]);
                }
            for (ptrdiff_t i = 0; i < width; i++) {
                ptrdiff_t m = p * SG_BC_ROWS + i;
                const float* a = x + m * lda + k0;
                for (ptrdiff_t k = kv; k < kc; k++) d[k * width + i] = m < M ? a[k] : 0.0f;
            }
        }
        float bt = k0 == 0 ? beta : 1.0f;
        for (ptrdiff_t n0 = 0; n0 < N; n0 += SG_BC_WROWS) {
            ptrdiff_t nr = N - n0 < SG_BC_WROWS ? N - n0 : SG_BC_WROWS;
            const float* w[SG_BC_WROWS];
            for (int r = 0; r < SG_BC_WROWS; r++) w[r] = W + (n0 + (r < nr ? r : nr - 1)) * ldw + k0;
            const float* pf = n0 + 2 * SG_BC_WROWS <= N ? W + (n0 + SG_BC_WROWS) * ldw + k0 : NULL;
            const float* bn = k0 == 0 && bias != NULL ? bias + n0 : NULL;
            for (ptrdiff_t p = 0; p < panels; p++) {
                ptrdiff_t mr = M - p * SG_BC_ROWS < SG_BC_ROWS ? M - p * SG_BC_ROWS : SG_BC_ROWS;
                ADT_LANES_FN(sg_bcast_micro)(kc, w, xb + p * SG_BC_ROWS * kc, C + p * SG_BC_ROWS * ldc + n0, ldc,
                                             mr, nr, alpha, bt, bn, p == 0 ? pf : NULL, ldw, n0 + 8 <= N);
            }
        }
    }
    return 0;
}
#undef SG_BC_ROWS
#undef SG_BC_WROWS
#undef SG_BC_MAX_KC


#undef SG_MR
#undef SG_NR
#endif /* ADT_W == 8 || ADT_HAVE_V4 */
