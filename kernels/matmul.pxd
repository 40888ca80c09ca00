# Fully connected layer on kernels.gemm: the nogil cores other modules cimport.
# Shapes (row-major): inp (N, C), weight (OC, C), bias (OC,) or NULL, out (N, OC).

cdef void matmul_forward_c(float* out, const float* inp, const float* weight,
                           const float* bias, Py_ssize_t N, Py_ssize_t C,
                           Py_ssize_t OC, int n_threads) noexcept nogil

cdef void matmul_backward_c(float* dinp, float* dweight, float* dbias,
                            const float* dout, const float* inp, const float* weight,
                            Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC,
                            int n_threads, bint ow_dinp, bint ow_dweight,
                            bint ow_dbias) noexcept nogil
