# Scalar-mode AD: one statement per scalar op on a float64 adtape Tape,
# CoDiPack style.  A statement is its operands' (identifier, partial) pairs
# followed by their count; identifiers are handed out in statement order, so
# the reverse sweep walks identifiers downward while popping statements.

from libc.stdint cimport int64_t

from adtape._tape cimport Tape, TapeStruct


cdef class ScalarTape:
    cdef Tape tape
    cdef TapeStruct* t
    cdef int64_t n_ids          # identifiers handed out; 0 means passive (a constant)
    cdef bint swept

    cdef int ensure_recording(self) except -1
    cdef int fail(self, int rc) except -1
    cdef Scalar emit1(self, double value, int64_t a, double da)
    cdef Scalar emit2(self, double value, int64_t a, double da, int64_t b, double db)


cdef class Scalar:
    cdef readonly double value
    cdef readonly int64_t index
    cdef readonly ScalarTape tape


# Reverse sweep over n_ids statements: adjoint[arg] += partial * adjoint[id].
cdef int scalar_sweep(TapeStruct* t, double* adjoint, int64_t n_ids) noexcept nogil
