"""adtape._parcopy.copy: the tape's parallel memcpy from Python (the calibration's copy)."""
import numpy as np
import pytest

from adtape._parcopy import copy
from kernels import threads


@pytest.mark.parametrize("n", [0, 1, 1000, (1 << 20) // 4 + 7, 3 << 20])
def test_copies_every_byte_on_any_thread_count(n):
    src = np.arange(n, dtype=np.float32)
    for nt in (1, 2):
        previous = threads.get_num_threads()
        threads.set_num_threads(nt)
        try:
            dst = np.full(n, -1.0, np.float32)
            copy(dst, src)
        finally:
            threads.set_num_threads(previous)
        np.testing.assert_array_equal(dst, src)


def test_bytes_not_shapes_must_agree():
    dst = np.zeros(8, np.uint8)
    copy(dst, np.arange(2, dtype=np.float32))            # 8 bytes into 8 bytes
    assert dst.view(np.float32).tolist() == [0.0, 1.0]


@pytest.mark.parametrize("dst, src, match", [
    (np.zeros(4, np.float32), np.zeros(5, np.float32), "bytes"),
    (np.zeros((4, 4), np.float32)[:, ::2], np.zeros(8, np.float32), "C-contiguous"),
    ([0.0] * 4, np.zeros(4, np.float32), "NumPy arrays"),
])
def test_bad_arguments_raise(dst, src, match):
    with pytest.raises((TypeError, ValueError), match=match):
        copy(dst, src)


def test_read_only_and_overlapping_destinations_raise():
    a = np.zeros(16, np.float32)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy(ro, a[:4])
    with pytest.raises(ValueError, match="overlap"):
        copy(a[2:6], a[:4])
    copy(a[4:8], a[:4])                                   # adjacent is fine
