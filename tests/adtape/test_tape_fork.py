"""A forked child never touches its parent's spill file or I/O thread (issue 23 item 3).

The child used to run the atexit close on the inherited tape: it truncated the
shared spill file, then hung joining an I/O thread that does not exist in it,
and the parent's next pop raised TapeCorruptionError.  Each case runs in a
child process of its own, so a hang or crash fails the test instead of pytest.
"""
import subprocess
import sys

CHILD_EXITS_NORMALLY = r"""
import os, sys
import numpy as np
import adtape

data = np.arange(1 << 19, dtype=np.float64)            # 4 MiB through a 256 KiB budget
tape = adtape.Tape(memory_budget=256 << 10, spill_dir=sys.argv[1])
tape.push_many(data)
tape.push_array(data[:1000].reshape(10, 100))
tape._sync()
assert tape.stats["spilled_bytes"] > 2 << 20, tape.stats
pid = os.fork()
if pid == 0:
    # Every use of the inherited tape is a clear error naming the fork.
    for use in (lambda: tape.push(1.0), lambda: tape.pop_array(), lambda: tape.pop(),
                lambda: tape.push_many(data[:5]), lambda: len(tape), lambda: tape.stats):
        try:
            use()
        except adtape.TapeForkError as exc:
            assert "fork" in str(exc), exc
        else:
            raise SystemExit("the inherited tape was usable in the child")
    # The child spills on a tape of its own, then exits normally (atexit runs).
    own = adtape.Tape(memory_budget=128 << 10, spill_dir=sys.argv[1])
    own.push_many(data[::-1].copy())
    own._sync()
    assert own.stats["spilled_bytes"] > 0
    assert np.array_equal(own.pop_many(data.size), data[::-1])
    own.push_many(data)         # left on the tape: atexit closes it
    tape.close()
    sys.exit(0)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
assert np.array_equal(tape.pop_array(), data[:1000].reshape(10, 100))
assert np.array_equal(tape.pop_many(data.size), data)
assert len(tape) == 0
print("ok")
"""


def test_fork_with_spilled_data_on_both_sides(tmp_path):
    res = subprocess.run([sys.executable, "-c", CHILD_EXITS_NORMALLY, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    assert list(tmp_path.iterdir()) == []
