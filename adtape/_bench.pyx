"""nogil drivers of the tape's C API, for the thread tests and bench/tape_stress.py.

They exercise the tape the way another Cython module would: through the inline
functions of adtape/_tape.pxd, from real OS threads that hold no GIL.
"""
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport malloc, free

import numpy as np
cimport numpy as cnp

from adtape._tape cimport (Tape, TapeStruct, TapeCursor, cursor_open, cursor_close,
                           cursor_push_f64, cursor_pop_f64, tape_push_f64, tape_pop_f64,
                           tape_push_f64_unlocked, tape_pop_f64_unlocked, tape_reserve,
                           tape_commit_record, tape_lock, tape_unlock, RECORD_BYTES)

cnp.import_array()

from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cdef extern from "pthread.h" nogil:
    ctypedef struct pthread_t:
        pass
    int pthread_create(pthread_t* th, void* attr, void* (*fn)(void*) noexcept nogil, void* arg)
    int pthread_join(pthread_t th, void** ret)


cdef double now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1e9 + ts.tv_nsec


def push_pop_ns(Tape tape, int64_t n, int64_t repeats=1, bint locked=True, bint cursor=False):
    """Push n float64 then pop them, ``repeats`` times, in a nogil loop.

    ``locked``: each op takes the tape's lock (tape_push_f64) or not (the
    _unlocked variants); ``cursor``: the whole batch goes through a TapeCursor
    (one lock for the batch).  Returns (ns per push, ns per pop).  Values are
    checked on the way back, so the loop cannot be optimized away and a wrong
    pop raises.
    """
    cdef TapeStruct* t = &tape.t
    cdef TapeCursor c
    cdef int64_t r, i
    cdef double v, push_ns = 0, pop_ns = 0, t0
    cdef int rc = 0
    cdef int64_t bad = -1
    if tape.dtype != np.float64:
        raise TypeError("push_pop_ns drives a float64 tape")
    with nogil:
        for r in range(repeats):
            t0 = now_ns()
            if cursor:
                cursor_open(t, &c)
                for i in range(n):
                    rc |= cursor_push_f64(t, &c, <double>i)
                cursor_close(t, &c)
            elif locked:
                for i in range(n):
                    rc |= tape_push_f64(t, <double>i)
            else:
                for i in range(n):
                    rc |= tape_push_f64_unlocked(t, <double>i)
            push_ns += now_ns() - t0
            t0 = now_ns()
            if cursor:
                cursor_open(t, &c)
                for i in range(n - 1, -1, -1):
                    rc |= cursor_pop_f64(t, &c, &v)
                    if v != <double>i:
                        bad = i
                cursor_close(t, &c)
            elif locked:
                for i in range(n - 1, -1, -1):
                    rc |= tape_pop_f64(t, &v)
                    if v != <double>i:
                        bad = i
            else:
                for i in range(n - 1, -1, -1):
                    rc |= tape_pop_f64_unlocked(t, &v)
                    if v != <double>i:
                        bad = i
            pop_ns += now_ns() - t0
    if rc:
        tape.check(rc)
    if bad >= 0:
        raise AssertionError(f"tape returned a wrong value at index {bad}")
    return push_ns / (n * repeats), pop_ns / (n * repeats)


cdef struct Worker:
    TapeStruct* t
    int64_t first        # values pushed are first, first + 1, ...
    int64_t n_ops
    int64_t pop_every
    double* popped       # out: values this worker popped
    int64_t n_popped
    int rc


cdef void* worker_main(void* arg) noexcept nogil:
    cdef Worker* w = <Worker*>arg
    cdef int64_t i
    cdef double v
    for i in range(w.n_ops):
        if tape_push_f64(w.t, <double>(w.first + i)) != 0:
            w.rc = -1
            return NULL
        if w.pop_every > 0 and i % w.pop_every == w.pop_every - 1:
            if tape_pop_f64(w.t, &v) != 0:
                w.rc = -1
                return NULL
            w.popped[w.n_popped] = v
            w.n_popped += 1
    return NULL


def shared_push_pop(Tape tape, int n_threads, int64_t n_ops, int64_t pop_every=2):
    """n_threads OS threads each push n_ops distinct values into one shared tape,
    popping one value after every ``pop_every`` pushes.

    Returns (popped values as an array, seconds).  Every value pushed is either in
    the popped array or still on the tape, exactly once, if the lock works.
    """
    cdef Worker* workers
    cdef pthread_t* threads
    cdef int k
    cdef double t0, t1
    cdef int64_t per_worker = n_ops // pop_every + 1 if pop_every > 0 else 0
    cdef cnp.ndarray popped = np.empty(n_threads * per_worker, dtype=np.float64)
    cdef double* out = <double*>cnp.PyArray_DATA(popped)
    if tape.dtype != np.float64:
        raise TypeError("shared_push_pop drives a float64 tape")
    if n_threads < 1:
        raise ValueError("n_threads must be >= 1")
    workers = <Worker*>malloc(n_threads * sizeof(Worker))
    threads = <pthread_t*>malloc(n_threads * sizeof(pthread_t))
    if workers == NULL or threads == NULL:
        free(workers)
        free(threads)
        raise MemoryError()
    for k in range(n_threads):
        workers[k].t = &tape.t
        workers[k].first = k * n_ops
        workers[k].n_ops = n_ops
        workers[k].pop_every = pop_every
        workers[k].popped = out + k * per_worker
        workers[k].n_popped = 0
        workers[k].rc = 0
    with nogil:
        t0 = now_ns()
        for k in range(n_threads):
            pthread_create(&threads[k], NULL, worker_main, &workers[k])
        for k in range(n_threads):
            pthread_join(threads[k], NULL)
        t1 = now_ns()
    parts = []
    failed = any(workers[k].rc for k in range(n_threads))
    for k in range(n_threads):
        parts.append(popped[k * per_worker: k * per_worker + workers[k].n_popped])
    free(workers)
    free(threads)
    if failed:
        tape.check(-1)
    return np.concatenate(parts), (t1 - t0) / 1e9


cdef struct LifoWorker:
    TapeStruct* t
    int64_t n_ops
    int64_t errors
    int rc


cdef void* lifo_main(void* arg) noexcept nogil:
    cdef LifoWorker* w = <LifoWorker*>arg
    cdef int64_t i
    cdef double v
    for i in range(w.n_ops):
        w.rc |= tape_push_f64(w.t, <double>i)
    for i in range(w.n_ops - 1, -1, -1):
        w.rc |= tape_pop_f64(w.t, &v)
        if v != <double>i:
            w.errors += 1
    return NULL


def per_thread_lifo(list tapes, int64_t n_ops):
    """One OS thread per tape pushes 0..n_ops-1 then pops them back, checking exact LIFO
    order.  Returns (order errors per thread, seconds)."""
    cdef int n = len(tapes), k
    cdef LifoWorker* workers = <LifoWorker*>malloc(n * sizeof(LifoWorker))
    cdef pthread_t* threads = <pthread_t*>malloc(n * sizeof(pthread_t))
    cdef double t0, t1
    if workers == NULL or threads == NULL:
        free(workers)
        free(threads)
        raise MemoryError()
    for k in range(n):
        workers[k].t = &(<Tape?>tapes[k]).t
        workers[k].n_ops = n_ops
        workers[k].errors = 0
        workers[k].rc = 0
    with nogil:
        t0 = now_ns()
        for k in range(n):
            pthread_create(&threads[k], NULL, lifo_main, &workers[k])
        for k in range(n):
            pthread_join(threads[k], NULL)
        t1 = now_ns()
    errors = [workers[k].errors for k in range(n)]
    failed = [k for k in range(n) if workers[k].rc]
    free(workers)
    free(threads)
    if failed:
        (<Tape>tapes[failed[0]]).check(-1)
    return errors, (t1 - t0) / 1e9


def reserve_and_fill(Tape tape, size_t nbytes, unsigned char seed):
    """Write a byte record straight into tape storage, as a kernel saving an
    activation would: tape_reserve, fill byte k with (seed + k) % 251, commit."""
    cdef TapeStruct* t = &tape.t
    cdef unsigned char* p
    cdef size_t k
    cdef int rc = 0
    with nogil:
        tape_lock(t)
        p = <unsigned char*>tape_reserve(t, nbytes)
        if p == NULL:
            rc = -1
        else:
            for k in range(nbytes):
                p[k] = <unsigned char>((seed + k) % 251)
            rc = tape_commit_record(t, nbytes, RECORD_BYTES)
        tape_unlock(t)
    if rc:
        tape.check(rc)
