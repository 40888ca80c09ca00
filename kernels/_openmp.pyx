"""The OpenMP shim: thread-count queries with serial fallbacks when OpenMP is absent."""

from libc.string cimport memcpy

IF ADTAPE_OPENMP:
    cimport openmp
    from cython.parallel cimport prange

cdef int omp_get_max_threads_safe() noexcept nogil:
    IF ADTAPE_OPENMP:
        return openmp.omp_get_max_threads()
    ELSE:
        return 1

cdef int omp_get_thread_num_safe() noexcept nogil:
    IF ADTAPE_OPENMP:
        return openmp.omp_get_thread_num()
    ELSE:
        return 0

cdef void omp_set_num_threads_safe(int n) noexcept nogil:
    IF ADTAPE_OPENMP:
        openmp.omp_set_num_threads(n)


DEF PAR_COPY_MIN = 1 << 20      # below this one thread copies faster than a team starts
DEF COPY_ALIGN = 4096

cdef void par_memcpy(char* dst, const char* src, size_t n) noexcept nogil:
    """memcpy split into one contiguous, page-aligned range per OpenMP thread.

    One core's copy reaches about half of the machine's copy bandwidth; the AD
    tape's pushes and pops of activations go through here.  Safe to call from
    any thread (a team of its own) and without OpenMP (one memcpy).
    """
    cdef int nt = omp_get_max_threads_safe()
    cdef Py_ssize_t k
    cdef size_t per, lo, hi
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
    ELSE:
        memcpy(dst, src, n)


def openmp_enabled():
    """True when the kernels were built with OpenMP."""
    IF ADTAPE_OPENMP:
        return True
    ELSE:
        return False


def _set_omp_threads(int n):
    omp_set_num_threads_safe(n)


def _get_omp_threads():
    return omp_get_max_threads_safe()


cdef extern from "xmmintrin.h" nogil:
    unsigned int _mm_getcsr()
    void _mm_setcsr(unsigned int csr)

# MXCSR bits: flush-to-zero (results) and denormals-are-zero (inputs).
cdef enum:
    MXCSR_FTZ = 0x8000
    MXCSR_DAZ = 0x0040


cdef inline void _apply_ftz(bint enable) noexcept nogil:
    if enable:
        _mm_setcsr(_mm_getcsr() | MXCSR_FTZ | MXCSR_DAZ)
    else:
        _mm_setcsr(_mm_getcsr() & ~(<unsigned int>(MXCSR_FTZ | MXCSR_DAZ)))


def set_flush_denormal(bint enable, int n_threads=0):
    """Set (or clear) flush-to-zero and denormals-are-zero in this thread and every
    OpenMP worker.  MXCSR is per thread; threads created later inherit the creating
    thread's, so call this before BLAS starts its pool to cover BLAS threads too.
    Returns True when the calling thread's MXCSR has both bits as asked."""
    cdef int i
    if n_threads <= 0:
        n_threads = omp_get_max_threads_safe()
    _apply_ftz(enable)
    IF ADTAPE_OPENMP:
        for i in prange(n_threads, schedule='static', chunksize=1, nogil=True,
                        num_threads=n_threads):
            _apply_ftz(enable)
    return flush_denormal_enabled() == bool(enable)


def flush_denormal_enabled():
    """True when FTZ and DAZ are both set in the calling thread."""
    return (_mm_getcsr() & (MXCSR_FTZ | MXCSR_DAZ)) == (MXCSR_FTZ | MXCSR_DAZ)


cdef extern from "malloc.h" nogil:
    int mallopt(int param, int value)
    int M_TRIM_THRESHOLD
    int M_MMAP_THRESHOLD


def set_malloc_retention(long long nbytes=1 << 30):
    """Let the C allocator keep up to ``nbytes`` of freed memory for reuse.

    A training step allocates and frees the same large buffers every step; by
    default glibc maps blocks over 32 MiB fresh each time and trims freed heap,
    so every step faults its memory in again (microseconds per page on a VM).
    This raises the mmap threshold and the trim threshold for the whole process
    (same effect on every library in it, PyTorch included).  Returns True if
    the allocator took both settings.
    """
    if nbytes < 0 or nbytes > 2**31 - 1:
        raise ValueError(f"nbytes must lie in [0, 2**31 - 1], got {nbytes}")
    mmap_threshold = min(nbytes, 256 << 20)   # glibc caps this at HEAP_MAX/2 on 64-bit
    return bool(mallopt(M_MMAP_THRESHOLD, <int>mmap_threshold)
                and mallopt(M_TRIM_THRESHOLD, <int>nbytes))
