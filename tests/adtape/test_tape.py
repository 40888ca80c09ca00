"""The tape's API: LIFO semantics for every dtype, records, marks, stats, errors."""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import adtape
from adtape import Tape, TapeClosedError


@pytest.mark.parametrize("dtype, values", [
    (np.float64, [1.5, -2.25, 1e300, 0.0]),
    (np.float32, [1.5, -2.25, 3.0 * 2.0**100, 0.0]),
    (np.int64, [1, -2, 2**62, 0]),
])
def test_push_pop_peek_each_dtype(dtype, values):
    with Tape(dtype=dtype, sbo_size=2, slab_size=3) as tape:
        for v in values * 5:
            tape.push(v)
        assert len(tape) == 20
        for v in reversed(values * 5):
            assert tape.peek() == v
            assert tape.pop() == v
        assert len(tape) == 0


def test_push_many_pop_many_round_trip_and_order():
    a = np.arange(10_000, dtype=np.float64)
    with Tape(sbo_size=4, slab_size=33) as tape:
        tape.push(-1.0)
        tape.push_many(a)
        assert len(tape) == 10_001
        tail = tape.pop_many(10)
        np.testing.assert_array_equal(tail, a[-10:])  # the last n pushed, most recent last
        np.testing.assert_array_equal(tape.pop_many(len(a) - 10), a[:-10])
        assert tape.pop() == -1.0


def test_short_tape_makes_no_heap_allocation():
    with Tape(sbo_size=16) as tape:
        for i in range(16):
            tape.push(float(i))
        st = tape.stats
        assert st["in_sbo"] and st["heap_slabs"] == 0 and st["resident_bytes"] == 0
        tape.push(16.0)
        st = tape.stats
        assert not st["in_sbo"] and st["heap_slabs"] == 1


def test_slabs_are_linked_not_reallocated():
    with Tape(sbo_size=0, slab_size=4) as tape:
        tape.push_many(np.arange(40, dtype=np.float64))
        st = tape.stats
        assert st["n_slabs"] == 10 and st["resident_bytes"] == 10 * 32
        np.testing.assert_array_equal(tape.pop_many(40), np.arange(40.0))


def test_emptied_slabs_are_pooled_up_to_the_limit():
    with Tape(sbo_size=0, slab_size=4, keep_free_slabs=3) as tape:
        tape.push_many(np.arange(40, dtype=np.float64))
        tape.pop_many(40)
        st = tape.stats
        # the emptied bottom slab stays linked as the head; of the 9 above, 3 are kept
        assert st["n_slabs"] == 1 and st["pooled_slabs"] == 3 and st["heap_slabs"] == 4
        assert st["resident_bytes"] == 4 * 32


def test_records_arrays_and_bytes_interleave_with_scalars():
    arrays = [np.arange(7, dtype=np.float32).reshape(7, 1), np.ones((2, 3, 4)),
              np.array(5, dtype=np.int16), np.zeros((0, 3)), np.arange(10)[::2]]
    with Tape(sbo_size=1, slab_size=2) as tape:
        for k, a in enumerate(arrays):
            tape.push(float(k))
            tape.push_array(a)
            tape.push_bytes(bytes(range(k * 3)))
        for k, a in reversed(list(enumerate(arrays))):
            assert tape.pop_bytes() == bytes(range(k * 3))
            out = tape.pop_array()
            assert out.dtype == a.dtype and out.shape == a.shape
            np.testing.assert_array_equal(out, a)
            assert tape.pop() == float(k)
        assert len(tape) == 0


@pytest.mark.parametrize("slab_size", [None, 1 << 20])
def test_large_records_copy_in_parallel_exactly(slab_size):
    # Records of 1 MiB and more are copied by one thread per core (par_memcpy):
    # odd lengths, records across slab boundaries, into fresh arrays and into out=.
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8)
              for n in ((1 << 20) + 13, 3 * (1 << 20) + 4097, (1 << 20) - 1, 5 * (1 << 20) + 1)]
    arrays.append(rng.standard_normal((1031, 517)).astype(np.float32))
    with Tape(np.float64, slab_size=slab_size) as t:
        for a in arrays:
            t.push(1.5)
            t.push_array(a)
        for a in reversed(arrays):
            if a.dtype == np.uint8:
                np.testing.assert_array_equal(t.pop_array(), a)
            else:
                out = np.empty_like(a)
                assert t.pop_array(out=out) is out
                np.testing.assert_array_equal(out, a)
            assert t.pop() == 1.5
        assert len(t) == 0


def test_pop_array_into_out_checks_it():
    with Tape() as tape:
        tape.push_array(np.arange(6.0).reshape(2, 3))
        with pytest.raises(ValueError, match="shape"):
            tape.pop_array(out=np.empty((3, 2)))
        out = np.empty((2, 3))
        assert tape.pop_array(out=out) is out
        np.testing.assert_array_equal(out, np.arange(6.0).reshape(2, 3))


def test_entry_kind_mismatches_raise_and_keep_the_tape():
    with Tape() as tape:
        tape.push(1.0)
        tape.push_array(np.ones(3))
        with pytest.raises(TypeError, match="record"):
            tape.pop()
        with pytest.raises(TypeError, match="array"):
            tape.pop_bytes()
        with pytest.raises(TypeError, match="record"):
            tape.pop_many(1)
        np.testing.assert_array_equal(tape.pop_array(), np.ones(3))
        with pytest.raises(TypeError, match="scalar"):
            tape.pop_array()
        assert tape.pop() == 1.0


def test_mark_and_rewind_discard_a_region():
    with Tape(sbo_size=0, slab_size=2) as tape:
        tape.push_many(np.arange(5.0))
        m = tape.mark()
        tape.push_many(np.arange(100.0))
        tape.push_array(np.ones(4))
        tape.rewind(m)
        assert len(tape) == 5
        np.testing.assert_array_equal(tape.pop_many(5), np.arange(5.0))
        with pytest.raises(ValueError, match="popped past"):
            tape.rewind(m)
    with Tape() as other, Tape() as tape:
        with pytest.raises(ValueError, match="this tape"):
            tape.rewind(other.mark())


def test_clear_empties_and_tape_is_reusable():
    with Tape(sbo_size=0, slab_size=8) as tape:
        tape.push_many(np.arange(1000.0))
        tape.clear()
        assert len(tape) == 0 and tape.stats["n_slabs"] == 0
        tape.push(3.0)
        assert tape.pop() == 3.0


def test_bad_input_errors():
    with Tape() as tape:
        with pytest.raises(IndexError, match="empty"):
            tape.pop()
        with pytest.raises(IndexError, match="empty"):
            tape.peek()
        with pytest.raises(IndexError):
            tape.pop_many(1)
        with pytest.raises(TypeError):
            tape.push("x")
        with pytest.raises(TypeError, match="dtype"):
            tape.push_many(np.ones(3, dtype=np.float32))
        with pytest.raises(TypeError):
            tape.push_many([1.0, 2.0])
        with pytest.raises(TypeError):
            tape.push_array(np.array([object()]))
        assert len(tape) == 0
    with Tape(dtype=np.int64) as tape:
        with pytest.raises(TypeError):
            tape.push(1.5)
    with pytest.raises(TypeError, match="dtype"):
        Tape(dtype=np.complex128)
    with pytest.raises(ValueError, match="sbo_size"):
        Tape(sbo_size=10**6)
    with pytest.raises(ValueError, match="slab_size"):
        Tape(slab_size=0)
    with pytest.raises(ValueError, match="memory_budget"):
        Tape(memory_budget=-1)


def test_use_after_close_is_a_clear_error():
    tape = Tape()
    tape.push(1.0)
    tape.close()
    tape.close()  # idempotent
    assert tape.closed
    for call in (lambda: tape.push(1.0), tape.pop, tape.peek, lambda: len(tape),
                 lambda: tape.push_many(np.ones(2)), lambda: tape.pop_many(1),
                 lambda: tape.push_array(np.ones(2)), tape.pop_array, tape.mark, tape.clear,
                 lambda: tape.stats):
        with pytest.raises(TapeClosedError, match="closed"):
            call()
    assert isinstance(TapeClosedError("x"), ValueError)


def test_thread_local_tapes_give_each_thread_its_own():
    import threading
    pool = adtape.ThreadLocalTapes(sbo_size=0, slab_size=16)
    errors = []

    def work(k):
        tape = pool.get()
        assert pool.get() is tape
        for i in range(5000):
            tape.push(float(k * 10_000 + i))
        for i in reversed(range(5000)):
            if tape.pop() != float(k * 10_000 + i):
                errors.append(k)
                return

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and len(pool.tapes()) == 8
    pool.close()
    assert all(t.closed for t in [*pool.tapes()]) and pool.tapes() == []


def test_no_spill_file_left_by_gc_or_exit_or_kill(tmp_path):
    tape = Tape(sbo_size=0, slab_size=128, memory_budget=0, spill_dir=tmp_path, spill_unit=1)
    tape.push_many(np.arange(10_000.0))
    assert tape.stats["spills"] > 0
    assert os.listdir(tmp_path) == []  # the spill file is unlinked as soon as it is created
    del tape
    gc.collect()
    code = (f"import adtape, numpy as np, os, signal\n"
            f"t = adtape.Tape(slab_size=128, memory_budget=0, spill_dir={str(tmp_path)!r}, spill_unit=1)\n"
            f"t.push_many(np.arange(50000.0))\n"
            f"assert t.stats['spills'] > 0\n"
            f"os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(adtape.__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path.parent, env=env)
    assert proc.returncode == -9
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs", [dict(sbo_size=1, slab_size=3),
                                    dict(sbo_size=0, slab_size=1, memory_budget=16, spill_unit=1),
                                    dict(slab_size=1000, memory_budget=16_000, spill_unit=8000)])
def test_cython_cursor_batches_cross_slabs_and_spills(kwargs, tmp_path):
    from adtape import _bench
    with Tape(spill_dir=tmp_path, **kwargs) as tape:
        tape.push(-1.0)
        # push_pop_ns checks every popped value against what was pushed
        _bench.push_pop_ns(tape, 20_000, repeats=2, locked=True, cursor=True)
        _bench.push_pop_ns(tape, 20_000, repeats=1, locked=False, cursor=False)
        assert len(tape) == 1 and tape.pop() == -1.0
        if "memory_budget" in kwargs:
            assert tape.stats["spills"] > 0 and tape.stats["reloads"] > 0


@pytest.mark.parametrize("kwargs", [dict(), dict(sbo_size=0, slab_size=4),
                                    dict(slab_size=64, memory_budget=1024, spill_unit=256)])
def test_reserve_writes_records_in_place(kwargs, tmp_path):
    from adtape import _bench
    sizes = [0, 1, 7, 8, 100, 5000]
    with Tape(spill_dir=tmp_path, **kwargs) as tape:
        for k, n in enumerate(sizes):
            tape.push(float(k))
            _bench.reserve_and_fill(tape, n, k)
        for k, n in reversed(list(enumerate(sizes))):
            assert tape.pop_bytes() == bytes((k + i) % 251 for i in range(n))
            assert tape.pop() == float(k)
        assert len(tape) == 0
