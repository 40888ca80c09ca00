"""NumPy's names for the functions adtape can differentiate.

``import adtape.numpy as anp`` (as ``autograd.numpy``) gives functions that take
arrays, Python numbers and Tensors, broadcast like NumPy, keep float32/float64
and record onto the current ``OpTape``: ``anp.sin(x)``, ``anp.linalg.solve(a, b)``.
Each is a primitive of the derivative table (``adtape.numpy._vjps``, the built-in
ops of ``adtape.vjps``) or a composition of them; the rules can themselves be
differentiated, so ``grad`` of ``grad``, ``hessian`` and ``jvp`` work through all
of them.  A NumPy name adtape has no derivative rule for raises AttributeError
naming it, so ``hasattr(anp, "gradient")`` says whether adtape can differentiate
``numpy.gradient``; a supported function called with options it has no rule for
(``pad`` with ``mode="reflect"``, ``einsum`` with ``...``) raises
NotImplementedError naming them.  Comparisons (``x > 0``, ``np.less``, ``isnan``)
give boolean arrays of the values: they are piecewise constant, nothing to lose.

The same table answers NumPy when it is handed a Tensor (``adtape.numpy._protocol``):
``np.sin(t)`` records ``anp.sin(t)``, and what has no rule raises TypeError.

This module is the namespace; the functions are in ``_elementwise``, ``_reductions``,
``_shapes``, ``_products``, ``_constructors`` and ``linalg``, written over
``_fastpath`` (how they call the table's primitives).
"""
import numpy as np

from adtape import vjps as _ops
from adtape.numpy import linalg
from adtape.numpy._constructors import (
    argmax, argmin, argsort, array, asarray, full, full_like, ndim, ones_like, shape, size,
    zeros_like)
from adtape.numpy._elementwise import (
    absolute, arccos, arccosh, arcsin, arcsinh, arctan, arctan2, arctanh, around, cbrt, ceil,
    clip, copysign, cos, cosh, deg2rad, degrees, exp2, expm1, floor, fmax, fmin, fmod,
    greater, greater_equal, hypot, isfinite, isinf, isnan, ldexp, less, less_equal, log10,
    log1p, log2, logaddexp, logaddexp2, maximum, minimum, mod, nan_to_num, positive, rad2deg,
    radians, reciprocal, remainder, rint, round, select, sigmoid, sign, sin, sinc, sinh, sqrt,
    square, tan, trunc, where)
from adtape.numpy._products import dot, einsum, inner, kron, matmul, outer, tensordot, vdot
from adtape.numpy._reductions import (
    amax, amin, cumprod, cumsum, log_softmax, logsumexp, max, mean, min, nanmax, nanmean,
    nanmin, nanprod, nanstd, nansum, nanvar, prod, softmax, std, sum, var)
from adtape.numpy._shapes import (
    array_split, atleast_1d, atleast_2d, atleast_3d, broadcast_to, column_stack, concatenate,
    cross, diag, diagonal, diff, dstack, expand_dims, flip, fliplr, flipud, hstack, moveaxis,
    pad, partition, ravel, repeat, reshape, roll, rollaxis, rot90, sort, split, squeeze,
    stack, swapaxes, take, take_along_axis, tile, trace, transpose, tril, triu, vstack)

_CONSTANTS = {name: getattr(np, name) for name in (
    "pi", "e", "inf", "nan", "newaxis", "float32", "float64", "int32", "int64", "bool_",
    "ndarray", "zeros", "ones", "empty", "eye", "identity", "arange", "linspace")}
globals().update(_CONSTANTS)


# NumPy name -> adtape function with NumPy's signature (the part of it adtape supports).
# A ufunc is recorded when NumPy calls it on a Tensor with positional operands only;
# any other NumPy function is handed its arguments as the caller wrote them.
_FUNCTIONS = {
    "add": _ops.add, "subtract": _ops.sub, "multiply": _ops.mul, "divide": _ops.div,
    "true_divide": _ops.div, "negative": _ops.neg, "positive": positive,
    "power": _ops.power, "matmul": matmul, "exp": _ops.exp, "log": _ops.log,
    "tanh": _ops.tanh,
    "sin": sin, "cos": cos, "tan": tan, "arcsin": arcsin, "arccos": arccos, "arctan": arctan,
    "sinh": sinh, "cosh": cosh, "arcsinh": arcsinh, "arccosh": arccosh, "arctanh": arctanh,
    "sqrt": sqrt, "cbrt": cbrt, "square": square, "absolute": absolute, "abs": absolute,
    "reciprocal": reciprocal, "exp2": exp2, "expm1": expm1, "log2": log2, "log10": log10,
    "log1p": log1p, "sign": sign, "floor": floor, "ceil": ceil, "rint": rint, "trunc": trunc,
    "arctan2": arctan2, "hypot": hypot, "logaddexp": logaddexp, "logaddexp2": logaddexp2,
    "maximum": maximum, "minimum": minimum, "clip": clip, "where": where, "round": round,
    "around": around, "fmax": fmax, "fmin": fmin, "remainder": remainder, "mod": mod,
    "fmod": fmod, "sinc": sinc, "copysign": copysign, "nansum": nansum, "nanprod": nanprod,
    "nanmean": nanmean, "nanmax": nanmax, "nanmin": nanmin, "nanvar": nanvar,
    "nanstd": nanstd, "partition": partition, "degrees": degrees, "radians": radians, "rad2deg": rad2deg,
    "deg2rad": deg2rad, "nan_to_num": nan_to_num, "ldexp": ldexp, "select": select,
    "sum": sum, "mean": mean, "prod": prod, "max": max, "min": min, "amax": amax,
    "amin": amin, "var": var, "std": std, "cumsum": cumsum, "cumprod": cumprod,
    "reshape": reshape, "ravel": ravel, "transpose": transpose, "expand_dims": expand_dims,
    "squeeze": squeeze, "broadcast_to": broadcast_to, "swapaxes": swapaxes,
    "moveaxis": moveaxis, "flip": flip, "roll": roll, "pad": pad,
    "concatenate": concatenate, "stack": stack, "hstack": hstack, "vstack": vstack,
    "atleast_1d": atleast_1d, "atleast_2d": atleast_2d, "split": split,
    "array_split": array_split, "tile": tile, "repeat": repeat, "take": take,
    "take_along_axis": take_along_axis, "tril": tril, "triu": triu, "diagonal": diagonal,
    "trace": trace, "flipud": flipud, "fliplr": fliplr, "rot90": rot90, "rollaxis": rollaxis,
    "atleast_3d": atleast_3d, "dstack": dstack, "column_stack": column_stack, "diff": diff,
    "sort": sort, "cross": cross, "diag": diag,
    "dot": dot, "vdot": vdot, "inner": inner, "outer": outer, "tensordot": tensordot,
    "kron": kron, "einsum": einsum,
    "shape": shape, "ndim": ndim, "size": size, "zeros_like": zeros_like,
    "ones_like": ones_like, "full_like": full_like, "full": full, "argmax": argmax,
    "argmin": argmin, "less": less, "less_equal": less_equal, "greater": greater,
    "greater_equal": greater_equal, "isnan": isnan, "isfinite": isfinite, "isinf": isinf,
    "argsort": argsort,
}
_LINALG = {f"linalg.{name}": getattr(linalg, name) for name in linalg.__all__}
# Not NumPy's dispatched functions: scipy.special's and adtape.nn's names, and array/asarray
# (NumPy hands a Tensor to them as data: np.asarray(tensor) is the explicit detach).
_EXTRA = {"logsumexp": logsumexp, "softmax": softmax, "log_softmax": log_softmax,
          "sigmoid": sigmoid, "array": array, "asarray": asarray}
globals().update(_FUNCTIONS)
__all__ = sorted(set(_FUNCTIONS) | set(_EXTRA) | set(_CONSTANTS) | {"linalg"})


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(f"module 'adtape.numpy' has no attribute {name!r}")
    if hasattr(np, name):
        raise AttributeError(f"adtape.numpy has no {name!r}: adtape has no derivative rule for "
                             f"numpy.{name} yet (np.{name}(np.asarray(tensor)) computes it as "
                             f"a constant, if that is what is meant)")
    raise AttributeError(f"module 'adtape.numpy' has no attribute {name!r} (nor has numpy)")
