# C contract of kernels.loss: fused softmax + cross-entropy over a padded vocabulary.
# N rows (B*T) of Vp logits, the first V real; losses, lse, dlosses (N,); targets (N,)
# int32 in [0, V), or CE_IGNORE_INDEX for a row that takes no loss (its loss 0, its dlogits
# row untouched, or 0 where written).  The forward saves each row's log-sum-exp for the
# backward.

from libc.stdint cimport int32_t

cdef enum:
    CE_IGNORE_INDEX = -100      # PyTorch's ignore_index default


cdef void softmax_crossentropy_forward_core(float* losses, float* lse, const float* logits,
                                            const int32_t* targets, Py_ssize_t N, Py_ssize_t V,
                                            Py_ssize_t Vp, int n_threads) noexcept nogil
# dlogits += (softmax(logits) - onehot(target)) * dlosses over the V real columns; padded
# columns are left as they are.
cdef void softmax_crossentropy_backward_core(float* dlogits, const float* dlosses,
                                             const float* logits, const float* lse,
                                             const int32_t* targets, Py_ssize_t N, Py_ssize_t V,
                                             Py_ssize_t Vp, int n_threads) noexcept nogil
# dlogits = (softmax(logits) - onehot(target)) * dlosses, padded columns 0: written, not
# added into; dlogits may be logits itself (in place).
cdef void softmax_crossentropy_backward_overwrite_core(float* dlogits, const float* dlosses,
                                                       const float* logits, const float* lse,
                                                       const int32_t* targets, Py_ssize_t N,
                                                       Py_ssize_t V, Py_ssize_t Vp,
                                                       int n_threads) noexcept nogil
