"""Each call raises its own error when threads share a tape (issue 23 item 10).

The error used to be read from the tape's one shared slot after the lock was
released, so a thread could raise another thread's message, or the base TapeError
once another call had cleared the slot.
"""
import threading

import numpy as np

from adtape import Tape

BIG = 1 << 30


def test_eight_threads_each_get_their_own_error():
    tape = Tape(slab_size=64)
    wrong = []
    seen = [0] * 8
    start = threading.Barrier(8)

    def work(k):
        start.wait()
        chunk = np.full(50, float(k))
        for i in range(1500):
            if i % 3 == 0:
                tape.push_many(chunk)
            want = f"pop_many({BIG + k})"
            try:
                tape.pop_many(BIG + k)
            except IndexError as exc:
                seen[k] += 1
                if want not in str(exc):
                    wrong.append((k, type(exc).__name__, str(exc)))
            except Exception as exc:       # noqa: BLE001  (any other error is the bug)
                wrong.append((k, type(exc).__name__, str(exc)))
            else:
                wrong.append((k, "no error", ""))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    tape.close()
    assert wrong == [], f"{len(wrong)} calls raised another call's error, e.g. {wrong[:3]}"
    assert seen == [1500] * 8
