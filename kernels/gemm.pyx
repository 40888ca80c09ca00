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
