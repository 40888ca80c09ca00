# Causal self-attention, multi-head or grouped-query: the nogil cores other modules
# cimport.  qkv (B, T, C + 2 NKV hs) holds [q | k | v] head-major: NH query heads
# (head h at columns h*hs..), then NKV key heads, then NKV value heads, query head h
# reading kv head h // (NH / NKV) (NKV = NH: GPT-2's (B, T, 3C)); C = NH hs.
# out (B, T, C); lse (B, NH, T) each query's log-sum-exp of its scaled scores, which
# with qkv and out is all the backward needs (it recomputes the probabilities).
# bf: 0 float32 products, 1 bf16 operands by VDPBF16PS (the CPU must have AVX512_BF16),
# 2 bf16 operands by its float32 twin.

cdef int attention_forward_c(float* out, float* lse, const float* qkv,
                             Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH,
                             Py_ssize_t NKV, int n_threads, int bf) except -1 nogil

cdef int attention_backward_c(float* dqkv, const float* dout, const float* qkv,
                              const float* out, const float* lse, Py_ssize_t B, Py_ssize_t T,
                              Py_ssize_t C, Py_ssize_t NH, Py_ssize_t NKV, bint overwrite,
                              int n_threads, int bf) except -1 nogil
