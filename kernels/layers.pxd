# C contract of kernels.layers: the nogil cores of GPT-2's layers, for other Cython
# modules to cimport.  What the kernel modules share (checks, threads, vector width)
# is in kernels/_common.pxd.
#
# Pointers are C-contiguous float32 buffers (ids int32).  N = B*T rows, C channels,
# n = element count.  Forward cores overwrite their outputs; backward cores add (+=)
# into every gradient.  Nothing here checks its arguments: the def wrappers in
# layers.pyx do that once.

from libc.stdint cimport int32_t


cdef void encoder_forward_core(float* out, const int32_t* ids, const float* wte, const float* wpe,
                               Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, int n_threads) noexcept nogil
# Backward cores add into their gradient outputs; a set ow_* flag writes that output
# instead (its old contents are never read).
cdef void encoder_backward_core(float* dwte, float* dwpe, const float* dout, const int32_t* ids,
                                Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, int n_threads,
                                Py_ssize_t wte_rows, Py_ssize_t wpe_rows, bint ow_wte,
                                bint ow_wpe) noexcept nogil
cdef void layernorm_forward_core(float* out, float* mean, float* rstd, const float* inp,
                                 const float* weight, const float* bias,
                                 Py_ssize_t N, Py_ssize_t C, int n_threads) noexcept nogil
cdef int layernorm_backward_core(float* dinp, float* dweight, float* dbias, const float* dout,
                                 const float* inp, const float* weight, const float* mean,
                                 const float* rstd, Py_ssize_t N, Py_ssize_t C,
                                 int n_threads, bint ow_dinp, bint ow_dweight,
                                 bint ow_dbias) except -1 nogil
cdef void gelu_forward_core(float* out, const float* inp, Py_ssize_t n, int n_threads) noexcept nogil
cdef void gelu_backward_core(float* dinp, const float* inp, const float* dout, Py_ssize_t n,
                             int n_threads, bint overwrite) noexcept nogil
cdef void residual_forward_core(float* out, const float* inp1, const float* inp2, Py_ssize_t n,
                                int n_threads) noexcept nogil
cdef void residual_backward_core(float* dinp1, float* dinp2, const float* dout, Py_ssize_t n,
                                 int n_threads, bint ow1, bint ow2) noexcept nogil
