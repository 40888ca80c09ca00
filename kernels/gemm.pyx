"""Row-major sgemm split across our OpenMP threads, each calling BLAS single-threaded.

Two thread pools in one process (BLAS's own and OpenMP's) fight over the cores:
after a BLAS call its workers keep spinning, and the next OpenMP loop waits for a
core - milliseconds per call on a small machine, hundreds of calls per training
step.  So the kernels keep BLAS at one thread (``kernels.threads``) and split each
product themselves: ``gemm`` gives every thread a contiguous block of output
columns (or rows, when the output is taller than wide) and one ``sgemm`` call on
it, and adds the bias to that block in the same parallel region.
"""
cimport numpy as cnp
from cython.parallel cimport prange
from scipy.linalg.cython_blas cimport sgemm
from libc.stdint cimport uint16_t
from libc.string cimport memcpy

from kernels._common cimport check_disjoint, checked_data, resolve_threads
from kernels._openmp cimport omp_get_thread_num_safe

cdef extern from "<stdlib.h>" nogil:
    void* aligned_alloc(size_t alignment, size_t size)
    void free(void* ptr)

import numpy as np

cnp.import_array()

# Below this many multiply-adds one thread does the whole product, and a product gets
# only as many threads as leave each block at least this many (gemm()).
cdef enum:
    PARALLEL_MIN_FLOPS = 1 << 20
    MIN_BLOCK = 16
    # Products with at most _skinny_max_m rows and no transposed operand (the input
    # gradient at few tokens) are split by depth across the threads when each gets at
    # least this many rows of B (skinny_nn_depth): 2 threads, 12 weights from memory,
    # against the column split: 54 -> ~107 GFLOP/s at 8 x 768 x 2304, 128 -> 168 at 16
    # rows, 177 -> 199 at 32, 228 -> 237 at 64.
    DEPTH_SPLIT_MIN_K = 128

cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    /* The skinny kernels (kernels/skinny.h) in eight lanes, as target clones, and
       in sixteen for CPUs with AVX-512; the entry points below pick one. */
    #define ADT_W 8
    #include "skinny.h"
    #include "sgemm.h"
    #undef ADT_W
    #if ADT_HAVE_V4
    #define ADT_W 16
    #include "skinny.h"
    #include "sgemm.h"
    #undef ADT_W
    static int sk_narrow = 0;     /* set_skinny_lanes(8): the eight-lane kernels anyway */
    #define SK_WIDE (!sk_narrow && adt_cpu_v4())
    static void skinny_set_narrow(int narrow) { sk_narrow = narrow; }
    #else
    static void skinny_set_narrow(int narrow) { (void)narrow; }
    #define SK_WIDE 0
    #endif
    static int skinny_wide(void) { return SK_WIDE; }

    static ptrdiff_t bc_max_m = SG_BC_MAX_M;
    static ptrdiff_t set_bc_max_m(ptrdiff_t m) { ptrdiff_t old = bc_max_m; bc_max_m = m; return old; }

    /* The packed GEMM (kernels/sgemm.h) for one block, in place of BLAS, the bias
       (NULL: none) added in its micro-kernel and op(A)'s row sums added into a_sums
       (NULL: none) as it is packed: returns -1 (nothing written) where it cannot
       run.  A forward x @ W^T of up to bc_max_m rows (SG_BC_MAX_M, set_broadcast_max_m)
       reads W where it lies instead (sg_bcast, in either width). */
    static int packed_gemm(int trans_a, int trans_b, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                           float alpha, const float* A, ptrdiff_t lda, const float* B,
                           ptrdiff_t ldb, float beta, float* C, ptrdiff_t ldc,
                           const float* bias, double* a_sums) {
        if (K <= 0) return -1;
        if (trans_b && !trans_a && M <= bc_max_m && a_sums == NULL)
            return ADT_LANES_CALL(SK_WIDE, sg_bcast, (M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                                      bias));
        return ADT_LANES_CALL(SK_WIDE, sg_gemm, (M, N, K, alpha, A, trans_a ? 1 : lda,
                                                 trans_a ? lda : 1, B, trans_b ? 1 : ldb,
                                                 trans_b ? ldb : 1, beta, C, ldc, bias,
                                                 a_sums));
    }

    /* The most rows skinny_nt takes (up to m): with sixteen lanes (4 x 6 tiles) it
       beats the packed GEMM up to 40 rows and ties at 48 (measured on a Xeon with
       AVX-512, 12 layers' weights from memory, 2 threads, skinny vs packed: 182 vs
       166 GFLOP/s at 32 x 2304 x 768, 229 vs 198 at 32 x 768 x 768, 180 vs 147 for
       the lm_head's at 32 rows, 192 vs 183 at 40 x 2304 x 768, 197 vs 202 at 48). */
    static ptrdiff_t skinny_nt_limit(ptrdiff_t m) {
        return SK_WIDE && m > 40 ? 40 : m;
    }

    /* The most rows the split by depth takes (up to m): all of them with sixteen
       lanes; none by default in eight, where the column split (skinny_nn) is faster
       at every row count on an AMD EPYC (Zen 3, AVX2, 2 cores), across 12 layers'
       weights from memory: 34.7 vs 40.0 ms at 16 rows, 51 vs 78 at 32, 81 vs 148 at
       64 (on a Xeon in eight lanes the depth split won up to 32 rows: 87 vs 65
       GFLOP/s at 16 x 768 x 2304).  set_depth_split_max_m overrides the default. */
    /* On AMD's AVX-512 CPUs the split by depth stops at DS_AMD_MAX_M rows: past that the
       packed GEMM split by columns is faster (Zen 4, 2 threads, 12 weights from memory,
       medians of 9 interleaved, depth split vs packed: 114-171 vs 157-194 GFLOP/s at 64
       rows, 108-147 vs 157-181 at 32, mixed at 24, 131-164 vs 128-154 at 16, 63-135 vs
       49-79 at 8); the Xeon's measurements above (depth split 237 vs 228 at 64 rows)
       keep it on the other CPUs. */
    #define DS_AMD_MAX_M 16
    static ptrdiff_t ds_max_m = -1;
    static ptrdiff_t set_ds_max_m(ptrdiff_t m) { ptrdiff_t old = ds_max_m; ds_max_m = m; return old; }
    /* Whether the products take AMD's routes (here and in _use_packed): the CPU's
       vendor, unless set_amd_routes chose (1, 0; -1: the CPU's). */
    static int amd_routes_forced = -1;
    static int amd_routes(void) {
        static int amd = -1;
        if (amd_routes_forced >= 0) return amd_routes_forced;
        if (amd < 0) amd = __builtin_cpu_is("amd") ? 1 : 0;     /* benign race */
        return amd;
    }
    static int set_amd_routes_c(int flag) {
        int old = amd_routes_forced; amd_routes_forced = flag; return old;
    }
    static ptrdiff_t depth_split_limit(ptrdiff_t m) {
        ptrdiff_t limit = ds_max_m >= 0 ? ds_max_m : (!SK_WIDE ? 0 : amd_routes() ? DS_AMD_MAX_M : m);
        return m > limit ? limit : m;
    }

    /* The greatest depth skinny_tn takes (up to k): with sixteen lanes BLAS is as
       fast at 96 and faster past it (measured as above on 64-byte-aligned weight
       gradients written afresh, skinny vs BLAS: 222 vs 154 GFLOP/s at 48 tokens x
       2304 x 768, 199 vs 176 at 64, 192 vs 202 at 96, 184 vs 220 at 128; for the
       lm_head's 213 vs 165 at 64). */
    static ptrdiff_t skinny_tn_limit(ptrdiff_t k) {
        return SK_WIDE && k > 64 ? 64 : k;
    }

    /* C[i, j] (+)= alpha * sum_p A[i, p] B[j, p]  for i < M, j0 <= j < j1. */
    static void skinny_nt(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K, float alpha,
                          const float* A, ptrdiff_t lda, const float* B, ptrdiff_t ldb,
                          int accumulate, float* C, ptrdiff_t ldc) {
        ADT_LANES_CALL(SK_WIDE, skinny_nt, (M, j0, j1, K, alpha, A, lda, B, ldb, accumulate,
                                            C, ldc));
    }

    /* C[i, j] (+)= alpha * sum_p A[i, p] B[p, j]  for i < M, j0 <= j < j1, with the
       kernel's panel on the heap; returns -1 (nothing written) when malloc fails,
       so the caller can fall back to BLAS. */
    static int skinny_nn_alloc(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K,
                               float alpha, const float* A, ptrdiff_t lda, const float* B,
                               ptrdiff_t ldb, int accumulate, float* C, ptrdiff_t ldc) {
        int wide = SK_WIDE;
        size_t cols = wide ? 48 : 24;
        size_t n = (cols * SKINNY_NN_KC + 16) * (size_t)((j1 - j0) / cols + 1);
        float* panel = (float*)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        if (panel == NULL) return -1;
        ADT_LANES_CALL(wide, skinny_nn, (M, j0, j1, K, alpha, A, lda, B, ldb, accumulate, C,
                                         ldc, panel));
        free(panel);
        return 0;
    }

    /* P = the depth share k0 <= p < k1 of A B, for i < M and j < N. */
    static void skinny_nn_depth(ptrdiff_t M, ptrdiff_t N, ptrdiff_t k0, ptrdiff_t k1,
                                const float* A, ptrdiff_t lda, const float* B, ptrdiff_t ldb,
                                float* P, ptrdiff_t ldp) {
        ADT_LANES_CALL(SK_WIDE, skinny_nn_depth, (M, N, k0, k1, A, lda, B, ldb, P, ldp));
    }

    /* C[i, j] = alpha * sum_t P_t[i, j] + beta C[i, j] (+ bias[j])  for i < M,
       j0 <= j < j1: the nparts depth shares P_t = P + t M N added up. */
    static void depth_reduce(ptrdiff_t M, ptrdiff_t N, ptrdiff_t j0, ptrdiff_t j1, int nparts,
                             const float* P, float alpha, float beta, float* C, ptrdiff_t ldc,
                             const float* bias) {
        size_t part = (size_t)M * (size_t)N;
        for (ptrdiff_t i = 0; i < M; i++) {
            const float* p = P + i * N;
            float* c = C + i * ldc;
            for (ptrdiff_t j = j0; j < j1; j++) {
                float s = p[j];
                for (int t = 1; t < nparts; t++) s += p[t * part + j];
                float v = beta == 0.0f ? alpha * s : alpha * s + beta * c[j];
                c[j] = bias != NULL ? v + bias[j] : v;
            }
        }
    }

    /* skinny_nt_w16 (kernels/skinny.h) in the CPU's width. */
    static void skinny_w16(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K,
                           const float* A, ptrdiff_t lda, const uint16_t* W, ptrdiff_t ldw,
                           float* C, ptrdiff_t ldc) {
        ADT_LANES_CALL(SK_WIDE, skinny_nt_w16, (M, j0, j1, K, A, lda, W, ldw, C, ldc));
    }

    /* dst[0:n] = the bf16 src[0:n] (the top halves of float32s) widened, exact. */
    ADT_MULTIVERSION
    static void w16_widen(float* restrict dst, const uint16_t* restrict src, ptrdiff_t n) {
        for (ptrdiff_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(dst + i, &bits, sizeof(float));
        }
    }

    /* Rows of W that gemm_w16 widens at a time where skinny_nt takes the rows of A:
       about 128 KiB of them (6 to 24 rows, a multiple of both widths' row groups);
       W16_GEMM_ROWS past skinny_nt's rows. */
    static ptrdiff_t w16_rows(ptrdiff_t K) {
        ptrdiff_t rows = ((ptrdiff_t)1 << 15) / (K > 0 ? K : 1) / 6 * 6;
        return rows < 6 ? 6 : rows > 24 ? 24 : rows;
    }
    #define W16_GEMM_ROWS 128

    /* C[i, j] (+)= alpha * sum_p A[p, i] B[p, j]  for i0 <= i < i1, j0 <= j < j1. */
    static void skinny_tn(ptrdiff_t i0, ptrdiff_t i1, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K,
                          float alpha, const float* A, ptrdiff_t lda, const float* B,
                          ptrdiff_t ldb, int accumulate, float* C, ptrdiff_t ldc) {
        ADT_LANES_CALL(SK_WIDE, skinny_tn, (i0, i1, j0, j1, K, alpha, A, lda, B, ldb,
                                            accumulate, C, ldc));
    }
    """
    void skinny_nt(Py_ssize_t M, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t K, float alpha,
                   const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb,
                   int accumulate, float* C, Py_ssize_t ldc) nogil
    int skinny_nn_alloc(Py_ssize_t M, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t K,
                        float alpha, const float* A, Py_ssize_t lda, const float* B,
                        Py_ssize_t ldb, int accumulate, float* C, Py_ssize_t ldc) nogil
    void skinny_nn_depth(Py_ssize_t M, Py_ssize_t N, Py_ssize_t k0, Py_ssize_t k1,
                         const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb,
                         float* P, Py_ssize_t ldp) nogil
    void depth_reduce(Py_ssize_t M, Py_ssize_t N, Py_ssize_t j0, Py_ssize_t j1, int nparts,
                      const float* P, float alpha, float beta, float* C, Py_ssize_t ldc,
                      const float* bias) nogil
    Py_ssize_t skinny_nt_limit(Py_ssize_t m) nogil
    Py_ssize_t skinny_tn_limit(Py_ssize_t k) nogil
    Py_ssize_t depth_split_limit(Py_ssize_t m) nogil
    Py_ssize_t set_ds_max_m(Py_ssize_t m) nogil
    int amd_routes() nogil
    int set_amd_routes_c(int flag) nogil
    Py_ssize_t set_bc_max_m(Py_ssize_t m) nogil
    Py_ssize_t sg_set_direct_max_m(Py_ssize_t m) nogil
    void skinny_set_narrow(int narrow) nogil
    int skinny_wide() nogil
    void w16_widen(float* dst, const uint16_t* src, Py_ssize_t n) nogil
    void skinny_w16(Py_ssize_t M, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t K, const float* A,
                    Py_ssize_t lda, const uint16_t* W, Py_ssize_t ldw, float* C,
                    Py_ssize_t ldc) nogil
    Py_ssize_t w16_rows(Py_ssize_t K) nogil
    enum: W16_GEMM_ROWS
    int packed_gemm(int trans_a, int trans_b, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                    float alpha, const float* A, Py_ssize_t lda, const float* B,
                    Py_ssize_t ldb, float beta, float* C, Py_ssize_t ldc,
                    const float* bias, double* a_sums) nogil
    int adt_cpu_v4() nogil
    void skinny_tn(Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t K,
                   float alpha, const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb,
                   int accumulate, float* C, Py_ssize_t ldc) nogil

# Products with at most this many rows (and no transposed A) use the skinny kernels.
SKINNY_MAX_M = 64
cdef Py_ssize_t _skinny_max_m = SKINNY_MAX_M


def set_skinny_max_m(Py_ssize_t m):
    """Route products with at most ``m`` rows to the skinny kernels (0: always BLAS).

    For tests and benchmarks; returns the previous value."""
    global _skinny_max_m
    old = _skinny_max_m
    _skinny_max_m = m
    return old


def set_depth_split_max_m(Py_ssize_t m):
    """Split products with at most ``m`` rows (and no transposed operand) by depth
    across the threads; -1 restores the default (with sixteen lanes every skinny
    product, up to 16 rows on AMD's CPUs; none with eight).

    For tests and benchmarks; returns the previous value."""
    if m < -1:
        raise ValueError(f"m must be -1 or more, got {m}")
    return set_ds_max_m(m)


def set_broadcast_max_m(Py_ssize_t m):
    """Run the packed route's forward products x @ W^T of at most ``m`` rows (default
    128; 0: none) through the W-broadcast kernel (kernels/sgemm.h's sg_bcast, in eight
    or sixteen lanes), the others through the packed GEMM.

    For tests and benchmarks; returns the previous value."""
    if m < 0:
        raise ValueError(f"m must be 0 or more, got {m}")
    return set_bc_max_m(m)


def skinny_lanes():
    """Vector lanes of the skinny kernels on this CPU: 16 with AVX-512, else 8."""
    return 16 if skinny_wide() else 8


def set_skinny_lanes(int lanes):
    """Run the skinny kernels in ``lanes`` (8, or 16 where the CPU has AVX-512).

    For tests and benchmarks, so that both widths are checked on a machine with
    both; not thread-safe against running kernels.  Returns the previous width."""
    if lanes not in (8, 16):
        raise ValueError(f"lanes must be 8 or 16, got {lanes!r}")
    if lanes == 16 and not adt_cpu_v4():
        raise ValueError("16 lanes need a CPU with AVX-512 (x86-64-v4)")
    old = skinny_lanes()
    skinny_set_narrow(lanes == 8)
    return old


# Which products go to the packed GEMM (kernels/sgemm.h) instead of BLAS or the
# skinny kernels: 0 none, 1 where it was measured faster, 2 all (for tests).
# Sixteen lanes, measured on a 2-core Xeon with AVX-512 against OpenBLAS 0.3.30
# (SciPy's, SkylakeX kernels) and the skinny kernels, GPT-2 124M shapes,
# interleaved runs: it wins on the input gradient dout @ W (no transposition) from
# 16 to 512 rows, split by columns, e.g. across 12 layers' weights from memory
# 9.5 vs 10.4 ms (skinny) and 21 ms (BLAS) at 24 x 2304 x 768, 17 vs 21 ms (skinny)
# for the lm_head's at 24 rows, 43 vs 58 ms (BLAS) at 256 x 2304 x 768, 82 vs 94
# at 512 rows, 76 vs 96 ms for the lm_head's at 256 rows (up to 64 rows the split
# by depth in gemm() comes first, with two threads or more).  At 1024 rows it is a
# tie (a GPT-2 step at B=4, T=256: 3189 vs 3163 ms with BLAS); the skinny kernel
# stays faster at 8 rows, BLAS at 8192 rows (289-304 against 223-259 GFLOP/s) and
# on the weight-gradient products.
# The forward x @ W^T too, from 41 to 128 rows, once its transposed weight is packed
# 16 x 16 at a time through registers: across 12 layers' weights from memory, 16.5
# vs 20.8 ms (BLAS) at 64 x 2304 x 768, 7.7 vs 8.9 ms at 128 x 768 x 768; skinny_nt
# stays faster up to 40 rows, BLAS from 256.  That route now runs the W-broadcast
# kernel (sg_bcast: W read where it lies, x packed): Zen 4, 2 threads, 12 weights
# from memory, medians of 9 interleaved, against the packed GEMM: 1.08-1.33x at 64
# rows (198-206 GFLOP/s, 84-88% of the physical peak), 1.13-1.49x at 41-48,
# 0.99-1.16x at 128; one thread 1.08-1.19x at 64 rows (100-104 GFLOP/s).
# Eight lanes (6 x 16 tiles), measured on a 2-core AMD EPYC (Zen 3, AVX2) against
# OpenBLAS 0.3.30 (Haswell/Zen kernels) and the eight-lane skinny kernels, all four
# products of 12 layers with their weights from memory, 2 threads: the input
# gradient from 16 to 512 rows (75.6 vs 81.7 ms skinny at 64 rows, 138 vs 149 BLAS
# at 128, tied at 512; BLAS 3% faster at 1024); the forward from 41 to 256 rows
# (78.6 vs 82.7 ms skinny at 64, 141 vs 147 BLAS at 128; skinny_nt faster up to 32,
# tied at 48); and here also the weight gradient dout^T @ x at 16 to 512 tokens,
# split by rows or columns (66 vs 93 ms skinny_tn and 85 BLAS at 64 tokens written
# afresh, 124 vs 143 BLAS at 128, 39.8 vs 47.8 skinny at 32; skinny_tn faster at 8
# tokens, tied at 16), and at every depth past that once tall products pack their
# op(A) once per 256 depths (sgemm.h's SG_NC_TALL; single products, 2 threads,
# packed vs BLAS vs PyTorch's MKL: 19.7 vs 20.4 vs 19.1 ms at 2304 x 768 x 1024,
# 53.8 vs 56.8 vs 53.5 at 768 x 768 x 8192, 158 vs 169 vs 157 at 2304 x 768 x 8192,
# 217 vs 219 vs 214 at 3072 x 768 x 8192).
cdef int _packed_mode = 1
cdef enum:
    PACKED_NN_MIN_M = 16
    PACKED_NN_MAX_M = 512
    PACKED_NT_MIN_M = 41
    PACKED_NT_MAX_M = 128
    PACKED8_NT_MAX_M = 256
    PACKED8_TN_MIN_K = 16
    PACKED_AMD_NT_MAX_M = 512
    PACKED_AMD_NN_MAX_M = 1024


# On AMD's AVX-512 CPUs (OpenBLAS runs its SkylakeX kernels there: it knows neither
# Zen 4 nor Zen 5) the packed GEMM wins more: the weight gradient at every token
# count past the skinny kernel's, the forward up to 512 rows, the input gradient up to
# 1024, split by rows or columns.  Zen 4, GPT-2 124M's five layers, 12 weights from
# memory (the head's one), medians of 3 interleaved rounds, % of the physical peak,
# BLAS / packed (2026-11-28): 2 threads, weight gradient 73-85 / 84-92 at 128 tokens,
# 83-85 / 89-94 at 256-512, 71-84 / 80-89 at 1024, 77-85 / 86-89 at 4096, 75-87 /
# 88-91 at 8192; forward 77-83 / 85-91 at 256, 82-88 / 82-93 at 512, 76-89 / 76-86
# at 1024 (mixed; BLAS from 4096: 86-91 / 85-89); input gradient 76-84 / 80-90 at
# 1024, 86-90 / 83-89 at 4096.  One thread: weight gradient 86-89 / 91-95 at 1024
# tokens, 85-90 / 89-94 at 4096; forward 77-87 / 82-92 at 256; input gradient 88-91 /
# 93-95 at 1024, 89-92 / 86-90 at 4096.
cdef inline bint _use_packed(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t K,
                             bint by_columns) noexcept nogil:
    if _packed_mode == 2:
        return True
    if _packed_mode != 1:
        return False
    if not skinny_wide() and trans_a:
        return not trans_b and K >= PACKED8_TN_MIN_K
    if skinny_wide() and amd_routes():
        if trans_a:
            return not trans_b and K > skinny_tn_limit(_skinny_max_m)
        if trans_b:
            return PACKED_NT_MIN_M <= M <= PACKED_AMD_NT_MAX_M
        return PACKED_NN_MIN_M <= M <= PACKED_AMD_NN_MAX_M
    if trans_a or not by_columns:
        return False
    if trans_b:
        return PACKED_NT_MIN_M <= M <= (PACKED_NT_MAX_M if skinny_wide() else PACKED8_NT_MAX_M)
    return PACKED_NN_MIN_M <= M <= PACKED_NN_MAX_M


def set_amd_routes(flag):
    """Route the sixteen-lane products as on AMD's CPUs (True), as on the others
    (False), or as this CPU's vendor says (None, the default): the depth split's rows
    and the packed GEMM's share.  For tests and benchmarks; returns the previous
    setting."""
    if flag is not None and flag is not True and flag is not False:
        raise ValueError(f"flag must be True, False or None, got {flag!r}")
    old = set_amd_routes_c(-1 if flag is None else int(flag))
    return None if old < 0 else bool(old)


def packed_route(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K):
    """Whether a product op(A) (M, K) @ op(B) (K, N) on more than one thread goes to
    the packed GEMM (kernels/sgemm.h) under the present routes: the decision alone,
    for tests."""
    return _use_packed(trans_a, trans_b, M, K, N >= M)


def set_direct_b_max_m(m):
    """The most rows at which the packed GEMM reads a B whose rows run along the
    columns (dout @ W's weight) where it lies instead of packing it (kernels/sgemm.h);
    None: the default (128 rows in sixteen lanes, none in eight).  The same bits
    either way.  For tests and benchmarks; returns the previous setting."""
    if m is not None and (not isinstance(m, int) or m < 0):
        raise ValueError(f"m must be None or an int >= 0, got {m!r}")
    old = sg_set_direct_max_m(-1 if m is None else m)
    return None if old < 0 else old


def set_packed_gemm(int mode):
    """Route products to the packed GEMM (kernels/sgemm.h): 0 never (BLAS or the
    skinny kernels), 1 where it was measured faster, 2 always.  For tests and
    benchmarks; returns the previous mode."""
    global _packed_mode
    if mode not in (0, 1, 2):
        raise ValueError(f"mode must be 0, 1 or 2, got {mode!r}")
    old = _packed_mode
    _packed_mode = mode
    return old


cdef void sgemm_rowmajor(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N,
                         Py_ssize_t K, float alpha, const float* A, Py_ssize_t lda,
                         const float* B, Py_ssize_t ldb, float beta, float* C,
                         Py_ssize_t ldc) noexcept nogil:
    # Row-major C (M, N) = alpha op(A) (M, K) op(B) (K, N) + beta C.  BLAS is
    # column-major: the same memory holds C.T = op(B).T op(A).T, so B goes first.
    cdef Py_ssize_t i, j
    cdef char ta = b'T' if trans_b else b'N'
    cdef char tb = b'T' if trans_a else b'N'
    cdef int m = <int>N, n = <int>M, k = <int>K
    cdef int la = <int>ldb, lb = <int>lda, lc = <int>ldc
    if M == 0 or N == 0:
        return
    if K == 0:
        for i in range(M):
            for j in range(N):
                C[i * ldc + j] = 0.0 if beta == 0.0 else beta * C[i * ldc + j]
        return
    sgemm(&ta, &tb, &m, &n, &k, &alpha, <float*>B, &la, <float*>A, &lb, &beta, C, &lc)


cdef bint _block(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                 float alpha, const float* A, Py_ssize_t lda, const float* B,
                 Py_ssize_t ldb, float beta, float* C, Py_ssize_t ldc, const float* bias,
                 double* a_sums, bint by_columns, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    # This block of C: columns lo:hi of every row, or rows lo:hi of every column.
    # Its rows r0:r1 come from those rows of op(A), its columns c0:c1 from those
    # columns of op(B).  a_sums (NULL: none) is indexed like op(A)'s rows; True
    # where the block added its rows' sums into it (only the packed GEMM does).
    cdef Py_ssize_t r0 = 0 if by_columns else lo, r1 = M if by_columns else hi
    cdef Py_ssize_t c0 = lo if by_columns else 0, c1 = hi if by_columns else N
    cdef const float* A_block = A + r0 * (1 if trans_a else lda)
    cdef const float* B_block = B + c0 * (ldb if trans_b else 1)
    cdef float* C_block = C + r0 * ldc + c0
    cdef Py_ssize_t i, j
    cdef float* row
    cdef bint simple_beta = beta == 0.0 or beta == 1.0
    if hi <= lo:
        return True
    if _use_packed(trans_a, trans_b, M, K, by_columns) and packed_gemm(
            trans_a, trans_b, r1 - r0, c1 - c0, K, alpha, A_block, lda, B_block, ldb, beta,
            C_block, ldc, NULL if bias == NULL else bias + c0,
            NULL if a_sums == NULL else a_sums + r0) == 0:
        return True                               # the bias and the sums are in
    elif trans_a and not trans_b and K <= skinny_tn_limit(_skinny_max_m) and simple_beta:
        # A small-depth transposed product (dW at few tokens).
        skinny_tn(r0, r1, c0, c1, K, alpha, A, lda, B, ldb, beta == 1.0, C, ldc)
    elif (by_columns and not trans_a and M <= _skinny_max_m and simple_beta
            and ((trans_b and M <= skinny_nt_limit(_skinny_max_m))
                 or (not trans_b and skinny_nn_alloc(M, lo, hi, K, alpha, A, lda, B, ldb,
                                                     beta == 1.0, C, ldc) == 0))):
        if trans_b:
            skinny_nt(M, lo, hi, K, alpha, A, lda, B, ldb, beta == 1.0, C, ldc)
    elif bias != NULL and beta == 0.0:
        # C starts as the bias and BLAS adds the product: with beta 0 it would
        # first clear C, and the bias would then take another pass over it.  On the
        # Zen 3 VM, x @ W^T + b at 8192 rows cost 1-4 ms more than x @ W^T that
        # way (158.8 vs 155.0 ms at 2304 x 768, 55.9 vs 53.7 at 768 x 768), now
        # the same (156.8 vs 156.9, 52.7 vs 52.7).
        for i in range(r0, r1):
            memcpy(C + i * ldc + c0, bias + c0, (c1 - c0) * sizeof(float))
        sgemm_rowmajor(trans_a, trans_b, r1 - r0, c1 - c0, K, alpha, A_block, lda, B_block,
                       ldb, 1.0, C_block, ldc)
        return a_sums == NULL
    else:
        sgemm_rowmajor(trans_a, trans_b, r1 - r0, c1 - c0, K, alpha, A_block, lda, B_block,
                       ldb, beta, C_block, ldc)
    if bias != NULL:
        for i in range(r0, r1):
            row = C + i * ldc
            for j in range(c0, c1):
                row[j] = row[j] + bias[j]
    return a_sums == NULL


cdef int _depth_split(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, float alpha, const float* A,
                      Py_ssize_t lda, const float* B, Py_ssize_t ldb, float beta, float* C,
                      Py_ssize_t ldc, const float* bias, int nt) noexcept nogil:
    # C = alpha A B + beta C (+ bias) with few rows, split by depth: each thread
    # sums its share of the rows of B into its own M x N buffer (skinny_nn_depth),
    # then each adds up a block of columns.  -1 (nothing written) when the buffers
    # cannot be had.
    cdef size_t part = <size_t>M * <size_t>N
    cdef float* P = <float*>aligned_alloc(64, (nt * part * sizeof(float) + 63) // 64 * 64)
    cdef Py_ssize_t per = (K + nt - 1) // nt
    cdef Py_ssize_t cols = ((N + nt - 1) // nt + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK
    cdef Py_ssize_t k0, j0
    cdef int t
    if P == NULL:
        return -1
    for t in prange(nt, schedule='static', chunksize=1, nogil=True, num_threads=nt):
        k0 = t * per
        skinny_nn_depth(M, N, min(k0, K), min(k0 + per, K), A, lda, B, ldb, P + t * part, N)
    for t in prange(nt, schedule='static', chunksize=1, nogil=True, num_threads=nt):
        j0 = t * cols
        if j0 < N:
            depth_reduce(M, N, j0, min(j0 + cols, N), nt, P, alpha, beta, C, ldc, bias)
    free(P)
    return 0


cdef bint gemm(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
               float alpha, const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb,
               float beta, float* C, Py_ssize_t ldc, const float* bias, double* a_sums,
               int n_threads) noexcept nogil:
    """C = alpha op(A) op(B) + beta C (+ bias per column), split over n_threads.

    a_sums (NULL: none): where the product's path packs op(A) (the packed GEMM), the
    sum of each row of op(A) (not times alpha) is added into a_sums[0:M] on the way,
    in float64 in order of depth (the bias gradient of dW = dout^T x, without a pass
    of its own over dout).  Returns whether it was; where not, a_sums holds no sums
    or only some, and the caller sums op(A) itself."""
    cdef bint by_columns = N >= M
    cdef Py_ssize_t extent = N if by_columns else M
    cdef Py_ssize_t per, t, lo, hi
    cdef int nt = n_threads
    cdef int missed = 0
    cdef int* missed_p = &missed            # shared by the threads (set, never read)
    cdef Py_ssize_t i, j
    if M == 0 or N == 0:
        return a_sums == NULL                     # the caller sums op(A) if it asked
    if K == 0:
        # An empty product: C = beta C (+ bias), here, so that no path below (the
        # skinny kernels leave C as it was) need handle it.  op(A)'s row sums are 0.
        for i in range(M):
            for j in range(N):
                C[i * ldc + j] = ((0.0 if beta == 0.0 else beta * C[i * ldc + j])
                                  + (0.0 if bias == NULL else bias[j]))
        return True
    if M * N * K < PARALLEL_MIN_FLOPS or extent < 2 * MIN_BLOCK:
        nt = 1
    if nt > extent // MIN_BLOCK:
        nt = <int>(extent // MIN_BLOCK)
    # Blocks of `per` (in multiples of 16 columns, so that every block starts on a
    # cache line), each at least PARALLEL_MIN_FLOPS multiply-adds: below about 100^3
    # OpenBLAS's SkylakeX build runs its small-matrix kernels, which sum in another
    # order than its blocked ones, so that a product of 40 x 64 x 600 (dW = dout^T x at
    # 600 tokens) cut in two blocks got other bits than on one thread.  The loop leaves
    # `per` set for the nt it settles on.
    while nt > 1:
        per = ((extent + nt - 1) // nt + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK
        if (min(per, extent - (nt - 1) * per) * (M if by_columns else N) * K
                >= PARALLEL_MIN_FLOPS):
            break
        nt -= 1
    if nt <= 1:
        return _block(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias,
                      a_sums, by_columns, 0, extent)
    if (not trans_a and not trans_b and M <= depth_split_limit(_skinny_max_m)
            and K >= DEPTH_SPLIT_MIN_K * nt
            and _depth_split(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias, nt) == 0):
        return a_sums == NULL
    # Split by columns, every block packs all of op(A): the first one sums it.
    for t in prange(nt, schedule='static', chunksize=1, nogil=True, num_threads=nt):
        lo = t * per
        hi = lo + per
        if hi > extent:
            hi = extent
        if not _block(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias,
                      NULL if by_columns and lo > 0 else a_sums, by_columns, lo, hi):
            missed_p[0] = 1
    return not missed


cdef enum:
    # gemm_w16: up to this many rows of A, W widened in registers (skinny_nt_w16), in
    # groups of this many rows of W a task.
    W16_FUSED_MAX_M = 4
    W16_FUSED_ROWS = 64


cdef int gemm_w16(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, const float* A, Py_ssize_t lda,
                  const uint16_t* W, Py_ssize_t ldw, const float* bias, float* C,
                  Py_ssize_t ldc, int n_threads) except -1 nogil:
    """C (M, N) = A (M, K) @ W.T (+ bias), A float32, W (N, K) bf16 (uint16): a
    weight-only bf16 product, for decoding from bf16 weights (gpt2.generate).  W is
    read once from memory at two bytes an element: up to W16_FUSED_MAX_M rows of A it
    is widened (exact) in registers (skinny_nt_w16); past them a group of its rows at a
    time into per-thread float32 scratch, each group then multiplied by skinny_nt, or
    by BLAS past skinny_nt's rows (gemm()'s own routing, the packed GEMM at 41-256 rows,
    made a prompt's 128 rows 0.78-0.89x of float32 against BLAS's 0.95-1.17x: it packs
    A again for every group).  The groups are cut
    from column 0 whatever the thread count, so the bits do not depend on it."""
    cdef bint fused = M <= W16_FUSED_MAX_M
    cdef bint skinny = M <= skinny_nt_limit(_skinny_max_m)
    cdef Py_ssize_t step = (W16_FUSED_ROWS if fused else w16_rows(K) if skinny
                            else W16_GEMM_ROWS)
    cdef Py_ssize_t groups = (N + step - 1) // step, gi, j, g, r, i, c
    cdef int nt = n_threads
    cdef float* scratch = NULL
    cdef float* mine
    if M == 0 or N == 0:
        return 0
    if K == 0:
        for i in range(M):
            for c in range(N):
                C[i * ldc + c] = 0.0 if bias == NULL else bias[c]
        return 0
    if M * N * K < PARALLEL_MIN_FLOPS:
        nt = 1
    if nt > groups:
        nt = <int>groups
    if not fused:
        scratch = <float*>aligned_alloc(64, (<size_t>nt * step * K * sizeof(float) + 63) // 64 * 64)
        if scratch == NULL:
            with gil:
                raise MemoryError(f"gemm_w16: cannot allocate {nt} x {step} x {K} floats of "
                                  f"scratch")
    for gi in prange(groups, schedule='static', nogil=True, num_threads=nt):
        j = gi * step
        g = min(step, N - j)
        if fused:
            skinny_w16(M, j, j + g, K, A, lda, W, ldw, C, ldc)
        else:
            mine = scratch + omp_get_thread_num_safe() * step * K
            for r in range(g):
                w16_widen(mine + r * K, W + (j + r) * ldw, K)
            if skinny:
                skinny_nt(M, 0, g, K, 1.0, A, lda, mine, K, 0, C + j, ldc)
            else:
                sgemm_rowmajor(False, True, M, g, K, 1.0, A, lda, mine, K, 0.0, C + j, ldc)
        if bias != NULL:
            for i in range(M):
                for c in range(g):
                    C[i * ldc + j + c] = C[i * ldc + j + c] + bias[j + c]
    free(scratch)
    return 0


def gemm_rowmajor(c, a, b, bias=None, *, bint trans_a=False, bint trans_b=False,
                  float alpha=1.0, float beta=0.0, n_threads=None):
    """``c = alpha op(a) @ op(b) + beta c (+ bias)`` for C-contiguous float32 2-D arrays.

    The Python entry to ``gemm``, for tests and benchmarks; shapes are checked here.
    """
    for name, arr in (("c", c), ("a", a), ("b", b)):
        checked_data(name, arr, cnp.NPY_FLOAT32, None, name == "c")
        if arr.ndim != 2:
            raise ValueError(f"gemm_rowmajor: {name} must be 2-D, got shape {arr.shape}")
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    K2, N = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if K != K2 or c.shape != (M, N):
        raise ValueError(f"gemm_rowmajor: op(a) is {(M, K)}, op(b) is {(K2, N)}, c is {c.shape}")
    cdef const float* bias_p = NULL
    if bias is not None:
        bias_p = <const float*>checked_data("bias", bias, cnp.NPY_FLOAT32, (N,), False)
    check_disjoint((("c", c),), (("a", a), ("b", b), ("bias", bias)))
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t m = M, n = N, k = K, lda = a.shape[1], ldb = b.shape[1], ldc = N
    cdef const float* ap = <const float*>cnp.PyArray_DATA(a)
    cdef const float* bp = <const float*>cnp.PyArray_DATA(b)
    cdef float* cp = <float*>cnp.PyArray_DATA(c)
    with nogil:
        gemm(trans_a, trans_b, m, n, k, alpha, ap, lda, bp, ldb, beta, cp, ldc, bias_p, NULL,
             nt)
    return c
