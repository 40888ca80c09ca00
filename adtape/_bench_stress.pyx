"""nogil baselines for bench/tape_stress.py, shaped like adtape._bench.push_pop_ns.

Each driver pushes float64 values 0..n-1 then pops them back, ``repeats`` times,
timing the push and pop phases apart and checking every popped value, so that the
only difference from the tape's own driver is the container:

- ``DoublingBuffer``: one NumPy float64 array grown by doubling (the "one
  monolithic buffer, reallocated" design); growth reacquires the GIL to allocate
  the new array, as nogil code holding a NumPy buffer has to.
- ``raw_array_push_pop_ns``: a preallocated C array with the top index in a local
  variable, the cost of the loop itself on this machine.
- ``lock_floor_ns``: one uncontended atomic exchange (acquire) and one release
  store per operation, the floor of any lock on this CPU.

``CallFloor`` and ``CallFloorPositional`` are the Python-side floor: methods that
convert a float64 like Tape.push/pop and do nothing else.
"""
cimport cython
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memset
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

import numpy as np
cimport numpy as cnp

cnp.import_array()

cdef extern from *:
    """
    static inline void adtape_bench_lock_pair(volatile int *word) {
        (void)__atomic_exchange_n(word, 1, __ATOMIC_ACQUIRE);
        __atomic_store_n(word, 0, __ATOMIC_RELEASE);
    }
    """
    void adtape_bench_lock_pair(int *word) nogil


cdef double now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1e9 + ts.tv_nsec


cdef class DoublingBuffer:
    """A float64 stack in one NumPy array that doubles when full and never shrinks."""
    cdef object array
    cdef double* data
    cdef int64_t size
    cdef int64_t capacity

    def __cinit__(self, int64_t initial_capacity=16):
        if initial_capacity < 1:
            raise ValueError(f"initial_capacity must be >= 1, got {initial_capacity}")
        self.array = np.empty(initial_capacity, dtype=np.float64)
        self.data = <double*>cnp.PyArray_DATA(self.array)
        self.size = 0
        self.capacity = initial_capacity

    cdef void grow(self) noexcept nogil:
        with gil:
            bigger = np.empty(2 * self.capacity, dtype=np.float64)
            memcpy(cnp.PyArray_DATA(bigger), self.data, self.size * sizeof(double))
            self.array = bigger
            self.data = <double*>cnp.PyArray_DATA(bigger)
            self.capacity *= 2

    @property
    def capacity(self):
        return self.capacity

    @property
    def nbytes(self):
        """Bytes of the array currently held (its capacity, not its fill)."""
        return self.capacity * sizeof(double)

    def __len__(self):
        return self.size


def doubling_push_pop_ns(DoublingBuffer buf, int64_t n, int64_t repeats=1):
    """Push n float64 onto ``buf`` then pop them, ``repeats`` times, in a nogil loop.

    Returns (ns per push, ns per pop); a wrong popped value raises AssertionError.
    """
    cdef int64_t r, i
    cdef double v, push_ns = 0, pop_ns = 0, t0
    cdef int64_t bad = -1
    if buf.size != 0:
        raise ValueError(f"doubling_push_pop_ns needs an empty buffer, it holds {buf.size}")
    with nogil:
        for r in range(repeats):
            t0 = now_ns()
            for i in range(n):
                if buf.size == buf.capacity:
                    buf.grow()
                buf.data[buf.size] = <double>i
                buf.size += 1
            push_ns += now_ns() - t0
            t0 = now_ns()
            for i in range(n - 1, -1, -1):
                buf.size -= 1
                v = buf.data[buf.size]
                if v != <double>i:
                    bad = i
            pop_ns += now_ns() - t0
    if bad >= 0:
        raise AssertionError(f"doubling buffer returned a wrong value at index {bad}")
    return push_ns / (n * repeats), pop_ns / (n * repeats)


cdef double* grow_array(double* data, int64_t* capacity) noexcept nogil:
    """Double a malloc'd array (the cold path of raw_array_push_pop_ns)."""
    capacity[0] *= 2
    return <double*>realloc(data, capacity[0] * sizeof(double))


def raw_array_push_pop_ns(int64_t n, int64_t repeats=1):
    """The tape's fast path with its top index and bound in local variables.

    Push checks room, stores and bumps the index, with a realloc on the cold path
    (which also keeps gcc from vectorizing the loop, as real tape pushes interleaved
    with other work are not); the array is allocated and touched before timing, so the
    cold path is never taken.  Returns (ns per push, ns per pop).
    """
    cdef int64_t capacity = max(n, 1)
    cdef double* data = <double*>malloc(capacity * sizeof(double))
    cdef int64_t r, i, top
    cdef double v, push_ns = 0, pop_ns = 0, t0
    cdef int64_t bad = -1
    cdef bint failed = False
    if data == NULL:
        raise MemoryError(f"cannot allocate {n} float64 for the raw array baseline")
    with nogil:
        memset(data, 0x7F, capacity * sizeof(double))
        for r in range(repeats):
            top = 0
            t0 = now_ns()
            for i in range(n):
                if top == capacity:
                    data = grow_array(data, &capacity)
                    if data == NULL:
                        failed = True
                        break
                data[top] = <double>i
                top += 1
            push_ns += now_ns() - t0
            if failed:
                break
            t0 = now_ns()
            for i in range(n - 1, -1, -1):
                top -= 1
                v = data[top]
                if v != <double>i:
                    bad = i
            pop_ns += now_ns() - t0
    free(data)
    if failed:
        raise MemoryError("raw array baseline: realloc failed")
    if bad >= 0:
        raise AssertionError(f"raw array returned a wrong value at index {bad}")
    return push_ns / (n * repeats), pop_ns / (n * repeats)


def lock_floor_ns(int64_t n, int64_t repeats=1):
    """ns per uncontended lock/unlock pair: atomic exchange (acquire) + release store."""
    cdef int word = 0
    cdef int64_t r, i
    cdef double total = 0, t0
    with nogil:
        for r in range(repeats):
            t0 = now_ns()
            for i in range(n):
                adtape_bench_lock_pair(&word)
            total += now_ns() - t0
    return total / (n * repeats)


cdef class CallFloor:
    """push/pop that convert a float64 exactly as Tape.push/Tape.pop do and store one
    value: the cost of the Python call itself, the floor under Tape's Python path.
    Same calling convention as Tape's methods (METH_FASTCALL | METH_KEYWORDS)."""
    cdef double value

    def push(self, value):
        cdef double d = value
        self.value = d

    def pop(self):
        return self.value


cdef class CallFloorPositional:
    """CallFloor with positional-only methods (METH_O / METH_NOARGS), the calling
    convention CPython 3.11 specializes most directly."""
    cdef double value

    @cython.always_allow_keywords(False)
    def push(self, value):
        cdef double d = value
        self.value = d

    @cython.always_allow_keywords(False)
    def pop(self):
        return self.value
