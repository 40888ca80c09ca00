"""Softmax and log-softmax over the last axis as forward/backward kernel pairs.

Forward: ``y = exp(x - max) / sum(exp(x - max))``, or ``y = x - max - log(sum(...))``
for log-softmax, one pass for the maximum and one or two over the row.  Backward:
``dx = y * (g - sum(g * y))``, or ``dx = g - exp(y) * sum(g)``.  float32 and float64,
C-contiguous; exponentials and row sums in double.  Rows are split over threads by
ownership from PARALLEL_MIN elements up (below it a parallel region costs more than
the rows), so results do not depend on the thread count.  Backward kernels write
(they do not add into) ``dx``.  Each kernel has a ``_naive`` NumPy twin with the same
signature, which the tests compare against.
"""
from cython.parallel cimport prange
from libc.math cimport exp, log

import numpy as np
cimport numpy as cnp
from cython cimport floating

from kernels._openmp cimport checked_thread_count
from kernels.threads import get_num_threads

cnp.import_array()

PARALLEL_MIN = 1 << 15      # elements


cdef inline void forward_row(floating* y, const floating* x, Py_ssize_t n,
                             bint log_softmax) noexcept nogil:
    cdef Py_ssize_t i
    cdef double top = x[0]
    cdef double total = 0.0
    cdef double e, shift
    for i in range(1, n):
        if x[i] > top:
            top = x[i]
    if log_softmax:
        for i in range(n):
            total += exp(x[i] - top)
        shift = top + log(total)
        for i in range(n):
            y[i] = <floating>(x[i] - shift)
    else:
        for i in range(n):
            e = exp(x[i] - top)
            y[i] = <floating>e
            total += e
        total = 1.0 / total
        for i in range(n):
            y[i] = <floating>(y[i] * total)


cdef inline void backward_row(floating* dx, const floating* g, const floating* y,
                              Py_ssize_t n, bint log_softmax) noexcept nogil:
    cdef Py_ssize_t i
    cdef double total = 0.0
    if log_softmax:
        for i in range(n):
            total += g[i]
        for i in range(n):
            dx[i] = <floating>(g[i] - exp(y[i]) * total)
    else:
        for i in range(n):
            total += <double>g[i] * y[i]
        for i in range(n):
            dx[i] = <floating>(y[i] * (g[i] - total))


cdef void forward_core(floating* y, const floating* x, Py_ssize_t rows, Py_ssize_t n,
                       bint log_softmax, int nt) noexcept nogil:
    cdef Py_ssize_t r
    if nt > 1:
        for r in prange(rows, schedule="static", num_threads=nt):
            forward_row(y + r * n, x + r * n, n, log_softmax)
    else:
        for r in range(rows):
            forward_row(y + r * n, x + r * n, n, log_softmax)


cdef void backward_core(floating* dx, const floating* g, const floating* y, Py_ssize_t rows,
                        Py_ssize_t n, bint log_softmax, int nt) noexcept nogil:
    cdef Py_ssize_t r
    if nt > 1:
        for r in prange(rows, schedule="static", num_threads=nt):
            backward_row(dx + r * n, g + r * n, y + r * n, n, log_softmax)
    else:
        for r in range(rows):
            backward_row(dx + r * n, g + r * n, y + r * n, n, log_softmax)


cdef Py_ssize_t check(tuple outputs, tuple inputs) except -1:
    """Every array a C-contiguous float32/float64 ndarray of one shape and dtype (at least
    1-d); outputs writable and not overlapping the inputs.  Returns the row length."""
    # Through NumPy's C API: at a few rows the Python attribute reads (dtype, flags,
    # may_share_memory) cost more than the kernel.
    cdef cnp.ndarray arr, out, other, first_arr
    cdef int typenum
    cdef char* lo
    cdef char* other_lo
    first_name, first = outputs[0]
    for name, a in outputs + inputs:
        if type(a) is not np.ndarray:
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
        arr = <cnp.ndarray>a
        typenum = cnp.PyArray_TYPE(arr)
        if typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64:
            raise TypeError(f"{name} must be float32 or float64, got {a.dtype}")
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            raise ValueError(f"{name} must be C-contiguous")
    first_arr = <cnp.ndarray>first
    for name, a in outputs + inputs:
        arr = <cnp.ndarray>a
        if cnp.PyArray_TYPE(arr) != cnp.PyArray_TYPE(first_arr):
            raise TypeError(f"{name} is {a.dtype} but {first_name} is {first.dtype}")
        if not cnp.PyArray_SAMESHAPE(arr, first_arr):
            raise ValueError(f"{name} has shape {a.shape} but {first_name} has {first.shape}")
    if cnp.PyArray_NDIM(first_arr) == 0:
        raise ValueError(f"{first_name} must have at least one axis, got a 0-d array")
    for name, a in outputs:
        out = <cnp.ndarray>a
        if not cnp.PyArray_ISWRITEABLE(out):
            raise ValueError(f"{name} must be writable")
        lo = <char*>cnp.PyArray_DATA(out)
        for other_name, b in inputs:
            other = <cnp.ndarray>b
            other_lo = <char*>cnp.PyArray_DATA(other)
            # C-contiguous: each spans [data, data + nbytes), so bounds are exact.
            if (cnp.PyArray_NBYTES(out) and cnp.PyArray_NBYTES(other)
                    and lo < other_lo + cnp.PyArray_NBYTES(other)
                    and other_lo < lo + cnp.PyArray_NBYTES(out)):
                raise ValueError(f"{name} must not overlap {other_name}")
    return cnp.PyArray_DIM(first_arr, cnp.PyArray_NDIM(first_arr) - 1)


cdef int threads_for(object n_threads, Py_ssize_t size) except -1:
    if n_threads is not None:
        return checked_thread_count(n_threads, "n_threads")
    if size < PARALLEL_MIN:
        return 1
    return checked_thread_count(get_num_threads(), "n_threads")


def softmax_forward(out, x, *, log=False, n_threads=None):
    """out = softmax(x) over the last axis (``log``: log-softmax)."""
    cdef Py_ssize_t n = check((("out", out),), (("x", x),))
    cdef Py_ssize_t size = cnp.PyArray_SIZE(<cnp.ndarray>x)
    cdef int nt = threads_for(n_threads, size)
    cdef Py_ssize_t rows = size // n if n else 0
    cdef bint lg = bool(log)
    cdef void* po = cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef const void* px = cnp.PyArray_DATA(<cnp.ndarray>x)
    if rows == 0:
        return
    if cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_FLOAT32:
        with nogil:
            forward_core(<float*>po, <const float*>px, rows, n, lg, nt)
    else:
        with nogil:
            forward_core(<double*>po, <const double*>px, rows, n, lg, nt)


def softmax_backward(dx, g, y, *, log=False, n_threads=None):
    """dx = the gradient of softmax (``log``: log-softmax) over the last axis, from the
    output's gradient ``g`` and the forward output ``y``.  Writes dx."""
    cdef Py_ssize_t n = check((("dx", dx),), (("g", g), ("y", y)))
    cdef Py_ssize_t size = cnp.PyArray_SIZE(<cnp.ndarray>g)
    cdef int nt = threads_for(n_threads, size)
    cdef Py_ssize_t rows = size // n if n else 0
    cdef bint lg = bool(log)
    cdef void* pd = cnp.PyArray_DATA(<cnp.ndarray>dx)
    cdef const void* pg = cnp.PyArray_DATA(<cnp.ndarray>g)
    cdef const void* py = cnp.PyArray_DATA(<cnp.ndarray>y)
    if rows == 0:
        return
    if cnp.PyArray_TYPE(<cnp.ndarray>g) == cnp.NPY_FLOAT32:
        with nogil:
            backward_core(<float*>pd, <const float*>pg, <const float*>py, rows, n, lg, nt)
    else:
        with nogil:
            backward_core(<double*>pd, <const double*>pg, <const double*>py, rows, n, lg, nt)


def softmax_forward_naive(out, x, *, log=False, n_threads=None):
    """The NumPy twin of softmax_forward."""
    check((("out", out),), (("x", x),))
    if x.size == 0:
        return
    x64 = x.astype(np.float64)
    shifted = x64 - x64.max(axis=-1, keepdims=True)
    if log:
        out[...] = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    else:
        e = np.exp(shifted)
        out[...] = e / e.sum(axis=-1, keepdims=True)


def softmax_backward_naive(dx, g, y, *, log=False, n_threads=None):
    """The NumPy twin of softmax_backward."""
    check((("dx", dx),), (("g", g), ("y", y)))
    if g.size == 0:
        return
    g64, y64 = g.astype(np.float64), y.astype(np.float64)
    if log:
        dx[...] = g64 - np.exp(y64) * g64.sum(axis=-1, keepdims=True)
    else:
        dx[...] = y64 * (g64 - (g64 * y64).sum(axis=-1, keepdims=True))
