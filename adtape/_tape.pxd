# The C contract of the layered tape: structs and nogil functions that other
# Cython modules cimport.  Logic lives in free functions over a TapeStruct*;
# adtape._tape.Tape only owns one and turns status codes into exceptions.
#
# Storage is a byte stack: an inline small buffer (slab 0, never spilled), then
# linked heap slabs.  Scalars of the tape's dtype are pushed untagged; a byte
# record is its payload followed by a RecordTrailer, so a record is popped
# trailer first.  The fast paths below touch only the head slab, which is always
# resident; everything else goes through the *_slow functions in _tape.pyx.
#
# Every function returning int returns 0 on success and -1 on error, with the
# error kept in the calling thread's error slot, so that threads sharing a tape
# each get their own (Tape.check in _tape.pyx raises it).

from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.string cimport memcpy
from posix.types cimport off_t

cdef extern from "pthread.h" nogil:
    ctypedef struct pthread_t:
        pass
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass

cdef extern from *:
    """
    #include <sched.h>
    static inline void adtape_spin_lock(volatile int *word) {
        unsigned spins = 0;
        while (__atomic_exchange_n(word, 1, __ATOMIC_ACQUIRE)) {
            while (__atomic_load_n(word, __ATOMIC_RELAXED)) {
                if (++spins < 64) __builtin_ia32_pause();
                else { spins = 0; sched_yield(); }
            }
        }
    }
    static inline void adtape_spin_unlock(volatile int *word) {
        __atomic_store_n(word, 0, __ATOMIC_RELEASE);
    }
    """
    void adtape_spin_lock(int *word) nogil
    void adtape_spin_unlock(int *word) nogil

# Slab states.  Only the I/O thread and slow paths change them, under io_mu.
cdef enum SlabState:
    SLAB_RESIDENT = 0
    SLAB_WRITING = 1     # queued or being written; data still valid in memory
    SLAB_ON_DISK = 2     # data freed, bytes live in the spill file
    SLAB_LOADING = 3     # buffer allocated, read queued or in flight
    SLAB_CORRUPT = 4     # reload failed its checksum; data unusable

# Record kinds stored in a trailer.
cdef enum RecordKind:
    RECORD_BYTES = 1
    RECORD_ARRAY = 2

# Error codes, kept in the calling thread's error slot (last_error in _tape.pyx).
cdef enum TapeErr:
    ERR_NONE = 0
    ERR_EMPTY = 1        # IndexError
    ERR_KIND = 2         # TypeError: top entry is not what was asked for
    ERR_CLOSED = 3       # TapeClosedError
    ERR_NOMEM = 4        # MemoryError
    ERR_IO = 5           # SpillError (OSError) with errno
    ERR_CORRUPT = 6      # TapeCorruptionError
    ERR_MARK = 7         # ValueError: mark no longer valid
    ERR_FORKED = 8       # TapeForkError: the tape belongs to the parent of a fork
    ERR_SHARED = 9       # RuntimeError: a threadsafe=False tape used by two threads

cdef struct RecordTrailer:
    uint64_t nbytes          # payload bytes (the record occupies nbytes + sizeof trailer)
    int64_t kind
    int64_t prev_record_end  # logical position after the previous record (its fence)

# One entry per record on the tape, bottom first: what a mark and a popped
# trailer are checked against, so neither can make the tape misread its bytes.
cdef struct RecordEntry:
    uint64_t serial          # unique on this tape: a record popped and replaced differs
    int64_t start            # logical position of the record's first byte
    int64_t end              # and just past its trailer
    int64_t cum_bytes        # record_bytes with this record the top one

cdef struct Slab:
    char* data               # NULL while the bytes live only on disk
    Slab* prev
    Slab* next
    size_t cap               # bytes allocated
    size_t used              # bytes in use; exact for every slab but the head
    size_t base              # logical position of data[0] from the tape bottom
    int state                # SlabState
    int prefetched           # loaded ahead of need by the I/O thread
    int heap                 # 0 for the inline slab
    off_t file_offset        # where the bytes live in the spill file
    uint64_t checksum
    int io_result            # outcome of the last read by the I/O thread

# One transfer of a StateFile unit (adtape.statefile) through the tape's I/O thread:
# the same queue, thread, descriptors' rules and checksum as the slabs.
cdef struct StateIO:
    int is_write
    int fd
    char* buf
    size_t nbytes
    off_t offset
    int nrec                 # records inside buf, each checksummed
    const int64_t* rec_off
    const int64_t* rec_len
    uint64_t* sums           # write: computed here; read: expected
    const unsigned char* valid   # read: 0 = never written, reads as zeros (NULL: all)
    int status               # 0 queued or running, 1 done
    int err                  # errno of a failed transfer, 0
    int bad_record           # read: the first record failing its checksum, or -1
    int moved                # 1: bytes went to or came from the file (0: zeros read)
    int64_t io_ns

cdef struct IORequest:
    int is_write
    Slab* first              # lowest slab of a run of consecutive slabs
    int count
    IORequest* next
    StateIO* state           # not NULL: a state transfer (first and count unused)

cdef struct TapeStruct:
    # Hot fields: the head slab's window.  fence is the lowest byte a scalar pop
    # may take (max(head floor, end of last record)).
    char* top
    char* limit
    char* floor
    char* fence
    int locked_word
    int threadsafe
    int itemsize
    int closed               # 1 closed, 2 inherited by a forked child (see abandon_inherited)

    Slab* head
    Slab inline_slab
    char* inline_buf
    size_t slab_bytes
    size_t spill_unit
    int64_t memory_budget    # -1: no budget
    int prefetch_depth
    int max_free_slabs

    # Entry bookkeeping (len = n_records + (nbytes - record_bytes) / itemsize).
    int64_t n_records
    int64_t record_bytes
    int64_t last_record_end
    RecordEntry* records     # n_records entries used, records_cap allocated
    int64_t records_cap
    uint64_t next_record_serial
    uint64_t tape_serial     # unique per Tape in this process (marks name it)

    # Memory accounting and the free-slab pool.
    size_t resident_bytes    # heap slab bytes allocated (including the pool)
    size_t peak_resident_bytes
    size_t spilled_bytes
    size_t peak_spilled_bytes
    Slab* pool
    int pool_count
    int64_t heap_slabs

    # Spill file and the I/O thread.
    int owner_pid            # the process that created the tape, spill file and I/O thread
    int fd
    int dfd                  # the same file opened with O_DIRECT, or -1 (see _spill.pxi)
    char spill_path[4096]
    char spill_dir[4096]
    off_t file_end
    off_t file_size
    off_t peak_file_size     # the spill file's largest size (stats: spill file bound)
    pthread_mutex_t io_mu
    pthread_cond_t io_cv
    pthread_cond_t done_cv
    pthread_t io_thread
    int io_started
    int io_stop
    int io_busy
    int io_busy_state        # the request in flight is a state transfer
    int prefetch_slabs       # slabs queued for a prefetch read and not yet finished
    IORequest* queue_head
    IORequest* queue_tail
    int io_errno             # set by a failed background write, reported at the next slow path
    off_t io_err_offset
    off_t io_rollback_end    # lowest file offset of a failed write: file_end returns there
    size_t writing_bytes     # resident bytes queued for writing
    # Writing ahead (see make_room): each fill of the tape from empty records its peak
    # position; the next fill writes the slabs below last_fill_peak - budget (+ W) as
    # soon as they are full, so the disk has the whole fill to write them in.
    int write_ahead          # 1: learn from the last fill (default); 0: off
    int filling              # a fill from empty is under way (its peak is being tracked)
    size_t fill_peak
    size_t last_fill_peak
    size_t early_until       # slabs starting below this position are written early (0: none)
    int inject_write_errno   # fault injection for tests: next write fails with this errno
    int64_t io_hold_until_ns # test hook: the I/O thread starts no request before this time

    # Counters for stats.
    int64_t n_spills
    int64_t n_reloads
    int64_t prefetch_hits
    int64_t prefetch_misses
    int64_t io_wait_ns       # time pops spent waiting for spilled slabs
    int64_t push_wait_ns     # time pushes spent waiting for writes to free memory
    int64_t bytes_written
    int64_t bytes_read
    int64_t bytes_cancelled  # bytes whose queued write a pop took back before it started
    int64_t bytes_written_early  # bytes queued for writing by the write-ahead rule
    int64_t read_bytes_timed # bytes and time of reads, for the device rate (readahead_bytes)
    int64_t read_ns
    # State traffic (adtape.statefile) through this tape's I/O thread.
    int64_t state_bytes_read
    int64_t state_bytes_written
    int64_t state_read_ns
    int64_t state_write_ns
    int64_t state_wait_ns    # time callers waited for state transfers
    int64_t state_requests


ctypedef TapeStruct* TapePtr

# ---- slow paths and bulk operations (defined in _tape.pyx) ----------------
cdef int tape_init(TapeStruct* t, int itemsize, size_t sbo_bytes, char* inline_buf,
                   size_t slab_bytes, int64_t memory_budget, const char* spill_dir,
                   int prefetch_depth, int threadsafe, size_t spill_unit) noexcept nogil
cdef int tape_push_slow(TapeStruct* t, const void* src) noexcept nogil
cdef int tape_pop_slow(TapeStruct* t, void* dst) noexcept nogil
cdef int tape_peek_slow(TapeStruct* t, void* dst) noexcept nogil
cdef int tape_push_many(TapeStruct* t, const char* src, size_t n) noexcept nogil
cdef int tape_pop_many(TapeStruct* t, char* dst, size_t n) noexcept nogil
cdef int tape_push_record(TapeStruct* t, const char* src, size_t nbytes, int kind) noexcept nogil
cdef int tape_top_record(TapeStruct* t, RecordTrailer* out) noexcept nogil
cdef int tape_pop_record(TapeStruct* t, char* dst, size_t nbytes, int kind) noexcept nogil
cdef char* tape_reserve(TapeStruct* t, size_t nbytes) noexcept nogil
cdef int tape_commit_record(TapeStruct* t, size_t nbytes, int kind) noexcept nogil
cdef int64_t tape_len(TapeStruct* t) noexcept nogil
cdef size_t tape_nbytes(TapeStruct* t) noexcept nogil
cdef int tape_clear(TapeStruct* t) noexcept nogil
cdef void tape_close(TapeStruct* t) noexcept nogil

# ---- fast paths: inline, touch only the head slab ---------------------------
cdef inline void tape_lock(TapeStruct* t) noexcept nogil:
    if t.threadsafe:
        adtape_spin_lock(&t.locked_word)

cdef inline void tape_unlock(TapeStruct* t) noexcept nogil:
    if t.threadsafe:
        adtape_spin_unlock(&t.locked_word)

cdef inline int tape_push_f64(TapeStruct* t, double v) noexcept nogil:
    """Push one float64 (the tape's dtype must be float64)."""
    cdef int rc = 0
    tape_lock(t)
    if <size_t>(t.limit - t.top) >= 8:
        memcpy(t.top, &v, 8)
        t.top += 8
    else:
        rc = tape_push_slow(t, &v)
    tape_unlock(t)
    return rc

cdef inline int tape_pop_f64(TapeStruct* t, double* out) noexcept nogil:
    """Pop one float64 into *out; -1 if empty, closed or a record is on top."""
    cdef int rc = 0
    tape_lock(t)
    if <size_t>(t.top - t.fence) >= 8:
        t.top -= 8
        memcpy(out, t.top, 8)
    else:
        rc = tape_pop_slow(t, out)
    tape_unlock(t)
    return rc

cdef inline int tape_push_i64(TapeStruct* t, int64_t v) noexcept nogil:
    cdef int rc = 0
    tape_lock(t)
    if <size_t>(t.limit - t.top) >= 8:
        memcpy(t.top, &v, 8)
        t.top += 8
    else:
        rc = tape_push_slow(t, &v)
    tape_unlock(t)
    return rc

cdef inline int tape_pop_i64(TapeStruct* t, int64_t* out) noexcept nogil:
    cdef int rc = 0
    tape_lock(t)
    if <size_t>(t.top - t.fence) >= 8:
        t.top -= 8
        memcpy(out, t.top, 8)
    else:
        rc = tape_pop_slow(t, out)
    tape_unlock(t)
    return rc

cdef inline int tape_push_f32(TapeStruct* t, float v) noexcept nogil:
    cdef int rc = 0
    tape_lock(t)
    if <size_t>(t.limit - t.top) >= 4:
        memcpy(t.top, &v, 4)
        t.top += 4
    else:
        rc = tape_push_slow(t, &v)
    tape_unlock(t)
    return rc

cdef inline int tape_pop_f32(TapeStruct* t, float* out) noexcept nogil:
    cdef int rc = 0
    tape_lock(t)
    if <size_t>(t.top - t.fence) >= 4:
        t.top -= 4
        memcpy(out, t.top, 4)
    else:
        rc = tape_pop_slow(t, out)
    tape_unlock(t)
    return rc

# The unlocked variants are for a caller that already holds the tape (one tape
# per thread, or its own lock): no lock word is touched at all.
cdef inline int tape_push_f64_unlocked(TapeStruct* t, double v) noexcept nogil:
    if <size_t>(t.limit - t.top) >= 8:
        memcpy(t.top, &v, 8)
        t.top += 8
        return 0
    return tape_push_slow(t, &v)

cdef inline int tape_pop_f64_unlocked(TapeStruct* t, double* out) noexcept nogil:
    if <size_t>(t.top - t.fence) >= 8:
        t.top -= 8
        memcpy(out, t.top, 8)
        return 0
    return tape_pop_slow(t, out)

cdef inline int tape_push_i64_unlocked(TapeStruct* t, int64_t v) noexcept nogil:
    if <size_t>(t.limit - t.top) >= 8:
        memcpy(t.top, &v, 8)
        t.top += 8
        return 0
    return tape_push_slow(t, &v)

cdef inline int tape_pop_i64_unlocked(TapeStruct* t, int64_t* out) noexcept nogil:
    if <size_t>(t.top - t.fence) >= 8:
        t.top -= 8
        memcpy(out, t.top, 8)
        return 0
    return tape_pop_slow(t, out)


# A cursor keeps the head window in locals for a batch of pushes and pops, so a
# tight loop holds ``top`` in a register instead of storing it to the tape every
# time (each op then waits on no store).  Open it, run the batch, close it: the
# lock (if any) is held in between, and no other tape function may be called on
# the tape while it is open, except through the cursor.
cdef struct TapeCursor:
    char* top
    char* limit
    char* fence

cdef inline void cursor_open(TapeStruct* t, TapeCursor* c) noexcept nogil:
    tape_lock(t)
    c.top = t.top
    c.limit = t.limit
    c.fence = t.fence

cdef inline void cursor_close(TapeStruct* t, TapeCursor* c) noexcept nogil:
    t.top = c.top
    tape_unlock(t)

cdef inline int cursor_slow_push(TapeStruct* t, TapeCursor* c, const void* src) noexcept nogil:
    cdef int rc
    t.top = c.top
    rc = tape_push_slow(t, src)
    c.top = t.top
    c.limit = t.limit
    c.fence = t.fence
    return rc

cdef inline int cursor_slow_pop(TapeStruct* t, TapeCursor* c, void* dst) noexcept nogil:
    cdef int rc
    t.top = c.top
    rc = tape_pop_slow(t, dst)
    c.top = t.top
    c.limit = t.limit
    c.fence = t.fence
    return rc

cdef inline int cursor_push_f64(TapeStruct* t, TapeCursor* c, double v) noexcept nogil:
    if <size_t>(c.limit - c.top) >= 8:
        memcpy(c.top, &v, 8)
        c.top += 8
        return 0
    return cursor_slow_push(t, c, &v)

cdef inline int cursor_pop_f64(TapeStruct* t, TapeCursor* c, double* out) noexcept nogil:
    if <size_t>(c.top - c.fence) >= 8:
        c.top -= 8
        memcpy(out, c.top, 8)
        return 0
    return cursor_slow_pop(t, c, out)

cdef inline int cursor_push_i64(TapeStruct* t, TapeCursor* c, int64_t v) noexcept nogil:
    if <size_t>(c.limit - c.top) >= 8:
        memcpy(c.top, &v, 8)
        c.top += 8
        return 0
    return cursor_slow_push(t, c, &v)

cdef inline int cursor_pop_i64(TapeStruct* t, TapeCursor* c, int64_t* out) noexcept nogil:
    if <size_t>(c.top - c.fence) >= 8:
        c.top -= 8
        memcpy(out, c.top, 8)
        return 0
    return cursor_slow_pop(t, c, out)


cdef class Tape:
    cdef TapeStruct t
    cdef char sbo[2048]
    cdef object dtype
    cdef int kind            # 0 float64, 1 float32, 2 int64
    cdef object __weakref__
    cdef int check(self, int rc) except -1
    cdef int require_open(self) except -1
