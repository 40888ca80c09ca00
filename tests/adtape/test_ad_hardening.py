"""No silent wrong gradients (issue 40): conversions of a recorded Tensor that would drop
its derivative raise TypeError; truthiness is NumPy's; scipy.special's functions either
record (adtape.scipy.special, and scipy.special's ufuncs on a Tensor) or raise; ``grad`` of
a function whose output does not depend on its input warns.  References are float64 and
analytic."""
import math
import operator
import pathlib
import warnings

import numpy as np
import pytest
import scipy.special as ss

import adtape
import adtape.numpy as anp
import adtape.scipy.special as asp
from adtape import Tensor, check_grads, no_grad

EULER_GAMMA = 0.57721566490153286061


def recorded():
    """A leaf that requires grad, and a node computed from it."""
    leaf = Tensor(np.array([0.5, 0.0, 2.0]), requires_grad=True)
    return [leaf, leaf * 1.0]


# -- 1. conversions of a recorded Tensor raise ---------------------------------------------

CONVERSIONS = {
    "float": lambda t: float(t[0]),
    "math.sin": lambda t: math.sin(t[0]),
    "math.exp": lambda t: math.exp(t[0]),
    "math.log": lambda t: math.log(t[0]),
    "math.sqrt": lambda t: math.sqrt(t[0]),
    "math.erf": lambda t: math.erf(t[0]),
    "math.fsum": lambda t: math.fsum([t[0], t[2]]),
    "percent format": lambda t: "%f" % t[0],
    "np.float64 of an element": lambda t: np.float64(t[0]),
    "np.float32 of an element": lambda t: np.float32(t[0]),
    "np.float32": lambda t: np.float32(t),
    "np.float64": lambda t: np.float64(t),
    "np.asarray with a dtype": lambda t: np.asarray(t, dtype=np.float32),
    "np.asarray with its own dtype": lambda t: np.asarray(t, dtype=np.float64),
    "np.array with a dtype": lambda t: np.array(t, dtype=np.float64),
    "complex": lambda t: complex(t[0]),
    "np.vectorize(math.sin)": lambda t: np.vectorize(math.sin)(t),
    "store into an array": lambda t: np.zeros(3).__setitem__(slice(None), t),
}


@pytest.mark.parametrize("convert", CONVERSIONS.values(), ids=CONVERSIONS.keys())
@pytest.mark.parametrize("which", ["leaf", "node"])
def test_conversion_of_a_recorded_tensor_raises(convert, which):
    t = recorded()[which == "node"]
    with pytest.raises(TypeError, match=r"derivative of a recorded Tensor.*t\.item\(\)"):
        convert(t)


def test_math_function_inside_grad_raises_instead_of_a_zero_gradient():
    with pytest.raises(TypeError, match="adtape.numpy's functions"):
        adtape.grad(lambda x: math.sin(x[0]))(np.array([0.5]))
    with pytest.raises(TypeError, match="np.vectorize"):
        adtape.grad(lambda x: anp.sum(np.vectorize(math.sin)(x)))(np.array([0.5, 1.0]))
    assert adtape.grad(lambda x: anp.sin(x[0]))(np.array([0.5]))[0] == math.cos(0.5)


def test_deliberate_detaches_still_work_on_a_recorded_tensor():
    leaf, node = recorded()
    assert np.asarray(leaf) is leaf.data
    np.testing.assert_array_equal(np.asarray(node), [0.5, 0.0, 2.0], strict=True)
    assert leaf[2].item() == 2.0 and type(leaf[2].item()) is float
    copied = np.array(leaf)             # np.array copies, as it does an ndarray
    assert not np.shares_memory(copied, leaf.data)
    np.testing.assert_array_equal(copied, leaf.data, strict=True)
    with pytest.raises(ValueError, match="copy"):
        np.asarray(Tensor(np.ones(2)), dtype=np.float32, copy=False)


def test_float_of_a_loss_after_its_backward_is_its_value():
    w = Tensor(np.array([3.0]), requires_grad=True)
    loss = (w * w).sum()
    with pytest.raises(TypeError, match="loss.item|t.item"):
        float(loss)                     # a derivative still flows through it
    assert loss.item() == 9.0
    loss.backward()
    assert float(loss) == 9.0 and "%.1f" % loss == "9.0" and math.sqrt(loss) == 3.0
    kept = (w * w).sum()
    kept.backward(retain_graph=True)    # the graph can be swept again: still recorded
    with pytest.raises(TypeError):
        float(kept)


def test_int_is_allowed_on_a_recorded_tensor():
    # An integer part is piecewise constant: its derivative is zero, nothing is lost.
    t = Tensor(np.array([2.75]), requires_grad=True)
    assert int(t[0]) == 2 and type(int(t[0])) is int
    assert int(-t[0]) == -2


def test_operator_index_raises_as_for_a_float_array():
    for t in (Tensor(np.array(2.0)), Tensor(np.array(2.0), requires_grad=True)):
        with pytest.raises(TypeError):
            operator.index(t)
        with pytest.raises(TypeError):
            [0, 1, 2][t]


def test_conversions_of_a_constant_tensor_follow_numpy():
    t = Tensor(np.array([0.5, 0.0, 2.0]))
    assert float(t[0]) == 0.5 and math.sin(t[2]) == math.sin(2.0)
    assert np.float32(t[0]) == np.float32(0.5) and type(np.float32(t[0])) is np.float32
    assert complex(t[2]) == 2 + 0j
    np.testing.assert_array_equal(np.asarray(t, dtype=np.float32),
                                  np.array([0.5, 0.0, 2.0], np.float32), strict=True)
    np.testing.assert_array_equal(np.vectorize(math.exp)(t), np.exp([0.5, 0.0, 2.0]))
    with pytest.raises(TypeError):
        float(t)                        # NumPy: only one-element arrays convert


def test_conversions_under_no_grad_follow_numpy():
    leaf = Tensor(np.array([0.5, 2.0]), requires_grad=True)
    with no_grad():
        assert float(leaf[1]) == 2.0 and math.log(leaf[1]) == math.log(2.0)
        np.testing.assert_array_equal(np.float32(leaf), np.array([0.5, 2.0], np.float32))
        assert ss.logsumexp(leaf) == math.log(math.exp(0.5) + math.exp(2.0))
    with pytest.raises(TypeError):
        float(leaf[1])                  # recorded again outside


# -- 2. truthiness as NumPy's -----------------------------------------------------------

@pytest.mark.parametrize("requires_grad", [False, True])
def test_truth_of_a_one_element_tensor_is_its_value(requires_grad):
    t = Tensor(np.array([1.0, 0.0, -3.0]), requires_grad=requires_grad)
    assert bool(t[1:2]) is False and bool(t[0:1]) is True and bool(t[2]) is True
    taken = "true" if t[1:2] else "false"
    assert taken == "false"
    assert bool(Tensor(np.array(0.0))) is False
    assert bool(Tensor(np.array([[0.0]], np.float32))) is False


@pytest.mark.parametrize("requires_grad", [False, True])
def test_truth_of_a_larger_or_empty_tensor_raises_as_numpy(requires_grad):
    with pytest.raises(ValueError, match="more than one element is ambiguous"):
        bool(Tensor(np.array([1.0, 2.0]), requires_grad=requires_grad))
    with pytest.raises(ValueError, match="empty array is ambiguous"):
        bool(Tensor(np.zeros(0), requires_grad=requires_grad))


# -- 3. SciPy ---------------------------------------------------------------------------

@pytest.mark.parametrize("fun", [ss.logsumexp, ss.softmax, ss.log_softmax,
                                 lambda t: ss.logsumexp(t, b=np.ones(3))],
                         ids=["logsumexp", "softmax", "log_softmax", "logsumexp_b"])
def test_scipy_python_functions_raise_on_a_recorded_tensor(fun):
    leaf, node = recorded()
    for t in (leaf, node):
        with pytest.raises(TypeError, match="adtape.scipy.special"):
            fun(t)
    with pytest.raises(TypeError, match="adtape.scipy.special"):
        fun([leaf[0], leaf[1], leaf[2]])


def test_scipy_python_functions_take_a_constant_tensor():
    t = Tensor(np.array([0.0, math.log(3.0)]))
    assert ss.logsumexp(t) == pytest.approx(math.log(4.0), rel=1e-15)
    np.testing.assert_allclose(ss.softmax(t), [0.25, 0.75], rtol=1e-15)


def test_scipy_ufunc_on_a_tensor_records_adtape_scipy_special():
    x = np.array([-1.0, 0.0, 0.5])
    t = Tensor(x, requires_grad=True)
    out = ss.erf(t)
    assert type(out) is Tensor and out.requires_grad
    np.testing.assert_array_equal(out.data, ss.erf(x), strict=True)
    out.backward(np.ones(3))
    np.testing.assert_allclose(t.grad, 2 / math.sqrt(math.pi) * np.exp(-x * x), rtol=1e-15)
    t2 = Tensor(np.array([2.0]), requires_grad=True)
    (ss.xlogy(t2, math.e) + ss.gammaln(t2)).backward(np.ones(1))
    np.testing.assert_allclose(t2.grad, [1.0 + 1.0 - EULER_GAMMA], rtol=1e-14)  # psi(2)


def test_scipy_ufunc_without_a_rule_raises_naming_it():
    with pytest.raises(TypeError, match=r"scipy\.special\.erfinv .*adtape\.scipy\.special"):
        ss.erfinv(Tensor(np.array([0.5]), requires_grad=True))


X = np.array([0.3, 1.2, 2.5])           # in every function's domain
UNIT = np.array([0.2, 0.5, 0.9])        # in (0, 1), for logit
# name -> (function of the arguments, arguments, scipy's value)
SPECIAL = {
    "erf": (asp.erf, (X - 1,), ss.erf(X - 1)),
    "erfc": (asp.erfc, (X - 1,), ss.erfc(X - 1)),
    "gamma": (asp.gamma, (X,), ss.gamma(X)),
    "gammaln": (asp.gammaln, (X,), ss.gammaln(X)),
    "digamma": (asp.digamma, (X,), ss.digamma(X)),
    "psi": (asp.psi, (X,), ss.psi(X)),
    "polygamma": (lambda x: asp.polygamma(2, x), (X,), ss.polygamma(2, X)),
    "expit": (asp.expit, (X - 1,), ss.expit(X - 1)),
    "logit": (asp.logit, (UNIT,), ss.logit(UNIT)),
    "xlogy": (asp.xlogy, (X - 1, X), ss.xlogy(X - 1, X)),
    "xlog1py": (asp.xlog1py, (X - 1, X), ss.xlog1py(X - 1, X)),
    "logsumexp": (asp.logsumexp, (X,), ss.logsumexp(X)),
    "logsumexp_axis": (lambda a: asp.logsumexp(a, axis=0, keepdims=True),
                       (np.outer(X, UNIT),), ss.logsumexp(np.outer(X, UNIT), axis=0,
                                                          keepdims=True)),
    "logsumexp_b": (lambda a, b: asp.logsumexp(a, b=b), (X, UNIT), ss.logsumexp(X, b=UNIT)),
    "softmax": (asp.softmax, (np.outer(X, UNIT),), ss.softmax(np.outer(X, UNIT))),
    "softmax_axis": (lambda a: asp.softmax(a, axis=1), (np.outer(X, UNIT),),
                     ss.softmax(np.outer(X, UNIT), axis=1)),
    "log_softmax": (asp.log_softmax, (np.outer(X, UNIT),), ss.log_softmax(np.outer(X, UNIT))),
}


@pytest.mark.parametrize("name", SPECIAL)
def test_adtape_scipy_special_values_are_scipys(name):
    fun, args, expected = SPECIAL[name]
    out = fun(*[Tensor(a, requires_grad=True) for a in args])
    assert type(out) is Tensor and out.requires_grad and out.dtype == np.float64
    np.testing.assert_allclose(out.data, expected, rtol=4e-16, atol=0)


@pytest.mark.parametrize("name", SPECIAL)
def test_adtape_scipy_special_gradients_by_finite_differences(name):
    fun, args, _ = SPECIAL[name]
    check_grads(fun, *args, modes=("rev", "fwd"), order=2)


# Derivatives at points where they are known in closed form.
ANALYTIC = [
    ("erf'(0) = 2/sqrt(pi)", asp.erf, 0.0, 2 / math.sqrt(math.pi)),
    ("erf'(1) = 2/sqrt(pi)/e", asp.erf, 1.0, 2 / math.sqrt(math.pi) / math.e),
    ("erfc'(1) = -2/sqrt(pi)/e", asp.erfc, 1.0, -2 / math.sqrt(math.pi) / math.e),
    ("gammaln'(1) = -euler_gamma", asp.gammaln, 1.0, -EULER_GAMMA),
    ("gamma'(1) = -euler_gamma", asp.gamma, 1.0, -EULER_GAMMA),
    ("digamma'(1) = pi^2/6", asp.digamma, 1.0, math.pi ** 2 / 6),
    ("polygamma(1)'(1) = -2 zeta(3)", lambda x: asp.polygamma(1, x), 1.0,
     -2 * 1.2020569031595942854),
    ("expit'(0) = 1/4", asp.expit, 0.0, 0.25),
    ("logit'(1/2) = 4", asp.logit, 0.5, 4.0),
    ("d/dx xlogy(x, e) = 1", lambda x: asp.xlogy(x, math.e), 2.0, 1.0),
    ("d/dy xlogy(2, y) at e = 2/e", lambda y: asp.xlogy(2.0, y), math.e, 2 / math.e),
    ("d/dy xlog1py(2, y) at 1 = 1", lambda y: asp.xlog1py(2.0, y), 1.0, 1.0),
    ("d/dx xlog1py(x, e - 1) = 1", lambda x: asp.xlog1py(x, math.e - 1), 3.0, 1.0),
]


@pytest.mark.parametrize("fun, x, expected", [a[1:] for a in ANALYTIC],
                         ids=[a[0] for a in ANALYTIC])
def test_adtape_scipy_special_analytic_derivatives(fun, x, expected):
    got = adtape.grad(fun)(np.float64(x))
    assert got == pytest.approx(expected, rel=1e-14, abs=1e-15)


def test_second_derivatives_analytic():
    # gammaln'' = trigamma, trigamma(1) = pi^2/6; erf''(x) = -2x erf'(x).
    assert adtape.hessian(asp.gammaln)(np.float64(1.0)) == pytest.approx(math.pi ** 2 / 6,
                                                                         rel=1e-14)
    assert adtape.hessian(asp.erf)(np.float64(1.0)) == pytest.approx(
        -2 * 2 / math.sqrt(math.pi) / math.e, rel=1e-14)


def test_logsumexp_gradient_is_softmax_and_return_sign():
    a = np.array([0.0, math.log(2.0), math.log(5.0)])
    g = adtape.grad(asp.logsumexp)(a)
    np.testing.assert_allclose(g, [0.125, 0.25, 0.625], rtol=1e-15)
    out, sign = asp.logsumexp(Tensor(a, requires_grad=True), b=np.array([1.0, -4.0, 0.0]),
                              return_sign=True)
    assert sign == -1.0 and out.data == pytest.approx(math.log(7.0), rel=1e-15)
    g = adtape.grad(lambda a: asp.logsumexp(a, b=np.array([1.0, -4.0, 0.0]),
                                            return_sign=True)[0])(a)
    np.testing.assert_allclose(g, [-1 / 7, 8 / 7, 0.0], rtol=1e-14, atol=1e-16)


def test_special_in_scalar_mode_goes_to_adtape_math():
    assert adtape.grad(asp.erf)(1.0) == pytest.approx(2 / math.sqrt(math.pi) / math.e,
                                                      rel=1e-14)
    assert adtape.grad(asp.gammaln)(1.0) == pytest.approx(-EULER_GAMMA, rel=1e-12)
    with pytest.raises(NotImplementedError, match="0-d float64 array"):
        adtape.grad(asp.digamma)(1.0)


def test_polygamma_takes_an_integer_order():
    with pytest.raises(TypeError, match="integer order"):
        asp.polygamma(1.5, np.ones(2))
    with pytest.raises(ValueError, match=">= 0"):
        asp.polygamma(-1, np.ones(2))


def test_adtape_scipy_is_a_package_of_the_distribution():
    root = pathlib.Path(__file__).resolve().parents[2]
    assert '"adtape.scipy"' in (root / "pyproject.toml").read_text()


# -- 4. grad of a function whose output does not depend on its input warns ---------------

def warnings_of(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [w for w in caught if "independent of input" in str(w.message)]


def test_grad_of_a_disconnected_output_warns_once_and_is_zero():
    g, caught = warnings_of(lambda: adtape.grad(lambda x: anp.sum(np.ones(3)))(np.ones(3)))
    assert len(caught) == 1 and caught[0].category is UserWarning
    assert str(caught[0].message) == "Output seems independent of input."
    assert caught[0].filename == __file__       # points at the caller's line
    np.testing.assert_array_equal(g, np.zeros(3), strict=True)
    # Two arguments, neither reached: one warning for the call.
    _, caught = warnings_of(lambda: adtape.grad(lambda x, y: 2.0, argnums=(0, 1))(
        np.ones(2), np.ones(2)))
    assert len(caught) == 1


def test_grad_of_an_output_recorded_from_something_else_warns():
    w = Tensor(np.ones(3), requires_grad=True)
    _, caught = warnings_of(lambda: adtape.grad(lambda x: anp.sum(w * w))(np.ones(3)))
    assert len(caught) == 1


def test_grad_in_scalar_mode_and_under_a_recording_warns():
    g, caught = warnings_of(lambda: adtape.grad(lambda x: 2.0)(1.5))
    assert g == 0.0 and len(caught) == 1
    # grad of grad: the inner function does not depend on its argument.
    _, caught = warnings_of(lambda: adtape.grad(
        lambda x: anp.sum(adtape.grad(lambda y: anp.sum(np.ones(2)))(x) * x))(np.ones(2)))
    assert len(caught) == 1


def test_grad_of_a_connected_output_does_not_warn():
    _, caught = warnings_of(lambda: adtape.grad(lambda x: anp.sum(x * x))(np.ones(3)))
    assert caught == []
    _, caught = warnings_of(lambda: adtape.grad(lambda x, y: anp.sum(x), argnums=(0, 1))(
        np.ones(2), np.ones(2)))
    assert caught == []
    _, caught = warnings_of(lambda: adtape.grad(lambda x: x * x)(1.5))
    assert caught == []
