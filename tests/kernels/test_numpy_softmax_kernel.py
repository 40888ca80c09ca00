"""kernels/softmax.pyx: the softmax and log-softmax kernel pairs against their NumPy twins
(float32 and float64, any leading shape, one and several threads, bit-identical across
thread counts) and their misuse errors."""
import numpy as np
import pytest

from kernels import softmax as k

SHAPES = [(1,), (7,), (3, 5), (2, 3, 17), (0, 4), (3, 0), (300, 130)]


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_match_their_numpy_twins(shape, dtype, log):
    rng = np.random.default_rng(sum(shape) + log)
    x = (3 * rng.standard_normal(shape)).astype(dtype)
    g = rng.standard_normal(shape).astype(dtype)
    y, y_ref = np.empty_like(x), np.empty_like(x)
    k.softmax_forward(y, x, log=log)
    k.softmax_forward_naive(y_ref, x, log=log)
    tol = dict(rtol=2e-6, atol=1e-7) if dtype == np.float32 else dict(rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(y, y_ref, **tol)
    dx, dx_ref = np.empty_like(x), np.empty_like(x)
    k.softmax_backward(dx, g, y, log=log)
    k.softmax_backward_naive(dx_ref, g, y, log=log)
    np.testing.assert_allclose(dx, dx_ref, **tol)
    if x.size:
        many = np.empty_like(x)
        k.softmax_forward(many, x, log=log, n_threads=2)
        np.testing.assert_array_equal(many, y)        # rows owned by threads: same bits
        k.softmax_backward(many, g, y, log=log, n_threads=2)
        np.testing.assert_array_equal(many, dx)


def test_rows_sum_to_one_and_large_inputs_do_not_overflow():
    x = np.array([[1000.0, 1000.0, -1000.0], [-5.0, 0.0, 5.0]], np.float32)
    y = np.empty_like(x)
    k.softmax_forward(y, x)
    np.testing.assert_allclose(y.sum(axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(y[0], [0.5, 0.5, 0.0])
    k.softmax_forward(y, x, log=True)
    assert np.isfinite(y[1]).all() and y[0, 0] == pytest.approx(-np.log(2.0))


def test_misuse_is_an_error_naming_the_argument():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="x must be float32 or float64, got int64"):
        k.softmax_forward(np.empty((2, 3), np.float32), np.ones((2, 3), np.int64))
    with pytest.raises(TypeError, match="x is float64 but out is float32"):
        k.softmax_forward(np.empty_like(x), x.astype(np.float64))
    with pytest.raises(ValueError, match=r"x has shape \(3, 2\) but out has \(2, 3\)"):
        k.softmax_forward(np.empty_like(x), x.T.copy())
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        k.softmax_forward(np.empty((3, 2), np.float32), x.T)
    with pytest.raises(ValueError, match="at least one axis"):
        k.softmax_forward(np.empty((), np.float32), np.ones((), np.float32))
    with pytest.raises(ValueError, match="out must not overlap x"):
        k.softmax_forward(x, x)
    read_only = np.empty_like(x)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writable"):
        k.softmax_forward(read_only, x)
    with pytest.raises(TypeError, match="g must be a numpy.ndarray, got list"):
        k.softmax_backward(np.empty_like(x), [[1.0] * 3] * 2, x)
    with pytest.raises(ValueError, match="n_threads"):
        k.softmax_forward(np.empty_like(x), x, n_threads=0)
