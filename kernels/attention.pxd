# Causal multi-head self-attention: the nogil cores other modules cimport.
# qkv (B, T, 3C) holds [q | k | v], each head-major (head h at columns h*hs..);
# out (B, T, C); att (B, NH, T, T) softmax probabilities, zero above the diagonal.

cdef int attention_forward_c(float* out, float* att, const float* qkv,
                             Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH,
                             int n_threads) except -1 nogil

cdef int attention_backward_c(float* dqkv, const float* dout, const float* qkv,
                              const float* att, Py_ssize_t B, Py_ssize_t T, Py_ssize_t C,
                              Py_ssize_t NH, int n_threads) except -1 nogil
