"""What the kernel modules share: boundary checks, threads, vector width, stores.

The checks every def wrapper runs before its nogil core (dtype, contiguity, shape,
writability, overlap of outputs with inputs), the thread count of a call, the
vector width and build the lane kernels run in (``set_vector_lanes``,
``set_eight_lane_clones``), the threshold for non-temporal stores
(``set_stream_min_bytes``), zeroing, and the in-order column sums of the
layernorm and RMSNorm weight gradients.  The C contract is kernels/_common.pxd;
``kernels`` and ``kernels.layers`` re-export the Python switches.
"""
from cython.parallel cimport prange
from libc.string cimport memcpy
from libc.stdint cimport int32_t

import numpy as np
cimport numpy as cnp

from kernels._openmp cimport checked_thread_count
from kernels.threads import get_num_threads

cnp.import_array()

cdef extern from "simd.h":
    int adt_cpu_v4() nogil
    int adt_cpu_v3() nogil


# ---------------------------------------------------------------------------
# Vector width of the element-wise and row kernels (layers, loss, llama and
# attention): sixteen lanes where the CPU has AVX-512 (x86-64-v4), eight otherwise;
# set_vector_lanes(8) forces eight, so tests check both on one machine.

cdef bint _narrow = False


cdef bint _clones8 = False


cdef int lanes_kind() noexcept nogil:
    # The build the layers, loss and llama kernels run (ADT_LANES_CALL_X3 in
    # kernels/simd.h): 1 sixteen lanes, 2 the explicit x86-64-v3 build of eight, 0 the
    # eight-lane target clones.
    if lanes_wide():
        return 1
    return 2 if adt_cpu_v3() and not _clones8 else 0


def set_eight_lane_clones(flag):
    """Run the eight-lane layers and loss kernels through their portable target
    clones (True) instead of their explicit x86-64-v3 build (False, the default on a
    CPU with AVX2), so that tests can check one against the other.  Returns the
    previous setting.  Not thread-safe against running kernels."""
    global _clones8
    if not isinstance(flag, bool):
        raise ValueError(f"flag must be a bool, got {flag!r}")
    old = _clones8
    _clones8 = flag
    return old


cdef bint lanes_wide() noexcept nogil:
    return not _narrow and adt_cpu_v4()


def vector_lanes():
    """Vector lanes of the layers, loss and attention kernels: 16 on a CPU with
    AVX-512 (unless set_vector_lanes(8)), else 8."""
    return 16 if lanes_wide() else 8


def set_vector_lanes(lanes):
    """Run the layers, loss and attention kernels in ``lanes`` (8, or 16 where the CPU
    has AVX-512).  Returns the previous width.

    For tests and benchmarks; not thread-safe against running kernels."""
    global _narrow
    if isinstance(lanes, bool) or lanes not in (8, 16):
        raise ValueError(f"lanes must be 8 or 16, got {lanes!r}")
    if lanes == 16 and not adt_cpu_v4():
        raise ValueError("16 lanes need a CPU with AVX-512 (x86-64-v4)")
    old = vector_lanes()
    _narrow = lanes == 8
    return old


# ---------------------------------------------------------------------------
# Non-temporal stores (kernels/simd.h) for fresh outputs of kernels whose streams
# together pass stream_min_bytes: beyond the last-level cache nothing of them would
# stay cached for the next pass, and the stores then skip the write-allocate read.
# On the Zen 3 VM (32 MiB L3), out = a + b with two threads, plain vs streamed:
# 0.20-0.33 vs 0.29-0.41 ms at 1.5M floats (18 MiB in all), 1.1-1.3 vs 0.72-0.85 at
# 3.1M (36 MiB), 3.3 vs 1.9 at 6.3M (72 MiB); at B=8, T=1024 (C = 768) residual
# forward 2.7-3.4 -> 2.0-2.4 ms, layernorm forward 2.4-3.0 -> 2.0-2.3, encoder
# forward 2.5-3.3 -> 2.1-2.8; GELU forward 7.7-7.8 -> 6.4-6.8 (once exp2_fast had cut
# its arithmetic: before, bound by that, it lost 10% with them), while below the
# threshold they lose there too: 0.166 -> 0.197 ms at B=4, T=64, 0.69 -> 0.79 at
# B=4, T=256 (24 MiB in all).

cdef Py_ssize_t _stream_min_bytes = 32 << 20


cdef bint use_stream(const void* out, Py_ssize_t total_bytes, Py_ssize_t row) noexcept nogil:
    return (total_bytes >= _stream_min_bytes and (<size_t>out) % 64 == 0
            and row % 16 == 0)


def stream_min_bytes():
    """Bytes a kernel must move (all its streams) before its fresh outputs are
    written with non-temporal stores."""
    return _stream_min_bytes


def set_stream_min_bytes(n):
    """Set stream_min_bytes (0: always where aligned; for tests and tuning);
    returns the previous value."""
    global _stream_min_bytes
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"stream_min_bytes must be an integer >= 0, got {n!r}")
    old = _stream_min_bytes
    _stream_min_bytes = n
    return old


# ---------------------------------------------------------------------------
# Boundary checks

_TYPE_NAMES = {cnp.NPY_FLOAT32: "float32", cnp.NPY_FLOAT64: "float64", cnp.NPY_INT32: "int32",
               cnp.NPY_UINT16: "uint16 (bf16)"}


cdef void* checked_data(str name, object arr, int typenum, tuple shape, bint writable) except? NULL:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(arr).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>arr
    if (cnp.PyArray_TYPE(a) != typenum or not cnp.PyArray_ISNOTSWAPPED(a)
            or not cnp.PyArray_ISALIGNED(a)):
        raise TypeError(f"{name} must be an aligned native {_TYPE_NAMES[typenum]} array, "
                        f"got dtype {arr.dtype}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"{name} must be C-contiguous")
    if writable and not cnp.PyArray_ISWRITEABLE(a):
        raise ValueError(f"{name} must be writable (it is an output)")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    return cnp.PyArray_DATA(a)


cdef inline bint _spans_overlap(cnp.ndarray a, cnp.ndarray b) noexcept:
    cdef char* a0 = <char*>cnp.PyArray_DATA(a)
    cdef char* b0 = <char*>cnp.PyArray_DATA(b)
    return a0 < b0 + cnp.PyArray_NBYTES(b) and b0 < a0 + cnp.PyArray_NBYTES(a)


cdef int check_disjoint(tuple outputs, tuple inputs, tuple same_ok=()) except -1:
    cdef Py_ssize_t i, j, n_out = len(outputs), n = n_out + len(inputs)
    for i in range(n_out):
        name, arr = outputs[i]
        if arr is None:
            continue
        for j in range(i + 1, n):
            other_name, other = outputs[j] if j < n_out else inputs[j - n_out]
            if other is None or not _spans_overlap(arr, other):
                continue
            if ((name, other_name) in same_ok
                    and cnp.PyArray_DATA(<cnp.ndarray>arr) == cnp.PyArray_DATA(<cnp.ndarray>other)
                    and arr.nbytes == other.nbytes):
                continue
            raise ValueError(f"{name} overlaps {other_name}: an output may share memory with "
                             f"no input and no other output"
                             + (f" (it may be {other_name} itself)"
                                if (name, other_name) in same_ok else ""))
    return 0


cdef bint int32_within(object arr, Py_ssize_t hi) noexcept:
    cdef cnp.ndarray a = <cnp.ndarray>arr
    cdef const int32_t* p = <const int32_t*>cnp.PyArray_DATA(a)
    cdef Py_ssize_t i, n = cnp.PyArray_SIZE(a)
    for i in range(n):
        if p[i] < 0 or p[i] >= hi:
            return False
    return True


cdef Py_ssize_t leading_size(object arr) noexcept:
    cdef cnp.ndarray a = <cnp.ndarray>arr
    cdef Py_ssize_t k, n = 1
    for k in range(cnp.PyArray_NDIM(a) - 1):
        n *= cnp.PyArray_DIM(a, k)
    return n


cdef tuple check_rows(str name, arr, int ft, bint writable):
    checked_data(name, arr, ft, None, writable)
    if arr.ndim not in (2, 3) or arr.shape[arr.ndim - 1] < 1:
        raise ValueError(f"{name} must have shape (B, T, C) or (N, C) with C >= 1, got {arr.shape}")
    lead = arr.shape[:arr.ndim - 1]
    return leading_size(arr), arr.shape[arr.ndim - 1], lead


cdef int float_type(object arr) noexcept:
    if isinstance(arr, np.ndarray) and arr.dtype == np.float64:
        return cnp.NPY_FLOAT64
    return cnp.NPY_FLOAT32


# ---------------------------------------------------------------------------
# Threads and overwrite flags

cdef int resolve_threads(object n_threads) except -1:
    # Resolving the policy also sets BLAS to one thread inside ours: an explicit
    # count on the first call must not leave BLAS's own pool running (2 x 2
    # threads on 2 cores made a 16-row product 20 times slower).
    cdef int default = get_num_threads()
    if n_threads is None:
        return default
    return checked_thread_count(n_threads, "n_threads")


cdef int serial_if_small(int nt, object n_threads, Py_ssize_t work) noexcept:
    if n_threads is None and work < PARALLEL_MIN_WORK:
        return 1
    return nt


cpdef tuple overwrite_flags(overwrite, tuple names):
    """``overwrite`` for outputs ``names`` as a tuple of bools.

    A backward kernel adds its result into each gradient output, unless that output
    is flagged: then it writes the result over it (the buffer may hold anything, e.g.
    ``np.empty``), which saves zeroing it first and reading it back."""
    if type(overwrite) is tuple and len(<tuple>overwrite) == len(names):
        # The AD runtime's form, one bool per output: taken as it is.
        for f in <tuple>overwrite:
            if f is not True and f is not False:
                break
        else:
            return <tuple>overwrite
    if isinstance(overwrite, (bool, np.bool_)):
        return (bool(overwrite),) * len(names)
    flags = tuple(overwrite)
    if len(flags) != len(names) or not all([isinstance(f, (bool, np.bool_)) for f in flags]):
        raise ValueError(f"overwrite must be a bool or {len(names)} bools (for "
                         f"{', '.join(names)}), got {overwrite!r}")
    return tuple([bool(f) for f in flags])


# ---------------------------------------------------------------------------
# Zeroing

cdef extern from *:
    """
    /* n floats of p set to zero.  A piece of 1 MiB or more is written with stores
       that bypass the caches (on AVX-512 CPUs), so the old lines are not read
       first: half the memory traffic.  glibc's memset does that only above a
       threshold scaled to the last-level cache, which a VM may report as hundreds
       of MiB (480 on the 2-core Xeon we measure on, where zeroing ran at 18 GB/s). */
    #if ADT_HAVE_V4
    #include <immintrin.h>
    ADT_TARGET_V4 static void zero_streamed(float* p, size_t n) {
        size_t i = 0;
        for (; i < n && ((uintptr_t)(p + i) & 63) != 0; i++) p[i] = 0.0f;
        __m512 z = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) _mm512_stream_ps(p + i, z);
        for (; i < n; i++) p[i] = 0.0f;
        _mm_sfence();
    }
    #endif
    static void zero_span(float* p, size_t n) {
    #if ADT_HAVE_V4
        if (n >= ((size_t)1 << 18) && adt_cpu_v4()) {
            zero_streamed(p, n);
            return;
        }
    #endif
        memset(p, 0, n * sizeof(float));
    }
    """
    void zero_span(float* p, size_t n) nogil


cdef void zero_core(float* buf, Py_ssize_t n, int n_threads) noexcept nogil:
    # One contiguous piece per thread (whole cache lines), zeroed by zero_span.
    cdef Py_ssize_t per = ((n + n_threads - 1) // n_threads + 15) // 16 * 16
    cdef Py_ssize_t t, lo
    for t in prange(n_threads, schedule='static', chunksize=1, nogil=True,
                    num_threads=n_threads):
        lo = t * per
        if lo < n:
            zero_span(buf + lo, min(per, n - lo))


# ---------------------------------------------------------------------------
# Column sums

cdef inline void _accumulate(float* acc, const float* x, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        acc[i] = acc[i] + x[i]


cdef void reduce_blocks(float* dst, float* parts, Py_ssize_t n_blocks, Py_ssize_t C,
                        Py_ssize_t c0, Py_ssize_t c1, bint overwrite) noexcept nogil:
    cdef Py_ssize_t blk
    for blk in range(1, n_blocks):
        _accumulate(parts + c0, parts + blk * C + c0, c1 - c0)
    if overwrite:
        memcpy(dst + c0, parts + c0, (c1 - c0) * sizeof(float))
    else:
        _accumulate(dst + c0, parts + c0, c1 - c0)
