"""NumPy's protocols for Tensors: NumPy hands a Tensor to adtape.numpy's table.

``Tensor.__array_ufunc__`` and ``__array_function__`` (assigned in ``adtape._operators``)
are ``array_ufunc`` and ``array_function`` below: ``np.sin(t)``, ``np.sum(t, axis=0)``
and ``ndarray * t`` record the adtape op, and scipy.special's ufuncs
(``scipy.special.erf(t)``) adtape.scipy.special's.  Every other NumPy function,
ufunc, ufunc method (``np.add.reduce``) or ufunc keyword (``out=``, ``where=``,
``dtype=``) raises TypeError, for a Tensor that requires grad and a constant one
alike, so a program never loses a gradient silently and behaves the same with or
without grad.  ``np.asarray(t)`` is the explicit detach: it returns the data, and
no gradient flows through what is computed from it (the other conversions of a
recorded Tensor raise: see ``Tensor.__array__`` and ``Tensor.__float__``).
"""
import inspect
import sys

import numpy as np

from adtape.numpy import _FUNCTIONS, _LINALG


def _dispatch_tables(functions):
    """NumPy's ufunc -> adtape function, and NumPy's other function -> (adtape function,
    its signature), for the NumPy names (``"linalg.solve"``) of ``functions``."""
    ufuncs, array_functions = {}, {}
    for name, fun in functions.items():
        np_fun = np
        for part in name.split("."):
            np_fun = getattr(np_fun, part)
        if isinstance(np_fun, np.ufunc):
            ufuncs[np_fun] = fun
        else:
            array_functions[np_fun] = (fun, inspect.signature(fun))
    return ufuncs, array_functions


_UFUNCS, _ARRAY_FUNCTIONS = _dispatch_tables({**_FUNCTIONS, **_LINALG})


def _lost_gradient(what, reason="adtape has no rule recorded for it"):
    return TypeError(f"{what} on an adtape Tensor: {reason}, so the gradient would be lost; "
                     f"use adtape.numpy's (or adtape.scipy.special's) functions where they "
                     f"exist, or detach explicitly with np.asarray(tensor)")


def _ufunc_name(ufunc):
    name = ufunc.__name__
    if getattr(np, name, None) is ufunc:
        return f"numpy.{name}"
    special = sys.modules.get("scipy.special")
    if special is not None and getattr(special, name, None) is ufunc:
        return f"scipy.special.{name}"
    return f"the ufunc {name!r}"


def _scipy_special_ufunc(ufunc):
    """adtape.scipy.special's function for one of scipy.special's ufuncs, or None
    (imported on first use: adtape.numpy does not load SciPy's special functions)."""
    from adtape.scipy import special
    return special.UFUNCS.get(ufunc)


def array_ufunc(self, ufunc, method, *inputs, **kwargs):
    """``Tensor.__array_ufunc__``: record the ufunc's adtape op, or raise TypeError."""
    if method != "__call__":
        raise _lost_gradient(f"{_ufunc_name(ufunc)}.{method}")
    fun = _UFUNCS.get(ufunc) or _scipy_special_ufunc(ufunc)
    if fun is None:
        raise _lost_gradient(_ufunc_name(ufunc))
    if kwargs:
        name = _ufunc_name(ufunc)
        raise _lost_gradient(f"{name} with {', '.join(k + '=' for k in kwargs)}",
                             f"adtape records {name} only as a plain call on its operands "
                             f"(no out=, where=, dtype=, casting=...)")
    return fun(*inputs)


def array_function(self, func, types, args, kwargs):
    """``Tensor.__array_function__``: record the function's adtape op, or raise TypeError."""
    entry = _ARRAY_FUNCTIONS.get(func)
    module = getattr(func, "__module__", None) or "numpy"
    name = f"{'numpy.linalg' if module.startswith('numpy.linalg') else module}.{func.__name__}"
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
