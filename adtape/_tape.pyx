"""The layered tape: inline small buffer, linked slabs, locking, spill to disk, prefetch.

A Tape is a LIFO byte stack.  The first ``sbo_size`` elements live in a buffer
inside the Tape object; past it, fixed-size slabs are linked, so growth never
moves stored bytes.  With a ``memory_budget``, the oldest slabs (for a LIFO the
least recently used) are written to an unlinked spill file by a background I/O
thread, in units of at least ``spill_unit`` bytes, each slab with a checksum;
popping reads them back, and the I/O thread prefetches the spilled units below
the head before they are needed: a read-ahead window of at least
``prefetch_depth`` units, widened to what the device is measured to read in
50 ms, within the budget.

Concurrency model: every push/pop/peek takes the tape's spin lock (unless
``threadsafe=False``), so threads sharing one tape keep the multiset of entries
and the length exact; the order in which concurrent threads interleave is not
defined.  A reverse sweep that needs exact LIFO order per thread uses one tape
per thread (``ThreadLocalTapes``).  Slab states (resident, writing, on disk,
loading, corrupt) change only under ``io_mu``, taken by the slow paths and the
I/O thread; the fast paths touch only the head slab, which is always resident
and never seen by the I/O thread.

This file is the in-memory stack (slab memory and the pool, push/pop, records,
marks, the C API and the Python class); the disk tier (I/O thread, spill file,
checksums, write-behind, prefetch) is _spill.pxi, included below the pool.
"""

cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.number cimport PyNumber_Index
from libc.math cimport isinf
from libc.errno cimport errno, EINTR, EIO, EINVAL
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdio cimport snprintf
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memset, strncpy, strerror

from adtape._parcopy cimport par_memcpy
from posix.types cimport off_t
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

import ast
import atexit
import itertools
import os
import tempfile
import threading
import weakref

import numpy as np
from numpy.lib import format as npformat
cimport numpy as cnp

cnp.import_array()

cdef extern from "unistd.h" nogil:
    int getpid()
    int close(int fd)

cdef extern from "sys/mman.h" nogil:
    void* mmap(void* addr, size_t length, int prot, int flags, int fd, off_t offset)
    int munmap(void* addr, size_t length)
    int PROT_READ
    int PROT_WRITE
    int MAP_PRIVATE
    int MAP_ANONYMOUS
    void* MAP_FAILED
    int madvise(void* addr, size_t length, int advice)
    int MADV_HUGEPAGE

cdef extern from "pthread.h" nogil:
    int pthread_mutex_init(pthread_mutex_t* m, void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* m)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_cond_init(pthread_cond_t* c, void* attr)
    int pthread_cond_destroy(pthread_cond_t* c)
    int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m)
    int pthread_cond_signal(pthread_cond_t* c)
    int pthread_cond_broadcast(pthread_cond_t* c)
    int pthread_create(pthread_t* th, void* attr, void* (*fn)(void*) noexcept nogil, void* arg)
    int pthread_join(pthread_t th, void** ret)

DEF TRAILER = 24          # sizeof(RecordTrailer)
DEF MMAP_MIN = 131072     # slabs this large are mapped, so freeing returns memory to the OS
DEF HUGE_PAGE = 2097152   # slabs this large are huge-page aligned
DEF MAX_SBO_BYTES = 2048



# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

class TapeError(Exception):
    """Base class of tape errors."""


class TapeClosedError(TapeError, ValueError):
    """An operation on a tape that was closed."""


class TapeCorruptionError(TapeError):
    """A spilled unit failed its checksum when read back."""


class SpillError(TapeError, OSError):
    """Writing to or creating the spill file failed (full disk, unwritable dir)."""


class TapeForkError(TapeError, RuntimeError):
    """A forked child used a tape inherited from its parent (it must create its own)."""


# The error of the last failed call, one slot per thread: a call's error is set and
# read back by the same thread, whatever other threads do to the tape meanwhile.
cdef extern from *:
    """
    typedef struct { int code; int errnum; long long offset; char msg[512]; } adtape_error_t;
    static __thread adtape_error_t adtape_last_error;
    """
    ctypedef struct adtape_error_t:
        int code
        int errnum
        long long offset
        char msg[512]
    adtape_error_t last_error "adtape_last_error"


cdef void set_err(TapeStruct* t, int code, int err, off_t offset, const char* msg) noexcept nogil:
    last_error.code = code
    last_error.errnum = err
    last_error.offset = offset
    strncpy(last_error.msg, msg, 511)
    last_error.msg[511] = 0


cdef int fail(TapeStruct* t, int code, const char* msg) noexcept nogil:
    set_err(t, code, 0, 0, msg)
    return -1


# ---------------------------------------------------------------------------
# Slab memory
# ---------------------------------------------------------------------------

cdef inline int64_t now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline size_t round8(size_t n) noexcept nogil:
    return (n + 7) & ~(<size_t>7)


cdef char* data_alloc(size_t cap) noexcept nogil:
    """Slab memory.  Slabs of 2 MiB or more are 2 MiB-aligned mappings advised for
    transparent huge pages: a cold slab then costs one page fault, not 512 (this
    matters on VMs, where a fault costs microseconds)."""
    cdef char* p
    cdef uintptr_t start, aligned
    if cap >= HUGE_PAGE:
        p = <char*>mmap(NULL, cap + HUGE_PAGE, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if <void*>p == MAP_FAILED:
            return NULL
        start = <uintptr_t>p
        aligned = (start + HUGE_PAGE - 1) & ~(<uintptr_t>(HUGE_PAGE - 1))
        if aligned > start:
            munmap(p, aligned - start)
        munmap(<char*>aligned + cap, start + HUGE_PAGE - aligned)
        madvise(<void*>aligned, cap, MADV_HUGEPAGE)
        return <char*>aligned
    if cap >= MMAP_MIN:
        p = <char*>mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        return NULL if <void*>p == MAP_FAILED else p
    return <char*>malloc(cap)


cdef void data_free(char* p, size_t cap) noexcept nogil:
    if p == NULL:
        return
    if cap >= MMAP_MIN:
        munmap(p, cap)
    else:
        free(p)


# ---------------------------------------------------------------------------
# Window helpers: the head slab and its bounds
# ---------------------------------------------------------------------------

cdef inline size_t cur_pos(TapeStruct* t) noexcept nogil:
    return t.head.base + <size_t>(t.top - t.floor)


cdef inline void set_window(TapeStruct* t, Slab* s, size_t fill) noexcept nogil:
    t.head = s
    t.floor = s.data
    t.limit = s.data + s.cap
    t.top = s.data + fill
    if <size_t>t.last_record_end > s.base:
        t.fence = s.data + (<size_t>t.last_record_end - s.base)
    else:
        t.fence = s.data


# ---------------------------------------------------------------------------
# Free-slab pool and release (io_mu held)
# ---------------------------------------------------------------------------

cdef void release_slab(TapeStruct* t, Slab* s) noexcept nogil:
    """Return a slab no longer in the chain: to the pool if standard, else free it."""
    if s.state == SLAB_ON_DISK or s.state == SLAB_CORRUPT:
        t.spilled_bytes -= s.used
        free(s)
        t.heap_slabs -= 1
        return
    if s.cap == t.slab_bytes and t.pool_count < t.max_free_slabs:
        s.next = t.pool
        s.prev = NULL
        t.pool = s
        t.pool_count += 1
        return
    data_free(s.data, s.cap)
    t.resident_bytes -= s.cap
    t.heap_slabs -= 1
    free(s)


cdef Slab* take_slab(TapeStruct* t, size_t cap) noexcept nogil:
    """A resident slab of at least cap bytes: from the pool, else newly allocated."""
    cdef Slab* s
    if cap <= t.slab_bytes and t.pool != NULL:
        s = t.pool
        t.pool = s.next
        t.pool_count -= 1
    else:
        if cap < t.slab_bytes:
            cap = t.slab_bytes
        s = <Slab*>malloc(sizeof(Slab))
        if s == NULL:
            return NULL
        s.data = data_alloc(cap)
        if s.data == NULL:
            free(s)
            return NULL
        s.cap = cap
        s.heap = 1
        t.heap_slabs += 1
        t.resident_bytes += cap
        if t.resident_bytes > t.peak_resident_bytes:
            t.peak_resident_bytes = t.resident_bytes
    s.prev = NULL
    s.next = NULL
    s.used = 0
    s.base = 0
    s.state = SLAB_RESIDENT
    s.prefetched = 0
    s.file_offset = 0
    s.checksum = 0
    return s


cdef void free_pooled(TapeStruct* t) noexcept nogil:
    cdef Slab* s = t.pool
    t.pool = s.next
    t.pool_count -= 1
    data_free(s.data, s.cap)
    t.resident_bytes -= s.cap
    t.heap_slabs -= 1
    free(s)


# The disk tier: write-behind, read-back, prefetch (make_room, ensure_resident, ...).
include "_spill.pxi"


# ---------------------------------------------------------------------------
# Growing and shrinking the chain of slabs (tape lock held)
# ---------------------------------------------------------------------------

cdef int tape_grow(TapeStruct* t, size_t need) noexcept nogil:
    """Link a new head slab with at least need bytes (tape lock held)."""
    cdef Slab* h = t.head
    cdef Slab* s
    cdef size_t cap = round8(need)
    h.used = <size_t>(t.top - t.floor)
    pthread_mutex_lock(&t.io_mu)
    if h == &t.inline_slab or h.prev == &t.inline_slab:
        start_fill(t)       # growing out of the bottom slab: a fill from empty
    if h.base + h.used > t.fill_peak:
        t.fill_peak = h.base + h.used
    if make_room(t, cap if cap > t.slab_bytes else t.slab_bytes) < 0:
        pthread_mutex_unlock(&t.io_mu)
        return -1
    s = take_slab(t, cap)
    if s == NULL:
        pthread_mutex_unlock(&t.io_mu)
        return fail(t, ERR_NOMEM, "out of memory allocating a tape slab")
    s.base = h.base + h.used
    s.prev = h
    h.next = s
    set_window(t, s, 0)
    pthread_mutex_unlock(&t.io_mu)
    return 0


cdef int move_down(TapeStruct* t) noexcept nogil:
    """Make the slab below the head the head, reading it back if spilled (tape lock held).

    The old head stays linked above until the caller's trim_above releases it.
    """
    cdef Slab* below = t.head.prev
    cdef int rc
    t.head.used = <size_t>(t.top - t.floor)
    pthread_mutex_lock(&t.io_mu)
    if t.head.base + t.head.used > t.fill_peak:
        t.fill_peak = t.head.base + t.head.used
    t.early_until = 0          # a pop: this fill is over, write-ahead stops
    if below == &t.inline_slab or below.prev == &t.inline_slab:
        end_fill(t)         # back in the bottom slab: the fill is over
    rc = ensure_resident(t, below)
    if rc == 0:
        set_window(t, below, below.used)
        if t.memory_budget >= 0 and t.prefetch_depth > 0:
            prefetch(t)
    pthread_mutex_unlock(&t.io_mu)
    return rc


cdef inline void trim_above(TapeStruct* t) noexcept nogil:
    """Release the emptied slabs above the head after a successful pop."""
    cdef Slab* s
    cdef Slab* nxt
    if t.head.next == NULL:
        return
    pthread_mutex_lock(&t.io_mu)
    s = t.head.next
    t.head.next = NULL
    while s != NULL:
        nxt = s.next
        release_slab(t, s)
        s = nxt
    pthread_mutex_unlock(&t.io_mu)



# ---------------------------------------------------------------------------
# Byte-level stack operations (tape lock held)
# ---------------------------------------------------------------------------

cdef int write_bytes(TapeStruct* t, const char* src, size_t n) noexcept nogil:
    """Append n bytes, filling slabs in order (src NULL writes zeros)."""
    cdef size_t room, c
    while n > 0:
        room = <size_t>(t.limit - t.top)
        if room == 0:
            if tape_grow(t, 8) < 0:
                return -1
            continue
        c = room if room < n else n
        if src != NULL:
            par_memcpy(t.top, src, c)
            src += c
        else:
            memset(t.top, 0, c)
        t.top += c
        n -= c
    return 0


cdef int read_bytes(TapeStruct* t, char* dst, size_t n, size_t* done) noexcept nogil:
    """Pop n bytes into dst (original order; dst NULL discards); *done counts bytes popped.

    Emptied slabs are released as the read goes down, so a read longer than the
    budget stays within it.  On error the caller re-pushes what was popped.
    """
    cdef size_t avail, c
    done[0] = 0
    while n > 0:
        avail = <size_t>(t.top - t.floor)
        if avail == 0:
            if move_down(t) < 0:
                return -1
            trim_above(t)
            continue
        c = avail if avail < n else n
        t.top -= c
        n -= c
        if dst != NULL:
            par_memcpy(dst + n, t.top, c)
        done[0] += c
    return 0


cdef void keep_error_while(TapeStruct* t, int code, int err, off_t offset, char* msg_copy) noexcept nogil:
    last_error.code = code
    last_error.errnum = err
    last_error.offset = offset
    memcpy(last_error.msg, msg_copy, 512)


cdef int rewind_to(TapeStruct* t, size_t pos, int64_t n_records, int64_t record_bytes,
                   int64_t last_record_end) noexcept nogil:
    """Discard everything above logical position pos (tape lock held).

    The slab holding pos is made resident first, so a failure discards nothing.
    """
    cdef Slab* target = t.head
    cdef Slab* s
    cdef Slab* nxt
    pthread_mutex_lock(&t.io_mu)
    wait_io_idle(t)
    t.early_until = 0
    if cur_pos(t) > t.fill_peak:
        t.fill_peak = cur_pos(t)
    # At a slab boundary the lower slab ends exactly at pos: prefer it when it is
    # resident, so clear() frees every heap slab and nothing is read back in vain.
    while target.prev != NULL and (target.base > pos or (
            target.base == pos and target.prev.state == SLAB_RESIDENT)):
        target = target.prev
    if ensure_resident(t, target) < 0:
        pthread_mutex_unlock(&t.io_mu)
        return -1
    if target == &t.inline_slab or target.prev == &t.inline_slab:
        end_fill(t)
    s = target.next
    target.next = NULL
    while s != NULL:
        nxt = s.next
        release_slab(t, s)
        s = nxt
    t.n_records = n_records
    t.record_bytes = record_bytes
    t.last_record_end = last_record_end
    set_window(t, target, pos - target.base)
    recompute_file_end(t, target)
    pthread_mutex_unlock(&t.io_mu)
    return 0


cdef int undo_write(TapeStruct* t, size_t pos0) noexcept nogil:
    """Roll a failed multi-slab write back to pos0, keeping the write's error."""
    cdef char msg[512]
    cdef int code = last_error.code, err = last_error.errnum
    cdef off_t offset = last_error.offset
    memcpy(msg, last_error.msg, 512)
    rewind_to(t, pos0, t.n_records, t.record_bytes, t.last_record_end)
    keep_error_while(t, code, err, offset, msg)
    return -1


cdef extern from *:
    """
    static inline int adtape_try_claim(volatile int *word) {
        return __atomic_exchange_n(word, 1, __ATOMIC_ACQUIRE) == 0;
    }
    """
    int adtape_try_claim(int *word) nogil

cdef const char* SHARED_MSG = (
    b"a Tape(threadsafe=False) was used by two threads at once: give each thread its "
    b"own tape (ThreadLocalTapes) or create the tape with threadsafe=True")


cdef int bulk_lock(TapeStruct* t) noexcept nogil:
    """tape_lock for the bulk and GIL-releasing paths.

    A threadsafe=False tape has no lock, so its lock word serves as an in-use
    flag here: a second thread entering while the first is inside (and has
    released the GIL) gets an error instead of corrupting the slabs.
    """
    if t.threadsafe:
        adtape_spin_lock(&t.locked_word)
        return 0
    if adtape_try_claim(&t.locked_word):
        return 0
    return fail(t, ERR_SHARED, SHARED_MSG)


cdef inline void bulk_unlock(TapeStruct* t) noexcept nogil:
    adtape_spin_unlock(&t.locked_word)


cdef int lock_or_raise(Tape tape) except -1:
    if bulk_lock(&tape.t) < 0:
        tape.check(-1)
    return 0


cdef int raise_shared() except -1:
    raise RuntimeError(SHARED_MSG.decode())


cdef int check_open(TapeStruct* t) noexcept nogil:
    cdef char msg[512]
    if t.closed == 2:
        snprintf(msg, sizeof(msg),
                 "this tape belongs to process %d and was inherited through fork(): its "
                 "spill file and I/O thread are the parent's, so a child cannot use it; "
                 "create a new Tape in the child", t.owner_pid)
        return fail(t, ERR_FORKED, msg)
    if t.closed:
        return fail(t, ERR_CLOSED, "the tape is closed")
    return 0


cdef void abandon_inherited(TapeStruct* t) noexcept nogil:
    """In a forked child: let go of a tape inherited from the parent without touching
    what the parent still uses.

    The spill file's descriptor shares its offset-free pwrite/pread target with
    the parent, and the I/O thread does not exist here: truncating the file or
    joining the thread (as close() would) destroys the parent's spilled data or
    hangs.  Only the child's copy of the descriptor is closed; the copied slabs
    are left to the child's exit.  Every later operation fails in check_open.
    """
    if t.closed:
        return
    if t.fd >= 0:
        close(t.fd)
        t.fd = -1
    if t.dfd >= 0:
        close(t.dfd)
        t.dfd = -1
    t.io_started = 0
    t.locked_word = 0
    t.closed = 2
    t.top = t.limit = t.floor = t.fence = NULL


# ---------------------------------------------------------------------------
# The C API (declared in _tape.pxd)
# ---------------------------------------------------------------------------

cdef int tape_init(TapeStruct* t, int itemsize, size_t sbo_bytes, char* inline_buf,
                   size_t slab_bytes, int64_t memory_budget, const char* spill_dir,
                   int prefetch_depth, int threadsafe, size_t spill_unit) noexcept nogil:
    memset(t, 0, sizeof(TapeStruct))
    t.itemsize = itemsize
    t.threadsafe = threadsafe
    t.slab_bytes = round8(slab_bytes)
    t.spill_unit = spill_unit if spill_unit > 0 else 1
    t.memory_budget = memory_budget
    t.prefetch_depth = prefetch_depth
    t.max_free_slabs = 2 + prefetch_depth
    t.fd = -1
    t.dfd = -1
    t.owner_pid = getpid()
    t.io_rollback_end = <off_t>0x7FFFFFFFFFFFFFFF
    strncpy(t.spill_dir, spill_dir, sizeof(t.spill_dir) - 1)
    t.inline_buf = inline_buf
    t.inline_slab.data = inline_buf
    t.inline_slab.cap = sbo_bytes & ~(<size_t>7)
    t.inline_slab.state = SLAB_RESIDENT
    pthread_mutex_init(&t.io_mu, NULL)
    pthread_cond_init(&t.io_cv, NULL)
    pthread_cond_init(&t.done_cv, NULL)
    set_window(t, &t.inline_slab, 0)
    return 0


cdef int scalar_on_top(TapeStruct* t) noexcept nogil:
    """Move the window so a scalar of the tape's dtype sits right below top."""
    cdef size_t pos
    if check_open(t) < 0:
        return -1
    pos = cur_pos(t)
    if pos == 0:
        return fail(t, ERR_EMPTY, "pop from an empty tape")
    if <int64_t>pos == t.last_record_end:
        return fail(t, ERR_KIND, "the top entry is a byte record, not a scalar: "
                                 "take it with pop_array() or pop_bytes()")
    while t.top == t.floor:
        if move_down(t) < 0:
            return -1
        trim_above(t)
    return 0


cdef int tape_push_slow(TapeStruct* t, const void* src) noexcept nogil:
    if check_open(t) < 0 or tape_grow(t, t.itemsize) < 0:
        return -1
    memcpy(t.top, src, t.itemsize)
    t.top += t.itemsize
    return 0


cdef int tape_pop_slow(TapeStruct* t, void* dst) noexcept nogil:
    if scalar_on_top(t) < 0:
        return -1
    t.top -= t.itemsize
    memcpy(dst, t.top, t.itemsize)
    return 0


cdef int tape_peek_slow(TapeStruct* t, void* dst) noexcept nogil:
    if scalar_on_top(t) < 0:
        return -1
    memcpy(dst, t.top - t.itemsize, t.itemsize)
    return 0


cdef int tape_push_many(TapeStruct* t, const char* src, size_t n) noexcept nogil:
    """Push n elements of the tape's dtype from src."""
    cdef size_t pos0
    cdef int rc = 0
    if bulk_lock(t) < 0:
        return -1
    if check_open(t) < 0:
        rc = -1
    else:
        pos0 = cur_pos(t)
        if write_bytes(t, src, n * t.itemsize) < 0:
            rc = undo_write(t, pos0)
    bulk_unlock(t)
    return rc


cdef int tape_pop_many(TapeStruct* t, char* dst, size_t n) noexcept nogil:
    """Pop the last n elements into dst, most recent last."""
    cdef size_t pos, have, done = 0
    cdef char msg[512]
    cdef int rc = 0
    if bulk_lock(t) < 0:
        return -1
    if check_open(t) < 0:
        rc = -1
    else:
        pos = cur_pos(t)
        have = (pos - <size_t>t.last_record_end) // t.itemsize
        if n > have:
            if t.n_records > 0:
                snprintf(msg, sizeof(msg), "pop_many(%zu): only %zu scalars lie above the top "
                         "byte record", n, have)
                rc = fail(t, ERR_KIND, msg)
            else:
                snprintf(msg, sizeof(msg), "pop_many(%zu) from a tape holding %zu entries", n, have)
                rc = fail(t, ERR_EMPTY, msg)
        elif read_bytes(t, dst, n * t.itemsize, &done) < 0:
            write_bytes(t, dst + n * t.itemsize - done, done)
            rc = -1
    bulk_unlock(t)
    return rc


cdef int reserve_record_entry(TapeStruct* t) noexcept nogil:
    """Room in the record table for one more record, taken before the record is written
    so that a failure leaves the tape unchanged."""
    cdef int64_t cap
    cdef RecordEntry* grown
    if t.n_records < t.records_cap:
        return 0
    cap = 64 if t.records_cap == 0 else 2 * t.records_cap
    grown = <RecordEntry*>realloc(t.records, cap * sizeof(RecordEntry))
    if grown == NULL:
        return fail(t, ERR_NOMEM, "out of memory growing the tape's record table")
    t.records = grown
    t.records_cap = cap
    return 0


cdef void finish_record_push(TapeStruct* t, size_t start, size_t payload) noexcept nogil:
    """Account a record just written from start up to the top (entry reserved)."""
    cdef RecordEntry* e = &t.records[t.n_records]
    t.next_record_serial += 1
    t.n_records += 1
    t.record_bytes += round8(payload) + TRAILER
    t.last_record_end = <int64_t>cur_pos(t)
    t.fence = t.top
    e.serial = t.next_record_serial
    e.start = <int64_t>start
    e.end = t.last_record_end
    e.cum_bytes = t.record_bytes


cdef int push_record_parts(TapeStruct* t, const char* a, size_t na, const char* b, size_t nb,
                           int kind) noexcept nogil:
    """Push one record whose payload is a ++ b (tape lock held)."""
    cdef RecordTrailer tr
    cdef size_t pos0 = cur_pos(t)
    cdef size_t payload = na + nb
    if reserve_record_entry(t) < 0:
        return -1
    tr.nbytes = payload
    tr.kind = kind
    tr.prev_record_end = t.last_record_end
    if (write_bytes(t, a, na) < 0 or write_bytes(t, b, nb) < 0
            or write_bytes(t, NULL, round8(payload) - payload) < 0
            or write_bytes(t, <char*>&tr, TRAILER) < 0):
        return undo_write(t, pos0)
    finish_record_push(t, pos0, payload)
    return 0


cdef int check_trailer(TapeStruct* t, RecordTrailer* tr, size_t pos) noexcept nogil:
    """Whether the trailer just popped from pos describes the top record of the record
    table; a tape that misread it would read or write outside the record."""
    cdef RecordEntry* e
    cdef int64_t below = 0 if t.n_records < 2 else t.records[t.n_records - 2].end
    cdef char msg[512]
    cdef int ok = t.n_records >= 1 and (tr.kind == RECORD_BYTES or tr.kind == RECORD_ARRAY)
    if ok:
        e = &t.records[t.n_records - 1]
        ok = (tr.nbytes <= pos and e.end == <int64_t>pos and tr.prev_record_end == below
              and e.start == <int64_t>(pos - round8(tr.nbytes) - TRAILER))
    if not ok:
        snprintf(msg, sizeof(msg), "the top record's trailer at byte %zu does not check out "
                 "(kind %lld, %llu bytes, previous record ending at %lld): the tape is corrupt",
                 pos, <long long>tr.kind, <unsigned long long>tr.nbytes,
                 <long long>tr.prev_record_end)
        set_err(t, ERR_CORRUPT, 0, 0, msg)
        return -1
    return 0


cdef int pop_trailer(TapeStruct* t, RecordTrailer* tr, int kind) noexcept nogil:
    """Pop the trailer of the top record and its padding, checking its kind (tape lock held)."""
    cdef size_t pos, done = 0, pad_done = 0
    if check_open(t) < 0:
        return -1
    pos = cur_pos(t)
    if pos == 0:
        return fail(t, ERR_EMPTY, "pop from an empty tape")
    if <int64_t>pos != t.last_record_end:
        return fail(t, ERR_KIND, "the top entry is a scalar, not a byte record: take it with pop()")
    if read_bytes(t, <char*>tr, TRAILER, &done) < 0:
        write_bytes(t, <char*>tr + TRAILER - done, done)
        return -1
    if check_trailer(t, tr, pos) < 0:
        write_bytes(t, <char*>tr, TRAILER)
        return -1
    if tr.kind != kind:
        write_bytes(t, <char*>tr, TRAILER)
        if kind == RECORD_ARRAY:
            return fail(t, ERR_KIND, "the top record holds raw bytes, not an array: use pop_bytes()")
        return fail(t, ERR_KIND, "the top record holds an array, not raw bytes: use pop_array()")
    if read_bytes(t, NULL, round8(tr.nbytes) - tr.nbytes, &pad_done) < 0:
        write_bytes(t, NULL, pad_done)
        write_bytes(t, <char*>tr, TRAILER)
        return -1
    return 0


cdef void finish_record_pop(TapeStruct* t, RecordTrailer* tr) noexcept nogil:
    t.n_records -= 1
    t.record_bytes -= round8(tr.nbytes) + TRAILER
    t.last_record_end = tr.prev_record_end
    set_window(t, t.head, <size_t>(t.top - t.floor))


cdef void unpop_record(TapeStruct* t, RecordTrailer* tr, const char* a, size_t na,
                       const char* b, size_t nb) noexcept nogil:
    """Re-push the popped part of a record (a ++ b, then padding and trailer) after a
    failed read, keeping the read's error."""
    cdef char msg[512]
    cdef int code = last_error.code, err = last_error.errnum
    cdef off_t offset = last_error.offset
    memcpy(msg, last_error.msg, 512)
    write_bytes(t, a, na)
    write_bytes(t, b, nb)
    write_bytes(t, NULL, round8(tr.nbytes) - tr.nbytes)
    write_bytes(t, <char*>tr, TRAILER)
    keep_error_while(t, code, err, offset, msg)


cdef int tape_push_record(TapeStruct* t, const char* src, size_t nbytes, int kind) noexcept nogil:
    cdef int rc
    if bulk_lock(t) < 0:
        return -1
    rc = check_open(t)
    if rc == 0:
        rc = push_record_parts(t, src, nbytes, NULL, 0, kind)
    bulk_unlock(t)
    return rc


cdef int tape_top_record(TapeStruct* t, RecordTrailer* out) noexcept nogil:
    """Read the top record's trailer without popping it."""
    cdef int rc
    if bulk_lock(t) < 0:
        return -1
    rc = pop_trailer(t, out, RECORD_BYTES)
    if rc == 0:
        write_bytes(t, NULL, round8(out.nbytes) - out.nbytes)
        write_bytes(t, <char*>out, TRAILER)
    bulk_unlock(t)
    return rc


cdef int tape_pop_record(TapeStruct* t, char* dst, size_t nbytes, int kind) noexcept nogil:
    """Pop a raw record of exactly nbytes into dst."""
    cdef RecordTrailer tr
    cdef size_t done = 0
    cdef char msg[512]
    cdef int rc
    if bulk_lock(t) < 0:
        return -1
    rc = pop_trailer(t, &tr, kind)
    if rc == 0 and tr.nbytes != nbytes:
        unpop_record(t, &tr, NULL, 0, NULL, 0)
        snprintf(msg, sizeof(msg), "the top record holds %llu bytes, not %zu",
                 <unsigned long long>tr.nbytes, nbytes)
        rc = fail(t, ERR_KIND, msg)
    elif rc == 0:
        if read_bytes(t, dst, nbytes, &done) < 0:
            unpop_record(t, &tr, dst + nbytes - done, done, NULL, 0)
            rc = -1
        else:
            finish_record_pop(t, &tr)
    bulk_unlock(t)
    return rc


cdef char* tape_reserve(TapeStruct* t, size_t nbytes) noexcept nogil:
    """Reserve nbytes of contiguous tape storage for a record the caller fills in place.

    The pointer is valid until the next operation on the tape; finish with
    tape_commit_record(t, nbytes, kind).  Not locked: for a tape with one owner.
    """
    cdef char* p
    if check_open(t) < 0:
        return NULL
    if <size_t>(t.limit - t.top) < round8(nbytes):
        if tape_grow(t, round8(nbytes)) < 0:
            return NULL
    p = t.top
    t.top += round8(nbytes)
    return p


cdef int tape_commit_record(TapeStruct* t, size_t nbytes, int kind) noexcept nogil:
    cdef RecordTrailer tr
    cdef size_t pos0 = cur_pos(t) - round8(nbytes)
    tr.nbytes = nbytes
    tr.kind = kind
    tr.prev_record_end = t.last_record_end
    if reserve_record_entry(t) < 0 or write_bytes(t, <char*>&tr, TRAILER) < 0:
        return undo_write(t, pos0)
    finish_record_push(t, pos0, nbytes)
    return 0


cdef int64_t tape_len(TapeStruct* t) noexcept nogil:
    return t.n_records + (<int64_t>cur_pos(t) - t.record_bytes) // t.itemsize


cdef size_t tape_nbytes(TapeStruct* t) noexcept nogil:
    return cur_pos(t)


cdef int tape_clear(TapeStruct* t) noexcept nogil:
    cdef int rc
    if bulk_lock(t) < 0:
        return -1
    rc = check_open(t)
    if rc == 0:
        rc = rewind_to(t, 0, 0, 0, 0)
        pthread_mutex_lock(&t.io_mu)
        while t.pool != NULL:
            free_pooled(t)
        t.io_errno = 0
        t.io_rollback_end = <off_t>0x7FFFFFFFFFFFFFFF
        pthread_mutex_unlock(&t.io_mu)
    bulk_unlock(t)
    return rc


cdef void tape_close(TapeStruct* t) noexcept nogil:
    """Free every slab, stop the I/O thread and close the spill file.  Idempotent.

    In a child forked without the Python fork hook (a fork from C), only the
    child's descriptor is let go: the file and the thread are the parent's.
    """
    if not t.closed and getpid() != t.owner_pid:
        abandon_inherited(t)
    if t.closed:
        return
    tape_lock(t)
    if t.closed:
        tape_unlock(t)
        return
    rewind_to(t, 0, 0, 0, 0)
    spill_close(t)
    pthread_mutex_lock(&t.io_mu)
    while t.pool != NULL:
        free_pooled(t)
    pthread_mutex_unlock(&t.io_mu)
    free(t.records)
    t.records = NULL
    t.records_cap = 0
    pthread_mutex_destroy(&t.io_mu)
    pthread_cond_destroy(&t.io_cv)
    pthread_cond_destroy(&t.done_cv)
    t.closed = 1
    t.top = t.limit = t.floor = t.fence = NULL
    tape_unlock(t)


cdef int rewind_to_mark(TapeStruct* t, size_t pos, int64_t k, uint64_t serial) noexcept nogil:
    """Rewind to a mark after checking it against the record table (tape lock held).

    Valid: the mark's top record (its k-th) is still the k-th record, every record
    above it starts at or above the mark, and the mark lies on a scalar boundary
    at or below the top.  Anything else is a stale or foreign mark.
    """
    cdef int64_t end = 0, cum = 0
    if k < 0 or k > t.n_records or pos > cur_pos(t):
        return fail(t, ERR_MARK, "the mark lies above the tape's top: it was popped past")
    if k > 0:
        if t.records[k - 1].serial != serial:
            return fail(t, ERR_MARK, "the mark is stale: a record below it was popped since")
        end = t.records[k - 1].end
        cum = t.records[k - 1].cum_bytes
    if (<int64_t>pos < end or (k < t.n_records and t.records[k].start < <int64_t>pos)
            or (<int64_t>pos - end) % t.itemsize != 0):
        return fail(t, ERR_MARK, "the mark is stale: the entries below it were popped since")
    return rewind_to(t, pos, k, cum, end)


cdef int bad_array_record(TapeStruct* t, RecordTrailer* tr, char* meta_end, size_t popped,
                          const char* why) noexcept nogil:
    """Put back what was popped of a malformed array record and report it as corrupt
    (tape lock held).  Returns -1."""
    cdef char msg[512]
    cdef unsigned long long n = tr.nbytes
    unpop_record(t, tr, meta_end - popped, popped, NULL, 0)
    snprintf(msg, sizeof(msg), "the top array record (%llu bytes) is corrupt: %s", n, why)
    set_err(t, ERR_CORRUPT, 0, 0, msg)
    return -1


# ---------------------------------------------------------------------------
# Python API
# ---------------------------------------------------------------------------

DEF MAX_NDIM = 64
DEF MAX_DTYPE_CODE = 2048
DEF ARRAY_META_MAX = MAX_DTYPE_CODE + 8 * (MAX_NDIM + 3)
DEF ARRAY_MAGIC = 0x41445441505952   # "RYPATDA": ends every array record's header
_DTYPES = {np.dtype(np.float64): 0, np.dtype(np.float32): 1, np.dtype(np.int64): 2}
_open_tapes = weakref.WeakSet()


@atexit.register
def _close_open_tapes():
    for tape in list(_open_tapes):
        tape.close()


def _abandon_inherited_tapes():
    for tape in list(_open_tapes):
        abandon_inherited(&(<Tape>tape).t)
    _open_tapes.clear()


os.register_at_fork(after_in_child=_abandon_inherited_tapes)


class TapeMark:
    """A position on one tape, returned by Tape.mark() and accepted by Tape.rewind().

    It names its tape by a serial number unique in the process (not id(), which a
    later tape can reuse) and the record then on top by its serial, so a mark is
    refused once a record below it was popped, even if another took its place.
    """
    __slots__ = ("tape_id", "nbytes", "n_records", "record_serial", "length")

    def __init__(self, tape_id, nbytes, n_records, record_serial, length):
        self.tape_id = tape_id
        self.nbytes = nbytes
        self.n_records = n_records
        self.record_serial = record_serial
        self.length = length

    def __repr__(self):
        return f"TapeMark(length={self.length}, nbytes={self.nbytes})"


_tape_serials = itertools.count(1)


cdef class Tape:
    """A LIFO tape of float64 (or float32 / int64) scalars and byte records.

    Parameters
    ----------
    dtype : float64 (default), float32 or int64 - the type of scalar entries.
    sbo_size : elements kept inline in the Tape object (no heap allocation).
    slab_size : elements per heap slab (default: 2 MiB worth, one huge page; with
        a memory_budget at most budget / 32, down to 64 KiB).
    memory_budget : bytes of heap slabs kept in memory; past it the oldest slabs
        are written to a spill file.  None: no limit.  Writes are behind the pushes:
        the oldest slabs are queued for writing once the slabs in use pass
        memory_budget - W, W = min(2 * spill_unit, memory_budget / 4), and pushes go
        on while those writes run; a push waits for them only when its new slab would
        take allocated slab memory (pooled spares included) past memory_budget + S,
        the slack S = min(W, memory_budget / 32).  So peak_resident_bytes stays
        within memory_budget + S while pushing, unless one slab alone is larger (a
        record reserved in place gets a slab of its own size).  A pop that reaches a
        slab whose write has not started takes it back instead of waiting for it.
    spill_dir : directory of the spill file (default: the system temp dir).
    prefetch_depth : spilled units read ahead of need while popping, at least (the
        window widens to what the device reads in 50 ms, within the budget); 0: none.
    threadsafe : take the tape's lock on every operation.  With False, the tape
        belongs to one thread at a time (see ThreadLocalTapes): a second thread
        entering a bulk or GIL-releasing call (push_many, pop_many, the array and
        bytes records, rewind, clear, close), or a Python-level push/pop/peek while
        another thread is inside one, raises RuntimeError instead of corrupting the
        tape.  Cython code calling the unlocked fast paths is not checked.
    spill_unit : minimum bytes written or read per I/O request (default 1 MiB).
    keep_free_slabs : emptied slabs kept for reuse before they are freed (default:
        256 MiB worth without a budget, so a tape refilled every training step does
        not fault fresh pages in; with one, as many as the budget holds, counted
        against it: the slabs of the next fill reuse the buffers that the writes and
        pops free (GPT-2 124M at (4, 1024), budget 1/4: a forward pass 8.7 s with
        2 + prefetch_depth spares, 6.8 s with them).  clear() frees them.
    write_ahead : with a memory_budget, learn from each fill of the tape from empty
        (a training step's forward pass) how far it went; the next fill then writes
        the slabs that will not fit the budget as soon as they are full, instead of
        when the budget is reached, so the writes spread over the whole fill and the
        pushes rarely wait for the disk (default True).  A pop ends the write-ahead
        of the fill; what it queued is written as it would have been anyway.
    """

    def __cinit__(self, dtype=np.float64, sbo_size=32, slab_size=None, memory_budget=None,
                  spill_dir=None, prefetch_depth=2, threadsafe=True, spill_unit=1 << 20,
                  keep_free_slabs=None, write_ahead=True):
        cdef int itemsize
        cdef int64_t budget
        self.t.closed = 1
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be float64, float32 or int64, got {dtype!r}") from None
        if dt not in _DTYPES:
            raise TypeError(f"dtype must be float64, float32 or int64, got {dt}")
        self.dtype = dt
        self.kind = _DTYPES[dt]
        itemsize = dt.itemsize
        sbo_size = _count("sbo_size", sbo_size)
        if sbo_size * itemsize > MAX_SBO_BYTES:
            raise ValueError(f"sbo_size={sbo_size} exceeds the inline buffer "
                             f"({MAX_SBO_BYTES // itemsize} elements of {dt})")
        if slab_size is None:
            slab_size = _default_slab_bytes(memory_budget) // itemsize
        slab_size = _count("slab_size", slab_size)
        if slab_size == 0:
            raise ValueError("slab_size must be at least 1")
        prefetch_depth = _count("prefetch_depth", prefetch_depth)
        spill_unit = _count("spill_unit", spill_unit)
        if memory_budget is None:
            budget = -1
        else:
            budget = _count("memory_budget", memory_budget)
        if spill_dir is None:
            spill_dir = tempfile.gettempdir()
        spill_dir = os.fspath(spill_dir)
        if budget >= 0:
            if not os.path.exists(spill_dir):
                raise FileNotFoundError(f"spill_dir {spill_dir!r} does not exist")
            if not os.path.isdir(spill_dir):
                raise NotADirectoryError(f"spill_dir {spill_dir!r} is not a directory")
        encoded = os.fsencode(os.path.abspath(spill_dir))
        if len(encoded) > 4000:
            raise ValueError(f"spill_dir path is too long ({len(encoded)} bytes)")
        tape_init(&self.t, itemsize, sbo_size * itemsize, self.sbo,
                  slab_size * itemsize, budget, encoded, prefetch_depth,
                  1 if threadsafe else 0, max(spill_unit, 1))
        self.t.tape_serial = next(_tape_serials)
        self.t.write_ahead = 1 if write_ahead else 0
        if keep_free_slabs is not None:
            self.t.max_free_slabs = _count("keep_free_slabs", keep_free_slabs)
        elif budget < 0:
            self.t.max_free_slabs = max(4, (256 << 20) // (slab_size * itemsize))
        else:
            # As many as the budget holds: the head slabs of a fill then reuse the
            # buffers the writes free instead of mapping (and faulting in) fresh ones.
            # The spares count against memory_budget + S like slabs in use (make_room).
            self.t.max_free_slabs = max(self.t.max_free_slabs,
                                        budget // self.t.slab_bytes + 1)
        _open_tapes.add(self)

    def __dealloc__(self):
        if not self.t.closed:
            tape_close(&self.t)

    cdef int check(self, int rc) except -1:
        """Raise the tape's last error as the matching Python exception."""
        if rc == 0:
            return 0
        code = last_error.code
        msg = last_error.msg.decode("utf-8", "replace")
        last_error.code = ERR_NONE
        if code == ERR_EMPTY:
            raise IndexError(msg)
        if code == ERR_KIND:
            raise TypeError(msg)
        if code == ERR_CLOSED:
            raise TapeClosedError(msg)
        if code == ERR_NOMEM:
            raise MemoryError(msg)
        if code == ERR_IO:
            path = self.t.spill_path.decode("utf-8", "replace") or self.t.spill_dir.decode()
            raise SpillError(last_error.errnum, msg, path)
        if code == ERR_CORRUPT:
            raise TapeCorruptionError(msg)
        if code == ERR_MARK:
            raise ValueError(msg)
        if code == ERR_FORKED:
            raise TapeForkError(msg)
        if code == ERR_SHARED:
            raise RuntimeError(msg)
        raise TapeError(msg or "tape operation failed")

    cdef int require_open(self) except -1:
        if self.t.closed:
            self.check(check_open(&self.t))
        return 0
    # -- scalars ------------------------------------------------------------

    @cython.always_allow_keywords(False)
    def push(self, value):
        """Push one scalar of the tape's dtype.

        Nothing is rounded away silently: a float32 tape refuses a finite value
        beyond float32's range with OverflowError (inf and nan themselves are
        stored), and an int64 tape takes only integers (int, NumPy integers,
        anything with ``__index__``): floats, Decimal and Fraction raise
        TypeError even when their value is integral, as ``range()`` does.
        """
        cdef double d
        cdef float f
        cdef int64_t i
        cdef int rc
        if not self.t.threadsafe and self.t.locked_word:
            raise_shared()
        if self.kind == 0:
            d = value
            rc = tape_push_f64(&self.t, d)
        elif self.kind == 1:
            d = value
            f = <float>d
            if isinf(f) and not isinf(d):
                raise OverflowError(f"{value!r} overflows float32 (largest finite value "
                                    f"3.4028235e+38)")
            rc = tape_push_f32(&self.t, f)
        else:
            try:
                integer = PyNumber_Index(value)
            except TypeError:
                raise TypeError(f"an int64 tape takes integers, got {type(value).__name__} "
                                f"{value!r}") from None
            i = integer
            rc = tape_push_i64(&self.t, i)
        if rc:
            self.check(rc)

    @cython.always_allow_keywords(False)
    def pop(self):
        """Pop and return the most recently pushed scalar."""
        cdef double d
        cdef float f
        cdef int64_t i
        cdef int rc
        if not self.t.threadsafe and self.t.locked_word:
            raise_shared()
        if self.kind == 0:
            rc = tape_pop_f64(&self.t, &d)
            if rc:
                self.check(rc)
            return d
        if self.kind == 1:
            rc = tape_pop_f32(&self.t, &f)
            if rc:
                self.check(rc)
            return f
        rc = tape_pop_i64(&self.t, &i)
        if rc:
            self.check(rc)
        return i

    @cython.always_allow_keywords(False)
    def peek(self):
        """Return the most recently pushed scalar without popping it."""
        cdef char buf[8]
        cdef int rc = 0
        if not self.t.threadsafe and self.t.locked_word:
            raise_shared()
        tape_lock(&self.t)
        if <size_t>(self.t.top - self.t.fence) >= <size_t>self.t.itemsize:
            memcpy(buf, self.t.top - self.t.itemsize, self.t.itemsize)
        else:
            rc = tape_peek_slow(&self.t, buf)
        tape_unlock(&self.t)
        if rc:
            self.check(rc)
        if self.kind == 0:
            return (<double*>buf)[0]
        if self.kind == 1:
            return (<float*>buf)[0]
        return (<int64_t*>buf)[0]

    def push_many(self, values):
        """Push every element of an array of the tape's dtype (C order)."""
        cdef cnp.ndarray arr
        cdef int rc
        cdef size_t n
        cdef const char* src
        if not isinstance(values, np.ndarray):
            raise TypeError(f"push_many takes a numpy array, got {type(values).__name__}")
        if values.dtype != self.dtype:
            raise TypeError(f"push_many: array dtype {values.dtype} does not match the tape's "
                            f"dtype {self.dtype}")
        arr = np.ascontiguousarray(values)
        n = arr.size
        src = <const char*>cnp.PyArray_DATA(arr)
        with nogil:
            rc = tape_push_many(&self.t, src, n)
        if rc:
            self.check(rc)

    def pop_many(self, n):
        """Pop the last n scalars as an array, most recent last."""
        cdef cnp.ndarray out
        cdef int rc
        cdef size_t count = _count("n", n)
        cdef char* dst
        self.require_open()
        out = np.empty(count, dtype=self.dtype)
        dst = <char*>cnp.PyArray_DATA(out)
        with nogil:
            rc = tape_pop_many(&self.t, dst, count)
        if rc:
            self.check(rc)
        return out

    # -- records ------------------------------------------------------------

    def push_bytes(self, data):
        """Push a bytes-like object as one record."""
        cdef const unsigned char[::1] view
        cdef int rc
        cdef const char* src = NULL
        cdef size_t n
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            raise TypeError(f"push_bytes takes a bytes-like object, got {type(data).__name__}") from None
        n = view.shape[0]
        if n:
            src = <const char*>&view[0]
        with nogil:
            rc = tape_push_record(&self.t, src, n, RECORD_BYTES)
        if rc:
            self.check(rc)

    def pop_bytes(self):
        """Pop the top record pushed by push_bytes and return it as bytes."""
        cdef RecordTrailer tr
        cdef size_t done = 0
        cdef int rc
        lock_or_raise(self)
        rc = pop_trailer(&self.t, &tr, RECORD_BYTES)
        if rc:
            bulk_unlock(&self.t)
            self.check(rc)
        try:
            out = PyBytes_FromStringAndSize(NULL, tr.nbytes)
        except MemoryError:
            unpop_record(&self.t, &tr, NULL, 0, NULL, 0)
            bulk_unlock(&self.t)
            raise
        rc = read_bytes(&self.t, PyBytes_AS_STRING(out), tr.nbytes, &done)
        if rc:
            unpop_record(&self.t, &tr, PyBytes_AS_STRING(out) + tr.nbytes - done, done, NULL, 0)
        else:
            finish_record_pop(&self.t, &tr)
        bulk_unlock(&self.t)
        if rc:
            self.check(rc)
        return out

    def push_array(self, a):
        """Push a copy of an array as one record.

        Any dtype that round-trips exactly is taken: byte order, item size,
        datetime unit, string lengths and structured fields all come back as
        pushed.  Arrays holding Python objects (object fields, StringDType) and
        dtypes that cannot be described exactly raise TypeError, and the tape is
        left as it was.
        """
        cdef cnp.ndarray arr
        cdef char meta[ARRAY_META_MAX]
        cdef int64_t* ints
        cdef const unsigned char[::1] code_view
        cdef int ndim, k, rc
        cdef size_t nbytes, code_len, meta_len
        cdef const char* src
        if not isinstance(a, np.ndarray):
            raise TypeError(f"push_array takes a numpy array, got {type(a).__name__}")
        code = _dtype_code(a.dtype)
        arr = a if a.flags.c_contiguous else a.copy(order="C")
        ndim = arr.ndim
        if ndim > MAX_NDIM:
            raise ValueError(f"push_array: {ndim} dimensions exceed the limit of {MAX_NDIM}")
        # Record payload: data, dtype code (8-byte padded), shape, then ndim, code
        # length and a magic word: pop_array reads it from the top down.
        code_len = len(code)
        code_view = code
        meta_len = round8(code_len) + 8 * (ndim + 3)
        memset(meta, 0, round8(code_len))
        memcpy(meta, &code_view[0], code_len)
        ints = <int64_t*>(meta + round8(code_len))
        for k in range(ndim):
            ints[k] = arr.shape[k]
        ints[ndim] = ndim
        ints[ndim + 1] = <int64_t>code_len
        ints[ndim + 2] = ARRAY_MAGIC
        nbytes = arr.nbytes
        src = <const char*>cnp.PyArray_DATA(arr)
        with nogil:
            rc = bulk_lock(&self.t)
            if rc == 0:
                rc = check_open(&self.t)
                if rc == 0:
                    rc = push_record_parts(&self.t, src, nbytes, meta, meta_len, RECORD_ARRAY)
                bulk_unlock(&self.t)
        if rc:
            self.check(rc)

    def pop_array(self, out=None):
        """Pop the top array record; returns a new array, or fills ``out`` (same dtype, shape)."""
        cdef RecordTrailer tr
        cdef char meta[ARRAY_META_MAX]
        cdef char* meta_end = meta + ARRAY_META_MAX
        cdef int64_t tail[3]
        cdef size_t done = 0, meta_len = 24, nbytes, code_len = 0
        cdef int64_t ndim = 0, magic = 0
        cdef cnp.ndarray result
        cdef char* dst
        cdef int rc
        lock_or_raise(self)
        rc = pop_trailer(&self.t, &tr, RECORD_ARRAY)
        if rc:
            bulk_unlock(&self.t)
            self.check(rc)
        if tr.nbytes < 24:
            rc = bad_array_record(&self.t, &tr, meta_end, 0, "its payload is shorter than its header")
        else:
            rc = read_bytes(&self.t, meta_end - 24, 24, &done)
            if rc:
                unpop_record(&self.t, &tr, meta_end - done, done, NULL, 0)
        if rc == 0:
            memcpy(tail, meta_end - 24, 24)
            ndim, code_len, magic = tail[0], <size_t>tail[1], tail[2]
            if magic != ARRAY_MAGIC or ndim < 0 or ndim > MAX_NDIM or code_len == 0 \
                    or code_len > MAX_DTYPE_CODE:
                rc = bad_array_record(&self.t, &tr, meta_end, 24, "its header does not check out")
            else:
                meta_len = 24 + 8 * ndim + round8(code_len)
                if meta_len > tr.nbytes:
                    rc = bad_array_record(&self.t, &tr, meta_end, 24,
                                                "its header is longer than the record")
                else:
                    rc = read_bytes(&self.t, meta_end - meta_len, meta_len - 24, &done)
                    if rc:
                        unpop_record(&self.t, &tr, meta_end - 24 - done, done + 24, NULL, 0)
        if rc:
            bulk_unlock(&self.t)
            self.check(rc)
        try:
            shape = tuple((<int64_t*>(meta_end - 24 - 8 * ndim))[k] for k in range(ndim))
            dtype = _dtype_from_code(PyBytes_FromStringAndSize(meta_end - meta_len, code_len))
            valid = (dtype is not None and all(d >= 0 for d in shape)
                     and tr.nbytes - meta_len == _array_nbytes(dtype, shape))
        except BaseException:
            unpop_record(&self.t, &tr, meta_end - meta_len, meta_len, NULL, 0)
            bulk_unlock(&self.t)
            raise
        if not valid:
            bad_array_record(&self.t, &tr, meta_end, meta_len,
                             "its dtype or shape does not match its size")
            bulk_unlock(&self.t)
            self.check(-1)
        try:
            if out is None:
                result = np.empty(shape, dtype=dtype)
            else:
                if (not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != shape
                        or not out.flags.c_contiguous or not out.flags.writeable):
                    raise ValueError(f"pop_array(out=...): out must be a writable C-contiguous "
                                     f"{dtype} array of shape {shape}")
                result = out
        except BaseException:
            unpop_record(&self.t, &tr, meta_end - meta_len, meta_len, NULL, 0)
            bulk_unlock(&self.t)
            raise
        nbytes = result.nbytes
        dst = <char*>cnp.PyArray_DATA(result)
        with nogil:
            rc = read_bytes(&self.t, dst, nbytes, &done)
            if rc:
                unpop_record(&self.t, &tr, dst + nbytes - done, done, meta_end - meta_len, meta_len)
            else:
                finish_record_pop(&self.t, &tr)
            bulk_unlock(&self.t)
        if rc:
            self.check(rc)
        return result

    # -- whole-tape operations ------------------------------------------------

    def __len__(self):
        cdef int64_t n
        self.require_open()
        lock_or_raise(self)
        n = tape_len(&self.t)
        bulk_unlock(&self.t)
        return n

    @property
    def nbytes(self):
        """Logical bytes stored (scalars, records and their trailers)."""
        return tape_nbytes(&self.t)

    @property
    def dtype(self):
        return self.dtype

    @property
    def closed(self):
        return bool(self.t.closed)

    def mark(self):
        """Remember the current top; rewind(mark) later discards everything pushed after it.

        The mark stays valid while the entries below it stay on the tape: once a
        record at or below it is popped, rewind(mark) raises ValueError.
        """
        cdef int64_t k
        self.require_open()
        lock_or_raise(self)
        k = self.t.n_records
        m = TapeMark(self.t.tape_serial, tape_nbytes(&self.t), k,
                     self.t.records[k - 1].serial if k > 0 else 0, tape_len(&self.t))
        bulk_unlock(&self.t)
        return m

    def rewind(self, mark):
        """Discard every entry pushed after ``mark`` (from this tape's mark())."""
        cdef int rc = 0
        cdef size_t pos
        cdef int64_t k
        cdef uint64_t serial
        if not isinstance(mark, TapeMark) or mark.tape_id != self.t.tape_serial:
            raise ValueError("rewind takes a TapeMark returned by this tape's mark()")
        self.require_open()
        try:
            pos, k, serial = mark.nbytes, mark.n_records, mark.record_serial
        except (TypeError, OverflowError):
            raise ValueError(f"{mark!r} is not a mark this tape made") from None
        with nogil:
            rc = bulk_lock(&self.t)
            if rc == 0:
                rc = rewind_to_mark(&self.t, pos, k, serial)
                bulk_unlock(&self.t)
        if rc:
            self.check(rc)

    def clear(self):
        """Discard every entry; heap slabs are freed and the spill file emptied."""
        cdef int rc
        self.require_open()
        with nogil:
            rc = tape_clear(&self.t)
        if rc:
            self.check(rc)

    def close(self):
        """Free everything and remove the spill file.  Further use raises TapeClosedError."""
        if not self.t.threadsafe and self.t.locked_word:
            raise_shared()
        if not self.t.closed:
            with nogil:
                tape_close(&self.t)
        _open_tapes.discard(self)

    def __enter__(self):
        self.require_open()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def stats(self):
        """Counters: bytes resident/spilled, slabs, spills, reloads, prefetch hits and misses,
        bytes written to and read from the spill file, bytes queued or being written
        (writing_bytes), bytes whose queued write a pop took back before it started
        (bytes_cancelled), the nanoseconds pops waited on reads (io_wait_ns) and
        pushes on writes (push_wait_ns), bytes queued early by the write-ahead rule
        (bytes_written_early) and where it stops (write_ahead_until), the nanoseconds
        the reads took (read_ns, for the device rate) and the prefetch's current
        read-ahead window in bytes; the most bytes ever on disk (peak_spilled_bytes) and
        the spill file's largest size (peak_spill_file_bytes: above peak_spilled_bytes by
        at most one spill unit and each slab's padding to the O_DIRECT block).  Model
        state streamed through this tape's I/O thread (``adtape.statefile``):
        state_bytes_read and state_bytes_written, the nanoseconds the transfers took
        (state_read_ns, state_write_ns) and callers waited for them (state_wait_ns),
        state_requests."""
        cdef TapeStruct* t = &self.t
        cdef Slab* s
        cdef int64_t n_slabs = 0, resident_slabs = 0
        self.require_open()
        lock_or_raise(self)
        pthread_mutex_lock(&t.io_mu)
        s = t.head
        while s != NULL:
            if s.heap:
                n_slabs += 1
                if s.state == SLAB_RESIDENT or s.state == SLAB_WRITING:
                    resident_slabs += 1
            s = s.prev
        out = {
            "length": tape_len(t),
            "nbytes": tape_nbytes(t),
            "sbo_bytes": t.inline_slab.cap,
            "in_sbo": t.head == &t.inline_slab,
            "heap_slabs": t.heap_slabs,
            "n_slabs": n_slabs,
            "resident_slabs": resident_slabs,
            "pooled_slabs": t.pool_count,
            "resident_bytes": t.resident_bytes,
            "peak_resident_bytes": t.peak_resident_bytes,
            "spilled_bytes": t.spilled_bytes,
            "spill_file_bytes": t.file_size,
            "peak_spilled_bytes": t.peak_spilled_bytes,
            "peak_spill_file_bytes": t.peak_file_size,
            "memory_budget": None if t.memory_budget < 0 else t.memory_budget,
            "spills": t.n_spills,
            "reloads": t.n_reloads,
            "prefetch_hits": t.prefetch_hits,
            "prefetch_misses": t.prefetch_misses,
            "io_wait_ns": t.io_wait_ns,
            "push_wait_ns": t.push_wait_ns,
            "bytes_written": t.bytes_written,
            "bytes_read": t.bytes_read,
            "writing_bytes": t.writing_bytes,
            "bytes_cancelled": t.bytes_cancelled,
            "bytes_written_early": t.bytes_written_early,
            "read_ns": t.read_ns,
            "write_ahead_until": t.early_until,
            "readahead_bytes": readahead_bytes(t) if t.memory_budget >= 0 else 0,
            "state_bytes_read": t.state_bytes_read,
            "state_bytes_written": t.state_bytes_written,
            "state_read_ns": t.state_read_ns,
            "state_write_ns": t.state_write_ns,
            "state_wait_ns": t.state_wait_ns,
            "state_requests": t.state_requests,
        }
        pthread_mutex_unlock(&t.io_mu)
        bulk_unlock(t)
        return out

    def _state_io(self, bint is_write, int fd, buf, off_t offset, rec_off, rec_len, sums,
                  valid=None):
        """Queue a state transfer on this tape's I/O thread, behind its queued slab
        requests (``adtape.statefile``): ``buf`` (uint8, the first ``buf.nbytes`` bytes)
        written to or read from ``fd`` at ``offset``; records at ``rec_off`` of
        ``rec_len`` bytes inside it, whose checksums a write stores into ``sums``
        (uint64) and a read checks against them, records with ``valid`` 0 reading as
        zeros.  Returns a ``StateRequest``."""
        cdef TapeStruct* t = &self.t
        cdef cnp.ndarray b = _state_array(buf, "buf", cnp.NPY_UINT8, not is_write)
        cdef cnp.ndarray ro = _state_array(rec_off, "rec_off", cnp.NPY_INT64, False)
        cdef cnp.ndarray rl = _state_array(rec_len, "rec_len", cnp.NPY_INT64, False)
        cdef cnp.ndarray su = _state_array(sums, "sums", cnp.NPY_UINT64, is_write)
        cdef cnp.ndarray va = None
        cdef Py_ssize_t n = cnp.PyArray_SIZE(ro), nbytes = cnp.PyArray_SIZE(b)
        cdef StateIO* io
        cdef IORequest* req
        cdef int rc
        if valid is not None:
            va = _state_array(valid, "valid", cnp.NPY_UINT8, False)
            if cnp.PyArray_SIZE(va) != n:
                raise ValueError("valid must have one entry per record")
        if cnp.PyArray_SIZE(rl) != n or cnp.PyArray_SIZE(su) != n:
            raise ValueError("rec_off, rec_len and sums must have one entry per record")
        if n and (ro.min() < 0 or rl.min() < 0 or (ro + rl).max() > nbytes):
            raise ValueError("a record lies outside buf")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self.require_open()
        if getpid() != t.owner_pid:
            self.check(check_open(t))
        handle = StateRequest.__new__(StateRequest)
        io = <StateIO*>malloc(sizeof(StateIO))
        req = <IORequest*>malloc(sizeof(IORequest))
        if io == NULL or req == NULL:
            free(io)
            free(req)
            raise MemoryError("out of memory queueing a state transfer")
        io.is_write = is_write
        io.fd = fd
        io.buf = <char*>cnp.PyArray_DATA(b)
        io.nbytes = <size_t>nbytes
        io.offset = offset
        io.nrec = <int>n
        io.rec_off = <const int64_t*>cnp.PyArray_DATA(ro)
        io.rec_len = <const int64_t*>cnp.PyArray_DATA(rl)
        io.sums = <uint64_t*>cnp.PyArray_DATA(su)
        io.valid = <const unsigned char*>cnp.PyArray_DATA(va) if va is not None else NULL
        io.status = 0
        io.err = 0
        io.bad_record = -1
        io.moved = 0
        io.io_ns = 0
        req.is_write = is_write
        req.first = NULL
        req.count = 0
        req.next = NULL
        req.state = io
        (<StateRequest>handle).io = io
        (<StateRequest>handle).tape = self
        (<StateRequest>handle).refs = (b, ro, rl, su, va)
        pthread_mutex_lock(&t.io_mu)
        rc = start_io_thread(t)
        if rc == 0:
            append_request(t, req)
        pthread_mutex_unlock(&t.io_mu)
        if rc < 0:
            io.status = 1
            free(req)
            self.check(rc)
        return handle

    def __repr__(self):
        if self.t.closed:
            return f"<adtape.Tape dtype={self.dtype} closed>"
        return f"<adtape.Tape dtype={self.dtype} len={len(self)} nbytes={self.nbytes}>"

    # -- test hooks -----------------------------------------------------------

    def _inject_write_error(self, int err):
        """Make every spill write fail with errno ``err`` (0 turns injection off).  For tests."""
        self.require_open()
        pthread_mutex_lock(&self.t.io_mu)
        self.t.inject_write_errno = err
        pthread_mutex_unlock(&self.t.io_mu)

    def _overwrite_top(self, data):
        """Overwrite the top len(data) bytes in place, as memory corruption would.  For
        tests of the record checks; the bytes must lie in the head slab."""
        cdef const unsigned char[::1] view = bytes(data)
        self.require_open()
        if view.shape[0] == 0 or <size_t>(self.t.top - self.t.floor) < <size_t>view.shape[0]:
            raise ValueError("_overwrite_top: the bytes must lie in the head slab")
        memcpy(self.t.top - view.shape[0], &view[0], view.shape[0])

    def _hold_io(self, double seconds):
        """Keep the I/O thread from starting any request for ``seconds`` (0 lets it go);
        closing the tape lets it go too.  For tests of the write-behind."""
        self.require_open()
        pthread_mutex_lock(&self.t.io_mu)
        self.t.io_hold_until_ns = now_ns() + <int64_t>(seconds * 1e9) if seconds > 0 else 0
        pthread_cond_broadcast(&self.t.io_cv)
        pthread_mutex_unlock(&self.t.io_mu)

    def _spill_fd(self):
        """The spill file's descriptor (-1 before the first spill).  For tests."""
        return self.t.fd

    def _spill_direct(self):
        """Whether the spill file takes O_DIRECT I/O (False before the first spill or
        where the filesystem refuses it).  For tests and benchmarks."""
        return self.t.dfd >= 0

    def _sync(self):
        """Wait until the I/O thread is idle (state transfers included).  For tests and
        benchmarks."""
        self.require_open()
        with nogil:
            pthread_mutex_lock(&self.t.io_mu)
            while self.t.io_busy or self.t.queue_head != NULL:
                pthread_cond_wait(&self.t.done_cv, &self.t.io_mu)
            pthread_mutex_unlock(&self.t.io_mu)


cdef class StateRequest:
    """One state transfer queued on a tape's I/O thread (``Tape._state_io``): ``done``,
    ``wait()``, then ``err`` (errno, 0) and ``bad_record`` (the first record whose
    checksum failed on a read, or -1).  Keeps its buffers alive until done."""
    cdef StateIO* io
    cdef Tape tape
    cdef object refs

    def __dealloc__(self):
        if self.io == NULL:
            return
        if self.tape is not None and not self.tape.t.closed and self.io.status == 0:
            if getpid() != self.tape.t.owner_pid:
                return              # the parent's thread owns it: leak, never free under it
            with nogil:
                self._wait_c()
        free(self.io)
        self.io = NULL

    cdef void _wait_c(self) noexcept nogil:
        cdef TapeStruct* t = &self.tape.t
        cdef int64_t started
        pthread_mutex_lock(&t.io_mu)
        if self.io.status == 0:
            started = now_ns()
            while self.io.status == 0:
                pthread_cond_wait(&t.done_cv, &t.io_mu)
            t.state_wait_ns += now_ns() - started
        pthread_mutex_unlock(&t.io_mu)

    @property
    def done(self):
        cdef int status
        if self.tape.t.closed:
            return True
        pthread_mutex_lock(&self.tape.t.io_mu)
        status = self.io.status
        pthread_mutex_unlock(&self.tape.t.io_mu)
        return status != 0

    def wait(self):
        """Wait until the transfer is done (the time counts as the tape's
        ``state_wait_ns``)."""
        if self.tape.t.closed or self.io.status != 0:
            return
        if getpid() != self.tape.t.owner_pid:
            raise TapeForkError("this state transfer was queued by another process")
        with nogil:
            self._wait_c()

    @property
    def err(self):
        return self.io.err

    @property
    def bad_record(self):
        return self.io.bad_record

    @property
    def io_ns(self):
        return self.io.io_ns

    @property
    def moved(self):
        """Whether bytes moved (a read of records never written only zeroes the buffer)."""
        return bool(self.io.moved)


cdef cnp.ndarray _state_array(object arr, str name, int typenum, bint writable):
    if (not isinstance(arr, np.ndarray) or cnp.PyArray_TYPE(<cnp.ndarray>arr) != typenum
            or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>arr)):
        raise TypeError(f"{name} must be a C-contiguous {np.dtype(cnp.PyArray_DescrFromType(typenum))} "
                        f"array")
    if writable and not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>arr):
        raise ValueError(f"{name} must be writable")
    return <cnp.ndarray>arr


def checksum_bytes(data):
    """The disk tier's 64-bit checksum of a contiguous buffer, computed without the GIL:
    the one the spill file's slabs carry, for the other state the disk tier stores
    (``adtape.statefile``)."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    cdef uint64_t h
    cdef const char* p = <const char*>&view[0] if n else NULL
    with nogil:
        h = checksum(p, n)
    return h


def _default_slab_bytes(memory_budget):
    """2 MiB (one huge page); with a budget, at most budget / 32 (a power of two,
    64 KiB to 2 MiB), so the one slab that may stand above the budget stays small."""
    size = 2 << 20
    if memory_budget is not None and isinstance(memory_budget, (int, np.integer)):
        while size > (64 << 10) and size > memory_budget // 32:
            size //= 2
    return size


_DTYPE_CODES = {}      # dtype -> the bytes that describe it in an array record
_CODE_DTYPES = {}      # and back


def _dtype_code(dt):
    """The exact description of an array dtype stored in its record, or TypeError.

    A dtype without fields is its ``dtype.str`` ('>f8', '<M8[ns]', '|S5');
    a structured one is the ``.npy`` format's descr (names, formats, padding).
    Whatever does not decode back to an equal dtype is refused, as are Python
    objects (their bytes are pointers, meaningless once popped).
    """
    code = _DTYPE_CODES.get(dt)
    if code is not None:
        return code
    if dt.hasobject:
        raise TypeError(f"push_array cannot store arrays of Python objects (dtype {dt})")
    try:
        if dt.fields is None and dt.subdtype is None:
            code = b"s" + dt.str.encode("ascii")
        else:
            code = b"d" + repr(npformat.dtype_to_descr(dt)).encode("ascii")
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        raise TypeError(f"push_array cannot describe dtype {dt} exactly: {exc}") from None
    if len(code) > MAX_DTYPE_CODE:
        raise TypeError(f"push_array: the description of dtype {dt} takes {len(code)} bytes, "
                        f"over the limit of {MAX_DTYPE_CODE}")
    back = _dtype_from_code(code)
    if back is None or back != dt or back.itemsize != dt.itemsize:
        raise TypeError(f"push_array cannot store dtype {dt}: it does not round-trip exactly "
                        f"(it would come back as {back})")
    _DTYPE_CODES[dt] = code
    _CODE_DTYPES[code] = back
    return code


def _dtype_from_code(code):
    """The dtype an array record describes, or None if the description is not valid."""
    dt = _CODE_DTYPES.get(code)
    if dt is not None:
        return dt
    try:
        text = code[1:].decode("ascii")
        if code[:1] == b"s":
            dt = np.dtype(text)
        elif code[:1] == b"d":
            dt = npformat.descr_to_dtype(ast.literal_eval(text))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    # Bytes popped into an object array would be taken for pointers.
    return None if dt is None or dt.hasobject else dt


def _array_nbytes(dt, shape):
    n = dt.itemsize
    for d in shape:
        n *= d
    return n


def _count(name, value):
    """A non-negative integer parameter, or a clear error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


class ThreadLocalTapes:
    """One tape per thread, created on first use with the same settings.

    A reverse sweep needs its own entries back in exact LIFO order; with one
    tape per thread no other thread can interleave.  These tapes skip the lock
    (threadsafe=False) unless told otherwise.
    """

    def __init__(self, **tape_kwargs):
        tape_kwargs.setdefault("threadsafe", False)
        self._kwargs = tape_kwargs
        self._local = threading.local()
        self._tapes = []
        self._lock = threading.Lock()

    def get(self):
        """The calling thread's tape."""
        tape = getattr(self._local, "tape", None)
        if tape is None or tape.closed:
            tape = Tape(**self._kwargs)
            self._local.tape = tape
            with self._lock:
                self._tapes.append(tape)
        return tape

    def tapes(self):
        """Every tape created so far (one per thread that asked)."""
        with self._lock:
            return list(self._tapes)

    def close(self):
        """Close every thread's tape."""
        with self._lock:
            tapes, self._tapes = self._tapes, []
        for tape in tapes:
            tape.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
