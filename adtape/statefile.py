"""Fixed-size state on the tape's disk tier, streamed through a window of memory.

The tape spills what a forward pass pushes and reads it back in reverse; a model's
optimizer state is different: the same records are read, updated and written back
every step, in the same order.  ``StateFile`` keeps such records in a file of the
tape's kind (created in ``spill_dir`` and unlinked at once, so a killed process
leaves nothing behind; ``O_DIRECT`` where the filesystem allows it; ``SpillError``
for a full disk, found when the file is created, since its whole size is reserved
then) and moves them through a tape's own I/O thread (``Tape._state_io``): the same
queue as the tape's spilled slabs, the same checksum on every record, checked on
every read (``TapeCorruptionError`` naming the file and offset on a mismatch), the
traffic counted in that tape's ``stats`` (``state_bytes_read``, ...).  A model's
training engine ``attach``es its state to its ``OpTape``'s byte tape, so activations
and state share one disk queue; until then the file has a tape of its own.

Records are grouped into I/O *units* (consecutive records, one read and one write
each).  Units asked for with ``prefetch`` are read ahead of ``acquire`` into a pool of
page-aligned buffers (``window`` units at most, so the memory is bounded); a unit
``release``d dirty is written behind, and its buffer takes the next read at once,
queued behind the write (the queue runs in order).  ``stats`` counts the bytes and
the time the caller waited.  A record never written reads as zeros (no I/O).
``read_record``/``write_record`` move one record synchronously, in any order
(checkpoints).  One thread drives a ``StateFile`` (the training loop's); the tape's I/O
thread does the transfers.
"""
import collections
import os
import tempfile
import time

import numpy as np

from adtape._tape import (SpillError, Tape, TapeClosedError, TapeCorruptionError,
                          checksum_bytes)

ALIGN = 4096            # O_DIRECT: buffer, offset and length in whole blocks
RECORD_ALIGN = 64       # records inside a unit start on cache lines


def aligned_buffer(nbytes):
    """A page-aligned uint8 array of ``nbytes`` (O_DIRECT reads and writes into it)."""
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
        # Per unit: its records' offsets and sizes in the unit, their checksums (stored
        # by the I/O thread as it writes them) and whether each was ever written.
        self._rec_off, self._rec_len, self._sums, self._valid = [], [], [], []
        file_end = 0
        for u, (a, b) in enumerate(units):
            pos = 0
            offs = []
            for r in range(a, b):
                self.unit_of[r] = u
                self.record_offset.append(pos)
                offs.append(pos)
                pos += (record_nbytes[r] + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN
            size = (pos + ALIGN - 1) // ALIGN * ALIGN
            self.unit_offset.append(file_end)
            self.unit_nbytes.append(size)
            self._rec_off.append(np.array(offs, np.int64))
            self._rec_len.append(np.array(record_nbytes[a:b], np.int64))
            self._sums.append(np.zeros(b - a, np.uint64))
            self._valid.append(np.zeros(b - a, np.uint8))
            file_end += size
        self.file_bytes = file_end

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
        # The tape whose I/O thread moves the units: our own until ``attach``.
        self._own_tape = Tape(np.float64, spill_dir=spill_dir)
        self.tape = self._own_tape

        # The pool serves ``acquire`` (``pooled``: the units it may be asked for; the
        # others move only through the caller's buffers, read_into / write_from).
        pooled = range(len(units)) if pooled is None else list(pooled)
        biggest = max([self.unit_nbytes[u] for u in pooled] or [ALIGN])
        self._pool_bytes = biggest
        self._free = [aligned_buffer(biggest) for _ in range(window)]
        self.window = window
        self._state = ["disk"] * len(units)      # disk | loading | resident
        self._buffer = [None] * len(units)       # the pool buffer of a loading/resident unit
        self._external = [False] * len(units)     # loading into the caller's buffer
        self._last = [None] * len(units)          # the unit's latest transfer
        self._last_read = [None] * len(units)     # and its latest read
        self._held = set()                        # units acquired and not yet released
        self._wanted = collections.deque()        # units to read ahead, in order
        self._inflight = collections.deque()      # (request, kind, unit), in queue order
        self._error = None
        self._closed = False
        self.stats = dict(bytes_read=0, bytes_written=0, units_read=0, units_written=0,
                          read_wait_ns=0, buffer_wait_ns=0, prefetch_hits=0,
                          prefetch_misses=0, io_ns=0)

    # -- the tape that moves the units ---------------------------------------------------

    def attach(self, tape):
        """Move the units through ``tape``'s I/O thread from now on (an OpTape's byte
        tape: one queue for activations and state); ``detach`` before that tape closes."""
        self._drain()
        self.tape = tape

    def detach(self):
        """Back to this file's own tape (before the attached one closes)."""
        self._drain()
        self.tape = self._own_tape

    def _drain(self):
        # Wait for every queued transfer (each keeps its buffer alive) and reap it.
        if self._inflight:
            self._wait_for(self._inflight[-1][0], "buffer_wait_ns")
        self._reap()

    # -- queueing and reaping (the queue runs in order) ------------------------------------

    def _fd(self):
        return self.dfd if self.dfd >= 0 else self.fd

    def _submit(self, kind, u, buf):
        write = kind == "write"
        # A read gets the flags as they are now; a write makes every record valid.
        valid = None if write else self._valid[u].copy()
        if write:
            self._valid[u][:] = 1
        req = self.tape._state_io(write, self._fd(), buf[:self.unit_nbytes[u]],
                                  self.unit_offset[u], self._rec_off[u], self._rec_len[u],
                                  self._sums[u], valid)
        self._last[u] = req
        if kind == "read":
            self._last_read[u] = req
        self._inflight.append((req, kind, u))
        return req

    def _reap(self):
        # Account for the transfers done, oldest first; the first failure is kept for
        # the caller's next call.
        while self._inflight and self._inflight[0][0].done:
            req, kind, u = self._inflight.popleft()
            self.stats["io_ns"] += req.io_ns
            if req.err and self._error is None:
                if kind == "write":
                    self._error = SpillError(req.err, f"cannot write the {self.name} file "
                                             f"{self.path!r} at offset {self.unit_offset[u]}: "
                                             f"{os.strerror(req.err)}")
                else:
                    self._error = OSError(req.err, f"reading the {self.name} file "
                                          f"{self.path!r} at offset {self.unit_offset[u]} "
                                          f"failed: {os.strerror(req.err)}")
            elif kind == "read" and req.bad_record >= 0 and self._error is None:
                self._error = self._corrupt(self.units[u][0] + req.bad_record)
            ok = not req.err and (kind == "write" or req.bad_record < 0)
            if ok and req.moved:
                key = "written" if kind == "write" else "read"
                self.stats[f"bytes_{key}"] += self.unit_nbytes[u]
                self.stats[f"units_{key}"] += 1
            if kind == "read" and self._last[u] is req and self._state[u] == "loading":
                if self._external[u] or not ok:
                    self._drop(u)
                else:
                    self._state[u] = "resident"
            if self._last[u] is req:
                self._last[u] = None
            if self._last_read[u] is req:
                self._last_read[u] = None

    def _wait_for(self, req, counter):
        if not req.done:
            t0 = time.perf_counter_ns()
            req.wait()
            self.stats[counter] += time.perf_counter_ns() - t0

    def _drop(self, u):
        # Unit u's pool buffer goes back to the pool (any transfer still queued into it
        # runs before whatever is queued into it next).
        if self._buffer[u] is not None and not self._external[u]:
            self._free.append(self._buffer[u])
        self._buffer[u] = None
        self._external[u] = False
        self._state[u] = "disk"

    def _schedule(self):
        while self._wanted and self._free:
            u = self._wanted.popleft()
            if self._state[u] != "disk" or u in self._held:
                continue
            self._load(u, self._free.pop())

    def _load(self, u, buf):
        self._buffer[u] = buf
        self._state[u] = "loading"
        self._submit("read", u, buf)

    def _enter(self):
        if self._closed:
            raise TapeClosedError(f"the {self.name} file is closed")
        self._reap()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # -- the caller's side -------------------------------------------------------------

    def prefetch(self, units):
        """Read these units ahead, in this order, as buffers free up (replaces any
        earlier read-ahead not yet started)."""
        self._enter()
        self._wanted = collections.deque(units)
        self._schedule()

    def acquire(self, u):
        """Unit ``u``'s buffer (uint8, its records at ``record_offset``) once read; the
        caller owns it until ``release``."""
        if self.unit_nbytes[u] > self._pool_bytes:
            raise ValueError(f"{self.name} unit {u} is larger than the pool's buffers: read it "
                             f"with read_into")
        self._enter()
        if u in self._held:
            raise RuntimeError(f"{self.name} unit {u} is acquired already")
        try:
            self._wanted.remove(u)          # consumed now: no read ahead of it any more
        except ValueError:
            pass
        if self._state[u] == "resident":
            self.stats["prefetch_hits"] += 1
        else:
            self.stats["prefetch_misses"] += 1
            if self._external[u]:       # being read into a caller's buffer: let it end
                self._wait_for(self._last[u], "read_wait_ns")
                self._enter()
            if self._state[u] == "disk":
                if not self._free:
                    self._evict_read_ahead()
                self._load(u, self._free.pop())
            self._wait_for(self._last[u], "read_wait_ns")
            self._enter()
        self._held.add(u)
        return self._buffer[u]

    def _evict_read_ahead(self):
        # Every buffer is taken: take back the one read ahead the furthest and not
        # acquired; it is read again later, after the unit needed now.
        for v in range(len(self._state) - 1, -1, -1):
            if self._state[v] in ("resident", "loading") and v not in self._held \
                    and not self._external[v]:
                self._drop(v)
                self._wanted.appendleft(v)
                return
        raise RuntimeError(f"{self.name}: every one of the {self.window} buffers is acquired")

    def written(self, r):
        """Whether record ``r`` was ever written (else it reads as zeros)."""
        u = int(self.unit_of[r])
        return bool(self._valid[u][r - self.units[u][0]])

    def record_view(self, buf, r, dtype=np.float32):
        """Record ``r`` inside its unit's buffer, as an array of ``dtype``."""
        start = self.record_offset[r]
        return buf[start:start + self.record_nbytes[r]].view(dtype)

    def release(self, u, dirty=True):
        """Hand unit ``u``'s buffer back: written behind when ``dirty``."""
        if self._state[u] != "resident" or u not in self._held:
            raise RuntimeError(f"{self.name} unit {u} was not acquired")
        self._held.discard(u)
        if dirty:
            self._submit("write", u, self._buffer[u])
        self._drop(u)
        self._reap()
        self._schedule()

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
        self._enter()
        self._idle_unit(u)
        if kind == "read":
            self._buffer[u] = buf
            self._external[u] = True
            self._state[u] = "loading"
        self._submit(kind, u, buf)

    def wait(self, u, writes=True):
        """Wait until no read or write of unit ``u`` is queued or running (``writes``
        False: no read; a write behind may still run, from a buffer that must not
        change until it has)."""
        req = self._last[u] if writes else self._last_read[u]
        if req is not None:
            self._wait_for(req, "read_wait_ns")
        self._enter()

    def flush(self):
        """Wait until every write queued has reached the file, and drop the read-ahead."""
        self._wanted.clear()
        self._enter()
        for i in range(len(self._inflight) - 1, -1, -1):
            if self._inflight[i][1] == "write":
                self._wait_for(self._inflight[i][0], "buffer_wait_ns")
                break
        self._enter()

    def _idle_unit(self, u):
        # No transfer of unit u queued and its bytes on disk (a read-ahead of it is
        # dropped: it would go stale).
        if u in self._held:
            raise RuntimeError(f"{self.name} unit {u} is acquired: release it first")
        if self._last[u] is not None:
            self._wait_for(self._last[u], "buffer_wait_ns")
            self._enter()
        if self._state[u] != "disk":
            self._drop(u)
        try:
            self._wanted.remove(u)
        except ValueError:
            pass

    def read_record(self, r, out=None, dtype=np.float32):
        """Record ``r`` read now (checked), into ``out`` if given."""
        nbytes = self.record_nbytes[r]
        if out is None:
            out = np.empty(nbytes // np.dtype(dtype).itemsize, dtype)
        view = out.reshape(-1).view(np.uint8)
        if view.nbytes != nbytes:
            raise ValueError(f"{self.name} record {r} holds {nbytes} bytes, out has "
                             f"{view.nbytes}")
        self._enter()
        u = int(self.unit_of[r])
        self._idle_unit(u)
        i = r - self.units[u][0]
        if not self._valid[u][i]:
            view[:] = 0
            return out
        # Records lie anywhere in a unit: through the page cache, not O_DIRECT.
        self._pread(view, self.unit_offset[u] + self.record_offset[r])
        if checksum_bytes(view) != self._sums[u][i]:
            raise self._corrupt(r)
        self.stats["bytes_read"] += nbytes
        return out

    def write_record(self, r, data):
        """Write record ``r`` now from ``data`` (its exact size)."""
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if view.nbytes != self.record_nbytes[r]:
            raise ValueError(f"{self.name} record {r} holds {self.record_nbytes[r]} bytes, "
                             f"got {view.nbytes}")
        self._enter()
        u = int(self.unit_of[r])
        self._idle_unit(u)
        self._pwrite(view, self.unit_offset[u] + self.record_offset[r])
        i = r - self.units[u][0]
        self._sums[u][i] = checksum_bytes(view)
        self._valid[u][i] = 1
        self.stats["bytes_written"] += view.nbytes

    def _pread(self, view, offset):
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(5, f"{self.name} file {self.path!r}: unexpected end at offset "
                                 f"{offset + done}")
            done += n

    def _pwrite(self, view, offset):
        done = 0
        while done < len(view):
            try:
                done += os.pwritev(self.fd, [view[done:]], offset + done)
            except OSError as e:
                raise SpillError(e.errno, f"cannot write the {self.name} file {self.path!r} at "
                                 f"offset {offset + done}: {os.strerror(e.errno)}") from None

    def _corrupt(self, r):
        off = self.unit_offset[self.unit_of[r]] + self.record_offset[r]
        return TapeCorruptionError(f"{self.name} file {self.path!r}: record {r} at offset "
                                   f"{off} fails its checksum (the bytes read back are not "
                                   f"those written)")

    def _corrupt_for_tests(self, r, byte=0):
        """Flip one byte of record ``r`` on disk (tests)."""
        self._drain()
        off = self.unit_offset[self.unit_of[r]] + self.record_offset[r] + byte
        b = os.pread(self.fd, 1, off)
        os.pwrite(self.fd, bytes([b[0] ^ 0xFF]), off)
        os.fdatasync(self.fd)

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            # Every queued transfer finishes before its descriptor closes.
            while self._inflight:
                req = self._inflight.popleft()[0]
                if not req.done:
                    req.wait()
        finally:
            os.close(self.fd)
            if self.dfd >= 0:
                os.close(self.dfd)
            self._own_tape.close()
            self.tape = None
            self._free = []
            self._buffer = [None] * len(self.units)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
