# C contract of kernels.llama: the nogil cores of Llama's RMSNorm, rotary embedding and
# SwiGLU, for other Cython modules to cimport.
#
# Pointers are C-contiguous float32 buffers.  N = B*T rows of C channels; rrms (N,).
# RoPE rows are (B*T, W), W = n_heads * 2h, the tables cos/sin (maxT, h), row r at
# position r % T.  SwiGLU rows gate_up (N, 2I) = [gate | up], out (N, I).  Forward
# cores overwrite their outputs; backward cores add (+=) into each gradient unless its
# ow_* flag (overwrite) is set, when they write it without reading it.  Nothing here
# checks its arguments: the def wrappers in llama.pyx do that once.

cdef void rmsnorm_forward_core(float* out, float* rrms, const float* inp, const float* weight,
                               float eps, Py_ssize_t N, Py_ssize_t C,
                               int n_threads) noexcept nogil
# -1 with a Python MemoryError set when the partial sums of dweight cannot be allocated.
cdef int rmsnorm_backward_core(float* dinp, float* dweight, const float* dout,
                               const float* inp, const float* weight, const float* rrms,
                               Py_ssize_t N, Py_ssize_t C, int n_threads, bint ow_dinp,
                               bint ow_dweight) except -1 nogil
# out may be inp itself (in place).
cdef void rope_forward_core(float* out, const float* inp, const float* cos, const float* sin,
                            Py_ssize_t B, Py_ssize_t T, Py_ssize_t W, Py_ssize_t h,
                            Py_ssize_t n_rot_heads, int n_threads) noexcept nogil
# dinp may be dout itself, and then ow must be set.
cdef void rope_backward_core(float* dinp, const float* dout, const float* cos, const float* sin,
                             Py_ssize_t B, Py_ssize_t T, Py_ssize_t W, Py_ssize_t h,
                             Py_ssize_t n_rot_heads, int n_threads, bint ow) noexcept nogil
cdef void swiglu_forward_core(float* out, const float* gate_up, Py_ssize_t N, Py_ssize_t I,
                              int n_threads) noexcept nogil
cdef void swiglu_backward_core(float* dgate_up, const float* dout, const float* gate_up,
                               Py_ssize_t N, Py_ssize_t I, int n_threads,
                               bint ow) noexcept nogil
