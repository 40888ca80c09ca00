"""adtape.buffers: 64-byte-aligned arrays, and the buffers that use them."""
import numpy as np
import pytest

from adtape import buffers
from gpt2.config import GPT2Config
from gpt2.model import ActivationArena


@pytest.mark.parametrize("shape", [0, 1, 7, (3, 5), (2, 3, 17), (16, 768), 1 << 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8])
def test_empty_and_zeros_are_aligned_contiguous_arrays(shape, dtype):
    for make in (buffers.empty, buffers.zeros):
        a = make(shape, dtype)
        want = (shape,) if isinstance(shape, int) else shape
        assert a.shape == want and a.dtype == dtype
        assert a.flags.c_contiguous and a.flags.writeable
        assert buffers.is_aligned(a)
        a[...] = 3                      # the whole extent is usable
        assert (a == 3).all()
    assert not buffers.zeros(shape, dtype).any()


def test_large_arrays_start_on_a_page():
    # From PAGE_ALIGN_MIN bytes every array starts on a 4096-byte page (so any two
    # lie a multiple of 4096 bytes apart: no 4K aliasing between a kernel's input and
    # output); below it, on a cache line.
    for _ in range(3):
        for nbytes in (buffers.PAGE_ALIGN_MIN, 25 << 20, (25 << 20) + 12):
            a = buffers.empty(nbytes // 4, np.float32)
            assert a.ctypes.data % buffers.PAGE == 0 and a.nbytes == nbytes // 4 * 4
    small = [buffers.empty(buffers.PAGE_ALIGN_MIN // 4 - 1) for _ in range(8)]
    assert all(buffers.is_aligned(a) for a in small)


def test_empty_like_and_independence():
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    y = buffers.empty_like(x)
    assert y.shape == x.shape and y.dtype == x.dtype and buffers.is_aligned(y)
    a, b = buffers.zeros(100), buffers.zeros(100)
    a[:] = 1
    assert not b.any() and not np.shares_memory(a, b)
    assert not buffers.is_aligned(buffers.zeros(100)[1:])


def test_activation_buffers_all_start_on_a_cache_line():
    # T = 3 and C = 24: sizes that are not multiples of 16 floats.
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=24, vocab_size=70, block_size=8)
    acts = ActivationArena(cfg, 1, 3)
    names = [n for n, v in vars(acts).items() if isinstance(v, np.ndarray) and n != "flat"]
    assert len(names) > 20
    for name in names:
        assert buffers.is_aligned(getattr(acts, name)), name
        assert np.shares_memory(getattr(acts, name), acts.flat)
    # and they do not overlap one another
    spans = sorted((getattr(acts, n).ctypes.data, getattr(acts, n).nbytes) for n in names)
    for (a0, n0), (a1, _) in zip(spans, spans[1:]):
        assert a0 + n0 <= a1


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="negative dimensions"):
        buffers.empty((3, -2))
    with pytest.raises(TypeError):
        buffers.empty((3, "a"))
    with pytest.raises(TypeError):
        buffers.empty(4, "not a dtype")
    with pytest.raises(TypeError):
        buffers.empty((2.5, 3))
    with pytest.raises(MemoryError):
        buffers.empty((1 << 40, 1 << 40))
    assert buffers.empty((np.int64(3), np.int32(2))).shape == (3, 2)
