/* bfloat16 for the bf16 kernels (kernels/bf16.pyx): the conversions, the CPU check and
 * the bf16-operand products that accumulate in float32.
 *
 * A bf16 is the top half of a float32 (sign, 8 exponent bits, 7 mantissa bits), held
 * in a uint16_t.  Widening is exact (the bits shifted up); narrowing rounds to nearest,
 * ties to even, in integer arithmetic (the same bits as PyTorch's and as NumPy's
 * reference in the tests), NaN kept NaN.  The conversions are written as plain loops
 * that GCC vectorizes in the target clones: they are bound by memory, and
 * VCVTNEPS2BF16 would flush subnormals to zero.
 *
 * The products (C (+)= op(A) op(B) (+ bias), A and B bf16, C float32) lay their operands
 * out as pairs of depths, two bf16 in a uint32_t (the even depth in the low half), the
 * layout VDPBF16PS and TDPBF16PS read, once per product for all the threads (the
 * engine below, run as phases by bf16.pyx: the pack tasks, then the tile tasks).  The
 * tile loop is built four times:
 *   - VDPBF16PS (bf16_gemm.h): an 8 x 32 tile of C in sixteen zmm accumulators, one
 *     broadcast of A's pair and two VDPBF16PS per row and depth pair; for AVX512_BF16
 *     (bf_task_nat, where bf16_cpu_native() says the CPU and the OS have it) and
 *     portably (bf_task_twin, VDPBF16PS done by two float32 multiply-adds in the
 *     instruction's order: the products of two bf16 are exact in float32, so each step
 *     rounds once either way and the twin gives the instruction's bits wherever no
 *     subnormal occurs; the instruction reads subnormal inputs as zero and flushes
 *     subnormal results);
 *   - AMX (bf16_amx.h): a 32 x 32 tile of C in four tiles; with the tile instructions
 *     (bf_amx_task_amx, where the CPU has AMX-BF16 and Linux grants the tiles) and
 *     with the tiles held in memory (bf_amx_task_amxtwin, for the tests).
 * The order of the sums depends only on the depth: each element is summed over a block
 * of BF_KC depths (pairs in order) and the block's sum added into C.  How C is cut into
 * tasks and chunks, and between threads, changes nothing.
 */
#ifndef ADTAPE_KERNELS_BF16_H
#define ADTAPE_KERNELS_BF16_H

#include <stdint.h>
#include <string.h>
#include "simd.h"
#include "bf16_bits.h"

/* ---- conversions ---- */

/* out[i] = in[i] rounded to bf16 */
ADT_MULTIVERSION_WIDE
static void bf16_round_span(uint16_t* restrict out, const float* restrict in, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) out[i] = bf16_from_bits(bf16_f32_bits(in[i]));
}

/* out[i] = in[i] widened to float32 (exact) */
ADT_MULTIVERSION
static void bf16_widen_span(float* restrict out, const uint16_t* restrict in, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) out[i] = bf16_bits_f32((uint32_t)in[i] << 16);
}

/* out[i] = in[i] rounded to bf16 and widened back: the float32 that the bf16 stands
   for (the emulated products' operand when the caller gave float32) */
ADT_MULTIVERSION
static void bf16_round_f32_span(float* restrict out, const float* restrict in, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++)
        out[i] = bf16_bits_f32((uint32_t)bf16_from_bits(bf16_f32_bits(in[i])) << 16);
}

/* dbias[c0:c1] (+)= the column sums of dout (N x OC), each in float64 in order of rows,
   BF_DBIAS_COLS columns a pass so that the sums stay in L1.  A thread owns a range of
   columns, so a sum does not depend on the thread count. */
#define BF_DBIAS_COLS 256
ADT_MULTIVERSION
static void bf16_dbias_cols(float* dbias, const float* dout, ptrdiff_t N, ptrdiff_t OC,
                            ptrdiff_t c0, ptrdiff_t c1, int overwrite) {
    double acc[BF_DBIAS_COLS] __attribute__((aligned(64)));
    for (ptrdiff_t s0 = c0; s0 < c1; s0 += BF_DBIAS_COLS) {
        ptrdiff_t w = c1 - s0 < BF_DBIAS_COLS ? c1 - s0 : BF_DBIAS_COLS;
        for (ptrdiff_t j = 0; j < w; j++) acc[j] = 0.0;
        for (ptrdiff_t n = 0; n < N; n++) {
            const float* row = dout + n * OC + s0;
            for (ptrdiff_t j = 0; j < w; j++) acc[j] += (double)row[j];
        }
        for (ptrdiff_t j = 0; j < w; j++)
            dbias[s0 + j] = overwrite ? (float)acc[j] : dbias[s0 + j] + (float)acc[j];
    }
}

/* ---- the CPU ---- */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define BF_HAVE_NATIVE 1
#include <cpuid.h>
#include <immintrin.h>
/* Whether the CPU has AVX512F and AVX512_BF16 and the OS saves the AVX-512 state:
   CPUID leaf 1 ECX bit 27 (OSXSAVE) and XCR0's SSE, AVX, opmask and ZMM bits (0xE6,
   read by XGETBV), leaf 7 subleaf 0 EBX bit 16 (AVX512F), subleaf 1 EAX bit 5
   (AVX512_BF16).  GCC 12's __builtin_cpu_supports knows no "avx512bf16". */
static int bf16_cpu_check(void) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid(1, a, b, c, d);
    if (!((c >> 27) & 1u)) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if ((lo & 0xE6u) != 0xE6u) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((b >> 16) & 1u) || a < 1) return 0;     /* a: the last subleaf of leaf 7 */
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 5) & 1u;
}
static int bf16_cpu_native(void) {
    static int has = -1;
    if (has < 0) has = bf16_cpu_check();   /* benign race */
    return has;
}
#else
#define BF_HAVE_NATIVE 0
static int bf16_cpu_native(void) { return 0; }
#endif

/* ---- the packed products: tiles and blocks ---- */

#define BF_MR 8          /* rows of a tile */
#define BF_NR 32         /* columns of a tile: two vectors of sixteen */
#define BF_KC 512        /* depths of a block (256 pairs): a B panel is 32 KiB */
_Static_assert(BF_KC % 2 == 0, "bf16.h: a block holds whole pairs");

typedef uint32_t bf_pairs __attribute__((vector_size(64)));
/* A uint32 read from a bf16 array (two bf16: a depth pair, the even depth low) */
typedef uint32_t bf_u32 __attribute__((aligned(2), may_alias));

/* ---- the engine: operands laid out once per product ---- */

/* The packed paths lay each product's operands out once, into buffers that all the
 * threads read.  They used to pack both per 256 x 256 block of C in each thread, as
 * Goto/BLIS GEMMs do per thread: on the Xeon EMR at 16 threads the AMX path's packing
 * cost more than its products (a TDPBF16PS does 16 times a VDPBF16PS's work on the
 * same bytes: 20-34% of the AMX peak at 1024 rows), and at a (4, 256) step's shapes a
 * block packs 390 K bf16 in about 127 us on one Zen 3 core, against the ~200 us of
 * VDPBF16PS work it feeds on a Zen 5 core.
 *
 * Layouts.  B: panels of 32 columns, each kpad rows of 32 pairs (the depth pairs, then
 * zeros up to kpad, a multiple of 16); a B tile (AMX) is 16 rows of a panel's 16
 * columns, a VDPBF16PS step a row's two vectors.  A: rows of kpad pairs, read where A
 * lies when its rows run along the depth and the depth is a multiple of 32 (x in the
 * forward, dout in dout @ W: no copy; the last M % 32 rows are copied into a
 * zero-padded tile), else packed (dout^T in dout^T @ x).  Products whose packed
 * operands would pass bf_sp_chunk_pairs are done in chunks of rows and of columns, each
 * with its own pack phase.
 *
 * Sums: every element of C over blocks of BF_KC depths in order, each block's sum added
 * into C (its first onto the bias or zero, or C's old value where it accumulates):
 * however C is cut into tasks and chunks, and on any thread count, the same bits. */
#define BF_AMX_MR 32          /* rows of a tile of C (two of A's tiles) */
#define BF_AMX_KP 16          /* depth pairs of a tile */
#define BF_KB (BF_KC / 2)     /* depth pairs of a block: a B panel's block is 32 KiB */
#define BF_SP_PANELS 2       /* B panels a pack task lays out */
/* a chunk's packed operands: at most 8 MiB each, so that a product's buffer stays below
   glibc's largest mmap threshold (32 MiB) and is reused, not faulted in afresh, call
   after call (bf16.pyx's _set_chunk_pairs sets it smaller for the tests) */
static ptrdiff_t bf_sp_chunk_pairs = (ptrdiff_t)1 << 21;
/* for the benchmarks (bf16.pyx's _set_task_tiles): a task's rows and columns of C
   (multiples of 32; 0: chosen by the shape and the threads) */
static ptrdiff_t bf_sp_tiles[2] = {0, 0};
/* for the tests (bf16.pyx's _set_plain_transposes): packing's transposes and transposed
   stores in plain loops on any CPU */
static int bf_sp_plain_transposes = 0;
/* Whether the transposes run in vector registers: every CPU with a packed path but the
   twins' elsewhere (AVX-512), unless the tests ask for the plain loops. */
static inline int bf_sp_vector_transposes(void) {
    return bf16_cpu_native() && !bf_sp_plain_transposes;
}
_Static_assert(BF_NR == 32 && BF_KB % BF_AMX_KP == 0,
               "bf16.h: the blocks must hold whole AMX tiles");

/* kp depth pairs padded to whole AMX tiles */
static inline ptrdiff_t bf_kpad(ptrdiff_t kp) {
    return (kp + BF_AMX_KP - 1) / BF_AMX_KP * BF_AMX_KP;
}

static inline ptrdiff_t bf_ceil(ptrdiff_t a, ptrdiff_t b) { return (a + b - 1) / b; }

/* Row-major C (M x N) (+= where accumulate) op(A) op(B) (+ bias per column), op(A)[i, k]
   = A[i a_rs + k a_cs], op(B)[k, j] = B[k b_rs + j b_cs], M, N, K > 0; and its plan. */
typedef struct {
    ptrdiff_t M, N, K;
    const uint16_t* A;
    ptrdiff_t a_rs, a_cs;
    const uint16_t* B;
    ptrdiff_t b_rs, b_cs;
    int accumulate;
    float* C;
    ptrdiff_t ldc;
    const float* bias;
    ptrdiff_t kpad;            /* depth pairs of the packed operands */
    int a_direct;              /* A's tiles read from A (its rows 0 to m_full) */
    ptrdiff_t m_full;          /* a_direct: the rows in whole tiles */
    ptrdiff_t mch, nch;        /* rows and columns of a chunk (multiples of 32) */
    ptrdiff_t mchunks, nchunks;
    ptrdiff_t tile_m, tile_n;  /* a task's block of C */
    ptrdiff_t b_slices;        /* depth slices of a B pack task (a narrow chunk's B is
                                  laid out by several threads) */
    int c_trans;               /* C stored transposed: element (i, j) at C[j ldc + i],
                                  the bias per row (bf_sp_trans_c) */
    int c_stream;              /* C's whole tiles stored past the caches (bf_sp_stream_c) */
    int b_direct;              /* B's pairs read where B lies (bf_sp_direct_b): no B panels */
    ptrdiff_t b_sub;           /* b_direct with B's rows a multiple of 4 KiB apart: each
                                  block of depths in sub-blocks of b_sub pairs (else 0) */
    int n_threads;             /* the threads the tasks were planned for */
    size_t a_pairs;            /* the pairs A's packed rows (or tail) need */
    uint32_t* pa;              /* A's chunk packed (mch rows of kpad pairs), or its tail */
    uint32_t* pb;              /* B's chunk packed (nch / 32 panels) */
} bf_sprod;

typedef struct { ptrdiff_t i0, i1, j0, j1; } bf_sp_span;

/* The share of n_threads' time that t equal tasks keep busy. */
static inline double bf_sp_balance(ptrdiff_t t, ptrdiff_t n_threads) {
    return (double)t / (double)(bf_ceil(t, n_threads) * n_threads);
}

/* p's tasks for its n_threads: the largest square tile that gives each thread about
   four, or that tile halved in one side or both where that shares the tasks out more
   evenly (or the benchmarks' bf_sp_tiles); B's pack tasks cut by depth (slices of at
   least 256 pairs) until there are about four a thread (a chunk of 64 columns of a
   deep B: one task of 6 MiB otherwise).  Squares alone left 9 tasks to 2 threads at
   GPT-2's 768 x 768 weight gradient and at SmolLM2's 64-row products (one thread idle
   a ninth of the time).  Zen 4, 2 threads, tiles alternated call by call, medians of
   12-40, GFLOP/s, square -> halved: 768 x 768 dW at 1024 tokens 373 -> 402, at 4096 320
   -> 329-338; 2304 x 768 dW (27 tasks) at 1024 tokens 391 -> 402; 64 rows, SmolLM2's
   576 -> 576 forward 342 -> 361, 3072 -> 576 dX 328 -> 352. */
static void bf_sp_plan_tasks(bf_sprod* p) {
    ptrdiff_t n_threads = p->n_threads;
    ptrdiff_t rows = p->M < p->mch ? p->M : p->mch, cols = p->N < p->nch ? p->N : p->nch;
    ptrdiff_t tile = 256;
    while (tile > BF_AMX_MR && bf_ceil(rows, tile) * bf_ceil(cols, tile) < 4 * n_threads)
        tile /= 2;
    ptrdiff_t tm = tile, tn = tile;
    double best = bf_sp_balance(bf_ceil(rows, tm) * bf_ceil(cols, tn), n_threads);
    for (int halve = 1; halve < 4; halve++) {     /* one side, the other, both */
        ptrdiff_t m = halve & 2 ? tile / 2 : tile, n = halve & 1 ? tile / 2 : tile;
        if (m < BF_AMX_MR || n < BF_AMX_MR) continue;
        double b = bf_sp_balance(bf_ceil(rows, m) * bf_ceil(cols, n), n_threads);
        if (b > best + 0.02) best = b, tm = m, tn = n;
    }
    p->tile_m = bf_sp_tiles[0] > 0 ? bf_sp_tiles[0] : tm;
    p->tile_n = bf_sp_tiles[1] > 0 ? bf_sp_tiles[1] : tn;
    ptrdiff_t b_tasks = bf_ceil(p->nch, BF_NR * BF_SP_PANELS), most_slices = p->kpad / 256;
    p->b_slices = bf_ceil(4 * n_threads, b_tasks);
    if (p->b_slices > most_slices) p->b_slices = most_slices;
    if (p->b_slices < 1) p->b_slices = 1;
}

/* Plans p for n_threads; returns the pairs its packed operands need (bf_sp_attach). */
static size_t bf_sp_init(bf_sprod* p, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                          const uint16_t* A, ptrdiff_t a_rs, ptrdiff_t a_cs, const uint16_t* B,
                          ptrdiff_t b_rs, ptrdiff_t b_cs, int accumulate, float* C,
                          ptrdiff_t ldc, const float* bias, int n_threads) {
    memset(p, 0, sizeof *p);
    p->M = M, p->N = N, p->K = K, p->A = A, p->a_rs = a_rs, p->a_cs = a_cs;
    p->B = B, p->b_rs = b_rs, p->b_cs = b_cs, p->accumulate = accumulate;
    p->C = C, p->ldc = ldc, p->bias = bias;
    p->kpad = bf_kpad((K + 1) / 2);
    ptrdiff_t most = bf_sp_chunk_pairs / p->kpad / BF_NR * BF_NR;
    if (most < BF_NR) most = BF_NR;
    p->nch = bf_ceil(N, BF_NR) * BF_NR < most ? bf_ceil(N, BF_NR) * BF_NR : most;
    p->nchunks = bf_ceil(N, p->nch);
    p->a_direct = a_cs == 1 && a_rs % 2 == 0 && K % (2 * BF_AMX_KP) == 0;
    size_t a_pairs;
    if (p->a_direct) {
        p->m_full = M / BF_AMX_MR * BF_AMX_MR;
        p->mch = M;
        p->mchunks = 1;
        a_pairs = M % BF_AMX_MR ? (size_t)BF_AMX_MR * (size_t)p->kpad : 0;
    } else {
        p->mch = bf_ceil(M, BF_AMX_MR) * BF_AMX_MR < most ? bf_ceil(M, BF_AMX_MR) * BF_AMX_MR : most;
        p->mchunks = bf_ceil(M, p->mch);
        a_pairs = (size_t)p->mch * (size_t)p->kpad;
    }
    p->a_pairs = a_pairs;
    p->n_threads = n_threads;
    bf_sp_plan_tasks(p);
    return a_pairs + (size_t)p->nch * (size_t)p->kpad;
}

/* Whether B's rows a multiple of 4 KiB apart are read in place a sub-block of depths
   at a time (1), up to BF_SUB_MAX_M rows of C, or laid out (0: the benchmarks'); and
   the pairs of a sub-block for rows `bytes` apart (0: none).  Such rows map to 16 /
   gcd(bytes / 4 KiB, 16) sets of an L2 of 16 ways that repeats every 64 KiB (Zen 4,
   Zen 5); a sub-block takes 4 lines a pair of them (its two rows, and the next
   sub-block's fetched ahead): 64 pairs where the rows reach 16 sets, 32 where 8.
   Fewer sets (rows 16 KiB apart: 8192 columns) lost to W laid out (Zen 4, 64 rows,
   sub-blocks of 16 pairs: 284 against 297 GFLOP/s). */
static int bf_sp_sub = 1;
#define BF_SUB_MAX_M 128
static inline ptrdiff_t bf_sub_pairs(ptrdiff_t bytes) {
    ptrdiff_t pages = bytes / 4096 % 16, sets = 16;
    while (pages % 2 == 0 && sets > 1) pages /= 2, sets /= 2;
    return sets >= 8 ? 16 * sets / 4 : 0;
}

/* B's pairs read where B lies, with no pack phase for B: the VDPBF16PS builds'
   tiles interleave the two rows of each depth pair in registers.  Where op(B)'s rows
   run along the columns (b_cs 1: the weight in dout @ W), the depth is whole pairs and
   the columns whole panels; for few rows of C, where laying B out would be read once
   or twice a pair (dout @ W at 64 rows: 13% of the tiles' time on Zen 4).  The same
   sums in the same order: the same bits.  Returns the pairs p's packed operands need
   now. */
static size_t bf_sp_direct_b(bf_sprod* p) {
    /* Rows a multiple of 4 KiB apart map every line of a panel's block (512 rows of 64
       bytes) to one L1 set and to few L2 sets, which the row tiles then read from L3:
       Zen 4, 64 rows, in place / laid out: 0.93-0.97x for Llama's 2048, 8192 and 14336
       columns (0.61-0.77x at 256 rows), against 1.34-1.43x for Qwen2.5's 896, 1536,
       4864 and 8960 and for 2080.  Those are read by sub-blocks of depths (b_sub) up
       to BF_SUB_MAX_M rows, where their rows reach 8 L2 sets or more. */
    ptrdiff_t bytes = p->b_rs * (ptrdiff_t)sizeof(uint16_t);
    int aliased = bytes % 4096 == 0;
    ptrdiff_t sub = aliased && bf_sp_sub && p->M <= BF_SUB_MAX_M ? bf_sub_pairs(bytes) : 0;
    if (p->b_cs == 1 && p->K % 2 == 0 && p->N % BF_NR == 0 && (!aliased || sub > 0)) {
        p->b_direct = 1;
        p->b_sub = sub;
        p->nch = p->N;
        p->nchunks = 1;
        bf_sp_plan_tasks(p);
    }
    return p->a_pairs + (p->b_direct ? 0 : (size_t)p->nch * (size_t)p->kpad);
}

/* C of p is stored transposed (element (i, j) at C[j ldc + i]) and its bias is per row
   i: out^T = W x^T, where laying out x (few rows) costs less than laying out W.  A's
   rows (W's, from memory, 8 short streams a tile) are then fetched ahead by the
   VDPBF16PS tiles: Zen 4, 2 threads, GPT-2's five forwards at 64 rows, 12 weights from
   memory, six alternations: 14.7-16.5 ms against 16.3-17.2; fetching A ahead in every
   product cost the 64-row backward (41 -> 48 ms, dout^T's packed rows). */
static void bf_sp_trans_c(bf_sprod* p) { p->c_trans = 1; }

/* C of p written afresh (not accumulated) in one block of depths, 64-byte aligned rows:
   the VDPBF16PS build's whole tiles store it with non-temporal stores, which skip the
   read of each line before it is written.  For weight gradients at few rows (the
   depth): far larger than the caches at a step's sizes and next read by the optimizer,
   as the float32 skinny weight gradient streams them (kernels/skinny.h).  The native
   VDPBF16PS path only (its micro-kernel's add == 2; the AMX tiles read add as a flag).
   Returns whether it took. */
static int bf_sp_stream_c(bf_sprod* p) {
    p->c_stream = !p->accumulate && !p->c_trans && (p->K + 1) / 2 <= BF_KB
                  && ((uintptr_t)p->C & 63) == 0 && p->ldc % 16 == 0;
    return p->c_stream;
}

/* Gives p its packing buffer (bf_sp_init's pairs, 64-byte aligned). */
static void bf_sp_attach(bf_sprod* p, uint32_t* buf) {
    p->pb = buf;
    p->pa = p->b_direct ? buf : buf + (size_t)p->nch * (size_t)p->kpad;
}

static ptrdiff_t bf_sp_chunks(const bf_sprod* p) { return p->mchunks * p->nchunks; }

static bf_sp_span bf_sp_chunk_span(const bf_sprod* p, ptrdiff_t chunk) {
    bf_sp_span s;
    s.i0 = chunk / p->nchunks * p->mch;
    s.j0 = chunk % p->nchunks * p->nch;
    s.i1 = s.i0 + p->mch < p->M ? s.i0 + p->mch : p->M;
    s.j1 = s.j0 + p->nch < p->N ? s.j0 + p->nch : p->N;
    return s;
}

/* A's rows from row i (of the chunk from row i0; i a multiple of 8) as a tile reads
   them: the first row's address, and the rows' stride in bytes. */
static inline const char* bf_sp_a_rows(const bf_sprod* p, ptrdiff_t i0, ptrdiff_t i,
                                       ptrdiff_t* stride) {
    if (p->a_direct && i < p->m_full) {
        *stride = p->a_rs * (ptrdiff_t)sizeof(uint16_t);
        return (const char*)(p->A + i * p->a_rs);
    }
    *stride = p->kpad * (ptrdiff_t)sizeof(uint32_t);
    return (const char*)(p->pa + (i - (p->a_direct ? p->m_full : i0)) * p->kpad);
}

#if BF_HAVE_NATIVE
__attribute__((target("avx512f")))
static void bf_tr16_avx512(const void* src, ptrdiff_t ss, uint32_t* dst, ptrdiff_t ds);

/* bf_sp_store_trans of two whole VDPBF16PS tiles (16 x 32, rows of BF_NR at t): two
   16 x 16 transposes (bf_tr16_avx512), then each column's sixteen sums a whole line
   of C (where C's rows are 64-byte aligned).  Eight rows a tile left every line of C
   to be written in two halves, by two tiles: with C's rows a multiple of 4 KiB apart
   (a vocabulary of 49152: all 32 lines of a tile in one L1 set and one L2 set) each
   half cost the line a trip to L3. */
__attribute__((target("avx512f")))
static void bf_store_trans16(const float* t, float* c, ptrdiff_t ldc, int add,
                             const float* bias) {
    float col[16 * 16] __attribute__((aligned(64)));
    __m512 b = bias != NULL ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int j0 = 0; j0 < BF_NR; j0 += 16) {
        bf_tr16_avx512(t + j0, BF_NR, (uint32_t*)col, 16);
        for (int k = 0; k < 16; k++) {
            __m512 v = _mm512_load_ps(col + 16 * k);
            float* out = c + (j0 + k) * ldc;
            if (bias != NULL) v = _mm512_add_ps(v, b);
            if (add) v = _mm512_add_ps(_mm512_loadu_ps(out), v);
            _mm512_storeu_ps(out, v);
        }
    }
}

/* bf_sp_store_trans of a whole VDPBF16PS tile (8 x 32): four 8 x 8 transposes in ymm
   registers (unpacks, shuffles, 128-bit lane permutes) */
__attribute__((target("avx2")))
static void bf_store_trans8(const float* t, float* c, ptrdiff_t ldc, int add,
                            const float* bias) {
    __m256 b = bias != NULL ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    for (int j0 = 0; j0 < BF_NR; j0 += 8) {
        __m256 r[8], u[8], v[8];
        for (int k = 0; k < 8; k++) r[k] = _mm256_load_ps(t + k * BF_NR + j0);
        for (int k = 0; k < 8; k += 2) {
            u[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
            u[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
        }
        for (int k = 0; k < 8; k += 4) {
            v[k] = _mm256_shuffle_ps(u[k], u[k + 2], 0x44);
            v[k + 1] = _mm256_shuffle_ps(u[k], u[k + 2], 0xEE);
            v[k + 2] = _mm256_shuffle_ps(u[k + 1], u[k + 3], 0x44);
            v[k + 3] = _mm256_shuffle_ps(u[k + 1], u[k + 3], 0xEE);
        }
        for (int k = 0; k < 8; k++) {
            /* column j0 + k: v[k % 4]'s and v[4 + k % 4]'s lane k / 4 */
            __m256 col = _mm256_permute2f128_ps(v[k % 4], v[4 + k % 4], k < 4 ? 0x20 : 0x31);
            float* out = c + (j0 + k) * ldc;
            if (bias != NULL) col = _mm256_add_ps(col, b);
            if (add) col = _mm256_add_ps(_mm256_loadu_ps(out), col);
            _mm256_storeu_ps(out, col);
        }
    }
}
#endif

/* C[j ldc + r] = t[r][j] (+ bias[r] where not NULL) (+ C[j ldc + r] where add) for r <
   mr, j < nr: a tile's sums (rows of BF_NR in t) stored transposed. */
static void bf_sp_store_trans(const float* t, float* c, ptrdiff_t ldc, int add,
                              const float* bias, ptrdiff_t mr, ptrdiff_t nr) {
#if BF_HAVE_NATIVE
    if (mr == BF_MR && nr == BF_NR && bf_sp_vector_transposes()) {
        bf_store_trans8(t, c, ldc, add, bias);
        return;
    }
#endif
    for (ptrdiff_t j = 0; j < nr; j++)
        for (ptrdiff_t r = 0; r < mr; r++) {
            float v = bias != NULL ? t[r * BF_NR + j] + bias[r] : t[r * BF_NR + j];
            c[j * ldc + r] = add ? c[j * ldc + r] + v : v;
        }
}

/* A build's tile of C: mr x nr (at most rows x 32) at c over kp depth pairs, A's rows
   at a (stride a_stride bytes; fetched ahead where `ahead`: bf_sp_trans_c's weight
   rows), B's panel at b (b_rs 0), or B read in place (b_rs > 0,
   bf_sp_direct_b: b the bf16 of op(B)'s first depth at the tile's first column, its
   depths b_rs elements apart); C = the sum + bias (where not NULL) (+ C where add). */
typedef void (*bf_tile_fn)(ptrdiff_t kp, const char* a, ptrdiff_t a_stride, int ahead,
                           const void* b, ptrdiff_t b_rs, float* c, ptrdiff_t ldc, int add,
                           const float* bias, ptrdiff_t mr, ptrdiff_t nr);
/* A build's whole tile (rows x 32) over a sub-block of kp depth pairs of B read in
   place (b_rs > 0): its sums from 0 (first) or from the ones spilled at part, then
   spilled there (not last) or finished into C as bf_tile_fn's (last). */
typedef void (*bf_part_fn)(ptrdiff_t kp, const char* a, ptrdiff_t a_stride, const void* b,
                           ptrdiff_t b_rs, ptrdiff_t sub, float* part, int first, int last,
                           float* c, ptrdiff_t ldc, int add, const float* bias);

/* Task t of chunk `chunk` of p: its block of C over all depths, in tiles of `rows` x
   32, each block of BF_KC depths (`pairs` pairs in all: the builds that sum in whole
   tiles of depth read the zero pairs of the padding too) in order. */
static void bf_sp_task(const bf_sprod* p, ptrdiff_t chunk, ptrdiff_t t, bf_tile_fn tile,
                       bf_part_fn part, ptrdiff_t rows, ptrdiff_t pairs) {
    bf_sp_span s = bf_sp_chunk_span(p, chunk);
    ptrdiff_t tiles_n = bf_ceil(s.j1 - s.j0, p->tile_n);
    ptrdiff_t r0 = s.i0 + t / tiles_n * p->tile_m, c0 = s.j0 + t % tiles_n * p->tile_n;
    ptrdiff_t r1 = r0 + p->tile_m < s.i1 ? r0 + p->tile_m : s.i1;
    ptrdiff_t c1 = c0 + p->tile_n < s.j1 ? c0 + p->tile_n : s.j1;
    for (ptrdiff_t k0 = 0; k0 < pairs; k0 += BF_KB) {
        ptrdiff_t kp = pairs - k0 < BF_KB ? pairs - k0 : BF_KB;
        /* 1: add into C; 2: store past the caches (bf_sp_stream_c: one block) */
        int add = p->accumulate || k0 > 0 ? 1 : p->c_stream ? 2 : 0;
        for (ptrdiff_t j = c0; j < c1; j += BF_NR) {
            const void* panel = p->b_direct
                ? (const void*)(p->B + 2 * k0 * p->b_rs + j)
                : (const void*)(p->pb + ((j - s.j0) / BF_NR * p->kpad + k0) * BF_NR);
            ptrdiff_t b_rs = p->b_direct ? p->b_rs : 0;
            const float* bias = k0 == 0 && p->bias != NULL ? p->bias + j : NULL;
            ptrdiff_t nr = c1 - j < BF_NR ? c1 - j : BF_NR;
            if (p->b_sub && part != NULL) {
                /* B's rows a multiple of 4 KiB apart: a panel's block of rows (512 lines)
                   maps to one L1 set and 16 L2 sets, past what L2 holds of it, so that
                   every row tile read it from L3.  The row tiles go over b_sub pairs at
                   a time (bf_sub_pairs: lines that L2 holds), their sums spilled and
                   taken up again in between: the same sums in the same order. */
                float sums[BF_SUB_MAX_M * BF_NR] __attribute__((aligned(64)));
                ptrdiff_t sub = p->b_sub;
                for (ptrdiff_t s0 = 0; s0 < kp; s0 += sub) {
                    ptrdiff_t ks = kp - s0 < sub ? kp - s0 : sub;
                    int first = s0 == 0, last = s0 + ks == kp;
                    for (ptrdiff_t i = r0; i < r1; i += rows) {
                        ptrdiff_t stride, mr = r1 - i < rows ? r1 - i : rows;
                        const char* a = bf_sp_a_rows(p, s.i0, i, &stride)
                                        + (k0 + s0) * sizeof(uint32_t);
                        if (mr == rows && nr == BF_NR)  /* r1 - r0 <= p->M <= BF_SUB_MAX_M */
                            part(ks, a, stride, (const uint16_t*)panel + 2 * s0 * b_rs, b_rs,
                                 sub, sums + (i - r0) * BF_NR, first, last,
                                 p->C + i * p->ldc + j, p->ldc, add, bias);
                        else if (last)      /* an edge tile: its whole block at once */
                            tile(kp, a - s0 * sizeof(uint32_t), stride, 0, panel, b_rs,
                                 p->C + i * p->ldc + j, p->ldc, add, bias, mr, nr);
                    }
                }
                continue;
            }
            for (ptrdiff_t i = r0; i < r1; i += rows) {
                ptrdiff_t stride, mr = r1 - i < rows ? r1 - i : rows;
                const char* a = bf_sp_a_rows(p, s.i0, i, &stride) + k0 * sizeof(uint32_t);
#if BF_HAVE_NATIVE
                if (p->c_trans && rows == BF_MR && r1 - i >= 2 * BF_MR && nr == BF_NR
                        && bf_sp_vector_transposes()
                        && (!p->a_direct || i + 2 * BF_MR <= p->m_full)) {
                    /* two tiles, then whole lines of C^T (bf_store_trans16) */
                    float buf[2 * BF_MR * BF_NR] __attribute__((aligned(64)));
                    tile(kp, a, stride, 1, panel, b_rs, buf, BF_NR, 0, NULL, BF_MR, nr);
                    tile(kp, a + BF_MR * stride, stride, 1, panel, b_rs, buf + BF_MR * BF_NR,
                         BF_NR, 0, NULL, BF_MR, nr);
                    bf_store_trans16(buf, p->C + j * p->ldc + i, p->ldc, add,
                                     k0 == 0 && p->bias != NULL ? p->bias + i : NULL);
                    i += BF_MR;
                    continue;
                }
#endif
                if (p->c_trans) {
                    /* the tile's sums into a buffer, then C^T = them (+ C) (+ bias): the
                       same sums, the same roundings */
                    float buf[BF_AMX_MR * BF_NR] __attribute__((aligned(64)));
                    tile(kp, a, stride, p->c_trans, panel, b_rs, buf, BF_NR, 0, NULL, mr, nr);
                    bf_sp_store_trans(buf, p->C + j * p->ldc + i, p->ldc, add,
                                      k0 == 0 && p->bias != NULL ? p->bias + i : NULL, mr, nr);
                } else {
                    tile(kp, a, stride, 0, panel, b_rs, p->C + i * p->ldc + j, p->ldc, add,
                         bias, mr, nr);
                }
            }
        }
    }
    if (p->c_stream) adt_stream_fence();    /* the streamed stores, before anyone reads C */
}

/* ---- packing's transposes ---- */

/* dst[j ds + i] = src[i ss + j] for i, j < 16: a 16 x 16 block of uint32 (src may be a
   bf16 array read as pairs: 2-byte aligned). */
static inline void bf_tr16_plain(const void* src, ptrdiff_t ss, uint32_t* dst, ptrdiff_t ds) {
    const char* s = (const char*)src;
    for (ptrdiff_t i = 0; i < 16; i++)
        for (ptrdiff_t j = 0; j < 16; j++)
            memcpy(&dst[j * ds + i], s + (i * ss + j) * (ptrdiff_t)sizeof(uint32_t),
                   sizeof(uint32_t));
}

#if BF_HAVE_NATIVE
/* The same in zmm registers: 32-bit then 64-bit unpacks (a 4 x 4 transpose in each
   128-bit lane of each group of four rows), then two rounds of 128-bit lane shuffles
   (the 4 x 4 transpose of the lanes). */
__attribute__((target("avx512f")))
static void bf_tr16_avx512(const void* src, ptrdiff_t ss, uint32_t* dst, ptrdiff_t ds) {
    const uint32_t* s = (const uint32_t*)src;
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void*)(s + i * ss));
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4 g + c]: in lane L, column 4 L + c of rows 4 g to 4 g + 3 */
    for (int g = 0; g < 4; g++) {
        __m512i* q = t + 4 * g;
        r[4 * g + 0] = _mm512_unpacklo_epi64(q[0], q[2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(q[0], q[2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(q[1], q[3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(q[1], q[3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i a = r[c], b = r[4 + c], e = r[8 + c], f = r[12 + c];
        __m512i v0 = _mm512_shuffle_i32x4(a, b, 0x44), v1 = _mm512_shuffle_i32x4(a, b, 0xEE);
        __m512i v2 = _mm512_shuffle_i32x4(e, f, 0x44), v3 = _mm512_shuffle_i32x4(e, f, 0xEE);
        _mm512_storeu_si512((void*)(dst + (0 + c) * ds), _mm512_shuffle_i32x4(v0, v2, 0x88));
        _mm512_storeu_si512((void*)(dst + (4 + c) * ds), _mm512_shuffle_i32x4(v0, v2, 0xDD));
        _mm512_storeu_si512((void*)(dst + (8 + c) * ds), _mm512_shuffle_i32x4(v1, v3, 0x88));
        _mm512_storeu_si512((void*)(dst + (12 + c) * ds), _mm512_shuffle_i32x4(v1, v3, 0xDD));
    }
}
#endif

/* bf_tr16_plain's block, in registers where the CPU has AVX-512 (every CPU that runs a
   packed path but the twins' elsewhere). */
static inline void bf_tr16(const void* src, ptrdiff_t ss, uint32_t* dst, ptrdiff_t ds) {
#if BF_HAVE_NATIVE
    if (bf_sp_vector_transposes()) {
        bf_tr16_avx512(src, ss, dst, ds);
        return;
    }
#endif
    bf_tr16_plain(src, ss, dst, ds);
}

/* The pack tasks of a chunk: B's panels, BF_SP_PANELS a task, each cut by depth into
   p->b_slices slices (where the chunk needs them: each chunk of columns once, or at
   every chunk of rows where there are several of columns), then A's rows, 32 a task
   (at a chunk's first columns), or A's tail. */
static ptrdiff_t bf_sp_pack_b_tasks(const bf_sprod* p, ptrdiff_t chunk) {
    bf_sp_span s = bf_sp_chunk_span(p, chunk);
    if (p->b_direct || (p->nchunks == 1 && chunk > 0)) return 0;
    return bf_ceil(s.j1 - s.j0, BF_NR * BF_SP_PANELS) * p->b_slices;
}
static ptrdiff_t bf_sp_pack_tasks(const bf_sprod* p, ptrdiff_t chunk) {
    bf_sp_span s = bf_sp_chunk_span(p, chunk);
    ptrdiff_t a = 0;
    if (p->a_direct)
        a = chunk == 0 && p->M % BF_AMX_MR ? 1 : 0;
    else if (chunk % p->nchunks == 0)
        a = bf_ceil(s.i1 - s.i0, BF_AMX_MR);
    return bf_sp_pack_b_tasks(p, chunk) + a;
}

static ptrdiff_t bf_sp_tile_tasks(const bf_sprod* p, ptrdiff_t chunk) {
    bf_sp_span s = bf_sp_chunk_span(p, chunk);
    return bf_ceil(s.i1 - s.i0, p->tile_m) * bf_ceil(s.j1 - s.j0, p->tile_n);
}

/* Lays out the depth pairs q0 to q1 (multiples of 16, q1 at most kpad) of the panel of
   op(B)'s columns j to j + 32 (those below j_end) at panel. */
ADT_MULTIVERSION
static void bf_sp_pack_panel(const bf_sprod* p, ptrdiff_t j, ptrdiff_t j_end, ptrdiff_t q0,
                             ptrdiff_t q1, uint32_t* restrict panel) {
    ptrdiff_t K = p->K, kp = (K + 1) / 2, kfull = K / 2;
    ptrdiff_t nr = j_end - j < BF_NR ? j_end - j : BF_NR;
    const uint16_t* b = p->B + j * p->b_cs;
    ptrdiff_t b_rs = p->b_rs, b_cs = p->b_cs, qe = q1 < kp ? q1 : kp;
    if (b_rs == 1) {
        /* columns along the depth (the forward's weight): a column's pairs are its bf16
           in order (little-endian: the even depth in the low half); 16 columns by 16
           pairs transposed at a time */
        for (ptrdiff_t g = q0; g < qe; g += BF_AMX_KP) {
            ptrdiff_t ge = g + BF_AMX_KP < kfull ? g + BF_AMX_KP : kfull, c = 0;
            if (ge - g == BF_AMX_KP && b_cs % 2 == 0)
                for (; c + 16 <= nr; c += 16)
                    bf_tr16(b + c * b_cs + 2 * g, b_cs / 2, panel + g * BF_NR + c, BF_NR);
            for (; c < nr; c++) {
                const uint16_t* col = b + c * b_cs;
                for (ptrdiff_t q = g; q < ge; q++)
                    memcpy(&panel[q * BF_NR + c], col + 2 * q, sizeof(uint32_t));
            }
        }
        if (kp > kfull && q0 <= kfull && kfull < qe)     /* odd K */
            for (ptrdiff_t c = 0; c < nr; c++) panel[kfull * BF_NR + c] = b[c * b_cs + 2 * kfull];
    } else {
        /* rows along the columns (the weight in dout @ W, x in dout^T x): two rows
           interleaved at a time */
        for (ptrdiff_t q = q0; q < qe; q++) {
            const uint16_t* lo = b + 2 * q * b_rs;
            const uint16_t* hi = lo + b_rs;
            uint32_t* row = panel + q * BF_NR;
            if (2 * q + 1 >= K)
                for (ptrdiff_t c = 0; c < nr; c++) row[c] = lo[c * b_cs];
            else if (b_cs == 1)
                for (ptrdiff_t c = 0; c < nr; c++) row[c] = (uint32_t)lo[c] | (uint32_t)hi[c] << 16;
            else
                for (ptrdiff_t c = 0; c < nr; c++)
                    row[c] = (uint32_t)lo[c * b_cs] | (uint32_t)hi[c * b_cs] << 16;
        }
    }
    if (nr < BF_NR)
        for (ptrdiff_t q = q0; q < qe; q++)
            for (ptrdiff_t c = nr; c < BF_NR; c++) panel[q * BF_NR + c] = 0;
    if (q1 > qe)
        memset(panel + qe * BF_NR, 0, (size_t)(q1 - qe) * BF_NR * sizeof *panel);
}

/* Lays out op(A)'s rows i to i + 32 (those below i_end; zeros past them) at rows. */
ADT_MULTIVERSION
static void bf_sp_pack_rows(const bf_sprod* p, ptrdiff_t i, ptrdiff_t i_end,
                            uint32_t* restrict rows) {
    ptrdiff_t K = p->K, kp = (K + 1) / 2, kfull = K / 2, kpad = p->kpad;
    ptrdiff_t mr = i_end - i < BF_AMX_MR ? i_end - i : BF_AMX_MR;
    ptrdiff_t a_rs = p->a_rs, a_cs = p->a_cs;
    const uint16_t* a = p->A + i * a_rs;
    if (a_cs == 1) {
        /* rows along the depth: a row's pairs are its bf16 in order */
        for (ptrdiff_t r = 0; r < mr; r++) {
            const uint16_t* ar = a + r * a_rs;
            uint32_t* out = rows + r * kpad;
            memcpy(out, ar, (size_t)kfull * sizeof(uint32_t));
            if (kp > kfull) out[kfull] = ar[2 * kfull];
        }
    } else {
        /* (dout^T): 16 depth pairs at a time, each across the 32 rows (two rows of
           dout interleaved), then turned into the rows' 64-byte runs */
        uint32_t t[BF_AMX_KP][BF_AMX_MR] __attribute__((aligned(64)));
        for (ptrdiff_t q0 = 0; q0 < kp; q0 += BF_AMX_KP) {
            ptrdiff_t nq = kp - q0 < BF_AMX_KP ? kp - q0 : BF_AMX_KP;
            for (ptrdiff_t q = 0; q < nq; q++) {
                const uint16_t* lo = a + 2 * (q0 + q) * a_cs;
                const uint16_t* hi = lo + a_cs;
                if (2 * (q0 + q) + 1 >= K)
                    for (ptrdiff_t r = 0; r < mr; r++) t[q][r] = lo[r * a_rs];
                else if (a_rs == 1)
                    for (ptrdiff_t r = 0; r < mr; r++)
                        t[q][r] = (uint32_t)lo[r] | (uint32_t)hi[r] << 16;
                else
                    for (ptrdiff_t r = 0; r < mr; r++)
                        t[q][r] = (uint32_t)lo[r * a_rs] | (uint32_t)hi[r * a_rs] << 16;
            }
            if (nq == BF_AMX_KP && mr == BF_AMX_MR) {
                bf_tr16(&t[0][0], BF_AMX_MR, rows + q0, kpad);
                bf_tr16(&t[0][16], BF_AMX_MR, rows + 16 * kpad + q0, kpad);
            } else {
                for (ptrdiff_t r = 0; r < mr; r++)
                    for (ptrdiff_t q = 0; q < nq; q++) rows[r * kpad + q0 + q] = t[q][r];
            }
        }
    }
    for (ptrdiff_t r = 0; r < mr; r++)
        memset(rows + r * kpad + kp, 0, (size_t)(kpad - kp) * sizeof *rows);
    memset(rows + mr * kpad, 0, (size_t)(BF_AMX_MR - mr) * (size_t)kpad * sizeof *rows);
}

/* Pack task t of chunk `chunk` (bf_sp_pack_tasks). */
static void bf_sp_pack(const bf_sprod* p, ptrdiff_t chunk, ptrdiff_t t) {
    bf_sp_span s = bf_sp_chunk_span(p, chunk);
    ptrdiff_t nb = bf_sp_pack_b_tasks(p, chunk);
    if (t < nb) {
        ptrdiff_t slice = bf_ceil(p->kpad / BF_AMX_KP, p->b_slices) * BF_AMX_KP;
        ptrdiff_t q0 = t % p->b_slices * slice, q1 = q0 + slice < p->kpad ? q0 + slice : p->kpad;
        ptrdiff_t j = s.j0 + t / p->b_slices * BF_NR * BF_SP_PANELS;
        for (int k = 0; k < BF_SP_PANELS && j < s.j1 && q0 < q1; k++, j += BF_NR)
            bf_sp_pack_panel(p, j, s.j1, q0, q1,
                             p->pb + (j - s.j0) / BF_NR * p->kpad * BF_NR);
    } else if (p->a_direct) {
        bf_sp_pack_rows(p, p->m_full, p->M, p->pa);
    } else {
        ptrdiff_t i = s.i0 + (t - nb) * BF_AMX_MR;
        bf_sp_pack_rows(p, i, s.i1, p->pa + (i - s.i0) * p->kpad);
    }
}

/* ---- the VDPBF16PS builds ---- */

/* acc + the dot products of the sixteen pairs of b with the pair a, the odd depth
   first: VDPBF16PS, done with float32 multiply-adds (each product is exact) */
ADT_INLINE adt_v16 bf_dot_twin(adt_v16 acc, uint32_t a, bf_pairs b) {
    float a_even = bf16_bits_f32(a << 16), a_odd = bf16_bits_f32(a & 0xFFFF0000u);
    adt_v16 b_even = (adt_v16)(b << 16), b_odd = (adt_v16)(b & 0xFFFF0000u);
    acc = acc + a_odd * b_odd;
    return acc + a_even * b_even;
}

/* b0, b1 = the pairs of the rows lo and hi (a depth and the next) at 32 columns, in
   the columns' order */
ADT_INLINE void bf_interleave_twin(bf_pairs* b0, bf_pairs* b1, const uint16_t* lo,
                                   const uint16_t* hi) {
    for (int l = 0; l < 16; l++) {
        (*b0)[l] = (uint32_t)lo[l] | (uint32_t)hi[l] << 16;
        (*b1)[l] = (uint32_t)lo[16 + l] | (uint32_t)hi[16 + l] << 16;
    }
}

#define BF_FN(f) f##_twin
#define BF_ATTR ADT_MULTIVERSION
#define BF_INLINE_ATTR
#define BF_DOT(acc, a, b) bf_dot_twin(acc, a, b)
#define BF_STREAM(p, v) adt_store16(p, v)
#define BF_INTERLEAVE(b0, b1, lo, hi) bf_interleave_twin(&(b0), &(b1), lo, hi)
#define BF_UNPERMUTE(acc0, acc1) ((void)0)
#include "bf16_gemm.h"

#if BF_HAVE_NATIVE
#define BF_TARGET __attribute__((target("avx512f,avx512bf16")))
BF_TARGET ADT_INLINE adt_v16 bf_dot_nat(adt_v16 acc, uint32_t a, bf_pairs b) {
    return (adt_v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)a),
                                     (__m512bh)b);
}
/* The pairs of the rows lo and hi at 32 columns by two 16-bit unpacks, which work
   within 128-bit lanes: b0 holds columns 0-3, 8-11, 16-19, 24-27, b1 columns 4-7,
   12-15, 20-23, 28-31 (bf_unpermute_nat puts the sums back in order). */
BF_TARGET ADT_INLINE void bf_interleave_nat(bf_pairs* b0, bf_pairs* b1, const uint16_t* lo,
                                            const uint16_t* hi) {
    __m512i r0 = _mm512_loadu_si512((const void*)lo), r1 = _mm512_loadu_si512((const void*)hi);
    *b0 = (bf_pairs)_mm512_unpacklo_epi16(r0, r1);
    *b1 = (bf_pairs)_mm512_unpackhi_epi16(r0, r1);
}
/* acc0, acc1 summed over bf_interleave_nat's pairs, put in the columns' order */
BF_TARGET ADT_INLINE void bf_unpermute_nat(adt_v16* acc0, adt_v16* acc1) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                         30, 31);
    __m512 a = (__m512)*acc0, b = (__m512)*acc1;
    *acc0 = (adt_v16)_mm512_permutex2var_ps(a, lo, b);
    *acc1 = (adt_v16)_mm512_permutex2var_ps(a, hi, b);
}

#define BF_FN(f) f##_nat
#define BF_ATTR BF_TARGET
#define BF_INLINE_ATTR BF_TARGET
#define BF_DOT(acc, a, b) bf_dot_nat(acc, a, b)
#define BF_STREAM(p, v) _mm512_stream_ps(p, (__m512)(v))
#define BF_INTERLEAVE(b0, b1, lo, hi) bf_interleave_nat(&(b0), &(b1), lo, hi)
#define BF_UNPERMUTE(acc0, acc1) bf_unpermute_nat(&(acc0), &(acc1))
#include "bf16_gemm.h"
#endif

/* ---- the AMX builds ---- */

/* The twin: the AMX build's code on tiles held in memory, TDPBF16PS done as Intel's
   pseudocode writes it (for each row, each depth pair, each column: the even product
   added, then the odd; each product exact in float32), for the tests on any CPU. */
typedef struct { uint32_t r[16][16]; } bf_twin_tile;

static inline void bf_twin_load(bf_twin_tile* t, const void* src, ptrdiff_t stride) {
    for (int i = 0; i < 16; i++) memcpy(t->r[i], (const char*)src + i * stride, 64);
}
static inline void bf_twin_store(const bf_twin_tile* t, void* dst, ptrdiff_t stride) {
    for (int i = 0; i < 16; i++) memcpy((char*)dst + i * stride, t->r[i], 64);
}
ADT_MULTIVERSION
static void bf_twin_dp(bf_twin_tile* c, const bf_twin_tile* a, const bf_twin_tile* b) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc = bf16_bits_f32(c->r[m][n]);
            for (int k = 0; k < 16; k++) {
                uint32_t x = a->r[m][k], y = b->r[k][n];
                acc += bf16_bits_f32(x << 16) * bf16_bits_f32(y << 16);
                acc += bf16_bits_f32(x & 0xFFFF0000u) * bf16_bits_f32(y & 0xFFFF0000u);
            }
            c->r[m][n] = bf16_f32_bits(acc);
        }
}

#define BF_AMX_FN(f) f##_amxtwin
#define BF_AMX_ATTR
#define BF_AMX_STATE bf_twin_tile bf_tiles[8]
#define BF_TCFG() ((void)0)
#define BF_TREL() ((void)0)
#define BF_TZERO(t) memset(&bf_tiles[t], 0, sizeof bf_tiles[t])
#define BF_TLOAD(t, src, stride) bf_twin_load(&bf_tiles[t], src, stride)
#define BF_TSTORE(t, dst, stride) bf_twin_store(&bf_tiles[t], dst, stride)
#define BF_TDP(c, a, b) bf_twin_dp(&bf_tiles[c], &bf_tiles[a], &bf_tiles[b])
#include "bf16_amx.h"

#if BF_HAVE_NATIVE
#include "peak.h"
#define BF_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

/* Whether the CPU has AMX-BF16 and Linux gave this process the tile data state
   (peak.h asks for it). */
static int bf16_cpu_amx(void) {
    static int has = -1;
    if (has < 0) has = (adt_peak_isas() >> ADT_PEAK_AMX_BF16) & 1;   /* benign race */
    return has;
}

/* Eight tiles of 16 rows of 64 bytes. */
BF_AMX_TARGET static inline void bf_amx_config(void) {
    struct adt_peak_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

#define BF_AMX_FN(f) f##_amx
#define BF_AMX_ATTR BF_AMX_TARGET
#define BF_AMX_STATE ((void)0)
#define BF_TCFG() bf_amx_config()
#define BF_TREL() _tile_release()
#define BF_TZERO(t) _tile_zero(t)
#define BF_TLOAD(t, src, stride) _tile_loadd(t, src, stride)
#define BF_TSTORE(t, dst, stride) _tile_stored(t, dst, stride)
#define BF_TDP(c, a, b) _tile_dpbf16ps(c, a, b)
#include "bf16_amx.h"
#else
static int bf16_cpu_amx(void) { return 0; }
#endif

/* The builds, as kernels/bf16.pyx numbers its paths. */
enum { BF_PATH_NATIVE = 1, BF_PATH_TWIN = 2, BF_PATH_AMX = 3, BF_PATH_AMX_TWIN = 4 };

/* Tile task t of chunk `chunk` of p (bf_sp_tile_tasks) on the build `path` names. */
static void bf_sp_run_task(int path, const bf_sprod* p, ptrdiff_t chunk, ptrdiff_t t) {
#if BF_HAVE_NATIVE
    if (path == BF_PATH_AMX) {
        bf_amx_task_amx(p, chunk, t);
        return;
    }
    if (path == BF_PATH_NATIVE) {
        bf_task_nat(p, chunk, t);
        return;
    }
#endif
    if (path == BF_PATH_AMX_TWIN)
        bf_amx_task_amxtwin(p, chunk, t);
    else
        bf_task_twin(p, chunk, t);
}

#endif /* ADTAPE_KERNELS_BF16_H */
