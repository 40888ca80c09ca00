"""The ``math`` module's functions for scalar mode: ``import adtape.math as amath``.

Each function takes a ``Scalar`` (recorded on its ``ScalarTape``: one statement with
the partial derivatives), a Tensor or an array (``adtape.numpy``'s function, so a
0-d Tensor can be differentiated to any order), or a plain real number (the
``math`` module's result, a float).  ``math.sin(x)`` itself cannot record: it calls
``float(x)``, which raises TypeError for a recorded Scalar instead of dropping its
derivative.  Integer-valued functions (``floor``, ``ceil``, ``trunc``) return ints:
their derivative is zero wherever it exists.  Functions of integers (``factorial``,
``comb``, ``gcd``, ...) and predicates (``isnan``, ...) read values only.
"""
import math as _math

import numpy as np

from adtape.scalar import Scalar, atan2_, copysign_, hypot_
from adtape.tensor import Tensor

__all__ = ["sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh",
           "asinh", "acosh", "atanh", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p",
           "sqrt", "cbrt", "pow", "hypot", "fabs", "copysign", "erf", "erfc", "gamma",
           "lgamma", "degrees", "radians", "dist", "fsum", "prod", "sumprod", "floor", "ceil",
           "trunc", "isfinite", "isinf", "isnan", "isclose", "factorial", "comb", "perm",
           "gcd", "lcm", "isqrt", "pi", "e", "tau", "inf", "nan"]

pi, e, tau, inf, nan = _math.pi, _math.e, _math.tau, _math.inf, _math.nan
factorial, comb, perm, gcd, lcm, isqrt = (_math.factorial, _math.comb, _math.perm, _math.gcd,
                                          _math.lcm, _math.isqrt)


def _is_array(x):
    return type(x) is Tensor or isinstance(x, (np.ndarray, np.generic))


def _unary(name, numpy_name=None):
    """``math.<name>``: a Scalar's method, adtape.numpy's function, or math's."""
    math_fun = getattr(_math, name)

    def f(x):
        if type(x) is Scalar:
            return getattr(x, name)()
        if _is_array(x):
            from adtape import numpy as anp  # here: adtape.numpy imports this module
            if numpy_name is None:
                raise NotImplementedError(f"adtape.math.{name} of an array or Tensor: "
                                          f"adtape.numpy has no rule for it")
            return getattr(anp, numpy_name)(x)
        return math_fun(x)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"math.{name}, recorded for a Scalar (numpy.{numpy_name} for arrays)."
    return f


sin = _unary("sin", "sin")
cos = _unary("cos", "cos")
tan = _unary("tan", "tan")
asin = _unary("asin", "arcsin")
acos = _unary("acos", "arccos")
atan = _unary("atan", "arctan")
sinh = _unary("sinh", "sinh")
cosh = _unary("cosh", "cosh")
tanh = _unary("tanh", "tanh")
asinh = _unary("asinh", "arcsinh")
acosh = _unary("acosh", "arccosh")
atanh = _unary("atanh", "arctanh")
exp = _unary("exp", "exp")
exp2 = _unary("exp2", "exp2")
expm1 = _unary("expm1", "expm1")
log2 = _unary("log2", "log2")
log10 = _unary("log10", "log10")
log1p = _unary("log1p", "log1p")
sqrt = _unary("sqrt", "sqrt")
cbrt = _unary("cbrt", "cbrt")
fabs = _unary("fabs", "absolute")
erf = _unary("erf")
erfc = _unary("erfc")


def log(x, base=None):
    """``math.log(x[, base])``."""
    out = _unary_log(x)
    return out if base is None else out / _unary_log(base)


_unary_log = _unary("log", "log")


def _binary(name, scalar_fun, numpy_name):
    math_fun = getattr(_math, name)

    def f(x, y):
        if type(x) is Scalar or type(y) is Scalar:
            return scalar_fun(x, y)
        if _is_array(x) or _is_array(y):
            from adtape import numpy as anp  # here: adtape.numpy imports this module
            return getattr(anp, numpy_name)(x, y)
        return math_fun(x, y)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"math.{name}, recorded for Scalars (numpy.{numpy_name} for arrays)."
    return f


atan2 = _binary("atan2", atan2_, "arctan2")
hypot = _binary("hypot", hypot_, "hypot")


def copysign(x, y):
    """``|x|`` with the sign of ``y``."""
    if type(x) is Scalar or type(y) is Scalar:
        return copysign_(x, y)
    if _is_array(x) or _is_array(y):
        raise NotImplementedError("adtape.math.copysign of an array or Tensor: adtape.numpy "
                                  "has no rule for numpy.copysign")
    return _math.copysign(x, y)


def pow(x, y):
    """``x ** y`` as a float (``math.pow``)."""
    if type(x) is Scalar or type(y) is Scalar or _is_array(x) or _is_array(y):
        return x ** y
    return _math.pow(x, y)


def _digamma(x):
    from scipy.special import digamma
    return float(digamma(x))


def lgamma(x):
    """``log|Gamma(x)|``; its derivative is the digamma function."""
    if type(x) is Scalar:
        return x.apply(_math.lgamma(x.value), _digamma(x.value))
    if _is_array(x):
        raise NotImplementedError("adtape.math.lgamma of an array or Tensor: adtape.numpy "
                                  "has no rule for it")
    return _math.lgamma(x)


def gamma(x):
    """``Gamma(x)``; its derivative is ``Gamma(x) * digamma(x)``."""
    if type(x) is Scalar:
        v = _math.gamma(x.value)
        return x.apply(v, v * _digamma(x.value))
    if _is_array(x):
        raise NotImplementedError("adtape.math.gamma of an array or Tensor: adtape.numpy "
                                  "has no rule for it")
    return _math.gamma(x)


def degrees(x):
    return x * (180.0 / _math.pi)


def radians(x):
    return x * (_math.pi / 180.0)


def fsum(iterable):
    """The sum of the items (Scalars are added with their derivatives; floats exactly,
    as ``math.fsum``)."""
    items = list(iterable)
    if not any(type(v) is Scalar or _is_array(v) for v in items):
        return _math.fsum(items)
    total = 0.0
    for v in items:
        total = total + v
    return total


def prod(iterable, *, start=1):
    total = start
    for v in iterable:
        total = total * v
    return total


def sumprod(p, q):
    total = 0.0
    for a, b in zip(p, q, strict=True):
        total = total + a * b
    return total


def dist(p, q):
    """The Euclidean distance between two points given as sequences of coordinates."""
    if len(p) != len(q):
        raise ValueError("dist: both points must have the same number of dimensions")
    return sqrt(sumprod([a - b for a, b in zip(p, q)], [a - b for a, b in zip(p, q)]))


def _value(x):
    return x.value if type(x) is Scalar else x


def floor(x):
    return _math.floor(_value(x))


def ceil(x):
    return _math.ceil(_value(x))


def trunc(x):
    return _math.trunc(_value(x))


def isfinite(x):
    return _math.isfinite(_value(x))


def isinf(x):
    return _math.isinf(_value(x))


def isnan(x):
    return _math.isnan(_value(x))


def isclose(a, b, *, rel_tol=1e-09, abs_tol=0.0):
    return _math.isclose(_value(a), _value(b), rel_tol=rel_tol, abs_tol=abs_tol)
