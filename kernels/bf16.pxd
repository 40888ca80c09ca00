# C contract of kernels.bf16: bfloat16 conversions and the linear layer's products with
# bf16 operands and float32 accumulation, the nogil cores other modules cimport.
#
# A bf16 is a uint16_t holding the top half of a float32.  Shapes (row-major) as in
# kernels.matmul: inp (N, C), weight (OC, C), bias (OC,) or NULL, out (N, OC).  The
# weight is the step's bf16 copy of the float32 master weight (to_bf16_c once per step,
# after the optimizer); inp the bf16 copy of the layer's input, which the backward takes
# again.  Outputs and gradients are float32.  Forward cores overwrite their outputs;
# backward cores add (+=) into every gradient unless its ow_* flag is set.  Results do
# not depend on n_threads.  Nothing here checks its arguments: the def wrappers in
# bf16.pyx do that once.

from libc.stdint cimport uint16_t

# out[0:n] = inp[0:n] rounded to bf16 (nearest, ties to even; NaN stays NaN)
cdef void to_bf16_c(uint16_t* out, const float* inp, Py_ssize_t n, int n_threads) noexcept nogil
# out[0:n] = inp[0:n] widened to float32 (exact)
cdef void from_bf16_c(float* out, const uint16_t* inp, Py_ssize_t n, int n_threads) noexcept nogil

# out = inp @ weight^T + bias.  -1 with MemoryError set where scratch cannot be had
# (the emulated path widens both operands into float32 scratch; the AVX512_BF16 path
# packs blocks of them).
cdef int matmul_forward_bf16_c(float* out, const uint16_t* inp, const uint16_t* weight,
                               const float* bias, Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC,
                               int n_threads) except -1 nogil

# dinp (+)= bf16(dout) @ weight (skipped where dinp is NULL), dweight (+)= bf16(dout)^T
# @ inp, dbias (+)= the column sums of the float32 dout (float64 sums; skipped where
# dbias is NULL).  dout is float32, rounded to bf16 once for both products.
cdef int matmul_backward_bf16_c(float* dinp, float* dweight, float* dbias, const float* dout,
                                const uint16_t* inp, const uint16_t* weight, Py_ssize_t N,
                                Py_ssize_t C, Py_ssize_t OC, int n_threads, bint ow_dinp,
                                bint ow_dweight, bint ow_dbias) except -1 nogil
