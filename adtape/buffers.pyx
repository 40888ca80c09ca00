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
from cpython.ref cimport Py_INCREF

import operator

import numpy as np

cdef extern from "numpy/arrayobject.h":
    object PyArray_NewFromDescr(type subtype, cnp.dtype descr, int nd, cnp.npy_intp* dims,
                                cnp.npy_intp* strides, void* data, int flags, void* obj)

cnp.import_array()

ALIGN = 64
PAGE = 4096
PAGE_ALIGN_MIN = 64 * 1024    # below this, 64 bytes (at most 4 KiB lost per array)

cdef enum:
    MAX_DIMS = 32     # NumPy's NPY_MAXDIMS


cdef cnp.dtype FLOAT32 = np.dtype(np.float32)


cpdef cnp.ndarray empty(shape, dtype=FLOAT32):
    """An uninitialised C-contiguous array of ``shape`` whose data is 64-byte aligned
    (4096-byte from PAGE_ALIGN_MIN bytes)."""
    return _new(shape, dtype, False)


cdef cnp.ndarray _new(shape, dtype, bint zeroed):
    # Built with NumPy's C API (one raw byte array, a view of it at the aligned offset):
    # the kernel ops allocate their outputs per call, and slicing, view and reshape from
    # Python cost about 0.7 us a call, more than a small kernel takes.
    cdef cnp.dtype dt = dtype if isinstance(dtype, cnp.dtype) else np.dtype(dtype)
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef Py_ssize_t nbytes = dt.itemsize, d
    cdef int k, ndim
    if type(shape) is not tuple:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    ndim = len(shape)
    if ndim > MAX_DIMS:
        raise ValueError(f"an array may have at most {MAX_DIMS} dimensions, got shape {shape}")
    for k in range(ndim):
        item = shape[k]
        d = item if type(item) is int else operator.index(item)
        if d < 0:
            raise ValueError(f"negative dimensions are not allowed, got shape {shape}")
        dims[k] = d
    for k in range(ndim):
        if dims[k] and nbytes > (PY_SSIZE_T_MAX - PAGE) // dims[k]:
            raise MemoryError(f"an array of shape {shape} and dtype {dt} is too large")
        nbytes *= dims[k]
    return _aligned(dt, ndim, dims, nbytes, zeroed)


cdef cnp.ndarray _aligned(cnp.dtype dt, int ndim, cnp.npy_intp* dims, Py_ssize_t nbytes,
                          bint zeroed):
    # zeroed: the raw bytes from NumPy's zeroing allocator (calloc: a block the C library
    # maps afresh is zero already, its pages touched by whoever writes them first)
    cdef Py_ssize_t align = PAGE if nbytes >= PAGE_ALIGN_MIN else ALIGN
    cdef cnp.npy_intp raw_bytes = nbytes + align
    cdef cnp.ndarray raw = (cnp.PyArray_ZEROS(1, &raw_bytes, cnp.NPY_UINT8, 0) if zeroed else
                            cnp.PyArray_EMPTY(1, &raw_bytes, cnp.NPY_UINT8, 0))
    cdef Py_ssize_t start = -<Py_ssize_t>cnp.PyArray_DATA(raw) & (align - 1)
    Py_INCREF(dt)        # PyArray_NewFromDescr steals a reference
    cdef cnp.ndarray out = PyArray_NewFromDescr(np.ndarray, dt, ndim, dims, NULL,
                                                <char*>cnp.PyArray_DATA(raw) + start,
                                                cnp.NPY_ARRAY_CARRAY, NULL)
    Py_INCREF(raw)       # PyArray_SetBaseObject steals a reference
    cnp.PyArray_SetBaseObject(out, raw)
    return out


def zeros(shape, dtype=FLOAT32):
    """Like ``empty``, filled with zeros by the allocator (calloc: a block the C library
    maps afresh is zero already, its pages cleared as they are first written), so that a
    large array costs no pass of its own: GPT-2 124M's four training arenas (2 GB) took
    1.85 s of one thread's memset."""
    return _new(shape, dtype, True)


cpdef cnp.ndarray empty_like(cnp.ndarray a):
    """``empty(a.shape, a.dtype)``."""
    return _aligned(<cnp.dtype>cnp.PyArray_DESCR(a), cnp.PyArray_NDIM(a), cnp.PyArray_DIMS(a),
                    cnp.PyArray_NBYTES(a), False)


def is_aligned(cnp.ndarray a):
    """Whether ``a``'s data starts on a 64-byte boundary (an empty array has no data
    and counts as aligned)."""
    return a.size == 0 or (<Py_ssize_t>cnp.PyArray_DATA(a) & 63) == 0
