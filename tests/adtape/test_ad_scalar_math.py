"""Scalar mode covers the math module: adtape.math's functions record their derivatives
(checked against torch.autograd in float64 and by finite differences); math's own
functions refuse a recorded Scalar instead of dropping its derivative."""
import math

import numpy as np
import pytest
import torch

import adtape as ad
import adtape.math as amath
from adtape import Scalar, ScalarTape

# name -> (ours, torch, a point in its domain)
UNARY = {
    "sin": (amath.sin, torch.sin, 0.7), "cos": (amath.cos, torch.cos, 0.7),
    "tan": (amath.tan, torch.tan, 0.4), "asin": (amath.asin, torch.asin, 0.3),
    "acos": (amath.acos, torch.acos, -0.6), "atan": (amath.atan, torch.atan, 1.7),
    "sinh": (amath.sinh, torch.sinh, 0.9), "cosh": (amath.cosh, torch.cosh, -0.9),
    "tanh": (amath.tanh, torch.tanh, 0.5), "asinh": (amath.asinh, torch.asinh, -1.3),
    "acosh": (amath.acosh, torch.acosh, 1.8), "atanh": (amath.atanh, torch.atanh, 0.45),
    "exp": (amath.exp, torch.exp, 0.8), "exp2": (amath.exp2, torch.exp2, 1.3),
    "expm1": (amath.expm1, torch.expm1, -0.2), "log": (amath.log, torch.log, 2.5),
    "log2": (amath.log2, torch.log2, 2.5), "log10": (amath.log10, torch.log10, 0.3),
    "log1p": (amath.log1p, torch.log1p, 0.6), "sqrt": (amath.sqrt, torch.sqrt, 1.9),
    "cbrt": (amath.cbrt, lambda x: x ** (1 / 3), 2.2), "fabs": (amath.fabs, torch.abs, -1.1),
    "erf": (amath.erf, torch.erf, 0.35), "erfc": (amath.erfc, torch.erfc, 0.35),
    "gamma": (amath.gamma, lambda x: torch.lgamma(x).exp(), 2.3),
    "lgamma": (amath.lgamma, torch.lgamma, 3.1),
    "degrees": (amath.degrees, torch.rad2deg, 0.4),
    "radians": (amath.radians, torch.deg2rad, 30.0),
}
BINARY = {
    "atan2": (amath.atan2, torch.atan2, (0.4, -1.2)),
    "hypot": (amath.hypot, torch.hypot, (0.4, -1.2)),
    "pow": (amath.pow, torch.pow, (1.7, 0.6)),
    "log_base": (amath.log, lambda x, b: torch.log(x) / torch.log(b), (5.0, 3.0)),
    "copysign": (amath.copysign, torch.copysign, (0.8, -2.0)),
}


def torch_grad(f, *xs):
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in xs]
    out = f(*ts)
    out.backward()
    return out.item(), [t.grad.item() if t.grad is not None else 0.0 for t in ts]


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_functions_match_torch_and_math(name):
    ours, theirs, x = UNARY[name]
    value, g = ad.value_and_grad(ours)(x)
    ref_value, (ref_g,) = torch_grad(theirs, x)
    assert value == pytest.approx(ref_value, rel=1e-13)
    assert g == pytest.approx(ref_g, rel=1e-12)
    plain = ours(x)                     # a real number gives math's float
    assert type(plain) is float and plain == pytest.approx(ref_value, rel=1e-13)
    ad.check_grads(ours, x)


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_functions_match_torch(name):
    ours, theirs, (x, y) = BINARY[name]
    value, grads = ad.value_and_grad(ours, argnums=(0, 1))(x, y)
    ref_value, ref_grads = torch_grad(theirs, x, y)
    assert value == pytest.approx(ref_value, rel=1e-13)
    assert list(grads) == pytest.approx(ref_grads, rel=1e-12, abs=1e-15)
    ad.check_grads(ours, x, y)
    # One operand a constant.
    assert ad.grad(lambda a: ours(a, y))(x) == pytest.approx(ref_grads[0], rel=1e-12)
    assert ad.grad(lambda b: ours(x, b))(y) == pytest.approx(ref_grads[1], rel=1e-12,
                                                             abs=1e-15)


def test_math_functions_refuse_a_recorded_scalar_instead_of_dropping_its_derivative():
    with pytest.raises(TypeError, match=r"float\(\) of a Scalar.*adtape\.math\.sin"):
        ad.grad(lambda x: math.sin(x))(0.3)
    with pytest.raises(TypeError, match="would drop its derivative"):
        ad.grad(lambda x: math.exp(x) * x)(0.3)
    # A constant Scalar has nothing to drop; the value is the explicit detach.
    assert float(Scalar(2.5)) == 2.5
    with ScalarTape() as st:
        x = st.variable(0.25)
        assert x.value == 0.25 and math.sin(x.value) == math.sin(0.25)


def test_comparisons_rounding_and_sums_of_scalars():
    def f(x, y):
        assert x < y and y > x and x <= x and not (x >= y) and x < 1
        assert math.floor(y) == 1 and math.ceil(x) == 1 and math.trunc(y) == 1
        assert amath.floor(x) == 0 and amath.isfinite(x) and not amath.isnan(y)
        assert amath.isclose(x, x)
        return amath.fsum([x, y, x * y]) + amath.prod([x, y]) + amath.dist([x, 0.0], [0.0, y])
    gx, gy = ad.grad(f, argnums=(0, 1))(0.3, 1.4)
    r = math.hypot(0.3, 1.4)
    assert gx == pytest.approx(1 + 1.4 + 1.4 + 0.3 / r, rel=1e-13)
    assert gy == pytest.approx(1 + 0.3 + 0.3 + 1.4 / r, rel=1e-13)
    assert amath.fsum([0.1] * 10) == 1.0        # math.fsum's exact sum for floats


def test_math_functions_on_tensors_go_to_adtape_numpy_and_differentiate_twice():
    f = lambda x: amath.sin(x) * amath.exp(x) + amath.atan2(x, 2.0)  # noqa: E731
    x = np.float64(0.6)
    d2 = ad.grad(ad.grad(f))(x)
    ref = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    out = torch.sin(ref) * torch.exp(ref) + torch.atan2(ref, torch.tensor(2.0))
    g, = torch.autograd.grad(out, ref, create_graph=True)
    g2, = torch.autograd.grad(g, ref)
    assert float(d2) == pytest.approx(g2.item(), rel=1e-12)
    with pytest.raises(NotImplementedError, match="erf of an array"):
        amath.erf(np.float64(0.5))


def test_scalar_mode_cannot_differentiate_twice_and_says_what_to_do():
    with pytest.raises(TypeError, match=r"scalar mode does not differentiate twice.*np\.float64"):
        ad.grad(ad.grad(lambda x: amath.sin(x)))(0.3)
    assert float(ad.grad(ad.grad(lambda x: amath.sin(x)))(np.float64(0.3))) == pytest.approx(
        -math.sin(0.3), rel=1e-14)
