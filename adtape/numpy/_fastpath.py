"""How adtape.numpy's functions call the primitives of the derivative table
(``adtape.numpy._vjps``): a Tensor operand takes a fast path that runs the NumPy
function and records a node saving only what the rule reads; any other operand goes
through the primitive, and a ``Scalar`` to scalar mode (``adtape.math``)."""
import types

import numpy as np

from adtape import math as _math
from adtape.numpy import _vjps as _t
from adtape.scalar import Scalar
from adtape.tensor import Tensor, _constant, _record, _state

_ndarray = np.ndarray


def _data(a):
    return a.data if type(a) is Tensor else a



def _fast_unary(prim):
    """``prim(x, **static)`` with a fast path for a Tensor ``x``: the NumPy function, and a
    node saving what the rule reads."""
    fun, saves = _t.SPEC[prim.name]
    save_ans = saves in ("ans", "both")
    save_x = saves in ("operands", "both")

    def call(x, **static):
        if type(x) is not Tensor:
            return prim(x, **static)
        out = fun(x.data, **static)
        if type(out) is not _ndarray:
            out = np.asarray(out)
        if x.requires_grad and _state.enabled:
            return _record(prim, out, (x,), (out if save_ans else None,
                                             x if save_x else None), static)
        return _constant(out)
    call.__name__ = call.__qualname__ = prim.name
    return call


_fast = types.SimpleNamespace(**{name: _fast_unary(getattr(_t, name)) for name in (
    "SIGMOID", "NAN_TO_NUM", "ROUND", "PROD", "MAX", "MIN", "VAR", "LOGSUMEXP", "CUMSUM",
    "CUMPROD", "SOFTMAX", "LOG_SOFTMAX", "BROADCAST_TO", "ROLL", "PAD", "TILE", "TRIL", "TRIU",
    "DIAGONAL", "INV", "DET", "LOGABSDET", "CHOLESKY", "EIGH", "SVD", "NORM2")})


def _elementwise(prim, scalar_name=None):
    """The adtape.numpy function of a unary primitive: a Tensor takes a fast path that
    records what the rule reads; a Scalar goes to scalar mode."""
    fun, saves = _t.SPEC[prim.name]
    save_ans = saves in ("ans", "both")
    save_x = saves in ("operands", "both")

    def f(x):
        if type(x) is Tensor:
            out = fun(x.data)
            if type(out) is not _ndarray:
                out = np.asarray(out)
            if x.requires_grad and _state.enabled:
                return _record(prim, out, (x,), (out if save_ans else None,
                                                 x if save_x else None), None)
            return _constant(out)
        if type(x) is Scalar:
            return getattr(_math, scalar_name or prim.name)(x)
        return prim(x)
    f.__name__ = f.__qualname__ = prim.name
    f.__doc__ = f"numpy.{prim.name}, recorded (rule in adtape.numpy._vjps)."
    return f


def _by_reference(a):
    """A residual operand: an ndarray constant is kept by reference (as a constant
    Tensor), not copied onto the tape."""
    return _constant(a) if type(a) is _ndarray else a


def _binary(prim, doc=""):
    """The adtape.numpy function of a binary (broadcasting) primitive, with a fast path
    for Tensor operands."""
    fun, saves = _t.SPEC[prim.name]
    save_ans = saves in ("ans", "both")
    save_x = saves in ("operands", "both")

    def f(x1, x2):
        t1 = type(x1) is Tensor
        t2 = type(x2) is Tensor
        if not (t1 or t2):
            return prim(x1, x2)
        xd = x1.data if t1 else x1
        yd = x2.data if t2 else x2
        out = fun(xd, yd)
        if type(out) is not _ndarray:
            out = np.asarray(out)
        if _state.enabled and ((t1 and x1.requires_grad) or (t2 and x2.requires_grad)):
            return _record(prim, out, (x1, x2), (out if save_ans else None,
                                                 _by_reference(x1) if save_x else None,
                                                 _by_reference(x2) if save_x else None), None)
        return _constant(out)
    f.__name__ = f.__qualname__ = prim.name
    f.__doc__ = doc or f"numpy.{prim.name}, recorded (rule in adtape.numpy._vjps)."
    return f
