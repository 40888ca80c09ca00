"""Threads: a shared tape keeps the multiset and the length; per-thread tapes keep LIFO order."""
import threading

import numpy as np

from adtape import Tape, ThreadLocalTapes, _bench


def test_eight_os_threads_share_one_tape_without_losing_entries():
    n_threads, n_ops = 8, 100_000
    with Tape(sbo_size=4, slab_size=1000) as tape:
        popped, _ = _bench.shared_push_pop(tape, n_threads, n_ops, pop_every=2)
        assert len(tape) == n_threads * n_ops - len(popped)
        rest = tape.pop_many(len(tape))
        everything = np.sort(np.concatenate([popped, rest]))
        np.testing.assert_array_equal(everything, np.arange(n_threads * n_ops, dtype=np.float64))


def test_shared_tape_under_a_memory_budget_keeps_every_entry(tmp_path):
    n_threads, n_ops = 8, 100_000
    with Tape(slab_size=512, memory_budget=64 * 1024, spill_unit=8192, spill_dir=tmp_path) as tape:
        popped, _ = _bench.shared_push_pop(tape, n_threads, n_ops, pop_every=3)
        assert tape.stats["spills"] > 0
        rest = tape.pop_many(len(tape))
        everything = np.sort(np.concatenate([popped, rest]))
        np.testing.assert_array_equal(everything, np.arange(n_threads * n_ops, dtype=np.float64))


def test_per_thread_tapes_keep_exact_lifo_order():
    tapes = [Tape(threadsafe=False, slab_size=777) for _ in range(8)]
    errors, _ = _bench.per_thread_lifo(tapes, 100_000)
    assert errors == [0] * 8
    assert all(len(t) == 0 for t in tapes)
    for t in tapes:
        t.close()


def test_python_threads_share_one_tape():
    tape = Tape(sbo_size=0, slab_size=64)
    popped = [[] for _ in range(8)]

    def work(k):
        for i in range(20_000):
            tape.push(float(k * 20_000 + i))
            if i % 2:
                popped[k].append(tape.pop())

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = sorted(v for p in popped for v in p) + list(tape.pop_many(len(tape)))
    np.testing.assert_array_equal(np.sort(got), np.arange(160_000, dtype=np.float64))
    tape.close()


def test_thread_local_pool_in_os_threads_is_lifo():
    with ThreadLocalTapes(slab_size=100) as pool:
        tapes = [pool.get()] + [Tape(threadsafe=False, slab_size=100) for _ in range(3)]
        errors, _ = _bench.per_thread_lifo(tapes, 50_000)
        assert errors == [0, 0, 0, 0]
        for t in tapes[1:]:
            t.close()
