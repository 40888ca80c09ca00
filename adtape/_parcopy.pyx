"""par_memcpy: one contiguous, page-aligned range per OpenMP thread (serial without OpenMP)."""

from libc.string cimport memcpy

import numpy as np

IF ADTAPE_OPENMP:
    cimport openmp
    from cython.parallel cimport prange

DEF PAR_COPY_MIN = 1 << 20      # below this one thread copies faster than a team starts
DEF COPY_ALIGN = 4096


cdef void par_memcpy(char* dst, const char* src, size_t n) noexcept nogil:
    """memcpy split into one contiguous, page-aligned range per OpenMP thread.

    One core's copy reaches about half of the machine's copy bandwidth; the AD
    tape's pushes and pops of activations go through here.  Safe to call from
    any thread (a team of its own) and without OpenMP (one memcpy).
    """
    cdef int nt = 1
    cdef Py_ssize_t k
    cdef size_t per, lo, hi
    IF ADTAPE_OPENMP:
        nt = openmp.omp_get_max_threads()
    if n < PAR_COPY_MIN or nt < 2:
        memcpy(dst, src, n)
        return
    per = (n // <size_t>nt + COPY_ALIGN - 1) // COPY_ALIGN * COPY_ALIGN
    IF ADTAPE_OPENMP:
        for k in prange(nt, schedule="static", chunksize=1, num_threads=nt):
            lo = <size_t>k * per
            if lo < n:
                hi = lo + per
                if hi > n:
                    hi = n
                memcpy(dst + lo, src + lo, hi - lo)


def copy(dst, src):
    """dst[...] = src through par_memcpy, on the OpenMP threads in force: the copy the
    tape's pushes and pops make (the performance model's calibration times it).  Both
    C-contiguous NumPy arrays of the same number of bytes, dst writable."""
    if not (isinstance(dst, np.ndarray) and isinstance(src, np.ndarray)):
        raise TypeError(f"copy takes two NumPy arrays, got {type(dst).__name__} and "
                        f"{type(src).__name__}")
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError("copy: both arrays must be C-contiguous")
    if not dst.flags.writeable:
        raise ValueError("copy: dst is read-only")
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy: dst holds {dst.nbytes} bytes, src {src.nbytes}")
    cdef size_t n = src.nbytes
    cdef size_t d = dst.ctypes.data, s = src.ctypes.data
    if n and d < s + n and s < d + n:
        raise ValueError("copy: dst and src overlap")
    with nogil:
        par_memcpy(<char*>d, <const char*>s, n)
