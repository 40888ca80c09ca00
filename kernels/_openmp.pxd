# The one place that touches omp.h.  Without OpenMP (ADTAPE_OPENMP false at
# build time) every function is a serial no-op fallback.

cdef int omp_get_max_threads_safe() noexcept nogil
cdef int omp_get_thread_num_safe() noexcept nogil
cdef void omp_set_num_threads_safe(int n) noexcept nogil
# n itself if it is an int in [1, MAX_THREADS] (kernels.threads.MAX_THREADS), else
# ValueError naming `name`, the value and the cap: every thread count passes here.
cdef int checked_thread_count(object n, str name) except -1
