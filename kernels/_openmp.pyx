"""The OpenMP shim: thread-count queries with serial fallbacks when OpenMP is absent."""

IF ADTAPE_OPENMP:
    cimport openmp

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
