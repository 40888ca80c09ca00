"""Faults: unwritable spill dir, full disk, corrupt spill file.  After each, what was
pushed before is intact."""
import errno
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import adtape
from adtape import SpillError, Tape, TapeCorruptionError


def spilling_tape(spill_dir, **kw):
    kw.setdefault("slab_size", 64)
    kw.setdefault("memory_budget", 2 * 64 * 8)
    kw.setdefault("spill_unit", 64 * 8)
    return Tape(spill_dir=spill_dir, **kw)


def push_until_error(tape, start=0, limit=100_000):
    """Push start, start + 1, ... until a push raises; return (the tape's length, the exception)."""
    for i in range(start, start + limit):
        try:
            tape.push(float(i))
        except SpillError as exc:
            return i, exc
    raise AssertionError("no push failed")


def test_missing_or_file_spill_dir_is_rejected_up_front(tmp_path):
    with pytest.raises(FileNotFoundError, match="spill_dir"):
        Tape(memory_budget=1024, spill_dir=tmp_path / "missing")
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match="spill_dir"):
        Tape(memory_budget=1024, spill_dir=tmp_path / "f")


def test_spill_dir_gone_before_the_first_spill(tmp_path):
    d = tmp_path / "spill"
    d.mkdir()
    tape = spilling_tape(d)
    shutil.rmtree(d)
    assert tape.stats["spills"] == 0 and tape._spill_fd() == -1
    n, exc = push_until_error(tape)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOENT
    assert "spill_dir" in str(exc) and str(d) in str(exc)
    assert len(tape) == n
    np.testing.assert_array_equal(tape.pop_many(n), np.arange(n, dtype=np.float64))
    tape.close()


def test_full_disk_keeps_everything_and_recovers(tmp_path):
    tape = spilling_tape(tmp_path)
    for i in range(2000):
        tape.push(float(i))
    assert tape.stats["spills"] > 0
    tape._inject_write_error(errno.ENOSPC)
    n, exc = push_until_error(tape, start=2000)
    assert exc.errno == errno.ENOSPC and "No space left" in str(exc)
    assert "unchanged" in str(exc)
    assert len(tape) == n
    # the disk has room again: pushing and spilling go on, nothing was lost
    tape._inject_write_error(0)
    for i in range(n, n + 3000):
        tape.push(float(i))
    total = n + 3000
    np.testing.assert_array_equal(tape.pop_many(total), np.arange(total, dtype=np.float64))
    assert tape.stats["spilled_bytes"] == 0
    tape.close()


def test_full_disk_during_push_many_is_all_or_nothing(tmp_path):
    tape = spilling_tape(tmp_path)
    tape.push_many(np.arange(1000.0))
    tape._inject_write_error(errno.ENOSPC)
    with pytest.raises(SpillError):
        for _ in range(50):
            tape.push_many(np.arange(1000.0, 1500.0))
            tape._sync()
    tape._inject_write_error(0)
    assert len(tape) % 500 == 0
    rest = tape.pop_many(len(tape) - 1000)
    np.testing.assert_array_equal(rest, np.tile(np.arange(1000.0, 1500.0), len(rest) // 500))
    np.testing.assert_array_equal(tape.pop_many(1000), np.arange(1000.0))
    tape.close()


def test_real_file_size_limit_gives_efbig(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the write itself (no injection)."""
    code = f"""
import resource, signal, errno, numpy as np, adtape
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
t = adtape.Tape(slab_size=8192, memory_budget=1 << 17, spill_dir={str(tmp_path)!r})
pushed = 0
try:
    for k in range(64):
        t.push_many(np.arange(k * 65536, (k + 1) * 65536, dtype=np.float64))
        pushed += 65536
        t._sync()
except adtape.SpillError as exc:
    assert exc.errno == errno.EFBIG, exc
    assert len(t) == pushed, (len(t), pushed)
    assert np.array_equal(t.pop_many(pushed), np.arange(pushed, dtype=np.float64))
    print("EFBIG-OK", pushed)
"""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(adtape.__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert "EFBIG-OK" in proc.stdout, proc.stdout + proc.stderr
    assert os.listdir(tmp_path) == []


def test_flipped_byte_in_spill_file_is_detected(tmp_path):
    tape = spilling_tape(tmp_path, prefetch_depth=0)
    tape.push_many(np.arange(5000.0))
    tape._sync()
    fd = tape._spill_fd()
    assert fd >= 0 and tape.stats["spilled_bytes"] > 0
    with open(f"/proc/self/fd/{fd}", "r+b") as f:  # the file is unlinked; reach it by its fd
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x40]))
    # everything resident above the corrupt unit comes back intact
    resident = 5000 - tape.stats["spilled_bytes"] // 8
    np.testing.assert_array_equal(tape.pop_many(resident), np.arange(5000.0 - resident, 5000.0))
    # the unit holding offset 100 is the oldest: pop down to it
    with pytest.raises(TapeCorruptionError, match=r"offset 0\b.*checksum"):
        tape.pop_many(5000 - resident)
    assert len(tape) == 5000 - resident  # a failed pop takes nothing
    with pytest.raises(TapeCorruptionError):
        tape.pop_many(5000 - resident)
    tape.clear()
    tape.push(1.0)
    assert tape.pop() == 1.0
    tape.close()


def test_flipped_byte_found_by_prefetch_is_reported_when_reached(tmp_path):
    tape = spilling_tape(tmp_path, prefetch_depth=4)
    tape.push_many(np.arange(5000.0))
    tape._sync()
    fd = tape._spill_fd()
    with open(f"/proc/self/fd/{fd}", "r+b") as f:
        f.seek(8 * 4000 - 8)  # inside a unit prefetch reads early
        f.write(b"\xff")
    got = []
    with pytest.raises(TapeCorruptionError, match="checksum"):
        while len(tape):
            got.append(tape.pop())
    assert got == [float(v) for v in range(4999, 4999 - len(got), -1)]
    tape.close()
