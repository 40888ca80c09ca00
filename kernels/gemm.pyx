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

import numpy as np

from kernels.threads import get_num_threads

cnp.import_array()

# Below this many multiply-adds one thread does the whole product.
cdef enum:
    PARALLEL_MIN_FLOPS = 1 << 20
    MIN_BLOCK = 16

cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    /* Products with few rows (M <= SKINNY_MAX_M = 64: a forward or input-gradient
       product at small B*T) stream the weight matrix once without packing it.
       BLAS packs both operands first, and at 16 rows every packed weight element
       is used only 16 times, so packing costs about as much as the arithmetic:
       OpenBLAS reached 67 GFLOP/s here, a third of this machine's sgemm peak. */

    /* C[i, j] (+)= alpha * sum_p A[i, p] B[j, p]  for i < M, j0 <= j < j1:
       4 rows of A against 3 rows of B, eight lanes along p, a horizontal sum
       per output at the end.  Rows past the edge repeat the last valid row:
       computed, never stored. */
    ADT_MULTIVERSION
    static void skinny_nt(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K, float alpha,
                          const float* A, ptrdiff_t lda, const float* B, ptrdiff_t ldb,
                          int accumulate, float* C, ptrdiff_t ldc) {
        ptrdiff_t K8 = K & ~(ptrdiff_t)7;
        for (ptrdiff_t j = j0; j < j1; j += 3) {
            ptrdiff_t nr = j1 - j < 3 ? j1 - j : 3;
            const float* b[3] = {B + j * ldb, B + (j + (nr > 1)) * ldb,
                                 B + (j + (nr > 2 ? 2 : nr - 1)) * ldb};
            for (ptrdiff_t i = 0; i < M; i += 4) {
                ptrdiff_t mr = M - i < 4 ? M - i : 4;
                const float* a[4] = {A + i * lda, A + (i + (mr > 1)) * lda,
                                     A + (i + (mr > 2 ? 2 : mr - 1)) * lda,
                                     A + (i + (mr > 3 ? 3 : mr - 1)) * lda};
                /* While the 4-row blocks of A run over these rows of B (from L1),
                   fetch the next rows of B, one per block, ahead of the streamer. */
                const float* pf = B + (j + 3 + (i / 4) % 3) * ldb;
                adt_v8 c00 = {0}, c01 = {0}, c02 = {0}, c10 = {0}, c11 = {0}, c12 = {0};
                adt_v8 c20 = {0}, c21 = {0}, c22 = {0}, c30 = {0}, c31 = {0}, c32 = {0};
                for (ptrdiff_t p = 0; p < K8; p += 8) {
                    __builtin_prefetch(pf + p);
                    adt_v8 b0 = adt_load(b[0] + p), b1 = adt_load(b[1] + p);
                    adt_v8 b2 = adt_load(b[2] + p);
                    adt_v8 x = adt_load(a[0] + p);
                    c00 += x * b0; c01 += x * b1; c02 += x * b2;
                    x = adt_load(a[1] + p);
                    c10 += x * b0; c11 += x * b1; c12 += x * b2;
                    x = adt_load(a[2] + p);
                    c20 += x * b0; c21 += x * b1; c22 += x * b2;
                    x = adt_load(a[3] + p);
                    c30 += x * b0; c31 += x * b1; c32 += x * b2;
                }
                float s[4][3] = {
                    {adt_hsum(c00), adt_hsum(c01), adt_hsum(c02)},
                    {adt_hsum(c10), adt_hsum(c11), adt_hsum(c12)},
                    {adt_hsum(c20), adt_hsum(c21), adt_hsum(c22)},
                    {adt_hsum(c30), adt_hsum(c31), adt_hsum(c32)}};
                for (ptrdiff_t p = K8; p < K; p++)
                    for (int r = 0; r < 4; r++)
                        for (int c = 0; c < 3; c++)
                            s[r][c] += a[r][p] * b[c][p];
                for (ptrdiff_t r = 0; r < mr; r++) {
                    float* row = C + (i + r) * ldc + j;
                    for (ptrdiff_t c = 0; c < nr; c++)
                        row[c] = accumulate ? row[c] + alpha * s[r][c] : alpha * s[r][c];
                }
            }
        }
    }

    #define SKINNY_NN_KC 128
    /* Floats from one strip of the panel to the next: one cache line more than
       the strip, so the strips do not all map to the same L1 sets. */
    #define SKINNY_NN_STRIP (24 * SKINNY_NN_KC + 16)

    /* C[i, j] (+)= alpha * sum_p A[i, p] B[p, j]  for i < M, j0 <= j < j1:
       4 rows of C by 24 columns (three 8-lane vectors) held in registers while p
       runs over a depth block of 256 rows of B (16 KiB of a 24-column strip,
       reused from L1 by every row block).  Columns past the last full strip
       take a scalar loop. */
    ADT_MULTIVERSION
    static void skinny_nn(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K, float alpha,
                          const float* A, ptrdiff_t lda, const float* B, ptrdiff_t ldb,
                          int accumulate, float* C, ptrdiff_t ldc, float* panel) {
        ptrdiff_t nfull = (j1 - j0) / 24 * 24, jfull = j0 + nfull;
        for (ptrdiff_t p0 = 0; p0 < K; p0 += SKINNY_NN_KC) {
            ptrdiff_t kc = K - p0 < SKINNY_NN_KC ? K - p0 : SKINNY_NN_KC;
            int acc = accumulate || p0 > 0;
            /* Copy the depth block, row by row (sequential reads the prefetchers
               follow), into 24-column strips, each contiguous: read in place, a
               strip's rows (a multiple of 1 KiB apart in GPT-2's weights) would
               fall into a few L1 sets and evict each other between row blocks. */
            for (ptrdiff_t p = 0; p < kc; p++) {
                const float* src = B + (p0 + p) * ldb + j0;
                for (ptrdiff_t s = 0; s < nfull; s += 24) {
                    float* dst = panel + s / 24 * SKINNY_NN_STRIP + 24 * p;
                    adt_store(dst, adt_load(src + s));
                    adt_store(dst + 8, adt_load(src + s + 8));
                    adt_store(dst + 16, adt_load(src + s + 16));
                }
            }
            for (ptrdiff_t j = j0; j < jfull; j += 24) {
                for (ptrdiff_t i = 0; i < M; i += 4) {
                    ptrdiff_t mr = M - i < 4 ? M - i : 4;
                    const float* a0 = A + i * lda + p0;
                    const float* a1 = A + (i + (mr > 1)) * lda + p0;
                    const float* a2 = A + (i + (mr > 2 ? 2 : mr - 1)) * lda + p0;
                    const float* a3 = A + (i + (mr > 3 ? 3 : mr - 1)) * lda + p0;
                    const float* bp = panel + (j - j0) / 24 * SKINNY_NN_STRIP;
                    /* The first row block also fetches this strip's rows of the next
                       depth block, so the copy above finds them in cache (the others
                       prefetch their own panel rows: harmless, and no branch). */
                    int ahead = i == 0 && p0 + kc < K;
                    const float* pf = ahead ? B + (p0 + kc) * ldb + j : bp;
                    ptrdiff_t pf_step = ahead ? ldb : 24;
                    adt_v8 c00 = {0}, c01 = {0}, c02 = {0}, c10 = {0}, c11 = {0}, c12 = {0};
                    adt_v8 c20 = {0}, c21 = {0}, c22 = {0}, c30 = {0}, c31 = {0}, c32 = {0};
                    for (ptrdiff_t p = 0; p < kc; p++, bp += 24, pf += pf_step) {
                        __builtin_prefetch(pf);
                        __builtin_prefetch(pf + 23);
                        adt_v8 b0 = adt_load(bp), b1 = adt_load(bp + 8), b2 = adt_load(bp + 16);
                        /* scalar * vector: gcc broadcasts with one vbroadcastss */
                        float x = a0[p];
                        c00 += x * b0; c01 += x * b1; c02 += x * b2;
                        x = a1[p];
                        c10 += x * b0; c11 += x * b1; c12 += x * b2;
                        x = a2[p];
                        c20 += x * b0; c21 += x * b1; c22 += x * b2;
                        x = a3[p];
                        c30 += x * b0; c31 += x * b1; c32 += x * b2;
                    }
                    adt_v8 t[4][3] = {{c00, c01, c02}, {c10, c11, c12},
                                      {c20, c21, c22}, {c30, c31, c32}};
                    for (ptrdiff_t r = 0; r < mr; r++) {
                        float* row = C + (i + r) * ldc + j;
                        for (int v = 0; v < 3; v++)
                            adt_store(row + 8 * v, acc ? adt_load(row + 8 * v) + alpha * t[r][v]
                                                       : alpha * t[r][v]);
                    }
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

    /* skinny_nn with its panel on the heap; returns -1 (nothing written) when
       malloc fails, so the caller can fall back to BLAS. */
    static int skinny_nn_alloc(ptrdiff_t M, ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t K,
                               float alpha, const float* A, ptrdiff_t lda, const float* B,
                               ptrdiff_t ldb, int accumulate, float* C, ptrdiff_t ldc) {
        size_t n = (size_t)SKINNY_NN_STRIP * (size_t)((j1 - j0) / 24 + 1);
        float* panel = (float*)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        if (panel == NULL) return -1;
        skinny_nn(M, j0, j1, K, alpha, A, lda, B, ldb, accumulate, C, ldc, panel);
        free(panel);
        return 0;
    }
    """
    void skinny_nt(Py_ssize_t M, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t K, float alpha,
                   const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb,
                   int accumulate, float* C, Py_ssize_t ldc) nogil
    int skinny_nn_alloc(Py_ssize_t M, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t K,
                        float alpha, const float* A, Py_ssize_t lda, const float* B,
                        Py_ssize_t ldb, int accumulate, float* C, Py_ssize_t ldc) nogil

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


cdef void _block(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                 float alpha, const float* A, Py_ssize_t lda, const float* B,
                 Py_ssize_t ldb, float beta, float* C, Py_ssize_t ldc, const float* bias,
                 bint by_columns, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    cdef Py_ssize_t i, j
    cdef float* row
    if hi <= lo:
        return
    if (by_columns and not trans_a and M <= _skinny_max_m and (beta == 0.0 or beta == 1.0)
            and (trans_b or skinny_nn_alloc(M, lo, hi, K, alpha, A, lda, B, ldb, beta == 1.0,
                                            C, ldc) == 0)):
        if trans_b:
            skinny_nt(M, lo, hi, K, alpha, A, lda, B, ldb, beta == 1.0, C, ldc)
        if bias != NULL:
            for i in range(M):
                row = C + i * ldc
                for j in range(lo, hi):
                    row[j] = row[j] + bias[j]
        return
    if by_columns:
        # Columns lo:hi of C come from columns lo:hi of op(B).
        sgemm_rowmajor(trans_a, trans_b, M, hi - lo, K, alpha, A, lda,
                       B + (lo * ldb if trans_b else lo), ldb, beta, C + lo, ldc)
        if bias != NULL:
            for i in range(M):
                row = C + i * ldc
                for j in range(lo, hi):
                    row[j] = row[j] + bias[j]
    else:
        # Rows lo:hi of C come from rows lo:hi of op(A).
        sgemm_rowmajor(trans_a, trans_b, hi - lo, N, K, alpha,
                       A + (lo if trans_a else lo * lda), lda, B, ldb, beta,
                       C + lo * ldc, ldc)
        if bias != NULL:
            for i in range(lo, hi):
                row = C + i * ldc
                for j in range(N):
                    row[j] = row[j] + bias[j]


cdef void gemm(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
               float alpha, const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb,
               float beta, float* C, Py_ssize_t ldc, const float* bias,
               int n_threads) noexcept nogil:
    """C = alpha op(A) op(B) + beta C (+ bias per column), split over n_threads."""
    cdef bint by_columns = N >= M
    cdef Py_ssize_t extent = N if by_columns else M
    cdef Py_ssize_t per, t, lo, hi
    cdef int nt = n_threads
    if M * N * K < PARALLEL_MIN_FLOPS or extent < 2 * MIN_BLOCK:
        nt = 1
    if nt > extent // MIN_BLOCK:
        nt = <int>(extent // MIN_BLOCK)
    if nt <= 1:
        _block(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias,
               by_columns, 0, extent)
        return
    # Blocks in multiples of 16 columns keep every block's start cache-line aligned.
    per = ((extent + nt - 1) // nt + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK
    for t in prange(nt, schedule='static', chunksize=1, nogil=True, num_threads=nt):
        lo = t * per
        hi = lo + per
        if hi > extent:
            hi = extent
        _block(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias,
               by_columns, lo, hi)


def gemm_rowmajor(c, a, b, bias=None, *, bint trans_a=False, bint trans_b=False,
                  float alpha=1.0, float beta=0.0, n_threads=None):
    """``c = alpha op(a) @ op(b) + beta c (+ bias)`` for C-contiguous float32 2-D arrays.

    The Python entry to ``gemm``, for tests and benchmarks; shapes are checked here.
    """
    for name, arr in (("c", c), ("a", a), ("b", b)):
        if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.ndim != 2:
            raise TypeError(f"gemm_rowmajor: {name} must be a 2-D float32 array")
        if not arr.flags.c_contiguous:
            raise ValueError(f"gemm_rowmajor: {name} must be C-contiguous")
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    K2, N = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if K != K2 or c.shape != (M, N):
        raise ValueError(f"gemm_rowmajor: op(a) is {(M, K)}, op(b) is {(K2, N)}, c is {c.shape}")
    cdef const float* bias_p = NULL
    if bias is not None:
        if (not isinstance(bias, np.ndarray) or bias.dtype != np.float32 or bias.shape != (N,)
                or not bias.flags.c_contiguous):
            raise ValueError(f"gemm_rowmajor: bias must be a contiguous float32 array of "
                             f"shape {(N,)}")
        bias_p = <const float*>cnp.PyArray_DATA(bias)
    cdef int nt = get_num_threads() if n_threads is None else n_threads
    cdef Py_ssize_t m = M, n = N, k = K, lda = a.shape[1], ldb = b.shape[1], ldc = N
    cdef const float* ap = <const float*>cnp.PyArray_DATA(a)
    cdef const float* bp = <const float*>cnp.PyArray_DATA(b)
    cdef float* cp = <float*>cnp.PyArray_DATA(c)
    with nogil:
        gemm(trans_a, trans_b, m, n, k, alpha, ap, lda, bp, ldb, beta, cp, ldc, bias_p, nt)
    return c
