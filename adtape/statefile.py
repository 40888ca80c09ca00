"""Fixed-size state on the tape's disk tier, streamed through a window of memory.

The tape spills what a forward pass pushes and reads it back in reverse; a model's
optimizer state is different: the same records are read, updated and written back
every step, in the same order.  ``StateFile`` keeps such records in a file of the
tape's kind (created in ``spill_dir`` and unlinked at once, so a killed process
leaves nothing behind; ``O_DIRECT`` where the filesystem allows it; the disk tier's
64-bit checksum on every record, checked on every read, ``TapeCorruptionError``
naming the file and offset on a mismatch; ``SpillError`` for a full disk, found when
the file is created, since its whole size is reserved then).

Records are grouped into I/O *units* (consecutive records, one read and one write
each).  A background I/O thread reads the units asked for with ``prefetch`` ahead of
``acquire``, into a pool of page-aligned buffers (``window`` units at most, so the
memory is bounded), and writes each unit ``release``d dirty behind the caller;
``stats`` counts the bytes and the time the caller waited.  A record never written
reads as zeros (no I/O).  ``read_record``/``write_record`` move one record
synchronously, in any order (checkpoints).
"""
import collections
import os
import tempfile
import threading
import time

import numpy as np

from adtape._tape import SpillError, TapeClosedError, TapeCorruptionError, checksum_bytes

ALIGN = 4096            # O_DIRECT: buffer, offset and length in whole blocks
RECORD_ALIGN = 64       # records inside a unit start on cache lines


def aligned_buffer(nbytes):
    """A page-aligned uint8 array of ``nbytes`` (O_DIRECT reads and writes into it)."""
    return _aligned_buffer(nbytes)


def _aligned_buffer(nbytes):
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


class StateFile:
    """``record_nbytes``: the size of each record; ``units``: (first, stop) record ranges,
    consecutive and covering every record, each read and written whole; ``window``: the
    unit buffers (memory: ``window`` times the largest unit)."""

    def __init__(self, record_nbytes, units, spill_dir=None, window=4, name="state",
                 pooled=None):
        record_nbytes = [int(n) for n in record_nbytes]
        if any(n < 0 for n in record_nbytes):
            raise ValueError("StateFile: record sizes must be >= 0")
        units = [(int(a), int(b)) for a, b in units]
        if not units or units[0][0] != 0 or units[-1][1] != len(record_nbytes) or any(
                a >= b or b != units[i + 1][0] for i, (a, b) in enumerate(units[:-1])):
            raise ValueError("StateFile: units must be consecutive non-empty record ranges "
                             "covering every record")
        if window < 2:
            raise ValueError(f"StateFile: window must be >= 2 units, got {window}")
        self.name = name
        self.units = units
        self.record_nbytes = record_nbytes
        self.unit_of = np.empty(len(record_nbytes), np.int64)
        self.record_offset = []         # within its unit's buffer
        self.unit_offset, self.unit_nbytes = [], []
        file_end = 0
        for u, (a, b) in enumerate(units):
            pos = 0
            for r in range(a, b):
                self.unit_of[r] = u
                self.record_offset.append(pos)
                pos += (record_nbytes[r] + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN
            size = (pos + ALIGN - 1) // ALIGN * ALIGN
            self.unit_offset.append(file_end)
            self.unit_nbytes.append(size)
            file_end += size
        self.file_bytes = file_end
        self.checksums = [None] * len(record_nbytes)    # None: never written (zeros)

        spill_dir = os.fspath(spill_dir) if spill_dir is not None else tempfile.gettempdir()
        if not os.path.isdir(spill_dir):
            raise FileNotFoundError(f"spill_dir {spill_dir!r} does not exist or is not a "
                                    f"directory")
        fd, self.path = tempfile.mkstemp(prefix=f"adtape-{name}-", dir=spill_dir)
        self.dfd = -1
        try:
            try:
                self.dfd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError:
                self.dfd = -1             # tmpfs and others: buffered only
            os.unlink(self.path)
            try:
                if file_end:
                    os.posix_fallocate(fd, 0, file_end)
            except OSError as e:
                raise SpillError(e.errno, f"cannot reserve {file_end:,} bytes for the {name} "
                                 f"file in spill_dir {spill_dir!r}: {os.strerror(e.errno)}"
                                 ) from None
        except BaseException:
            os.close(fd)
            if self.dfd >= 0:
                os.close(self.dfd)
            raise
        self.fd = fd
        self.spill_dir = spill_dir

        # The pool serves ``acquire`` (``pooled``: the units it may be asked for; the
        # others move only through the caller's buffers, read_into / write_from).
        pooled = range(len(units)) if pooled is None else list(pooled)
        biggest = max([self.unit_nbytes[u] for u in pooled] or [ALIGN])
        self._pool_bytes = biggest
        self._free = [_aligned_buffer(biggest) for _ in range(window)]
        self.window = window
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._state = ["disk"] * len(units)      # disk | loading | resident | writing
        self._buffer = [None] * len(units)
        self._external = [False] * len(units)     # the buffer is the caller's (read_into)
        self._held = set()                        # units acquired and not yet released
        self._wanted = collections.deque()        # units to read ahead, in order
        self._queue = collections.deque()         # ("read"|"write", unit) for the I/O thread
        self._error = None
        self._closed = False
        self.stats = dict(bytes_read=0, bytes_written=0, units_read=0, units_written=0,
                          read_wait_ns=0, buffer_wait_ns=0, prefetch_hits=0,
                          prefetch_misses=0, io_ns=0)
        self._thread = threading.Thread(target=self._io_main, name=f"adtape-{name}-io",
                                        daemon=True)
        self._thread.start()

    # -- the I/O thread --------------------------------------------------------------

    def _io_main(self):
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                kind, u = self._queue.popleft()
                buf = self._buffer[u]
            t0 = time.perf_counter_ns()
            try:
                if kind == "read":
                    self._read_unit(u, buf)
                else:
                    self._write_unit(u, buf)
                err = None
            except BaseException as e:     # reported to the caller's next call
                err = e
            with self._cv:
                self.stats["io_ns"] += time.perf_counter_ns() - t0
                if err is not None and self._error is None:
                    self._error = err
                if kind == "read":
                    self._state[u] = "resident" if err is None else "disk"
                    if err is not None or self._external[u]:
                        self._state[u] = "disk"
                        self._give_back(u)
                else:
                    self._state[u] = "disk"
                    self._give_back(u)
                self._cv.notify_all()

    def _records(self, u):
        a, b = self.units[u]
        return range(a, b)

    def _read_unit(self, u, buf):
        size = self.unit_nbytes[u]
        if all(self.checksums[r] is None for r in self._records(u)):
            buf[:size] = 0
            return
        self._pread(buf[:size], self.unit_offset[u])
        for r in self._records(u):
            view = buf[self.record_offset[r]:self.record_offset[r] + self.record_nbytes[r]]
            if self.checksums[r] is None:
                view[:] = 0
            elif checksum_bytes(view) != self.checksums[r]:
                raise self._corrupt(r)
        with self._lock:
            self.stats["bytes_read"] += size
            self.stats["units_read"] += 1

    def _write_unit(self, u, buf):
        size = self.unit_nbytes[u]
        sums = [checksum_bytes(buf[self.record_offset[r]:self.record_offset[r]
                                   + self.record_nbytes[r]]) for r in self._records(u)]
        self._pwrite(buf[:size], self.unit_offset[u])
        for r, s in zip(self._records(u), sums):
            self.checksums[r] = s
        with self._lock:
            self.stats["bytes_written"] += size
            self.stats["units_written"] += 1

    def _pread(self, view, offset, fd=None):
        if fd is None:
            fd = self.dfd if self.dfd >= 0 else self.fd
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(5, f"{self.name} file {self.path!r}: unexpected end at offset "
                                 f"{offset + done}")
            done += n

    def _pwrite(self, view, offset, fd=None):
        if fd is None:
            fd = self.dfd if self.dfd >= 0 else self.fd
        done = 0
        while done < len(view):
            try:
                done += os.pwritev(fd, [view[done:]], offset + done)
            except OSError as e:
                raise SpillError(e.errno, f"cannot write the {self.name} file {self.path!r} at offset "
                                 f"{offset + done}: {os.strerror(e.errno)}") from None

    def _corrupt(self, r):
        off = self.unit_offset[self.unit_of[r]] + self.record_offset[r]
        return TapeCorruptionError(f"{self.name} file {self.path!r}: record {r} at offset "
                                   f"{off} fails its checksum (the bytes read back are not "
                                   f"those written)")

    # -- scheduling (lock held) ------------------------------------------------------------

    def _give_back(self, u):
        if not self._external[u]:
            self._free.append(self._buffer[u])
        self._buffer[u] = None
        self._external[u] = False
        self._schedule()

    def _schedule(self):
        while self._wanted and self._free:
            u = self._wanted[0]
            if self._state[u] == "writing":
                break           # read it once written: the read-ahead keeps its order
            self._wanted.popleft()
            if self._state[u] != "disk" or self._buffer[u] is not None:
                continue
            self._buffer[u] = self._free.pop()
            self._state[u] = "loading"
            self._queue.append(("read", u))
            self._cv.notify_all()

    def _raise_pending(self):
        if self._closed:
            raise TapeClosedError(f"the {self.name} file is closed")
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # -- the caller's side -------------------------------------------------------------

    def prefetch(self, units):
        """Read these units ahead, in this order, as buffers free up (replaces any
        earlier read-ahead not yet started)."""
        with self._cv:
            self._raise_pending()
            self._wanted = collections.deque(units)
            self._schedule()

    def acquire(self, u):
        """Unit ``u``'s buffer (uint8, its records at ``record_offset``) once read; the
        caller owns it until ``release``."""
        if self.unit_nbytes[u] > self._pool_bytes:
            raise ValueError(f"{self.name} unit {u} is larger than the pool's buffers: read it "
                             f"with read_into")
        with self._cv:
            self._raise_pending()
            if u in self._wanted:      # consumed now: no read ahead of it any more
                self._wanted.remove(u)
            if self._state[u] == "resident":
                self.stats["prefetch_hits"] += 1
                self._held.add(u)
                return self._buffer[u]
            self.stats["prefetch_misses"] += 1
            t0 = time.perf_counter_ns()
            while self._state[u] != "resident":
                if self._state[u] == "disk" and self._buffer[u] is None:
                    if u in self._wanted:
                        self._wanted.remove(u)
                    self._wanted.appendleft(u)      # to the front: it is needed now
                    if not self._free:
                        self._evict_read_ahead()
                    self._schedule()
                if self._state[u] != "resident":
                    self._cv.wait()
                self._raise_pending()
            self.stats["read_wait_ns"] += time.perf_counter_ns() - t0
            self._held.add(u)
            return self._buffer[u]

    def _evict_read_ahead(self):
        # Every buffer is taken: give back one read ahead and not yet acquired (clean),
        # to be read again after the unit needed now (lock held).
        for v in range(len(self._state) - 1, -1, -1):
            if (self._state[v] == "resident" and v not in self._held
                    and not self._external[v]):
                self._state[v] = "disk"
                self._free.append(self._buffer[v])
                self._buffer[v] = None
                self._wanted.insert(1, v)
                return

    def record_view(self, buf, r, dtype=np.float32):
        """Record ``r`` inside its unit's buffer, as an array of ``dtype``."""
        start = self.record_offset[r]
        return buf[start:start + self.record_nbytes[r]].view(dtype)

    def release(self, u, dirty=True):
        """Hand unit ``u``'s buffer back: written behind when ``dirty``."""
        with self._cv:
            if self._state[u] != "resident" or u not in self._held:
                raise RuntimeError(f"{self.name} unit {u} was not acquired")
            self._held.discard(u)
            if dirty:
                self._state[u] = "writing"
                self._queue.append(("write", u))
                self._cv.notify_all()
            else:
                self._state[u] = "disk"
                self._give_back(u)

    # -- units read into and written from the caller's own buffers (the first
    # ``unit_nbytes[u]`` bytes of a page-aligned uint8 array, e.g. ``aligned_buffer``),
    # in the order asked, after everything queued before them --------------------------

    def read_into(self, u, buf):
        """Queue a read of unit ``u`` into ``buf``; ``wait(u)`` waits for it."""
        self._queue_external(u, buf, "read")

    def write_from(self, u, buf):
        """Queue a write of unit ``u`` from ``buf`` (which must not change until
        ``wait(u)``)."""
        self._queue_external(u, buf, "write")

    def _queue_external(self, u, buf, kind):
        with self._cv:
            self._raise_pending()
            self._idle_unit(u)
            self._buffer[u] = buf
            self._external[u] = True
            self._state[u] = "loading" if kind == "read" else "writing"
            self._queue.append((kind, u))
            self._cv.notify_all()

    def wait(self, u):
        """Wait until no read or write of unit ``u`` is queued or running."""
        with self._cv:
            t0 = time.perf_counter_ns()
            while self._state[u] in ("loading", "writing"):
                self._cv.wait()
                self._raise_pending()
            self.stats["read_wait_ns"] += time.perf_counter_ns() - t0
            self._raise_pending()

    def flush(self):
        """Wait until every write queued has reached the file, and drop the read-ahead."""
        with self._cv:
            self._wanted.clear()
            t0 = time.perf_counter_ns()
            while any(s == "writing" for s in self._state) or any(
                    k == "write" for k, _ in self._queue):
                self._cv.wait()
            self.stats["buffer_wait_ns"] += time.perf_counter_ns() - t0
            self._raise_pending()

    def _idle_unit(self, u):
        # Wait until nobody reads or writes unit u (lock held).
        while self._state[u] in ("loading", "writing"):
            self._cv.wait()
        if self._state[u] == "resident" and u in self._held:
            raise RuntimeError(f"{self.name} unit {u} is acquired: release it first")
        if self._state[u] == "resident":        # read ahead, not used: its bytes go stale
            self._state[u] = "disk"
            self._give_back(u)

    def read_record(self, r, out=None, dtype=np.float32):
        """Record ``r`` read now (checked), into ``out`` if given."""
        nbytes = self.record_nbytes[r]
        if out is None:
            out = np.empty(nbytes // np.dtype(dtype).itemsize, dtype)
        view = out.reshape(-1).view(np.uint8)
        if view.nbytes != nbytes:
            raise ValueError(f"{self.name} record {r} holds {nbytes} bytes, out has "
                             f"{view.nbytes}")
        with self._cv:
            self._raise_pending()
            self._idle_unit(self.unit_of[r])
            expected = self.checksums[r]
        if expected is None:
            view[:] = 0
            return out
        # Records lie anywhere in a unit: through the page cache, not O_DIRECT.
        self._pread(view, self.unit_offset[self.unit_of[r]] + self.record_offset[r], self.fd)
        if checksum_bytes(view) != expected:
            raise self._corrupt(r)
        with self._lock:
            self.stats["bytes_read"] += nbytes
        return out

    def write_record(self, r, data):
        """Write record ``r`` now from ``data`` (its exact size)."""
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if view.nbytes != self.record_nbytes[r]:
            raise ValueError(f"{self.name} record {r} holds {self.record_nbytes[r]} bytes, "
                             f"got {view.nbytes}")
        with self._cv:
            self._raise_pending()
            self._idle_unit(self.unit_of[r])
        self._pwrite(view, self.unit_offset[self.unit_of[r]] + self.record_offset[r], self.fd)
        with self._lock:
            self.checksums[r] = checksum_bytes(view)
            self.stats["bytes_written"] += view.nbytes

    def _corrupt_for_tests(self, r, byte=0):
        """Flip one byte of record ``r`` on disk (tests)."""
        off = self.unit_offset[self.unit_of[r]] + self.record_offset[r] + byte
        b = os.pread(self.fd, 1, off)
        os.pwrite(self.fd, bytes([b[0] ^ 0xFF]), off)
        os.fdatasync(self.fd)

    def close(self):
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        os.close(self.fd)
        if self.dfd >= 0:
            os.close(self.dfd)
        self._free = []
        self._buffer = [None] * len(self.units)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
