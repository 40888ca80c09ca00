"""Arrays whose data starts on a cache line (64 bytes): the buffers the kernels work on.

NumPy takes large arrays from ``malloc``, which aligns them to 16 bytes only: every
sixteen-lane load of such an array straddles two cache lines, and the weight
gradient products cannot stream their stores past the caches (they need a 64-byte
address).  Measured on a 2-core AVX-512 Xeon, 12 weight gradients of 2304 x 768
written afresh from 16 tokens: 8.7 ms at NumPy's alignment, 3.5 ms at 64 bytes.

Arrays of PAGE_ALIGN_MIN bytes or more start on a 4096-byte page.  A kernel that
reads x and writes y = f(x) stalls where y lies a little past x modulo 4096 bytes:
the load of x[i + k] has the low twelve address bits of the store to y[i] just
before it, and waits for that store ("4K aliasing").  glibc gives large blocks
arbitrary offsets once its mmap threshold has risen, so that distance was luck;
page starts make it a multiple of 4096 for every pair.  Zen 3 VM, layernorm forward
at B=8, T=1024 (C = 768): 1.46 ms with y - x = 0 modulo 4096, 2.81 with 64 bytes,
1.96 with 128; residual forward 1.50 / 1.55 / 1.79.

``empty`` and ``zeros`` give such arrays (a view into a slightly larger buffer,
which the view keeps alive); everything else about them is an ordinary C-contiguous
ndarray.
"""
cimport numpy as cnp
from cpython.pyport cimport PY_SSIZE_T_MAX

import operator

import numpy as np

cnp.import_array()

ALIGN = 64
PAGE = 4096
PAGE_ALIGN_MIN = 64 * 1024    # below this, 64 bytes (at most 4 KiB lost per array)


cpdef cnp.ndarray empty(shape, dtype=np.float32):
    """An uninitialised C-contiguous array of ``shape`` whose data is 64-byte aligned
    (4096-byte from PAGE_ALIGN_MIN bytes)."""
    cdef cnp.dtype dt = np.dtype(dtype)
    cdef cnp.ndarray raw
    cdef Py_ssize_t nbytes, start
    cdef object total = dt.itemsize           # a Python int: no overflow
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    for d in shape:
        if d < 0:
            raise ValueError(f"negative dimensions are not allowed, got shape {shape}")
        total *= operator.index(d)
    if total > PY_SSIZE_T_MAX - PAGE:
        raise MemoryError(f"an array of shape {shape} and dtype {dt} is too large")
    nbytes = total
    cdef Py_ssize_t align = PAGE if nbytes >= PAGE_ALIGN_MIN else ALIGN
    raw = np.empty(nbytes + align, np.uint8)
    start = -<Py_ssize_t>cnp.PyArray_DATA(raw) & (align - 1)
    return raw[start:start + nbytes].view(dt).reshape(shape)


def zeros(shape, dtype=np.float32):
    """Like ``empty``, filled with zeros."""
    cdef cnp.ndarray out = empty(shape, dtype)
    out.fill(0)
    return out


def empty_like(cnp.ndarray a):
    """``empty(a.shape, a.dtype)``."""
    return empty((<object>a).shape, a.dtype)


def is_aligned(cnp.ndarray a):
    """Whether ``a``'s data starts on a 64-byte boundary (an empty array has no data
    and counts as aligned)."""
    return a.size == 0 or (<Py_ssize_t>cnp.PyArray_DATA(a) & 63) == 0
