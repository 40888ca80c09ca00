# Parallel row-major sgemm driven by our own OpenMP threads, each calling BLAS
# single-threaded on its own block of the output: one thread pool in the
# process, so BLAS threads and OpenMP threads never compete for the cores.
from libc.stdint cimport uint16_t

cdef void sgemm_rowmajor(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N,
                         Py_ssize_t K, float alpha, const float* A, Py_ssize_t lda,
                         const float* B, Py_ssize_t ldb, float beta, float* C,
                         Py_ssize_t ldc) noexcept nogil

cdef bint gemm(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
               float alpha, const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb,
               float beta, float* C, Py_ssize_t ldc, const float* bias, double* a_sums,
               int n_threads) noexcept nogil

cdef int gemm_w16(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, const float* A, Py_ssize_t lda,
                  const uint16_t* W, Py_ssize_t ldw, const float* bias, float* C,
                  Py_ssize_t ldc, int n_threads) except -1 nogil
