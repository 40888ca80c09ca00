"""Write-ahead and direct I/O of the spill file (issue 24).

Write-ahead: a tape filled the same way again (a training step's forward pass) writes
the slabs that will not fit the budget as soon as they are full, spreading the writes
over the whole fill, instead of starting only near the budget.  The I/O thread is held
(Tape._hold_io), so the counters are structural, not timings.

Direct I/O: slabs whose buffers are page-aligned move between memory and the spill file
with O_DIRECT where the filesystem takes it, so the spill file does not pass through
(or crowd) the page cache; their file offsets are whole blocks.
"""
import errno
import os

import numpy as np
import pytest

from adtape import Tape

KiB = 1 << 10
MiB = 1 << 20
BUDGET = 4 * MiB
UNIT = 256 * KiB
W = 2 * UNIT              # min(2 spill units, budget / 4)
S = BUDGET // 32
BATCH = max(UNIT, min(8 * MiB, BUDGET // 4))    # bytes one write request gathers
SLAB = 64 * KiB
CHUNK = SLAB // 8
FILL = 4 * BUDGET         # activations at 4x the budget, as in the issue


def make_tape(spill_dir, **kwargs):
    return Tape(memory_budget=BUDGET, slab_size=SLAB // 8, spill_unit=UNIT, sbo_size=0,
                spill_dir=spill_dir, **kwargs)


def push_slabs(tape, first, count):
    for k in range(first, first + count):
        tape.push_many(np.arange(k * CHUNK, (k + 1) * CHUNK, dtype=np.float64))


def pop_slabs(tape, count):
    for k in reversed(range(count)):
        got = tape.pop_many(CHUNK)
        assert np.array_equal(got, np.arange(k * CHUNK, (k + 1) * CHUNK, dtype=np.float64)), k


def fill_and_drain(tape, slabs=FILL // SLAB):
    push_slabs(tape, 0, slabs)
    pop_slabs(tape, slabs)
    assert len(tape) == 0


def test_the_second_fill_writes_from_its_first_slabs(tmp_path):
    with make_tape(tmp_path) as tape:
        early = (BUDGET - W) // SLAB // 2       # well below where write-behind starts
        tape._hold_io(30.0)
        push_slabs(tape, 0, early)
        first = tape.stats
        assert first["writing_bytes"] == 0 and first["write_ahead_until"] == 0, (
            "a first fill has nothing to learn from: it must write behind as before")
        pop_slabs(tape, early)
        tape._hold_io(0)
        fill_and_drain(tape)                    # the fill the next one learns from
        tape._hold_io(30.0)
        push_slabs(tape, 0, early)
        st = tape.stats
        # The peak is seen when a slab fills or a pop crosses one: to the slab.
        assert FILL - BUDGET + W - SLAB <= st["write_ahead_until"] <= FILL - BUDGET + W
        # Full slabs are queued as the next one is taken, a whole write request at a
        # time (min(8 MiB, budget / 4)), but the one just below the head (queued when
        # the head fills): the head, that one and a part request wait.
        per_request = min(8 * MiB, BUDGET // 4) // SLAB
        assert st["writing_bytes"] == (early - 2) // per_request * per_request * SLAB > 0
        tape._hold_io(0)
        push_slabs(tape, early, FILL // SLAB - early)
        tape._sync()
        st = tape.stats
        assert st["peak_resident_bytes"] <= BUDGET + S
        assert st["spill_file_bytes"] <= st["spilled_bytes"] + UNIT
        # What the rule wrote: the fill less the budget, plus W, to the slab.
        written_early = st["bytes_written_early"]
        assert FILL - BUDGET <= written_early <= FILL - BUDGET + W + UNIT
        # Write-behind had little left to do: at most one write request at the very end.
        assert st["spilled_bytes"] <= written_early + BATCH + SLAB
        pop_slabs(tape, FILL // SLAB)
        st = tape.stats
        assert len(tape) == 0 and st["spilled_bytes"] == 0 and st["write_ahead_until"] == 0


def test_array_records_learn_from_each_fill_as_training_steps_do(tmp_path):
    # The AD runtime's pattern: array records pushed, then popped to empty (through the
    # bottom heap slab into the inline buffer), step after step, default sizes.
    arrays = [np.full(300_000, k, np.float32) for k in range(20)]       # 22.9 MiB a fill
    with Tape(memory_budget=4 * MiB, spill_dir=tmp_path) as tape:
        early = []
        for fill in range(3):
            before = tape.stats["bytes_written_early"]
            for a in arrays:
                tape.push_array(a)
            nbytes = tape.nbytes
            armed = tape.stats["write_ahead_until"]
            for a in reversed(arrays):
                assert np.array_equal(tape.pop_array(), a)
            early.append(tape.stats["bytes_written_early"] - before)
            assert len(tape) == 0
            if fill == 0:
                assert armed == 0
            else:
                assert nbytes - 4 * MiB - 2 * MiB <= armed <= nbytes - 4 * MiB + 2 * MiB
        assert early[0] == 0
        assert early[1] == early[2] >= nbytes - 4 * MiB - 2 * MiB


def test_write_ahead_off_writes_behind_only(tmp_path):
    with make_tape(tmp_path, write_ahead=False) as tape:
        fill_and_drain(tape)
        tape._hold_io(30.0)
        push_slabs(tape, 0, 8)
        st = tape.stats
        assert st["writing_bytes"] == 0 and st["bytes_written_early"] == 0
        assert st["write_ahead_until"] == 0
        pop_slabs(tape, 8)


def test_a_pop_ends_the_write_ahead_of_its_fill(tmp_path):
    with make_tape(tmp_path) as tape:
        fill_and_drain(tape)
        tape._hold_io(30.0)
        n = BATCH // SLAB + 4                   # a whole write request and more
        push_slabs(tape, 0, n)
        queued = tape.stats["writing_bytes"]
        assert queued > 0
        tape.pop_many(2 * CHUNK)                # crosses a slab: the fill is over
        assert tape.stats["write_ahead_until"] == 0
        push_slabs(tape, n - 2, BATCH // SLAB)  # still below BUDGET - W
        st = tape.stats
        assert st["writing_bytes"] <= queued, "pushes after a pop must not write ahead"
        tape._hold_io(0)
        pop_slabs(tape, n - 2 + BATCH // SLAB)
        assert len(tape) == 0


def test_a_small_fill_turns_write_ahead_off_for_the_next(tmp_path):
    with make_tape(tmp_path) as tape:
        fill_and_drain(tape)
        fill_and_drain(tape, slabs=(BUDGET // 2) // SLAB)    # fits: nothing to write
        tape._hold_io(30.0)
        push_slabs(tape, 0, 8)
        st = tape.stats
        assert st["writing_bytes"] == 0 and st["write_ahead_until"] == 0
        tape._hold_io(0)
        pop_slabs(tape, 8)


def test_clear_ends_a_fill_and_the_next_learns_from_it(tmp_path):
    with make_tape(tmp_path) as tape:
        push_slabs(tape, 0, FILL // SLAB)
        tape.clear()
        tape._hold_io(30.0)
        push_slabs(tape, 0, 4)
        assert FILL - BUDGET + W - SLAB <= tape.stats["write_ahead_until"] <= FILL - BUDGET + W
        tape._hold_io(0)
        pop_slabs(tape, 4)


# -- direct I/O ---------------------------------------------------------------------

def takes_o_direct(directory):
    path = os.path.join(directory, "probe")
    with open(path, "wb"):
        pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        return False
    finally:
        os.unlink(path)
    os.close(fd)
    return True


def round_trip_odd_records(directory):
    """Push records whose sizes leave slabs partly used (so offsets need rounding up to
    whole blocks), spill most of them, pop them back; returns the tape's spill state."""
    rng = np.random.default_rng(0)
    sizes = [int(n) for n in rng.integers(1, 700_000, 60)] + [262_144, 3, 262_145]
    records = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    with Tape(memory_budget=8 * MiB, spill_dir=directory, spill_unit=4 * MiB) as tape:
        for k, r in enumerate(records):
            tape.push_array(r)
            if k % 7 == 3:
                tape.push(float(k))             # scalars between records, as AD does
        tape._sync()
        st = tape.stats
        direct = tape._spill_direct()
        assert st["spilled_bytes"] > 4 * tape.stats["memory_budget"]
        on_disk = st["spills"] - st["reloads"]
        assert st["spill_file_bytes"] <= st["spilled_bytes"] + 4 * MiB + 4 * KiB * on_disk
        for k in reversed(range(len(records))):
            if k % 7 == 3:
                assert tape.pop() == float(k)
            got = tape.pop_array()
            assert got.dtype == np.float32 and np.array_equal(got, records[k]), k
        st = tape.stats
        assert len(tape) == 0 and st["spilled_bytes"] == 0
        assert st["bytes_read"] == st["bytes_written"]
    return direct


def test_aligned_slabs_spill_with_o_direct_where_the_filesystem_takes_it(tmp_path):
    # The default slabs (2 MiB, huge-page aligned) under a budget of 8 MiB.
    assert round_trip_odd_records(tmp_path) == takes_o_direct(tmp_path)


def test_a_full_disk_keeps_every_value_with_direct_io(tmp_path, tmpfs):
    # A real full filesystem (a 4 MiB tmpfs) under 2 MiB slabs: the failed write is an
    # OSError naming the spill file, and every value pushed is popped back intact.
    mnt = tmpfs(tmp_path / "tmpfs", "size=4m")
    rng = np.random.default_rng(1)
    records = [rng.standard_normal(300_000) for _ in range(20)]     # 2.3 MiB each
    pushed = 0
    with Tape(memory_budget=8 * MiB, spill_dir=mnt) as tape:
        with pytest.raises(OSError, match="spill file") as err:
            for r in records:
                tape.push_array(r)
                pushed += 1
                tape._sync()
        assert err.value.errno == errno.ENOSPC
        while pushed:
            pushed -= 1
            assert np.array_equal(tape.pop_array(), records[pushed]), pushed
        assert len(tape) == 0
    assert os.listdir(mnt) == []
