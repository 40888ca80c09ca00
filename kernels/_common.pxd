# C contract of kernels._common: the machinery every kernel module shares.  The
# boundary checks of the def wrappers, the thread count, the vector width and build
# the lane kernels run in, streamed stores, zeroing, and the column sums of the
# weight gradients of layernorm and RMSNorm.  Its Python switches
# (set_vector_lanes, set_eight_lane_clones, set_stream_min_bytes) are in _common.pyx;
# kernels and kernels.layers re-export them.

cimport numpy as cnp


cdef enum:
    # Elements below which a kernel runs on one thread by default.
    PARALLEL_MIN_WORK = 65536
    # Channel slices are whole 64-byte cache lines so threads never share one.
    LINE_FLOATS = 16
    # Row blocks of a column sum's partial sums (see column_sum_blocks).
    COLUMN_SUM_BLOCKS = 32


# ---------------------------------------------------------------------------
# Boundary checks

# The data pointer of `arr` after checking that it is an aligned native-endian ndarray
# of NumPy type number `typenum`, C-contiguous, of shape `shape` (None: any) and, when
# `writable`, writeable; otherwise it raises TypeError/ValueError naming `name`.
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
# Checks `arr`, of NumPy type `ft`, as rows: (B, T, C) or (N, C) with C >= 1; returns
# (N, C, its leading shape).
cdef tuple check_rows(str name, arr, int ft, bint writable)
# The NumPy type number the naive twins run in: float64 for float64 arrays, else
# float32 (checked_data then names any other dtype).
cdef int float_type(object arr) noexcept


cdef inline float* f32_data(arr):
    # The data of a float32 array that checked_data has passed.
    return <float*>cnp.PyArray_DATA(<cnp.ndarray>arr)


# ---------------------------------------------------------------------------
# Threads and overwrite flags

# The thread count of a kernel call: kernels.threads' policy for None, else the
# checked explicit count.
cdef int resolve_threads(object n_threads) except -1
# ``overwrite`` (a bool, or one bool per name) as a tuple of bools, one per output name.
cpdef tuple overwrite_flags(overwrite, tuple names)
# nt, or 1 for work below PARALLEL_MIN_WORK elements under the default policy
# (n_threads None): waking a second thread costs microseconds when the machine is
# idle and milliseconds when it is busy, more than such a kernel takes.
#
# SERIAL: on one thread a core runs its tasks in a plain loop, the same tasks in the
# same order as its prange (so the same bits), without entering a parallel region:
# libgomp's team set-up and barrier for a team of one cost about 0.4 us a call (2-core
# Xeon), more than the arithmetic of a 4x4 layernorm or GELU.
cdef int serial_if_small(int nt, object n_threads, Py_ssize_t work) noexcept


# ---------------------------------------------------------------------------
# Vector width and build, streamed stores, zeroing

# Whether the element-wise and row kernels (layers, loss, llama, attention) run their
# sixteen-lane AVX-512 paths: the CPU has them and set_vector_lanes(8) is not in force.
cdef bint lanes_wide() noexcept nogil
# The build of the layers, loss and llama kernels: 1 sixteen lanes, 2 eight lanes built
# for x86-64-v3, 0 eight lanes as target clones (kernels/simd.h's ADT_LANES_CALL_X3).
cdef int lanes_kind() noexcept nogil
# Whether an output at `out`, written in rows of `row` floats by a kernel that moves
# `total_bytes` in all, takes non-temporal stores: at least stream_min_bytes moved,
# the output 64-byte aligned and its rows whole cache lines.
cdef bint use_stream(const void* out, Py_ssize_t total_bytes, Py_ssize_t row) noexcept nogil
# buf[0:n] = 0 on n_threads (streamed past the caches for large pieces on AVX-512)
cdef void zero_core(float* buf, Py_ssize_t n, int n_threads) noexcept nogil


# ---------------------------------------------------------------------------
# Column sums (the weight gradients of layernorm and RMSNorm): each row block sums its
# rows into its own row of partial sums, then each thread owns a slice of the
# channels and adds the blocks up in order, so results do not depend on the thread
# count.

cdef inline Py_ssize_t column_sum_blocks(Py_ssize_t N) noexcept nogil:
    # A count set by N alone (never by the thread count): up to COLUMN_SUM_BLOCKS, at
    # least 64 rows each, so that zeroing and summing the partial rows stays small
    # next to the rows themselves.
    return max(<Py_ssize_t>1, min(N // 64, <Py_ssize_t>COLUMN_SUM_BLOCKS))


cdef inline Py_ssize_t slice_width(Py_ssize_t C, int n_slices) noexcept nogil:
    # Channels per slice when C is split n_slices ways, in whole cache lines; never 0,
    # which the slice count divides by (C = 0 gives no slices).
    cdef Py_ssize_t w = max((C + n_slices - 1) // n_slices, <Py_ssize_t>1)
    return (w + LINE_FLOATS - 1) // LINE_FLOATS * LINE_FLOATS


# dst[c] += (= when overwrite) the sum over blocks of parts[block, c] (n_blocks rows
# of C), blocks in order, for c in [c0, c1).  parts' first row is summed into.
cdef void reduce_blocks(float* dst, float* parts, Py_ssize_t n_blocks, Py_ssize_t C,
                        Py_ssize_t c0, Py_ssize_t c1, bint overwrite) noexcept nogil
