/* bfloat16 for the bf16 kernels (kernels/bf16.pyx): the conversions, the CPU check and
 * the packed bf16-operand GEMM that accumulates in float32.
 *
 * A bf16 is the top half of a float32 (sign, 8 exponent bits, 7 mantissa bits), held
 * in a uint16_t.  Widening is exact (the bits shifted up); narrowing rounds to nearest,
 * ties to even, in integer arithmetic (the same bits as PyTorch's and as NumPy's
 * reference in the tests), NaN kept NaN.  The conversions are written as plain loops
 * that GCC vectorizes in the target clones: they are bound by memory, and
 * VCVTNEPS2BF16 would flush subnormals to zero.
 *
 * The GEMM (bf16_gemm.h, included twice below) packs its operands as pairs of depths,
 * two bf16 in a uint32_t (the even depth in the low half), the layout VDPBF16PS reads:
 * for each depth pair p of a block, a panel of B holds BF_NR columns' pairs and a panel
 * of A BF_MR rows' pairs.  Its micro-kernel keeps BF_MR x 2 vectors of sixteen float32
 * accumulators (8 x 32: 16 of AVX-512's 32 registers) and does one broadcast of A's pair
 * and two VDPBF16PS per row and depth pair.  It is built
 *   - for AVX512_BF16 (bf_gemm_nat), run where bf16_cpu_native() says the CPU and the
 *     OS have it;
 *   - portably (bf_gemm_twin), with VDPBF16PS done by two float32 multiply-adds in the
 *     instruction's order, for the tests: the same packing, tiles and blocks, so that
 *     their logic is checked on any CPU.  The products of two bf16 are exact in
 *     float32, so each step rounds once either way: the twin gives the instruction's
 *     bits wherever no subnormal occurs (VDPBF16PS reads subnormal inputs as zero and
 *     flushes subnormal results to zero).
 * The order of the sums depends only on the depth: each element is summed over a block
 * of BF_KC depths (pairs in order, the odd depth of a pair before the even one, as the
 * instruction does) and the block's sum added into C.  How rows and columns are split
 * between threads changes nothing.
 */
#ifndef ADTAPE_KERNELS_BF16_H
#define ADTAPE_KERNELS_BF16_H

#include <stdint.h>
#include <string.h>
#include "simd.h"

/* ---- conversions ---- */

/* float32 bits -> bf16, round to nearest even; a NaN stays NaN (its sign and top
   payload bits kept, the quiet bit set), values past the largest bf16 go to inf. */
ADT_INLINE uint16_t bf16_from_bits(uint32_t u) {
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

ADT_INLINE uint32_t bf16_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

ADT_INLINE float bf16_bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* out[i] = in[i] rounded to bf16 */
ADT_MULTIVERSION
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

/* ---- the packed GEMM: blocks and packing (shared by both builds) ---- */

#define BF_MR 8          /* rows of a tile */
#define BF_NR 32         /* columns of a tile: two vectors of sixteen */
#define BF_KC 512        /* depths of a block (256 pairs): a B panel is 32 KiB */
#define BF_MC 96         /* rows of an A block */
#define BF_NC 512        /* columns of a B block (512 KiB) */
_Static_assert(BF_KC % 2 == 0 && BF_MC % BF_MR == 0 && BF_NC % BF_NR == 0,
               "bf16.h: the blocks must hold whole tiles and pairs");

typedef uint32_t bf_pairs __attribute__((vector_size(64)));

/* The AMX build's tiles: 32 x 32 of C (four 16 x 16 tiles of float32) from two tiles
   of A (16 rows x 16 depth pairs) and two of B (16 depth pairs x 16 columns). */
#define BF_AMX_MR 32
#define BF_AMX_KP 16     /* depth pairs of a tile */
_Static_assert(BF_MC % BF_AMX_MR == 0 && BF_NR == 32 && (BF_KC / 2) % BF_AMX_KP == 0,
               "bf16.h: the blocks must hold whole AMX tiles");

/* kp depth pairs padded to whole AMX tiles (the AMX build's panels; the others pass
   kp itself as their panels' depth) */
static inline ptrdiff_t bf_kpad(ptrdiff_t kp) {
    return (kp + BF_AMX_KP - 1) / BF_AMX_KP * BF_AMX_KP;
}

/* The pairs of a packing buffer for an M x N x K product (K > 0): a block of B panels,
   then one of A panels (sized for the AMX build's padding, which covers the others). */
static size_t bf_buffer_b_pairs(ptrdiff_t N, ptrdiff_t K) {
    ptrdiff_t kp = bf_kpad(K < BF_KC ? (K + 1) / 2 : BF_KC / 2);
    ptrdiff_t nc = N < BF_NC ? (N + BF_NR - 1) / BF_NR * BF_NR : BF_NC;
    return (size_t)nc * (size_t)kp;
}
static size_t bf_buffer_pairs(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K) {
    ptrdiff_t kp = bf_kpad(K < BF_KC ? (K + 1) / 2 : BF_KC / 2);
    ptrdiff_t mc = M < BF_MC ? (M + BF_AMX_MR - 1) / BF_AMX_MR * BF_AMX_MR : BF_MC;
    return bf_buffer_b_pairs(N, K) + (size_t)mc * (size_t)kp;
}

/* Pack op(A)[0:mc, 0:kc] (op(A)[i, k] = A[i a_rs + k a_cs]) as panels of BF_MR rows:
   for each depth pair the panel's BF_MR pairs; rows past mc and the odd depth past kc
   are zero. */
ADT_MULTIVERSION
static void bf_pack_a(ptrdiff_t mc, ptrdiff_t kc, const uint16_t* A, ptrdiff_t a_rs,
                      ptrdiff_t a_cs, uint32_t* restrict pa) {
    ptrdiff_t kp = (kc + 1) / 2, kfull = kc / 2;
    for (ptrdiff_t i = 0; i < mc; i += BF_MR, pa += kp * BF_MR) {
        ptrdiff_t mr = mc - i < BF_MR ? mc - i : BF_MR;
        const uint16_t* a = A + i * a_rs;
        if (a_cs == 1) {
            /* rows along the depth (x, dout): a row at a time */
            for (ptrdiff_t r = 0; r < mr; r++) {
                const uint16_t* ar = a + r * a_rs;
                for (ptrdiff_t p = 0; p < kfull; p++)
                    pa[p * BF_MR + r] = (uint32_t)ar[2 * p] | (uint32_t)ar[2 * p + 1] << 16;
                if (kp > kfull) pa[kfull * BF_MR + r] = ar[2 * kfull];
            }
        } else {
            /* (dout^T): a depth pair at a time, across the rows */
            for (ptrdiff_t p = 0; p < kp; p++) {
                const uint16_t* lo = a + 2 * p * a_cs;
                const uint16_t* hi = lo + a_cs;
                int odd = 2 * p + 1 < kc;
                for (ptrdiff_t r = 0; r < mr; r++)
                    pa[p * BF_MR + r] = (uint32_t)lo[r * a_rs]
                                        | (odd ? (uint32_t)hi[r * a_rs] << 16 : 0u);
            }
        }
        for (ptrdiff_t r = mr; r < BF_MR; r++)
            for (ptrdiff_t p = 0; p < kp; p++) pa[p * BF_MR + r] = 0;
    }
}

/* Pack op(B)[0:kc, 0:nc] (op(B)[k, j] = B[k b_rs + j b_cs]) as panels of BF_NR columns
   and kpad >= (kc + 1) / 2 depth pairs: for each depth pair the panel's BF_NR pairs;
   columns past nc, the odd depth past kc and the pairs past it are zero. */
ADT_MULTIVERSION
static void bf_pack_b(ptrdiff_t kc, ptrdiff_t nc, const uint16_t* B, ptrdiff_t b_rs,
                      ptrdiff_t b_cs, uint32_t* restrict pb, ptrdiff_t kpad) {
    ptrdiff_t kp = (kc + 1) / 2, kfull = kc / 2;
    for (ptrdiff_t j = 0; j < nc; j += BF_NR, pb += kpad * BF_NR) {
        memset(pb + kp * BF_NR, 0, (size_t)(kpad - kp) * BF_NR * sizeof *pb);
        ptrdiff_t nr = nc - j < BF_NR ? nc - j : BF_NR;
        const uint16_t* b = B + j * b_cs;
        if (b_rs == 1) {
            /* columns along the depth (the forward's weight): a column at a time */
            for (ptrdiff_t c = 0; c < nr; c++) {
                const uint16_t* bc = b + c * b_cs;
                for (ptrdiff_t p = 0; p < kfull; p++)
                    pb[p * BF_NR + c] = (uint32_t)bc[2 * p] | (uint32_t)bc[2 * p + 1] << 16;
                if (kp > kfull) pb[kfull * BF_NR + c] = bc[2 * kfull];
            }
        } else {
            /* rows along the columns (the weight in dout @ W, x in dout^T x): two rows
               interleaved at a time */
            for (ptrdiff_t p = 0; p < kp; p++) {
                const uint16_t* lo = b + 2 * p * b_rs;
                const uint16_t* hi = lo + b_rs;
                if (2 * p + 1 < kc)
                    for (ptrdiff_t c = 0; c < nr; c++)
                        pb[p * BF_NR + c] = (uint32_t)lo[c * b_cs] | (uint32_t)hi[c * b_cs] << 16;
                else
                    for (ptrdiff_t c = 0; c < nr; c++) pb[p * BF_NR + c] = lo[c * b_cs];
            }
        }
        for (ptrdiff_t c = nr; c < BF_NR; c++)
            for (ptrdiff_t p = 0; p < kp; p++) pb[p * BF_NR + c] = 0;
    }
}

/* ---- the two builds of the micro-kernel and its loops ---- */

/* acc + the dot products of the sixteen pairs of b with the pair a, the odd depth
   first: VDPBF16PS, done with float32 multiply-adds (each product is exact) */
ADT_INLINE adt_v16 bf_dot_twin(adt_v16 acc, uint32_t a, bf_pairs b) {
    float a_even = bf16_bits_f32(a << 16), a_odd = bf16_bits_f32(a & 0xFFFF0000u);
    adt_v16 b_even = (adt_v16)(b << 16), b_odd = (adt_v16)(b & 0xFFFF0000u);
    acc = acc + a_odd * b_odd;
    return acc + a_even * b_even;
}

#define BF_FN(f) f##_twin
#define BF_ATTR ADT_MULTIVERSION
#define BF_DOT(acc, a, b) bf_dot_twin(acc, a, b)
#include "bf16_gemm.h"
#undef BF_FN
#undef BF_ATTR
#undef BF_DOT

#if BF_HAVE_NATIVE
#define BF_TARGET __attribute__((target("avx512f,avx512bf16")))
BF_TARGET ADT_INLINE adt_v16 bf_dot_nat(adt_v16 acc, uint32_t a, bf_pairs b) {
    return (adt_v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)a),
                                     (__m512bh)b);
}
#define BF_FN(f) f##_nat
#define BF_ATTR BF_TARGET
#define BF_DOT(acc, a, b) bf_dot_nat(acc, a, b)
#include "bf16_gemm.h"
#undef BF_FN
#undef BF_ATTR
#undef BF_DOT
#endif

/* ---- the AMX build ---- */

/* Pack op(A)[0:mc, 0:kc] for AMX: panels of BF_AMX_MR rows, each row its kpad depth
   pairs in order (a tile of A is 16 rows of 16 pairs, read with a stride of kpad
   pairs); rows past mc, the odd depth past kc and the pairs past it are zero. */
ADT_MULTIVERSION
static void bf_pack_a_amx(ptrdiff_t mc, ptrdiff_t kc, const uint16_t* A, ptrdiff_t a_rs,
                          ptrdiff_t a_cs, uint32_t* restrict pa, ptrdiff_t kpad) {
    ptrdiff_t kp = (kc + 1) / 2, kfull = kc / 2;
    ptrdiff_t mpad = (mc + BF_AMX_MR - 1) / BF_AMX_MR * BF_AMX_MR;
    if (a_cs == 1) {
        /* rows along the depth (x, dout): a row's pairs are its bf16 in order */
        for (ptrdiff_t r = 0; r < mc; r++) {
            uint32_t* row = pa + r * kpad;
            memcpy(row, A + r * a_rs, (size_t)kc * sizeof(uint16_t));
            if (kp > kfull) row[kfull] = A[r * a_rs + 2 * kfull];
        }
    } else {
        /* (dout^T): a depth pair at a time, across the rows */
        for (ptrdiff_t p = 0; p < kp; p++) {
            const uint16_t* lo = A + 2 * p * a_cs;
            const uint16_t* hi = lo + a_cs;
            int odd = 2 * p + 1 < kc;
            for (ptrdiff_t r = 0; r < mc; r++)
                pa[r * kpad + p] = (uint32_t)lo[r * a_rs] | (odd ? (uint32_t)hi[r * a_rs] << 16 : 0u);
        }
    }
    for (ptrdiff_t r = 0; r < mc; r++)
        memset(pa + r * kpad + kp, 0, (size_t)(kpad - kp) * sizeof *pa);
    memset(pa + mc * kpad, 0, (size_t)(mpad - mc) * (size_t)kpad * sizeof *pa);
}

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

/* C tiles 0-3 (rows 0-15 | 16-31 x columns 0-15 | 16-31) += A tiles 4-5 x B tiles
   6-7 over kpad depth pairs: pa a packed A panel (row stride kpad pairs), pb a
   packed B panel (row stride BF_NR pairs). */
BF_AMX_TARGET static inline void bf_amx_product(ptrdiff_t kpad, const uint32_t* pa,
                                                const uint32_t* pb) {
    for (ptrdiff_t p = 0; p < kpad; p += BF_AMX_KP) {
        _tile_loadd(4, pa + p, kpad * 4);
        _tile_loadd(5, pa + 16 * kpad + p, kpad * 4);
        _tile_loadd(6, pb + p * BF_NR, BF_NR * 4);
        _tile_loadd(7, pb + p * BF_NR + 16, BF_NR * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* Load C tiles 0-3 from the 32 x 32 float32 block at c (row stride ld floats), or
   store them there. */
BF_AMX_TARGET static inline void bf_amx_load_c(const float* c, ptrdiff_t ld) {
    _tile_loadd(0, c, ld * 4);
    _tile_loadd(1, c + 16, ld * 4);
    _tile_loadd(2, c + 16 * ld, ld * 4);
    _tile_loadd(3, c + 16 * ld + 16, ld * 4);
}
BF_AMX_TARGET static inline void bf_amx_store_c(float* c, ptrdiff_t ld) {
    _tile_stored(0, c, ld * 4);
    _tile_stored(1, c + 16, ld * 4);
    _tile_stored(2, c + 16 * ld, ld * 4);
    _tile_stored(3, c + 16 * ld + 16, ld * 4);
}

/* The 32 x 32 tile of C at c, mr x nr of it in C: C = init + the products, init being
   C (where add) + bias[0:nr] (where not NULL), summed in the tiles.  A whole tile
   reads and writes C in place (its init from C, from rows of the bias, or zero);
   an edge tile goes through a buffer, the same sums in the same order. */
BF_AMX_TARGET static void bf_amx_tile(ptrdiff_t kpad, const uint32_t* pa, const uint32_t* pb,
                                      float* c, ptrdiff_t ldc, int add, const float* bias,
                                      ptrdiff_t mr, ptrdiff_t nr) {
    if (mr == BF_AMX_MR && nr == BF_NR && (bias == NULL || !add)) {
        if (add) {
            bf_amx_load_c(c, ldc);
        } else if (bias != NULL) {
            float rows[16][BF_NR] __attribute__((aligned(64)));
            for (int r = 0; r < 16; r++) memcpy(rows[r], bias, sizeof rows[r]);
            _tile_loadd(0, &rows[0][0], BF_NR * 4);
            _tile_loadd(1, &rows[0][16], BF_NR * 4);
            _tile_loadd(2, &rows[0][0], BF_NR * 4);
            _tile_loadd(3, &rows[0][16], BF_NR * 4);
        } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        bf_amx_product(kpad, pa, pb);
        bf_amx_store_c(c, ldc);
        return;
    }
    float t[BF_AMX_MR][BF_NR] __attribute__((aligned(64)));
    memset(t, 0, sizeof t);
    for (ptrdiff_t r = 0; r < mr; r++)
        for (ptrdiff_t j = 0; j < nr; j++)
            t[r][j] = (add ? c[r * ldc + j] : 0.0f) + (bias != NULL ? bias[j] : 0.0f);
    bf_amx_load_c(&t[0][0], BF_NR);
    bf_amx_product(kpad, pa, pb);
    bf_amx_store_c(&t[0][0], BF_NR);
    for (ptrdiff_t r = 0; r < mr; r++)
        memcpy(c + r * ldc, t[r], (size_t)nr * sizeof(float));
}

/* bf_gemm_twin's loops on AMX tiles: C (+= where accumulate) op(A) op(B) (+ bias),
   each element summed over blocks of BF_KC depths in order, as the other builds. */
BF_AMX_TARGET static void bf_gemm_amx(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, const uint16_t* A,
                                      ptrdiff_t a_rs, ptrdiff_t a_cs, const uint16_t* B,
                                      ptrdiff_t b_rs, ptrdiff_t b_cs, int accumulate, float* C,
                                      ptrdiff_t ldc, const float* bias, uint32_t* buf) {
    struct adt_peak_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    uint32_t* pb = buf;
    uint32_t* pa = buf + bf_buffer_b_pairs(N, K);
    for (ptrdiff_t j0 = 0; j0 < N; j0 += BF_NC) {
        ptrdiff_t nc = N - j0 < BF_NC ? N - j0 : BF_NC;
        for (ptrdiff_t k0 = 0; k0 < K; k0 += BF_KC) {
            ptrdiff_t kc = K - k0 < BF_KC ? K - k0 : BF_KC;
            ptrdiff_t kpad = bf_kpad((kc + 1) / 2);
            int add = accumulate || k0 > 0;
            bf_pack_b(kc, nc, B + k0 * b_rs + j0 * b_cs, b_rs, b_cs, pb, kpad);
            for (ptrdiff_t i0 = 0; i0 < M; i0 += BF_MC) {
                ptrdiff_t mc = M - i0 < BF_MC ? M - i0 : BF_MC;
                bf_pack_a_amx(mc, kc, A + i0 * a_rs + k0 * a_cs, a_rs, a_cs, pa, kpad);
                for (ptrdiff_t j = 0; j < nc; j += BF_NR) {
                    ptrdiff_t nr = nc - j < BF_NR ? nc - j : BF_NR;
                    const float* bj = k0 == 0 && bias != NULL ? bias + j0 + j : NULL;
                    for (ptrdiff_t i = 0; i < mc; i += BF_AMX_MR) {
                        ptrdiff_t mr = mc - i < BF_AMX_MR ? mc - i : BF_AMX_MR;
                        bf_amx_tile(kpad, pa + i * kpad, pb + j * kpad,
                                    C + (i0 + i) * ldc + j0 + j, ldc, add, bj, mr, nr);
                    }
                }
            }
        }
    }
    _tile_release();
}
#else
static int bf16_cpu_amx(void) { return 0; }
#endif

/* The builds, as kernels/bf16.pyx numbers its paths. */
enum { BF_PATH_NATIVE = 1, BF_PATH_TWIN = 2, BF_PATH_AMX = 3 };

/* C (+)= op(A) op(B) (+ bias) on the build `path` names (BF_PATH_NATIVE: AVX512_BF16,
   BF_PATH_AMX: AMX-BF16 tiles, else the portable twin), packing into buf
   (bf_buffer_pairs(M, N, K) pairs, 64-byte aligned). */
static void bf_gemm(int path, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, const uint16_t* A,
                    ptrdiff_t a_rs, ptrdiff_t a_cs, const uint16_t* B, ptrdiff_t b_rs,
                    ptrdiff_t b_cs, int accumulate, float* C, ptrdiff_t ldc, const float* bias,
                    uint32_t* buf) {
#if BF_HAVE_NATIVE
    if (path == BF_PATH_NATIVE) {
        bf_gemm_nat(M, N, K, A, a_rs, a_cs, B, b_rs, b_cs, accumulate, C, ldc, bias, buf);
        return;
    }
    if (path == BF_PATH_AMX) {
        bf_gemm_amx(M, N, K, A, a_rs, a_cs, B, b_rs, b_cs, accumulate, C, ldc, bias, buf);
        return;
    }
#else
    (void)path;
#endif
    bf_gemm_twin(M, N, K, A, a_rs, a_cs, B, b_rs, b_cs, accumulate, C, ldc, bias, buf);
}

#endif /* ADTAPE_KERNELS_BF16_H */
