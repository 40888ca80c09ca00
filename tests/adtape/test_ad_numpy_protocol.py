"""NumPy functions on Tensors: those adtape has a rule for record it (bit for bit as the adtape
op), every other one raises TypeError instead of losing the gradient; np.asarray is the
explicit detach; adtape.numpy gives the same table under NumPy's names."""
import importlib
import sys

import numpy as np
import pytest

import adtape as ad
import adtape.numpy as anp
from adtape.tensor import Tensor

RNG = np.random.default_rng(34)


def randn(*shape):
    return RNG.standard_normal(shape)


def positive(*shape):
    return RNG.uniform(0.5, 2.0, shape)


def vjp(f, *arrays):
    """``f``'s value and the gradients of its leaves for a random seed."""
    leaves = [Tensor(a, requires_grad=True) for a in arrays]
    out = f(*leaves)
    assert type(out) is Tensor and out.requires_grad, "nothing was recorded"
    out.backward(np.random.default_rng(7).standard_normal(out.shape).astype(out.dtype))
    return out.data, [leaf.grad for leaf in leaves]


def assert_bitwise_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b, strict=True)


C = randn(3, 4)     # an ndarray operand
# (name, through NumPy, the adtape op as written before NumPy's protocols, arrays)
RECORDED = [
    ("np.exp", np.exp, ad.exp, (randn(3, 4),)),
    ("np.log", np.log, ad.log, (positive(3, 4),)),
    ("np.tanh", np.tanh, ad.tanh, (randn(3, 4),)),
    ("np.negative", np.negative, lambda x: -x, (randn(3, 4),)),
    ("np.add", np.add, lambda x, y: x + y, (randn(3, 4), randn(4))),
    ("np.subtract", np.subtract, lambda x, y: x - y, (randn(3, 4), randn(3, 1))),
    ("np.multiply", np.multiply, lambda x, y: x * y, (randn(3, 4), randn(3, 4))),
    ("np.divide", np.divide, lambda x, y: x / y, (randn(3, 4), positive(4))),
    ("np.true_divide", np.true_divide, lambda x, y: x / y, (randn(3, 4), positive(3, 4))),
    ("np.power", np.power, lambda x, y: x ** y, (positive(3, 4), randn(3, 4))),
    ("np.matmul", np.matmul, lambda x, y: x @ y, (randn(2, 3, 4), randn(4, 5))),
    ("np.sum", np.sum, lambda x: x.sum(), (randn(3, 4),)),
    ("np.sum_axis_keepdims", lambda x: np.sum(x, axis=1, keepdims=True),
     lambda x: x.sum(axis=1, keepdims=True), (randn(3, 4),)),
    ("np.mean_axis", lambda x: np.mean(x, 0), lambda x: x.mean(axis=0), (randn(3, 4),)),
    ("np.reshape", lambda x: np.reshape(x, (2, 6)), lambda x: x.reshape(2, 6), (randn(3, 4),)),
    ("np.reshape_shape_kw", lambda x: np.reshape(x, shape=(-1,)), lambda x: x.reshape(-1),
     (randn(3, 4),)),
    ("np.transpose", np.transpose, lambda x: x.T, (randn(3, 4),)),
    ("np.transpose_axes", lambda x: np.transpose(x, (2, 0, 1)), lambda x: x.transpose(2, 0, 1),
     (randn(2, 3, 4),)),
    ("np.dot_2d", np.dot, lambda x, y: x @ y, (randn(3, 4), randn(4, 2))),
    ("np.dot_1d", np.dot, lambda x, y: x @ y, (randn(4), randn(4))),
    ("np.dot_2d_1d", np.dot, lambda x, y: x @ y, (randn(3, 4), randn(4))),
    # ndarray (op) Tensor comes through np.multiply etc.; before, Tensor's reflected
    # operators took it (__rmul__ is mul(tensor, ndarray)).
    ("ndarray*t", lambda x: C * x, lambda x: ad.mul(x, C), (randn(3, 4),)),
    ("ndarray+t", lambda x: C + x, lambda x: ad.add(x, C), (randn(4),)),
    ("ndarray-t", lambda x: C - x, lambda x: ad.sub(C, x), (randn(3, 4),)),
    ("ndarray/t", lambda x: C / x, lambda x: ad.div(C, x), (positive(3, 4),)),
    ("ndarray**t", lambda x: np.abs(C) ** x, lambda x: ad.power(np.abs(C), x), (randn(3, 4),)),
    ("ndarray@t", lambda x: C @ x, lambda x: ad.matmul(C, x), (randn(4, 2),)),
    ("float64*t", lambda x: np.float64(1.5) * x, lambda x: ad.mul(x, 1.5), (randn(3),)),
    ("float32 ndarray*float32 t", lambda x: C.astype(np.float32) * x,
     lambda x: ad.mul(x, C.astype(np.float32)), (randn(3, 4).astype(np.float32),)),
    ("float64 ndarray*float32 t", lambda x: C * x, lambda x: ad.mul(x, C),
     (randn(3, 4).astype(np.float32),)),
    ("t**2", lambda x: x ** 2, lambda x: ad.power(x, 2), (randn(3),)),
    ("2.0**t", lambda x: 2.0 ** x, lambda x: ad.power(2.0, x), (randn(3),)),
    ("np.sum(np.exp)", lambda x: np.sum(np.exp(x) * x), lambda x: (ad.exp(x) * x).sum(),
     (randn(3, 4),)),
]


@pytest.mark.parametrize("name,through_numpy,adtape_op,arrays", RECORDED,
                         ids=[case[0] for case in RECORDED])
def test_numpy_functions_with_a_rule_record_the_adtape_op_bit_for_bit(name, through_numpy,
                                                                       adtape_op, arrays):
    value, grads = vjp(through_numpy, *arrays)
    ref_value, ref_grads = vjp(adtape_op, *arrays)
    assert_bitwise_equal(value, ref_value)
    for g, ref in zip(grads, ref_grads):
        assert_bitwise_equal(g, ref)


def test_gradients_through_numpy_match_hand_derived_values():
    x = randn(3, 4)
    c = randn(3, 4)
    assert_bitwise_equal(ad.grad(lambda a: np.sum(np.exp(a)))(x), np.exp(x))
    assert_bitwise_equal(ad.grad(lambda a: np.sum(np.multiply(c, a)))(x), c)
    assert_bitwise_equal(ad.grad(lambda a: np.sum(c * a))(x), c)
    assert_bitwise_equal(ad.grad(lambda a: np.sum(np.power(a, 2)))(x), 2 * x)
    assert_bitwise_equal(ad.grad(lambda a: np.sum(np.tanh(a)))(x), 1 - np.tanh(x) ** 2)
    assert_bitwise_equal(ad.grad(lambda a: np.mean(a))(x), np.full_like(x, 1 / 12))
    assert_bitwise_equal(ad.grad(lambda a: np.sum(np.log(a)))(np.abs(x)), 1 / np.abs(x))
    assert_bitwise_equal(ad.grad(lambda a: np.dot(a, a))(x[0]), 2 * x[0])
    assert ad.grad(lambda a: np.sum(np.positive(a)))(x[0]).tolist() == [1.0] * 4


def lost_gradient(what):
    return pytest.raises(TypeError, match=rf"{what} on an adtape Tensor.*adtape\.numpy"
                                          rf".*np\.asarray\(tensor\)")


def test_the_issue_example_records_and_a_function_without_a_rule_raises():
    assert_bitwise_equal(ad.grad(lambda a: ad.sum(np.sin(a)))(np.zeros(2)), np.ones(2))
    with lost_gradient(r"numpy\.i0"):
        ad.grad(lambda a: ad.sum(np.i0(a)))(np.zeros(2))


@pytest.mark.parametrize("requires_grad", [True, False])
def test_a_numpy_function_without_a_rule_raises_naming_it(requires_grad):
    # A constant Tensor too: which functions work does not depend on grad being needed.
    t = Tensor(randn(3), requires_grad=requires_grad)
    with lost_gradient(r"numpy\.i0"):
        np.i0(t)
    with ad.no_grad(), lost_gradient(r"numpy\.gradient"):
        np.gradient(t)
    with lost_gradient(r"numpy\.nancumsum"):
        np.nancumsum(t)
    with lost_gradient(r"numpy\.linalg\.qr"):
        np.linalg.qr(t.reshape(1, 3))
    with lost_gradient(r"numpy\.heaviside"):
        np.heaviside(np.zeros(3), t)
    with lost_gradient(r"numpy\.floor_divide"):
        np.ones(3) // t
    with lost_gradient(r"numpy\.equal"):
        np.ones(3) == t     # was False (identity) before the protocol: never elementwise


def test_ufunc_methods_and_keywords_raise():
    t = Tensor(randn(2, 3), requires_grad=True)
    with lost_gradient(r"numpy\.add\.reduce"):
        np.add.reduce(t)
    with lost_gradient(r"numpy\.multiply\.accumulate"):
        np.multiply.accumulate(t)
    with lost_gradient(r"numpy\.add\.at"):
        np.add.at(t, 0, 1.0)
    with lost_gradient(r"numpy\.multiply\.outer"):
        np.multiply.outer(t, t)
    out = np.full((2, 3), 7.0)
    with lost_gradient(r"numpy\.add with out="):
        np.add(t, 1.0, out=out)
    with lost_gradient(r"numpy\.exp with dtype="):
        np.exp(t, dtype=np.float64)
    with lost_gradient(r"numpy\.multiply with where="):
        np.multiply(t, t, where=np.ones((2, 3), bool))
    with lost_gradient(r"numpy\.add with out="):
        out += t            # in place into an ndarray: nothing is written
    assert (out == 7.0).all()
    with lost_gradient(r"numpy\.sum with dtype="):
        np.sum(t, dtype=np.float32)
    with lost_gradient(r"numpy\.mean with out="):
        np.mean(t, out=np.empty(()))
    with lost_gradient(r"numpy\.mean with these arguments") as excinfo:
        np.mean(t, 0, np.float32)       # NumPy's third position is dtype, not keepdims
    assert "takes (a, axis=None, *, keepdims=False)" in str(excinfo.value)
    with lost_gradient(r"numpy\.reshape with order="):
        np.reshape(t, (3, 2), order="F")
    # dot of N-d operands is recorded now (as tensordot, a matmul: the last bit may differ).
    a = randn(2, 2, 3)
    np.testing.assert_allclose(np.dot(a, t[0]).data, np.dot(a, t.data[0]), rtol=1e-14)


def test_constant_tensors_through_numpy_stay_constant():
    t = Tensor(randn(3))
    out = np.exp(t)
    assert type(out) is Tensor and not out.requires_grad
    assert_bitwise_equal(out.data, np.exp(t.data))
    assert not (np.ones(3) * t).requires_grad
    with ad.no_grad():
        assert not np.sum(Tensor(randn(3), requires_grad=True)).requires_grad


def test_shape_functions_read_the_shape():
    t = Tensor(randn(3, 4), requires_grad=True)
    assert np.shape(t) == (3, 4) and np.ndim(t) == 2 and np.size(t) == 12
    assert np.size(t, 1) == 4


def test_np_asarray_is_the_explicit_detach():
    x = randn(4)
    t = Tensor(x, requires_grad=True)
    assert np.asarray(t) is t.data
    assert not isinstance(np.array(t), Tensor)
    # The factor read through np.asarray is a constant: d/da sum(a * c) = c = x, not 2x.
    assert_bitwise_equal(ad.grad(lambda a: ad.sum(a * np.asarray(a)))(x), x)
    assert_bitwise_equal(ad.grad(lambda a: ad.sum(np.sin(np.asarray(a)) * a))(x), np.sin(x))


def test_adtape_numpy_exposes_the_table_under_numpy_names():
    for name in anp._FUNCTIONS:
        assert hasattr(np, name) and hasattr(anp, name), name
    for name in anp.__all__:
        assert hasattr(anp, name), name
    assert anp.exp is ad.exp and anp.multiply is ad.mul and anp.divide is anp.true_divide
    assert not hasattr(anp, "gradient") and hasattr(anp, "sin")
    with pytest.raises(AttributeError, match=r"no derivative rule for numpy\.gradient"):
        anp.gradient
    with pytest.raises(AttributeError, match=r"no derivative rule for numpy\.linalg\.qr"):
        anp.linalg.qr
    with pytest.raises(AttributeError, match=r"no attribute 'not_a_numpy_name'"):
        anp.not_a_numpy_name
    # Arrays, Python numbers and Tensors alike; a Tensor operand records.
    x = randn(3)
    assert_bitwise_equal(anp.exp(x).data, np.exp(x))
    assert float(anp.log(1.0).data) == 0.0
    assert_bitwise_equal(ad.grad(lambda a: anp.sum(anp.multiply(x, a)))(np.zeros(3)), x)
    assert_bitwise_equal(anp.transpose(x.reshape(1, 3)).data, x.reshape(3, 1))
    assert anp.reshape(Tensor(x), (3, 1)).shape == (3, 1)
    assert ad.grad(lambda s: anp.exp(s))(0.0) == 1.0        # scalar mode
    namespace = {}
    exec("from adtape.numpy import *", namespace)
    assert set(anp.__all__) <= set(namespace)


def test_adtape_numpy_does_not_shadow_numpy_inside_adtape():
    for module in ("adtape.tensor", "adtape.vjps", "adtape.functional", "adtape.numpy"):
        assert importlib.import_module(module).np is sys.modules["numpy"]


def test_comparisons_give_boolean_arrays_of_the_values():
    x = randn(5)
    t = Tensor(x, requires_grad=True)
    for op in ("__lt__", "__le__", "__gt__", "__ge__"):
        assert_bitwise_equal(getattr(t, op)(0.1), getattr(x, op)(0.1))
    assert_bitwise_equal(np.ones(5) < t, np.ones(5) < x)        # through np.less
    assert_bitwise_equal(np.greater_equal(t, t), np.ones(5, bool))
    assert_bitwise_equal(anp.isnan(t), np.isnan(x))
    # The idiom they serve: relu as where(x > 0, x, 0).
    g = ad.grad(lambda a: anp.sum(anp.where(a > 0, a, 0.0) ** 2))(x)
    assert_bitwise_equal(g, np.where(x > 0, 2 * x, 0.0))
    assert (t == t) is True and (t != Tensor(x)) is True       # identity, as before
