# C contract of kernels.layers: the nogil cores the AD runtime cimports, plus the
# vectorizable exp and the boundary checks that kernels.loss and kernels.optim share.
#
# Pointers are C-contiguous float32 buffers (ids int32).  N = B*T rows, C channels,
# n = element count.  Forward cores overwrite their outputs; backward cores add (+=)
# into every gradient.  Nothing here checks its arguments: the def wrappers in
# layers.pyx do that once.

from libc.stdint cimport int32_t, uint32_t
from libc.string cimport memcpy


cdef inline float select_f32(bint cond, float a, float b) noexcept nogil:
    # cond ? a : b through a bit mask.  A plain ?: lets gcc sink the float maths
    # that feeds it into a branch, and -ftrapping-math (the default) then forbids
    # if-converting that branch, so the loop would not vectorize.
    cdef uint32_t abits, bbits, rbits
    cdef uint32_t mask = <uint32_t>0 - <uint32_t>cond
    cdef float r
    memcpy(&abits, &a, 4)
    memcpy(&bbits, &b, 4)
    rbits = (abits & mask) | (bbits & ~mask)
    memcpy(&r, &rbits, 4)
    return r


cdef inline float fast_expf(float x) noexcept nogil:
    # exp(x) within 2 ulp on [-87.3, 88.3] (Cephes expf: Cody-Waite reduction,
    # degree-6 polynomial, exponent built in the float's bits), written so gcc
    # vectorizes loops that call it at baseline SSE2, which libc expf does not.
    # Returns exactly 0 below -87.3 (no denormals downstream) and exp(88.3) above.
    cdef float xc = select_f32(x < <float>-87.3, <float>-87.3, x)
    xc = select_f32(xc > <float>88.3, <float>88.3, xc)
    # Adding 1.5*2^23 rounds x*log2(e) to an integer held in the low mantissa bits.
    cdef float shifted = xc * <float>1.44269504088896341 + <float>12582912.0
    cdef float n = shifted - <float>12582912.0
    cdef float r = xc - n * <float>0.693359375
    r = r + n * <float>2.12194440e-4
    cdef float p = <float>1.9875691500e-4
    p = p * r + <float>1.3981999507e-3
    p = p * r + <float>8.3334519073e-3
    p = p * r + <float>4.1665795894e-2
    p = p * r + <float>1.6666665459e-1
    p = p * r + <float>5.0000001201e-1
    p = p * r * r + r + <float>1.0
    cdef uint32_t nbits, scalebits
    cdef float scale
    memcpy(&nbits, &shifted, 4)
    scalebits = (nbits - <uint32_t>0x4B400000 + <uint32_t>127) << 23
    memcpy(&scale, &scalebits, 4)
    return select_f32(x < <float>-87.3, <float>0.0, p * scale)


cdef enum:
    # Width of the accumulator arrays of the sums below: wide enough that gcc does not
    # unroll the lane loop completely (it then vectorizes the row loop with costly
    # de-interleaving shuffles), and a multiple of every SIMD width.
    SUM_LANES = 64


cdef inline float halving_sum(float* acc, Py_ssize_t n) noexcept nogil:
    # Sum of acc[0:n] (n >= 1, acc is overwritten) by repeated halving: every step is
    # an elementwise add that vectorizes, where a plain float reduction would not
    # (it needs reassociation, i.e. -ffast-math).  Pairwise, so also accurate.
    cdef Py_ssize_t h, j
    while n > 1:
        h = n // 2
        for j in range(h):
            acc[j] = acc[j] + acc[n - h + j]
        n = n - h
    return acc[0]


cdef inline float sum_f32(const float* x, Py_ssize_t n) noexcept nogil:
    cdef float acc[SUM_LANES]
    cdef Py_ssize_t i = 0, j
    for j in range(SUM_LANES):
        acc[j] = 0
    while i + SUM_LANES <= n:
        for j in range(SUM_LANES):
            acc[j] = acc[j] + x[i + j]
        i = i + SUM_LANES
    for j in range(n - i):
        acc[j] = acc[j] + x[i + j]
    return halving_sum(acc, SUM_LANES)


cdef inline float max_f32(const float* x, Py_ssize_t n) noexcept nogil:
    # max of x[0:n], n >= 1
    cdef float acc[SUM_LANES]
    cdef Py_ssize_t i = 0, j, h, m
    for j in range(SUM_LANES):
        acc[j] = x[j % n]
    while i + SUM_LANES <= n:
        for j in range(SUM_LANES):
            acc[j] = select_f32(x[i + j] > acc[j], x[i + j], acc[j])
        i = i + SUM_LANES
    for j in range(n - i):
        acc[j] = select_f32(x[i + j] > acc[j], x[i + j], acc[j])
    m = SUM_LANES
    while m > 1:
        h = m // 2
        for j in range(h):
            acc[j] = select_f32(acc[m - h + j] > acc[j], acc[m - h + j], acc[j])
        m = m - h
    return acc[0]


# Boundary checks shared by the kernel modules.  checked_data returns the data
# pointer of `arr` after checking that it is an aligned native-endian ndarray of
# NumPy type number `typenum`, C-contiguous, of shape `shape` (None: any) and,
# when `writable`, writeable; otherwise it raises TypeError/ValueError naming `name`.
cdef void* checked_data(str name, object arr, int typenum, tuple shape, bint writable) except? NULL
# Raises ValueError "<output> overlaps <other>" where an output's memory overlaps an
# input's or another output's.  `outputs` and `inputs` are (name, array) pairs (an
# array of None is skipped) that checked_data has passed: each is C-contiguous, so
# it spans [data, data + nbytes) and the check compares bounds, never elements.
# `same_ok` names (output, other) pairs that may be the very same memory (an
# in-place use the kernel documents); a partial overlap is an error all the same.
cdef int check_disjoint(tuple outputs, tuple inputs, tuple same_ok=*) except -1
# Whether every element of `arr` (a C-contiguous int32 array checked_data has passed)
# lies in [0, hi), and the product of its dimensions but the last (its rows): both
# without NumPy's Python layers, which cost microseconds per call at small sizes.
cdef bint int32_within(object arr, Py_ssize_t hi) noexcept
cdef Py_ssize_t leading_size(object arr) noexcept
# The NumPy type number the naive twins run in: float64 for float64 arrays, else
# float32 (checked_data then names any other dtype).
cdef int float_type(object arr) noexcept
cdef int resolve_threads(object n_threads) except -1
# ``overwrite`` (a bool, or one bool per name) as a tuple of bools, one per output name.
cpdef tuple overwrite_flags(overwrite, tuple names)
cdef int serial_if_small(int nt, object n_threads, Py_ssize_t work) noexcept

# Whether the element-wise and row kernels (layers, loss, attention) run their
# sixteen-lane AVX-512 paths: the CPU has them and set_vector_lanes(8) is not in force.
cdef bint lanes_wide() noexcept nogil
# The build of the layers and loss kernels: 1 sixteen lanes, 2 eight lanes built for
# x86-64-v3, 0 eight lanes as target clones (kernels/simd.h's ADT_LANES_CALL_X3).
cdef int lanes_kind() noexcept nogil
# buf[0:n] = 0 on n_threads (streamed past the caches for large pieces on AVX-512)
cdef void zero_core(float* buf, Py_ssize_t n, int n_threads) noexcept nogil

# Elements below which a kernel runs on one thread by default.
cdef enum:
    PARALLEL_MIN_WORK = 65536


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
