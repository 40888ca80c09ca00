"""scipy.special's functions, recorded: ``import adtape.scipy.special as asp``, as
``autograd.scipy.special``.

Each takes arrays, Python numbers and Tensors, broadcasts like SciPy and records onto
the current ``OpTape``, as adtape.numpy's functions do.  ``logsumexp``, ``softmax`` and
``log_softmax`` are adtape.numpy's (with SciPy's signatures: ``axis=None`` is the whole
array); the others are primitives of this table, their values SciPy's.  Their rules call
SciPy's ufuncs, which record when handed Tensors (below), so every function here can be
differentiated to any order, in reverse and forward mode.

scipy.special's ufuncs called on a Tensor (``scipy.special.erf(t)``) record the function
of this table through NumPy's ``__array_ufunc__``, as ``np.sin(t)`` does; another of its
ufuncs raises TypeError.  Its Python functions (``scipy.special.logsumexp(t)``) convert
their arguments with ``np.asarray``, which raises TypeError for a recorded Tensor
instead of losing the gradient: call this module's function instead.
"""
import math
import operator

import numpy as np
import scipy.special as _sp

from adtape import math as _amath
from adtape import numpy as _anp
from adtape.numpy._vjps import _primitive
from adtape.scalar import Scalar
from adtape.tensor import Tensor, defvjp

__all__ = ["logsumexp", "softmax", "log_softmax", "expit", "logit", "erf", "erfc", "gamma",
           "gammaln", "digamma", "psi", "polygamma", "xlogy", "xlog1py"]

def _def(name, argnames, fun, *pullbacks, saves="operands"):
    prim = _primitive(name, argnames, fun, saves)
    return defvjp(prim, *pullbacks, differentiable=True)


def _polygamma(n, x):
    """``scipy.special.polygamma(n, x)``: recorded for a Tensor ``x`` (a rule's operand in
    a sweep that records), SciPy's array otherwise (SciPy's polygamma is no ufunc)."""
    return POLYGAMMA(x, n=n) if type(x) is Tensor else _sp.polygamma(n, x)


# -- the derivative table -------------------------------------------------------------

ERF = _def("erf", ("x",), _sp.erf,
           lambda g, ans, x: g * (2 / math.sqrt(math.pi)) * np.exp(-x * x))
ERFC = _def("erfc", ("x",), _sp.erfc,
            lambda g, ans, x: -g * (2 / math.sqrt(math.pi)) * np.exp(-x * x))
GAMMA = _def("gamma", ("x",), _sp.gamma, lambda g, ans, x: g * ans * _sp.psi(x), saves="both")
GAMMALN = _def("gammaln", ("x",), _sp.gammaln, lambda g, ans, x: g * _sp.psi(x))
DIGAMMA = _def("digamma", ("x",), _sp.psi, lambda g, ans, x: g * _polygamma(1, x))
POLYGAMMA = _def("polygamma", ("x",), lambda x, n: _sp.polygamma(n, x),
                 lambda g, ans, x, n: g * _polygamma(n + 1, x))
EXPIT = _def("expit", ("x",), _sp.expit, lambda g, ans, x: g * ans * (1 - ans), saves="ans")
LOGIT = _def("logit", ("x",), _sp.logit, lambda g, ans, x: g / (x * (1 - x)))
XLOGY = _def("xlogy", ("x", "y"), _sp.xlogy,
             lambda g, ans, x, y: g * np.log(y), lambda g, ans, x, y: g * x / y)
XLOG1PY = _def("xlog1py", ("x", "y"), _sp.xlog1py,
               lambda g, ans, x, y: g * np.log1p(y), lambda g, ans, x, y: g * x / (1 + y))


# -- the functions ----------------------------------------------------------------------

def _unary(prim, scalar_fun=None):
    """The function of a unary primitive; a Scalar (scalar mode) goes to adtape.math's
    ``scalar_fun`` where it has one."""
    def f(x):
        if type(x) is Scalar:
            if scalar_fun is None:
                raise NotImplementedError(
                    f"adtape.scipy.special.{prim.name} of a Scalar: scalar mode has no rule "
                    f"for it; call the transform with a 0-d float64 array for tensor mode")
            return scalar_fun(x)
        return prim(x)
    f.__name__ = f.__qualname__ = prim.name
    f.__doc__ = f"scipy.special.{prim.name}, recorded (rule in adtape.scipy.special)."
    return f


erf = _unary(ERF, _amath.erf)
erfc = _unary(ERFC, _amath.erfc)
gamma = _unary(GAMMA, _amath.gamma)
gammaln = _unary(GAMMALN, _amath.lgamma)
digamma = _unary(DIGAMMA)
psi = digamma
expit = _unary(EXPIT)
logit = _unary(LOGIT)


def polygamma(n, x):
    """``scipy.special.polygamma(n, x)`` for an integer order ``n`` (not differentiated)."""
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"adtape.scipy.special.polygamma takes an integer order n, got "
                        f"{n!r}") from None
    if n < 0:
        raise ValueError(f"polygamma: the order n must be >= 0, got {n}")
    return POLYGAMMA(x, n=n)


def xlogy(x, y):
    """``x * log(y)``, 0 where ``x == 0`` (scipy.special.xlogy), recorded."""
    return XLOGY(x, y)


def xlog1py(x, y):
    """``x * log1p(y)``, 0 where ``x == 0`` (scipy.special.xlog1py), recorded."""
    return XLOG1PY(x, y)


def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
    """``log(sum(b * exp(a), axis))`` computed stably, as ``scipy.special.logsumexp``.

    Without ``b`` it is adtape.numpy's ``logsumexp``.  With ``b`` (which may be a Tensor,
    and negative) the sum is shifted by the largest ``a`` (a constant) and logged; with
    ``return_sign`` the result is ``(log|sum|, sign of the sum)``, the sign an array."""
    if b is None and not return_sign:
        return _anp.logsumexp(a, axis=axis, keepdims=keepdims)
    a_data = np.asarray(a.data if type(a) is Tensor else a)
    if b is not None:
        b_shape = np.shape(b.data if type(b) is Tensor else b)
        a_data = np.broadcast_to(a_data, np.broadcast_shapes(a_data.shape, b_shape))
    top = np.max(a_data, axis=axis, keepdims=True) if a_data.size else np.zeros(())
    top = np.where(np.isfinite(top), top, 0.0)
    terms = _anp.exp(_anp.subtract(a, top))
    total = _anp.sum(terms if b is None else _anp.multiply(b, terms), axis=axis, keepdims=True)
    sign = np.sign(total.data)
    out = _anp.add(_anp.log(_anp.absolute(total) if return_sign else total), top)
    if not keepdims:
        axes = tuple(range(out.ndim)) if axis is None else axis
        out = _anp.squeeze(out, axis=axes)
        sign = np.squeeze(sign, axis=axes)
    return (out, sign) if return_sign else out


def softmax(x, axis=None):
    """``exp(x) / sum(exp(x), axis)``, as ``scipy.special.softmax`` (``axis=None``: over
    the whole array); adtape.numpy's ``softmax``."""
    return _anp.softmax(x, axis=axis)


def log_softmax(x, axis=None):
    """``x - logsumexp(x, axis)``, as ``scipy.special.log_softmax``; adtape.numpy's."""
    return _anp.log_softmax(x, axis=axis)


# scipy.special's ufuncs that record when NumPy hands them a Tensor (adtape.numpy's
# __array_ufunc__ looks them up here).
UFUNCS = {_sp.erf: erf, _sp.erfc: erfc, _sp.gamma: gamma, _sp.gammaln: gammaln,
          _sp.psi: digamma, _sp.expit: expit, _sp.logit: logit, _sp.xlogy: xlogy,
          _sp.xlog1py: xlog1py}
