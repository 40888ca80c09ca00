"""NumPy's names for the ops adtape can differentiate, and NumPy's protocols for Tensors.

``import adtape.numpy as anp`` (as ``autograd.numpy``) gives functions that take
arrays, Python numbers and Tensors and record like adtape's ops: ``anp.exp(x)``
is ``adtape.exp(x)``.  A NumPy name adtape has no derivative rule for raises
AttributeError naming it, so ``hasattr(anp, "sin")`` says whether adtape can
differentiate ``numpy.sin``.

The same table answers NumPy when it is handed a Tensor (``Tensor.__array_ufunc__``
and ``__array_function__``): ``np.exp(t)``, ``np.sum(t, axis=0)`` and
``ndarray * t`` record the adtape op.  Every other NumPy function, ufunc method
(``np.add.reduce``) or ufunc keyword (``out=``, ``where=``, ``dtype=``) raises
TypeError, for a Tensor that requires grad and a constant one alike, so a
program never loses a gradient silently and behaves the same with or without
grad.  ``np.asarray(t)`` is the explicit detach: it returns the data, and no
gradient flows through what is computed from it.
"""
import inspect

import numpy as np

from adtape import vjps as _ops
from adtape.tensor import Tensor, _constant

def _data(a):
    return a.data if type(a) is Tensor else a


def positive(x):
    """``+x``: a Tensor is returned as it is (there is nothing to record)."""
    return x if type(x) is Tensor else _constant(np.asarray(np.positive(x)))


# keepdims is keyword-only: NumPy's third and fourth positions are dtype and out.

def sum(a, axis=None, *, keepdims=False):
    return _ops.sum(a, axis, keepdims)


def mean(a, axis=None, *, keepdims=False):
    return _ops.mean(a, axis, keepdims)


def reshape(a, shape):
    return _ops.reshape(a, shape)


def transpose(a, axes=None):
    return _ops.transpose(a, axes)


def dot(a, b):
    """``numpy.dot`` of 1-d and 2-d operands, where it is ``matmul``."""
    a_ndim, b_ndim = np.ndim(_data(a)), np.ndim(_data(b))
    if a_ndim not in (1, 2) or b_ndim not in (1, 2):
        raise TypeError(f"dot of a {a_ndim}-d and a {b_ndim}-d operand: adtape has a rule for "
                        f"numpy.dot only with 1-d and 2-d operands (where it is matmul); use "
                        f"matmul, or multiply for a scalar operand")
    return _ops.matmul(a, b)


# These read only the shape: there is no value to differentiate.

def shape(a):
    return np.shape(_data(a))


def ndim(a):
    return np.ndim(_data(a))


def size(a, axis=None):
    return np.size(_data(a), axis)


# NumPy name -> adtape function with NumPy's signature (the part of it adtape supports).
# A ufunc is recorded when NumPy calls it on a Tensor with positional operands only;
# any other NumPy function is handed its arguments as the caller wrote them.
_FUNCTIONS = {
    "add": _ops.add,
    "subtract": _ops.sub,
    "multiply": _ops.mul,
    "divide": _ops.div,
    "true_divide": _ops.div,
    "negative": _ops.neg,
    "positive": positive,
    "power": _ops.power,
    "matmul": _ops.matmul,
    "exp": _ops.exp,
    "log": _ops.log,
    "tanh": _ops.tanh,
    "sum": sum,
    "mean": mean,
    "reshape": reshape,
    "transpose": transpose,
    "dot": dot,
    "shape": shape,
    "ndim": ndim,
    "size": size,
}
globals().update(_FUNCTIONS)
__all__ = list(_FUNCTIONS)

_UFUNCS = {}            # numpy ufunc -> adtape function
_ARRAY_FUNCTIONS = {}   # numpy function -> (adtape function, its signature)
for _name, _fun in _FUNCTIONS.items():
    _np_fun = getattr(np, _name)
    if isinstance(_np_fun, np.ufunc):
        _UFUNCS[_np_fun] = _fun
    else:
        _ARRAY_FUNCTIONS[_np_fun] = (_fun, inspect.signature(_fun))
del _name, _fun, _np_fun


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(f"module 'adtape.numpy' has no attribute {name!r}")
    if hasattr(np, name):
        raise AttributeError(f"adtape.numpy has no {name!r}: adtape has no derivative rule for "
                             f"numpy.{name} yet (np.{name}(np.asarray(tensor)) computes it as "
                             f"a constant, if that is what is meant)")
    raise AttributeError(f"module 'adtape.numpy' has no attribute {name!r} (nor has numpy)")


def _lost_gradient(what, reason="adtape has no rule recorded for it"):
    return TypeError(f"{what} on an adtape Tensor: {reason}, so the gradient would be lost; "
                     f"use adtape.numpy's functions where they exist, or detach explicitly "
                     f"with np.asarray(tensor)")


def _ufunc_name(ufunc):
    name = ufunc.__name__
    return f"numpy.{name}" if getattr(np, name, None) is ufunc else f"the ufunc {name!r}"


def _array_ufunc(ufunc, method, inputs, kwargs):
    """``Tensor.__array_ufunc__``: record the ufunc's adtape op, or raise TypeError."""
    if method != "__call__":
        raise _lost_gradient(f"{_ufunc_name(ufunc)}.{method}")
    fun = _UFUNCS.get(ufunc)
    if fun is None:
        raise _lost_gradient(_ufunc_name(ufunc))
    if kwargs:
        name = _ufunc_name(ufunc)
        raise _lost_gradient(f"{name} with {', '.join(k + '=' for k in kwargs)}",
                             f"adtape records {name} only as a plain call on its operands "
                             f"(no out=, where=, dtype=, casting=...)")
    return fun(*inputs)


def _array_function(func, args, kwargs):
    """``Tensor.__array_function__``: record the function's adtape op, or raise TypeError."""
    entry = _ARRAY_FUNCTIONS.get(func)
    name = f"{getattr(func, '__module__', None) or 'numpy'}.{func.__name__}"
    if entry is None:
        raise _lost_gradient(name)
    fun, signature = entry
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        unknown = [k + "=" for k in kwargs if k not in signature.parameters]
        raise _lost_gradient(f"{name} with {', '.join(unknown) or 'these arguments'}",
                             f"adtape.numpy.{func.__name__} takes {signature}"
                             + ("" if unknown else f" ({exc})")) from None
    return fun(*args, **kwargs)
