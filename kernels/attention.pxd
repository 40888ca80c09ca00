# Causal multi-head self-attention: the nogil cores other modules cimport.
# qkv (B, T, 3C) holds [q | k | v], each head-major (head h at columns h*hs..);
# out (B, T, C); lse (B, NH, T) each query's log-sum-exp of its scaled scores, which
# with qkv and out is all the backward needs (it recomputes the probabilities).

cdef int attention_forward_c(float* out, float* lse, const float* qkv,
                             Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH,
                             int n_threads) except -1 nogil

cdef int attention_backward_c(float* dqkv, const float* dout, const float* qkv,
                              const float* out, const float* lse, Py_ssize_t B, Py_ssize_t T,
                              Py_ssize_t C, Py_ssize_t NH, bint overwrite,
                              int n_threads) except -1 nogil
