"""The OpenMP shim: thread-count queries with serial fallbacks when OpenMP is absent."""

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


cdef enum:
    # The most threads a kernel accepts (n_threads, set_num_threads, OMP_NUM_THREADS):
    # over 5 times the hardware threads of the largest two-socket x86 servers
    # (2 x 192 cores x 2), so never a limit on real use, and a fixed figure, so the
    # same call succeeds or fails on every machine.  libgomp ends the process where
    # it cannot start a team: on a 2-core VM with 23 GiB, 4096 threads (8 MiB
    # stacks) ran, 40000 made it exit ("Thread creation failed"), 65536 segfaulted.
    OMP_MAX_THREADS = 4096

MAX_THREADS = OMP_MAX_THREADS


cdef int checked_thread_count(object n, str name) except -1:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= OMP_MAX_THREADS:
        raise ValueError(f"{name} must be an integer in [1, {OMP_MAX_THREADS}] "
                         f"(kernels.threads.MAX_THREADS), got {n!r}")
    return n


def check_thread_count(n, name="n_threads"):
    """``n`` if it is a thread count in [1, MAX_THREADS], else ValueError naming
    ``name``, the value and the cap."""
    return checked_thread_count(n, name)


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


def set_flush_denormal(bint enable, n_threads=None):
    """Set (or clear) flush-to-zero and denormals-are-zero in this thread and every
    OpenMP worker (``n_threads`` of them; None: OpenMP's current count).  MXCSR is
    per thread; threads created later inherit the creating thread's, so call this
    before BLAS starts its pool to cover BLAS threads too.
    Returns True when the calling thread's MXCSR has both bits as asked."""
    cdef int i
    cdef int nt = (omp_get_max_threads_safe() if n_threads is None
                   else checked_thread_count(n_threads, "n_threads"))
    _apply_ftz(enable)
    IF ADTAPE_OPENMP:
        for i in prange(nt, schedule='static', chunksize=1, nogil=True, num_threads=nt):
            _apply_ftz(enable)
    return flush_denormal_enabled() == bool(enable)


def flush_denormal_enabled():
    """True when FTZ and DAZ are both set in the calling thread."""
    return (_mm_getcsr() & (MXCSR_FTZ | MXCSR_DAZ)) == (MXCSR_FTZ | MXCSR_DAZ)


cdef extern from "malloc.h" nogil:
    int mallopt(int param, int value)
    int M_TRIM_THRESHOLD
    int M_MMAP_THRESHOLD


# The mmap threshold set_malloc_retention last set (None: glibc's own, dynamic)
_mmap_threshold = None


def set_malloc_retention(long long nbytes=1 << 30):
    """Let the C allocator keep up to ``nbytes`` of freed memory for reuse.

    A training step allocates and frees the same large buffers every step; by
    default glibc maps blocks over 32 MiB fresh each time and trims freed heap,
    so every step faults its memory in again: on a VM whose freed pages go back
    to the host, a page first touched again costs the host's fault as well as
    the clearing (Zen 4 VM: two 525 MB arrays, a Llama head's logits and their
    gradient, written 5 s apart: 0.76-1.11 s a round mapped afresh, 0.04 s
    kept in the heap; 5.4% of a LoRA step of Llama 3.2 1B at (1, 1024)).
    This sets the mmap threshold to ``nbytes`` (where the C library refuses
    that, 256 MiB, then 32 MiB) and the trim threshold to twice it (at most
    2 GiB), for the whole process (same effect on every library in it, PyTorch
    included).  Returns True if the allocator took both settings.
    """
    global _mmap_threshold
    if nbytes < 0 or nbytes > 2**31 - 1:
        raise ValueError(f"nbytes must lie in [0, 2**31 - 1], got {nbytes}")
    cdef long long threshold
    cdef bint mapped = False
    for threshold in (nbytes, 256 << 20, 32 << 20):
        if threshold <= nbytes and mallopt(M_MMAP_THRESHOLD, <int>threshold):
            _mmap_threshold = threshold
            mapped = True
            break
    return bool(mapped and mallopt(M_TRIM_THRESHOLD, <int>min(2 * nbytes, 2**31 - 1)))


def malloc_mmap_threshold():
    """The mmap threshold ``set_malloc_retention`` set in this process (bytes), or None
    before it was called."""
    return _mmap_threshold
