"""Write-behind (issue 24): writes start below the budget, pushes run past it while the
writes are held up, within memory_budget + S, and a pop takes back a queued write instead
of waiting for it.  The I/O thread is held (Tape._hold_io), so what a push or pop would
wait for cannot finish early: the counters are structural, not timings."""
import numpy as np

from adtape import Tape

KiB = 1 << 10
MiB = 1 << 20
BUDGET = 4 * MiB
UNIT = 256 * KiB
W = 2 * UNIT              # writes start at BUDGET - W: min(2 spill units, budget / 4)
S = BUDGET // 32          # the slack past the budget: min(W, budget / 32)
SLAB = 64 * KiB
CHUNK = SLAB // 8         # float64 per push_many: one slab


def make_tape(spill_dir):
    return Tape(memory_budget=BUDGET, slab_size=SLAB // 8, spill_unit=UNIT, sbo_size=0,
                spill_dir=spill_dir)


def push_slabs(tape, first, count):
    for k in range(first, first + count):
        tape.push_many(np.arange(k * CHUNK, (k + 1) * CHUNK, dtype=np.float64))


def pop_slabs(tape, count):
    for k in reversed(range(count)):
        got = tape.pop_many(CHUNK)
        assert np.array_equal(got, np.arange(k * CHUNK, (k + 1) * CHUNK, dtype=np.float64)), k


def test_pushes_run_past_the_budget_while_writes_are_held_and_pops_take_them_back(tmp_path):
    with make_tape(tmp_path) as tape:
        tape._hold_io(30.0)
        n = (BUDGET + S) // SLAB              # the most slabs the bound lets in
        push_slabs(tape, 0, (BUDGET - W) // SLAB + 1)
        st = tape.stats
        assert st["writing_bytes"] > 0, "writes must start below the budget"
        push_slabs(tape, (BUDGET - W) // SLAB + 1, n - (BUDGET - W) // SLAB - 1)
        st = tape.stats
        assert st["push_wait_ns"] == 0, "a push waited on a write although the bound held"
        assert st["resident_bytes"] == n * SLAB > BUDGET
        assert st["peak_resident_bytes"] <= BUDGET + S
        assert st["spilled_bytes"] == 0 and st["bytes_written"] == 0
        queued = st["writing_bytes"]
        assert queued >= (n * SLAB) - (BUDGET - W)
        pop_slabs(tape, n)
        st = tape.stats
        # Every queued write was taken back by the pops: none was written, none waited.
        assert st["bytes_cancelled"] == queued and st["writing_bytes"] == 0
        assert st["bytes_written"] == 0 and st["io_wait_ns"] == 0
        assert st["spill_file_bytes"] == 0 and len(tape) == 0


def test_a_push_past_budget_plus_w_waits_and_the_bound_holds(tmp_path):
    with make_tape(tmp_path) as tape:
        tape._hold_io(1.0)                    # outlasts the pushes up to the bound
        n = (BUDGET + S) // SLAB
        push_slabs(tape, 0, n)
        assert tape.stats["push_wait_ns"] == 0
        push_slabs(tape, n, 3 * n)            # the first of these must wait for the hold
        st = tape.stats
        assert st["push_wait_ns"] > 0
        assert st["peak_resident_bytes"] <= BUDGET + S
        assert st["bytes_written"] > 0
        tape._sync()
        st = tape.stats
        assert st["spill_file_bytes"] <= st["spilled_bytes"] + UNIT
        pop_slabs(tape, 4 * n)
        st = tape.stats
        assert st["spilled_bytes"] == 0 and len(tape) == 0
        assert st["bytes_read"] == st["bytes_written"]


def test_cancelled_writes_leave_the_file_consistent_when_pushing_resumes(tmp_path):
    # Push, take the top queued write back by popping into it, push again: every value
    # survives the round trip through the file, which never holds more than it should.
    with make_tape(tmp_path) as tape:
        n = (BUDGET + S) // SLAB
        keep = 8                              # below the top queued request (slabs 9-12)
        tape._hold_io(30.0)
        push_slabs(tape, 0, n)
        queued = tape.stats["writing_bytes"]
        for _ in range(n - keep):
            tape.pop_many(CHUNK)
        st = tape.stats
        assert st["bytes_cancelled"] == queued - keep * SLAB
        assert st["writing_bytes"] == keep * SLAB and st["bytes_written"] == 0
        tape._hold_io(0)
        push_slabs(tape, keep, 2 * n)
        tape._sync()
        st = tape.stats
        assert st["spill_file_bytes"] <= st["spilled_bytes"] + UNIT
        assert st["peak_resident_bytes"] <= BUDGET + S
        pop_slabs(tape, keep + 2 * n)
        assert len(tape) == 0 and tape.stats["spilled_bytes"] == 0
