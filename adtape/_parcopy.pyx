"""par_memcpy: one contiguous, page-aligned range per OpenMP thread (serial without OpenMP)."""

from libc.string cimport memcpy

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
