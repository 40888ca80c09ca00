# C contract of kernels.optim: AdamW and gradient-norm kernels over flat float32 buffers
# of n elements.

# grad_scale: multiplies each gradient as it is read (1: none; clipping by norm).
# zero_grads: also set grads to 0 in the same pass (grads is read-only otherwise).
cdef void adamw_core(float* params, float* grads, float* m, float* v, Py_ssize_t n,
                     int step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, float grad_scale, bint zero_grads,
                     int n_threads) noexcept nogil
cdef void scale_core(float* buf, float factor, Py_ssize_t n, int n_threads) noexcept nogil
# Sum of squares accumulated in float64, in a fixed order whatever the thread count;
# -1 (with a Python MemoryError set) when its scratch cannot be allocated.
cdef double sum_squares_core(const float* buf, Py_ssize_t n, int n_threads) except? -1 nogil
