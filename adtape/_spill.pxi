# The disk tier of the layered tape, included into _tape.pyx (one module, so the
# tape's error slot and its static functions stay one): the spill file, the I/O
# thread that writes the oldest slabs behind the pushes and reads spilled units
# back ahead of the pops, the checksums that check what comes back, and the
# read-ahead window sized from the measured device rate.
#
# The in-memory stack (_tape.pyx) calls in through make_room (before it takes a
# head slab), ensure_resident and prefetch (when a pop moves down),
# recompute_file_end and wait_io_idle (when it rewinds), spill_close (when it
# closes); every function here runs with io_mu held unless it says otherwise.

cdef extern from "unistd.h" nogil:
    ssize_t pread(int fd, void* buf, size_t count, off_t offset)
    ssize_t pwrite(int fd, const void* buf, size_t count, off_t offset)
    int ftruncate(int fd, off_t length)
    int unlink(const char* path)

cdef extern from "stdlib.h" nogil:
    int mkstemp(char* template)

cdef extern from "fcntl.h" nogil:
    int c_open "open"(const char* path, int flags)
    int O_RDWR
    int O_DIRECT

cdef extern from "unistd.h" nogil:
    int usleep(unsigned usec)

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t pwritev(int fd, const iovec* iov, int iovcnt, off_t offset)

DEF READAHEAD_NS = 50000000.0   # prefetch window: what the device reads in 50 ms
DEF DIRECT_ALIGN = 4096         # O_DIRECT: buffer, offset and length in whole blocks
# Writes go out in requests of up to this many bytes (slabs contiguous in the file, one
# pwritev): on the VM's ext4 disk, 2 MiB O_DIRECT writes that extend the file cost
# 0.40 s of system time per GB and 8 MiB ones 0.07 (dd, 2.6 GB), time the I/O thread
# would take from the training threads on a 2-core machine (in GPT-2's forward pass
# there the process's system time did not change measurably: 3.8 s either way, then).
DEF WRITE_BATCH = 8388608
DEF MAX_IOV = 64


# ---------------------------------------------------------------------------
# Checksums and the buffers of spilled slabs
# ---------------------------------------------------------------------------

cdef uint64_t checksum(const char* p, size_t n) noexcept nogil:
    """Four independent multiply-xor lanes over 8-byte words, then the tail."""
    cdef uint64_t h0 = 0x9E3779B97F4A7C15ULL, h1 = 0xC2B2AE3D27D4EB4FULL
    cdef uint64_t h2 = 0x165667B19E3779F9ULL, h3 = 0x27D4EB2F165667C5ULL
    cdef uint64_t w0, w1, w2, w3, tail = 0
    cdef uint64_t M = 0x9FB21C651E98DF25ULL
    cdef size_t i = 0
    while i + 32 <= n:
        memcpy(&w0, p + i, 8); memcpy(&w1, p + i + 8, 8)
        memcpy(&w2, p + i + 16, 8); memcpy(&w3, p + i + 24, 8)
        h0 = (h0 ^ w0) * M; h1 = (h1 ^ w1) * M
        h2 = (h2 ^ w2) * M; h3 = (h3 ^ w3) * M
        i += 32
    while i < n:
        tail = (tail ^ <unsigned char>p[i]) * 0x100000001B3ULL
        i += 1
    h0 ^= (h1 << 17 | h1 >> 47) ^ (h2 << 31 | h2 >> 33) ^ (h3 << 47 | h3 >> 17) ^ tail ^ n
    h0 ^= h0 >> 33
    h0 *= 0xFF51AFD7ED558CCDULL
    h0 ^= h0 >> 33
    return h0


cdef void recycle_buffer(TapeStruct* t, Slab* s) noexcept nogil:
    """Take a spilled slab's buffer: into the pool for the next head (no fresh pages to
    fault in), else free it (io_mu held)."""
    cdef Slab* spare = NULL
    if s.cap == t.slab_bytes and t.pool_count < t.max_free_slabs:
        spare = <Slab*>malloc(sizeof(Slab))
    if spare != NULL:
        memset(spare, 0, sizeof(Slab))
        spare.data = s.data
        spare.cap = s.cap
        spare.heap = 1
        spare.next = t.pool
        t.pool = spare
        t.pool_count += 1
        t.heap_slabs += 1
    else:
        data_free(s.data, s.cap)
        t.resident_bytes -= s.cap
    s.data = NULL


# ---------------------------------------------------------------------------
# The I/O thread
# ---------------------------------------------------------------------------

cdef int write_all(int fd, const char* p, size_t n, off_t off) noexcept nogil:
    cdef ssize_t w
    while n > 0:
        w = pwrite(fd, p, n, off)
        if w < 0:
            if errno == EINTR:
                continue
            return errno
        if w == 0:
            return EIO
        p += w
        n -= w
        off += w
    return 0


cdef int read_all(int fd, char* p, size_t n, off_t off) noexcept nogil:
    cdef ssize_t r
    while n > 0:
        r = pread(fd, p, n, off)
        if r < 0:
            if errno == EINTR:
                continue
            return errno
        if r == 0:
            return EIO
        p += r
        n -= r
        off += r
    return 0


# Slabs whose buffers are page-aligned (mapped: 128 KiB and up) move with O_DIRECT, from
# and into the slab itself: no copy into the page cache (on the 2-core machine that
# copy took a core for about a second per GB written, beside the training threads),
# and nothing of the spill file crowds the page cache.  Their file offsets are
# rounded up to whole blocks; the last block is written whole (the slab's capacity is
# whole blocks).  Smaller slabs, and filesystems that refuse O_DIRECT (tmpfs), use the
# buffered descriptor.

cdef inline size_t align_up(size_t n) noexcept nogil:
    return (n + DIRECT_ALIGN - 1) & ~(<size_t>(DIRECT_ALIGN - 1))


cdef inline int direct_capable(TapeStruct* t, Slab* s) noexcept nogil:
    """Whether slab s's buffer and capacity suit O_DIRECT (its offset is chosen to)."""
    return (t.dfd >= 0 and (<uintptr_t>s.data & (DIRECT_ALIGN - 1)) == 0
            and (s.cap & (DIRECT_ALIGN - 1)) == 0)


cdef inline int is_direct(TapeStruct* t, Slab* s) noexcept nogil:
    return direct_capable(t, s) and (s.file_offset & (DIRECT_ALIGN - 1)) == 0


cdef int write_slab(TapeStruct* t, Slab* s) noexcept nogil:
    """Write slab s's bytes at its file offset (io_mu NOT held); errno or 0."""
    cdef int err
    if is_direct(t, s):
        err = write_all(t.dfd, s.data, align_up(s.used), s.file_offset)
        if err != EINVAL:
            return err
    return write_all(t.fd, s.data, s.used, s.file_offset)


cdef int read_slab(TapeStruct* t, Slab* s) noexcept nogil:
    """Read slab s's bytes from its file offset (io_mu NOT held); errno or 0.  A direct
    read of whole blocks may stop short at the end of the file, past s.used."""
    cdef ssize_t r
    cdef size_t n, done = 0
    if is_direct(t, s):
        n = align_up(s.used)
        while done < s.used:
            r = pread(t.dfd, s.data + done, n - done, s.file_offset + <off_t>done)
            if r < 0:
                if errno == EINTR:
                    continue
                if errno == EINVAL and done == 0:
                    break
                return errno
            if r == 0:
                return EIO
            done += r
        if done >= s.used:
            return 0
    return read_all(t.fd, s.data, s.used, s.file_offset)


cdef void shrink_file(TapeStruct* t) noexcept nogil:
    """Give back the file bytes above file_end once they exceed one spill unit (io_mu held).

    Keeping up to one unit spares a truncate per reload when pushes and pops
    alternate at the spill boundary; any more would let the file outgrow what it holds.
    """
    if t.fd >= 0 and t.file_size - t.file_end > <off_t>t.spill_unit:
        if ftruncate(t.fd, t.file_end) == 0:
            t.file_size = t.file_end


cdef void reclaim_file(TapeStruct* t, Slab* s) noexcept nogil:
    """Slab s was read back: lower file_end to the top of the highest slab whose bytes the
    file still holds (io_mu held).

    Spill offsets rise along the chain, so the live file bytes end at the highest
    non-resident slab.  A prefetched unit completes lowest slab first, so when
    the slab that ends at file_end comes back, the resident slabs below it
    (read back earlier, out of order) are skipped too; lowering file_end only by
    the slab that ended exactly at it left their bytes stranded for good.
    """
    cdef Slab* p
    if s.file_offset + <off_t>s.used == t.file_end:
        p = s.prev
        while p != NULL and p.state == SLAB_RESIDENT:
            p = p.prev
        t.file_end = 0 if p == NULL else p.file_offset + <off_t>p.used
    shrink_file(t)


cdef int load_slab_data(TapeStruct* t, Slab* s) noexcept nogil:
    """Read a LOADING slab's bytes and check them (io_mu NOT held).  Returns errno or -1 on checksum."""
    cdef int err = read_slab(t, s)
    if err:
        return err
    if checksum(s.data, s.used) != s.checksum:
        return -1
    return 0


cdef void finish_load(TapeStruct* t, Slab* s, int err, int prefetched) noexcept nogil:
    """Publish the result of a read (io_mu held)."""
    if err == 0:
        s.state = SLAB_RESIDENT
        s.prefetched = prefetched
        t.spilled_bytes -= s.used
        t.n_reloads += 1
        t.bytes_read += s.used
        reclaim_file(t, s)
    else:
        data_free(s.data, s.cap)
        t.resident_bytes -= s.cap
        s.data = NULL
        s.state = SLAB_CORRUPT
        s.prefetched = err      # kept for the error message: -1 checksum, else errno


cdef void run_read(TapeStruct* t, IORequest* req) noexcept nogil:
    """Read a queued prefetch unit and publish it (io_mu held, released while reading).
    Run by the I/O thread, or by a pop waiting on an earlier unit."""
    cdef Slab* s = req.first
    cdef int i
    cdef int64_t started, elapsed
    pthread_mutex_unlock(&t.io_mu)
    started = now_ns()
    for i in range(req.count):
        s.io_result = load_slab_data(t, s)
        s = s.next
    elapsed = now_ns() - started
    pthread_mutex_lock(&t.io_mu)
    t.read_ns += elapsed
    s = req.first
    for i in range(req.count):
        t.read_bytes_timed += s.used
        finish_load(t, s, s.io_result, 1)
        s = s.next
    t.prefetch_slabs -= req.count


cdef int direct_run(TapeStruct* t, Slab* s, int count) noexcept nogil:
    """How many slabs from s on (at most count, MAX_IOV and WRITE_BATCH bytes) one
    O_DIRECT pwritev can write: direct-capable and back to back in the file (a slab's
    last block is written whole, as write_slab does) (io_mu NOT held; the slabs are
    SLAB_WRITING, so nobody else moves them)."""
    cdef int n = 0
    cdef size_t total = 0
    cdef off_t end = s.file_offset
    while (n < count and n < MAX_IOV and s != NULL and is_direct(t, s)
           and s.file_offset == end and total + align_up(s.used) <= WRITE_BATCH):
        total += align_up(s.used)
        end += <off_t>align_up(s.used)
        n += 1
        s = s.next
    return n


cdef int write_run(TapeStruct* t, Slab* s, int n) noexcept nogil:
    """Checksum n slabs from s and write them with one O_DIRECT pwritev (io_mu NOT held);
    errno or 0 (on EINVAL the caller writes them again one by one, buffered if need be)."""
    cdef iovec iov[MAX_IOV]
    cdef int i, k = 0
    cdef off_t off = s.file_offset
    cdef ssize_t w
    cdef size_t left
    for i in range(n):
        s.checksum = checksum(s.data, s.used)
        iov[i].iov_base = s.data
        iov[i].iov_len = align_up(s.used)
        s = s.next
    while k < n:
        w = pwritev(t.dfd, &iov[k], n - k, off)
        if w < 0:
            if errno == EINTR:
                continue
            return errno
        if w == 0:
            return EIO
        off += w
        left = <size_t>w
        while k < n and left >= iov[k].iov_len:
            left -= iov[k].iov_len
            k += 1
        if left:
            iov[k].iov_base = <char*>iov[k].iov_base + left
            iov[k].iov_len -= left
    return 0


cdef void* io_main(void* arg) noexcept nogil:
    cdef TapeStruct* t = <TapeStruct*>arg
    cdef IORequest* req
    cdef Slab* s
    cdef int i, j, n, err
    cdef off_t bad_offset, end
    pthread_mutex_lock(&t.io_mu)
    while True:
        while t.queue_head == NULL and not t.io_stop:
            pthread_cond_wait(&t.io_cv, &t.io_mu)
        if t.queue_head == NULL:
            break
        if not t.io_stop and t.io_hold_until_ns > now_ns():
            pthread_mutex_unlock(&t.io_mu)
            usleep(1000)
            pthread_mutex_lock(&t.io_mu)
            continue
        req = t.queue_head
        t.queue_head = req.next
        if t.queue_head == NULL:
            t.queue_tail = NULL
        t.io_busy = 1
        if req.state != NULL:
            t.io_busy_state = 1
            pthread_mutex_unlock(&t.io_mu)
            run_state(req.state)
            pthread_mutex_lock(&t.io_mu)
            account_state(t, req.state)
            t.io_busy_state = 0
        elif req.is_write:
            # Once a write failed, later queued writes fail too, so the spilled
            # slabs stay a prefix of the chain until the error is reported.
            err = t.io_errno
            if err == 0:
                err = t.inject_write_errno
            bad_offset = req.first.file_offset
            pthread_mutex_unlock(&t.io_mu)
            s = req.first
            i = 0
            while err == 0 and i < req.count:
                n = direct_run(t, s, req.count - i)
                if n > 1:
                    err = write_run(t, s, n)
                    if err == 0:
                        for j in range(n):
                            s = s.next
                        i += n
                        continue
                    if err != EINVAL:
                        bad_offset = s.file_offset
                        break
                    err = 0         # refused as a whole: slab by slab below
                s.checksum = checksum(s.data, s.used)
                err = write_slab(t, s)
                if err:
                    bad_offset = s.file_offset
                    break
                s = s.next
                i += 1
            pthread_mutex_lock(&t.io_mu)
            s = req.first
            for i in range(req.count):
                t.writing_bytes -= s.cap
                if err == 0:
                    end = s.file_offset + <off_t>(align_up(s.used) if is_direct(t, s) else s.used)
                    if end > t.file_size:
                        t.file_size = end
                        if end > t.peak_file_size:
                            t.peak_file_size = end
                    recycle_buffer(t, s)
                    s.state = SLAB_ON_DISK
                    t.spilled_bytes += s.used
                    if t.spilled_bytes > t.peak_spilled_bytes:
                        t.peak_spilled_bytes = t.spilled_bytes
                    t.bytes_written += s.used
                    t.n_spills += 1
                else:
                    s.state = SLAB_RESIDENT
                s = s.next
            if err:
                if t.io_errno == 0:
                    t.io_errno = err
                    t.io_err_offset = bad_offset
                if req.first.file_offset < t.io_rollback_end:
                    t.io_rollback_end = req.first.file_offset
        else:
            run_read(t, req)
        free(req)
        t.io_busy = 0
        pthread_cond_broadcast(&t.done_cv)
    pthread_mutex_unlock(&t.io_mu)
    return NULL


cdef int slab_io_pending(TapeStruct* t) noexcept nogil:
    """Whether a slab request is queued or in flight (io_mu held); state transfers
    (adtape.statefile) do not count: the slabs never wait for them."""
    cdef IORequest* req = t.queue_head
    if t.io_busy and not t.io_busy_state:
        return 1
    while req != NULL:
        if req.state == NULL:
            return 1
        req = req.next
    return 0


cdef void wait_io_idle(TapeStruct* t) noexcept nogil:
    """Wait until no slab request is queued or in flight (io_mu held)."""
    while slab_io_pending(t):
        pthread_cond_wait(&t.done_cv, &t.io_mu)


cdef void spill_close(TapeStruct* t) noexcept nogil:
    """Stop the I/O thread once its queue is done and close the spill file (io_mu NOT
    held; the tape holds nothing spilled any more)."""
    pthread_mutex_lock(&t.io_mu)
    t.io_stop = 1
    pthread_cond_signal(&t.io_cv)
    pthread_mutex_unlock(&t.io_mu)
    if t.io_started:
        pthread_join(t.io_thread, NULL)
        t.io_started = 0
    if t.fd >= 0:
        close(t.fd)
        t.fd = -1
    if t.dfd >= 0:
        close(t.dfd)
        t.dfd = -1


cdef int open_spill_file(TapeStruct* t) noexcept nogil:
    """Create the spill file and unlink it at once, so no path outlives the process."""
    cdef char msg[512]
    snprintf(t.spill_path, sizeof(t.spill_path), "%s/adtape-spill-XXXXXX", t.spill_dir)
    t.fd = mkstemp(t.spill_path)
    if t.fd < 0:
        snprintf(msg, sizeof(msg), "cannot create a spill file in spill_dir %s: %s",
                 t.spill_dir, strerror(errno))
        set_err(t, ERR_IO, errno, 0, msg)
        return -1
    t.dfd = c_open(t.spill_path, O_RDWR | O_DIRECT)     # -1 where refused: buffered only
    unlink(t.spill_path)
    return 0


cdef int start_io_thread(TapeStruct* t) noexcept nogil:
    if t.io_started:
        return 0
    if pthread_create(&t.io_thread, NULL, io_main, t) != 0:
        return fail(t, ERR_NOMEM, "cannot start the tape's I/O thread")
    t.io_started = 1
    return 0


cdef int enqueue(TapeStruct* t, int is_write, Slab* first, int count) noexcept nogil:
    cdef IORequest* req = <IORequest*>malloc(sizeof(IORequest))
    if req == NULL:
        return fail(t, ERR_NOMEM, "out of memory queueing tape I/O")
    req.is_write = is_write
    req.first = first
    req.count = count
    req.next = NULL
    req.state = NULL
    append_request(t, req)
    return 0


cdef void append_request(TapeStruct* t, IORequest* req) noexcept nogil:
    if t.queue_tail == NULL:
        t.queue_head = req
    else:
        t.queue_tail.next = req
    t.queue_tail = req
    pthread_cond_signal(&t.io_cv)


# ---------------------------------------------------------------------------
# State transfers (adtape.statefile): a unit of records read or written whole, in the
# queue's order behind the slabs' requests, each record checksummed as a slab is.
# ---------------------------------------------------------------------------

cdef void run_state(StateIO* s) noexcept nogil:
    """Do one state transfer (io_mu NOT held)."""
    cdef int i, any_valid = 0
    cdef int64_t started = now_ns()
    s.err = 0
    s.bad_record = -1
    s.moved = 1
    if s.is_write:
        for i in range(s.nrec):
            s.sums[i] = checksum(s.buf + s.rec_off[i], <size_t>s.rec_len[i])
        s.err = write_all(s.fd, s.buf, s.nbytes, s.offset)
    else:
        for i in range(s.nrec):
            if s.valid == NULL or s.valid[i]:
                any_valid = 1
                break
        if not any_valid:
            memset(s.buf, 0, s.nbytes)
            s.moved = 0
        else:
            s.err = read_all(s.fd, s.buf, s.nbytes, s.offset)
            if s.err == 0:
                for i in range(s.nrec):
                    if s.valid != NULL and not s.valid[i]:
                        memset(s.buf + s.rec_off[i], 0, <size_t>s.rec_len[i])
                    elif checksum(s.buf + s.rec_off[i], <size_t>s.rec_len[i]) != s.sums[i]:
                        s.bad_record = i
                        break
    s.io_ns = now_ns() - started


cdef void account_state(TapeStruct* t, StateIO* s) noexcept nogil:
    """Count a finished state transfer and publish it (io_mu held)."""
    t.state_requests += 1
    if s.err == 0 and s.moved:
        if s.is_write:
            t.state_bytes_written += s.nbytes
            t.state_write_ns += s.io_ns
        else:
            t.state_bytes_read += s.nbytes
            t.state_read_ns += s.io_ns
    s.status = 1


cdef int report_io_error(TapeStruct* t) noexcept nogil:
    """Turn a failed background write into this call's error (io_mu held).

    Waits until no write is in flight, so that file_end can go back to the
    lowest failed offset; every failed slab is resident again, nothing is lost.
    """
    cdef char msg[512]
    cdef int err = t.io_errno
    wait_io_idle(t)
    snprintf(msg, sizeof(msg),
             "writing to the spill file %s (unlinked) at offset %lld failed: %s; "
             "the data stays in memory and the tape is unchanged",
             t.spill_path, <long long>t.io_err_offset, strerror(err))
    set_err(t, ERR_IO, err, t.io_err_offset, msg)
    if t.io_rollback_end < t.file_end:
        t.file_end = t.io_rollback_end
    shrink_file(t)
    t.io_rollback_end = <off_t>0x7FFFFFFFFFFFFFFF
    t.io_errno = 0
    return -1


# ---------------------------------------------------------------------------
# Write-behind: queueing the oldest slabs (pushes)
# ---------------------------------------------------------------------------

cdef Slab* oldest_resident(TapeStruct* t) noexcept nogil:
    """The oldest resident heap slab below the head, or NULL (io_mu held)."""
    cdef Slab* s = t.inline_slab.next
    while s != NULL and s != t.head and s.state != SLAB_RESIDENT:
        s = s.next
    return NULL if s == NULL or s == t.head else s


cdef int spill_oldest(TapeStruct* t, int early) noexcept nogil:
    """Queue the oldest run of resident heap slabs below the head for writing (io_mu held);
    ``early``: queued by the write-ahead rule (counted in bytes_written_early).

    Returns 1 if a batch was queued, 0 if nothing can be spilled, -1 on error.
    """
    cdef Slab* s
    cdef Slab* first
    cdef size_t batch = 0, limit
    cdef int count = 0
    # A prefetched slab finishing below a slab written now would leave its file
    # bytes as a hole under it: let the reads land first, so the slabs they bring
    # back are the oldest resident ones and are the first written out again.
    while t.prefetch_slabs > 0:
        pthread_cond_wait(&t.done_cv, &t.io_mu)
    s = oldest_resident(t)
    if s == NULL:
        return 0
    if t.fd < 0 and open_spill_file(t) < 0:
        return -1
    if start_io_thread(t) < 0:
        return -1
    first = s
    limit = spill_batch_bytes(t)
    while (s != t.head and s.state == SLAB_RESIDENT and batch < limit
           and not (early and s.base >= t.early_until)):
        s.state = SLAB_WRITING
        if direct_capable(t, s):
            t.file_end = <off_t>align_up(<size_t>t.file_end)
        s.file_offset = t.file_end
        t.file_end += s.used
        t.writing_bytes += s.cap
        batch += s.used
        count += 1
        s = s.next
    if enqueue(t, 1, first, count) < 0:
        return -1
    if early:
        t.bytes_written_early += batch
    return 1


cdef inline size_t spill_batch_bytes(TapeStruct* t) noexcept nogil:
    """Bytes one write request gathers: a spill unit, or up to WRITE_BATCH where a
    quarter of the budget allows (large writes cost the I/O thread less CPU)."""
    cdef size_t b = WRITE_BATCH
    if t.memory_budget >= 0 and <size_t>(t.memory_budget // 4) < b:
        b = <size_t>(t.memory_budget // 4)
    return b if b > t.spill_unit else t.spill_unit


cdef int early_write_due(TapeStruct* t) noexcept nogil:
    """Whether the write-ahead rule asks for the oldest resident slabs to be written now:
    they start below early_until, the part of this fill that the last fill says will not
    fit the budget, and the full slabs there make a whole write request (or reach
    early_until) (io_mu held)."""
    cdef Slab* s
    cdef size_t run = 0, limit
    if t.early_until == 0:
        return 0
    s = oldest_resident(t)
    if s == NULL or s.base >= t.early_until:
        return 0
    limit = spill_batch_bytes(t)
    while s != t.head and s.state == SLAB_RESIDENT:
        if s.base >= t.early_until:
            return 1
        run += s.used
        if run >= limit:
            return 1
        s = s.next
    return 0


cdef void start_fill(TapeStruct* t) noexcept nogil:
    """A push grows the tape out of its bottom slab (the inline buffer or the first heap
    slab): a fill from empty begins.  Arm the write-ahead rule from the last fill's peak
    (io_mu held)."""
    if t.filling:
        return
    t.filling = 1
    t.fill_peak = 0
    if t.memory_budget < 0 or not t.write_ahead:
        return
    if t.last_fill_peak > <size_t>t.memory_budget:
        t.early_until = t.last_fill_peak - <size_t>t.memory_budget + <size_t>write_ahead_bytes(t)


cdef inline void end_fill(TapeStruct* t) noexcept nogil:
    """The tape is back in its bottom slab: the fill's peak is the next one's guide."""
    if t.filling:
        t.last_fill_peak = t.fill_peak
        t.filling = 0
    t.early_until = 0


cdef inline int64_t write_ahead_bytes(TapeStruct* t) noexcept nogil:
    """W: writes start once the slabs in use pass memory_budget - W = min(2 spill
    units, budget / 4), so they run while the pushes go on to the budget."""
    cdef int64_t w = <int64_t>(2 * t.spill_unit)
    return w if w < t.memory_budget // 4 else t.memory_budget // 4


cdef inline int64_t write_slack_bytes(TapeStruct* t) noexcept nogil:
    """S: how far past the budget pushes go on while writes are in flight,
    min(W, budget / 32); small, so that the process's RSS stays within a few
    percent of the budget."""
    cdef int64_t w = write_ahead_bytes(t)
    return w if w < t.memory_budget // 32 else t.memory_budget // 32


cdef int make_room(TapeStruct* t, size_t cap) noexcept nogil:
    """Before a head slab of cap bytes is taken: queue writes and, if need be, wait for
    them, so that allocated slab memory stays within memory_budget + S (io_mu held).

    Write-behind: the oldest resident slabs are queued, one spill unit per request,
    until the slabs in use, the new one included, will be at most memory_budget - W
    once the queued writes land.  The push waits only while the slabs in use would
    pass memory_budget + S.  Pooled spare buffers count against the same bound.
    When nothing is left to spill (the head slab alone is that large), the slab is
    taken anyway: the bound then gives way, never the push.

    Write-ahead: a tape filled the same way again (a training step) would reach the
    budget only near the end of its fill, and from there the pushes could go no faster
    than the disk writes.  So while a fill from empty has not yet popped, the slabs
    that the last fill's peak says must go to disk anyway (those below peak - budget
    + W) are queued as soon as they are full: the writes spread over the whole fill.
    """
    cdef int rc
    cdef int64_t budget = t.memory_budget
    cdef int64_t w, limit, in_use, started, after
    if budget < 0:
        return 0
    w = write_ahead_bytes(t)
    limit = budget + write_slack_bytes(t)
    while True:
        if t.io_errno:
            return report_io_error(t)
        in_use = <int64_t>(t.resident_bytes - t.pool_count * t.slab_bytes)
        if in_use + <int64_t>cap - <int64_t>t.writing_bytes > budget - w:
            rc = spill_oldest(t, 0)
            if rc < 0:
                return -1
            if rc == 1:
                continue
        elif early_write_due(t):
            rc = spill_oldest(t, 1)
            if rc < 0:
                return -1
            if rc == 1:
                continue
        if in_use + <int64_t>cap <= limit or t.writing_bytes == 0:
            break
        # Finished writes hand their buffers to the pool, out of in_use.
        started = now_ns()
        pthread_cond_wait(&t.done_cv, &t.io_mu)
        t.push_wait_ns += now_ns() - started
    # Spares a new head can reuse are kept (no fresh pages to fault in) while they fit;
    # the last one stays when the new head takes it, which adds nothing.
    while t.pool != NULL:
        after = <int64_t>t.resident_bytes
        if cap > t.slab_bytes:
            after += <int64_t>cap
        elif t.pool_count == 1:
            break
        if after <= limit:
            break
        free_pooled(t)
    return 0


# ---------------------------------------------------------------------------
# Read-back: prefetch and the slab a pop needs
# ---------------------------------------------------------------------------

cdef int give_buffer(TapeStruct* t, Slab* s) noexcept nogil:
    """Attach a data buffer to an on-disk slab about to be read (io_mu held)."""
    cdef Slab* spare
    if s.cap == t.slab_bytes and t.pool != NULL:
        spare = t.pool
        t.pool = spare.next
        t.pool_count -= 1
        s.data = spare.data
        t.heap_slabs -= 1
        free(spare)
        return 0
    s.data = data_alloc(s.cap)
    if s.data == NULL:
        return fail(t, ERR_NOMEM, "out of memory reading a spilled slab back")
    t.resident_bytes += s.cap
    if t.resident_bytes > t.peak_resident_bytes:
        t.peak_resident_bytes = t.resident_bytes
    return 0


cdef size_t readahead_bytes(TapeStruct* t) noexcept nogil:
    """How far below the head the prefetch keeps data resident or in flight.

    At least prefetch_depth spill units; beyond that, what the device has been
    measured to read in READAHEAD_NS, so a fast device gets the long window a
    fast reverse sweep needs.  The budget caps it (see prefetch).
    """
    cdef size_t floor = <size_t>t.prefetch_depth * t.spill_unit
    cdef double by_rate = 0.0
    if t.read_ns > 0:
        by_rate = <double>t.read_bytes_timed / <double>t.read_ns * READAHEAD_NS
    return floor if by_rate < <double>floor else <size_t>by_rate


cdef void prefetch(TapeStruct* t) noexcept nogil:
    """Queue reads of the spilled slabs below the head, highest first, in units of
    spill_unit bytes, until readahead_bytes of data below the head are resident or
    in flight, or the budget has no room left (io_mu held).

    The window is in bytes, not slabs: a reverse sweep popping large records
    crosses many slabs per record, and the reads must start while it is still
    popping the resident slabs above them.
    """
    cdef Slab* s = t.head.prev
    cdef Slab* low
    cdef size_t unit_bytes, ahead = 0
    cdef size_t target = readahead_bytes(t)
    cdef int count, i
    while s != NULL and s.state != SLAB_ON_DISK:
        if s.state == SLAB_WRITING:
            # Reading below a slab still being written would leave a hole in the
            # file under it: the file would hold more than the bytes spilled.
            return
        ahead += s.used
        if ahead >= target:
            return
        s = s.prev
    while s != NULL and s.state == SLAB_ON_DISK and ahead < target:
        count = 0
        unit_bytes = 0
        low = s
        while (s != NULL and s.state == SLAB_ON_DISK and unit_bytes < t.spill_unit
               and (t.memory_budget < 0 or <int64_t>(t.resident_bytes + s.cap) <= t.memory_budget
                    or (s.cap == t.slab_bytes and t.pool != NULL))):
            if give_buffer(t, s) < 0:
                last_error.code = ERR_NONE
                break
            s.state = SLAB_LOADING
            unit_bytes += s.used
            count += 1
            low = s
            s = s.prev
        if count == 0:
            return
        if enqueue(t, 0, low, count) < 0:
            # A prefetch is only a hint: put the slabs back on disk as they were.
            last_error.code = ERR_NONE
            s = low
            for i in range(count):
                recycle_buffer(t, s)
                s.state = SLAB_ON_DISK
                s = s.next
            return
        t.prefetch_slabs += count
        ahead += unit_bytes


cdef int cancel_queued_write(TapeStruct* t, Slab* s) noexcept nogil:
    """Take slab s out of its write request if that request has not started: a pop needs
    the bytes back before they would reach the disk (io_mu held).  Returns 1 if taken.

    A pop reaches slabs from the top down and the head is never written, so a slab it
    reaches is the last of its request, and the last bytes given a file offset.
    """
    cdef IORequest* req = t.queue_head
    cdef IORequest* prev = NULL
    cdef Slab* last
    cdef int i
    while req != NULL:
        if req.is_write and req.state == NULL:
            last = req.first
            for i in range(req.count - 1):
                last = last.next
            if last == s:
                break
        prev = req
        req = req.next
    if req == NULL:
        return 0
    req.count -= 1
    if req.count == 0:
        if prev == NULL:
            t.queue_head = req.next
        else:
            prev.next = req.next
        if t.queue_tail == req:
            t.queue_tail = prev
        free(req)
    s.state = SLAB_RESIDENT
    t.writing_bytes -= s.cap
    t.bytes_cancelled += s.used
    reclaim_file(t, s)
    return 1


cdef int ensure_resident(TapeStruct* t, Slab* s) noexcept nogil:
    """Make slab s resident, waiting for or doing the read (io_mu held)."""
    cdef int err
    cdef int64_t started, elapsed
    cdef IORequest* req
    cdef int waited = 0
    cdef char msg[512]
    while True:
        if s.state == SLAB_RESIDENT:
            if s.prefetched:
                s.prefetched = 0
                if not waited:
                    t.prefetch_hits += 1
            return 0
        if s.state == SLAB_CORRUPT:
            if s.prefetched == -1:
                snprintf(msg, sizeof(msg),
                         "spill file %s (unlinked), offset %lld, %zu bytes: checksum mismatch",
                         t.spill_path, <long long>s.file_offset, s.used)
                set_err(t, ERR_CORRUPT, 0, s.file_offset, msg)
            else:
                snprintf(msg, sizeof(msg),
                         "reading spill file %s (unlinked) at offset %lld failed: %s",
                         t.spill_path, <long long>s.file_offset, strerror(s.prefetched))
                set_err(t, ERR_CORRUPT, s.prefetched, s.file_offset, msg)
            return -1
        if s.state == SLAB_ON_DISK:
            if give_buffer(t, s) < 0:
                return -1
            s.state = SLAB_LOADING
            t.prefetch_misses += 1
            pthread_mutex_unlock(&t.io_mu)
            started = now_ns()
            err = load_slab_data(t, s)
            elapsed = now_ns() - started
            pthread_mutex_lock(&t.io_mu)
            t.io_wait_ns += elapsed
            t.read_ns += elapsed
            t.read_bytes_timed += s.used
            finish_load(t, s, err, 0)
            continue
        if s.state == SLAB_WRITING and cancel_queued_write(t, s):
            continue
        # Being written, or LOADING: the I/O thread owns it for now.
        if not waited:
            t.prefetch_misses += 1
            waited = 1
        started = now_ns()
        if (t.queue_head != NULL and not t.queue_head.is_write
                and t.queue_head.state == NULL):
            # A pop outruns one reader (checksums included): while the I/O thread
            # reads this slab, read the next queued unit here, in parallel.
            req = t.queue_head
            t.queue_head = req.next
            if t.queue_head == NULL:
                t.queue_tail = NULL
            run_read(t, req)
            free(req)
            pthread_cond_broadcast(&t.done_cv)
        else:
            pthread_cond_wait(&t.done_cv, &t.io_mu)
        t.io_wait_ns += now_ns() - started


cdef void recompute_file_end(TapeStruct* t, Slab* s) noexcept nogil:
    """file_end after discarding everything above slab s (io_mu held)."""
    while s != NULL and s.state != SLAB_ON_DISK and s.state != SLAB_CORRUPT:
        s = s.prev
    t.file_end = 0 if s == NULL else s.file_offset + <off_t>s.used
    shrink_file(t)
