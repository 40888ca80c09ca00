# A memcpy split over OpenMP threads, for the tape's copies of large records.
# The tape keeps it here rather than cimporting it from kernels/: the kernels are
# leaves that adtape.nn uses, and the tape core must not depend on them.

cdef void par_memcpy(char* dst, const char* src, size_t n) noexcept nogil
