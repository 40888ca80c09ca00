"""NumPy's names for the functions adtape can differentiate, and NumPy's protocols for Tensors.

``import adtape.numpy as anp`` (as ``autograd.numpy``) gives functions that take
arrays, Python numbers and Tensors, broadcast like NumPy, keep float32/float64
and record onto the current ``OpTape``: ``anp.sin(x)``, ``anp.linalg.solve(a, b)``.
Each is a primitive of the derivative table (``adtape.numpy_vjps``, the built-in
ops of ``adtape.vjps``) or a composition of them; the rules can themselves be
differentiated, so ``grad`` of ``grad``, ``hessian`` and ``jvp`` work through all
of them.  A NumPy name adtape has no derivative rule for raises AttributeError
naming it, so ``hasattr(anp, "gradient")`` says whether adtape can differentiate
``numpy.gradient``; a supported function called with options it has no rule for
(``pad`` with ``mode="reflect"``, ``einsum`` with ``...``) raises
NotImplementedError naming them.  Comparisons (``x > 0``, ``np.less``, ``isnan``)
give boolean arrays of the values: they are piecewise constant, nothing to lose.

The same table answers NumPy when it is handed a Tensor (``Tensor.__array_ufunc__``
and ``__array_function__``): ``np.sin(t)``, ``np.sum(t, axis=0)`` and
``ndarray * t`` record the adtape op, and scipy.special's ufuncs
(``scipy.special.erf(t)``) adtape.scipy.special's.  Every other NumPy function,
ufunc, ufunc method (``np.add.reduce``) or ufunc keyword (``out=``, ``where=``,
``dtype=``) raises TypeError, for a Tensor that requires grad and a constant one
alike, so a program never loses a gradient silently and behaves the same with or
without grad.  ``np.asarray(t)`` is the explicit detach: it returns the data, and
no gradient flows through what is computed from it (the other conversions of a
recorded Tensor raise: see ``Tensor.__array__`` and ``Tensor.__float__``).
"""
import builtins
import inspect
import math
import sys
import types

import numpy as np

from adtape import numpy_vjps as _t
from adtape import vjps as _ops
from adtape.scalar import Scalar
from adtape.tensor import Tensor, _constant, _record, _state

_ndarray = np.ndarray


def _data(a):
    return a.data if type(a) is Tensor else a


def positive(x):
    """``+x``: a Tensor is returned as it is (there is nothing to record)."""
    return x if type(x) is Tensor else _constant(np.asarray(np.positive(x)))


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
            from adtape import math as _math
            return getattr(_math, scalar_name or prim.name)(x)
        return prim(x)
    f.__name__ = f.__qualname__ = prim.name
    f.__doc__ = f"numpy.{prim.name}, recorded (rule in adtape.numpy_vjps)."
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
    f.__doc__ = doc or f"numpy.{prim.name}, recorded (rule in adtape.numpy_vjps)."
    return f


sin = _elementwise(_t.SIN)
cos = _elementwise(_t.COS)
tan = _elementwise(_t.TAN)
arcsin = _elementwise(_t.ARCSIN, "asin")
arccos = _elementwise(_t.ARCCOS, "acos")
arctan = _elementwise(_t.ARCTAN, "atan")
sinh = _elementwise(_t.SINH)
cosh = _elementwise(_t.COSH)
arcsinh = _elementwise(_t.ARCSINH, "asinh")
arccosh = _elementwise(_t.ARCCOSH, "acosh")
arctanh = _elementwise(_t.ARCTANH, "atanh")
sqrt = _elementwise(_t.SQRT)
cbrt = _elementwise(_t.CBRT)
square = _elementwise(_t.SQUARE)
absolute = _elementwise(_t.ABS, "fabs")
abs = absolute
reciprocal = _elementwise(_t.RECIPROCAL)
exp2 = _elementwise(_t.EXP2)
expm1 = _elementwise(_t.EXPM1)
log2 = _elementwise(_t.LOG2)
log10 = _elementwise(_t.LOG10)
log1p = _elementwise(_t.LOG1P)
sign = _elementwise(_t.SIGN)
floor = _elementwise(_t.FLOOR)
ceil = _elementwise(_t.CEIL)
rint = _elementwise(_t.RINT)
trunc = _elementwise(_t.TRUNC)


def sigmoid(x):
    """``1 / (1 + exp(-x))`` (not a NumPy name; as ``scipy.special.expit``)."""
    return _fast.SIGMOID(x)


arctan2 = _binary(_t.ARCTAN2)
hypot = _binary(_t.HYPOT)
logaddexp = _binary(_t.LOGADDEXP)
logaddexp2 = _binary(_t.LOGADDEXP2)
maximum = _binary(_t.MAXIMUM, "Elementwise maximum; on a tie each operand gets half the "
                              "gradient (as autograd).")
minimum = _binary(_t.MINIMUM, "Elementwise minimum; on a tie each operand gets half the "
                              "gradient (as autograd).")


fmax = _binary(_t.FMAX, "Elementwise maximum ignoring NaN; ties split the gradient.")
fmin = _binary(_t.FMIN, "Elementwise minimum ignoring NaN; ties split the gradient.")
remainder = _binary(_t.MOD)
mod = remainder
fmod = _binary(_t.FMOD)
sinc = _elementwise(_t.SINC)
copysign = _binary(_t.COPYSIGN, "``|x1|`` with the sign of ``x2`` (no gradient to ``x2``).")


def degrees(x):
    return _ops.mul(x, 180.0 / np.pi)


def radians(x):
    return _ops.mul(x, np.pi / 180.0)


rad2deg = degrees
deg2rad = radians


def nan_to_num(x, copy=True, nan=0.0, posinf=None, neginf=None):
    """NaN and infinities replaced; their elements get no gradient."""
    return _fast.NAN_TO_NUM(x, nan=nan, posinf=posinf, neginf=neginf)


def ldexp(x1, x2):
    """``x1 * 2**x2`` for integer ``x2`` (not differentiated)."""
    x2 = np.asarray(_data(x2))
    if x2.dtype.kind not in "iu":
        raise TypeError(f"ldexp: the exponent must be integers, got {x2.dtype}")
    scale = np.ldexp(np.ones((), np.asarray(_data(x1)).dtype), x2)
    return _ops.mul(x1, scale)


def select(condlist, choicelist, default=0):
    if len(condlist) != len(choicelist):
        raise ValueError("select: list of cases must be same length as list of conditions")
    out = default
    for cond, choice in zip(reversed(condlist), reversed(choicelist)):
        out = where(cond, choice, out)
    return out


def clip(a, a_min=None, a_max=None):
    """``numpy.clip``; the bounds may be arrays or Tensors too (they get the gradient
    where they are the result)."""
    if a_min is None and a_max is None:
        raise ValueError("clip: give a_min or a_max (or both)")
    if (type(a) is Tensor and isinstance(a_min, (float, int, type(None)))
            and isinstance(a_max, (float, int, type(None)))):
        # Scalar bounds: two ufuncs (np.clip's Python layers cost more at small sizes).
        out = a.data
        if a_min is not None:
            out = np.maximum(out, a_min)
        if a_max is not None:
            out = np.minimum(out, a_max)
        if type(out) is not _ndarray:
            out = np.asarray(out)
        if a.requires_grad and _state.enabled:
            return _record(_t.CLIP, out, (a, a_min, a_max), (None, a, a_min, a_max), None)
        return _constant(out)
    return _t.CLIP(a, a_min, a_max)


def where(condition, x=None, y=None):
    """``numpy.where(condition, x, y)``; ``condition`` is not differentiated."""
    if x is None or y is None:
        raise TypeError("where: adtape differentiates where(condition, x, y); the one-argument "
                        "form returns indices (np.nonzero)")
    condition = np.asarray(_data(condition), dtype=bool)
    tx, ty = type(x) is Tensor, type(y) is Tensor
    if tx or ty:
        out = np.where(condition, x.data if tx else x, y.data if ty else y)
        if _state.enabled and ((tx and x.requires_grad) or (ty and y.requires_grad)):
            return _record(_t.WHERE, out, (x, y), (None, None, None),
                           {"condition": condition})
        return _constant(out)
    return _t.WHERE(x, y, condition=condition)


def round(a, decimals=0):
    return _fast.ROUND(a, decimals=decimals)


around = round


# -- reductions (keepdims is keyword-only: NumPy's third and fourth positions are dtype
# and out) -------------------------------------------------------------------------

def _axis(axis):
    return tuple(axis) if isinstance(axis, list) else axis


def sum(a, axis=None, *, keepdims=False):
    return _ops.sum(a, _axis(axis), keepdims)


def mean(a, axis=None, *, keepdims=False):
    return _ops.mean(a, _axis(axis), keepdims)


def prod(a, axis=None, *, keepdims=False):
    return _fast.PROD(a, axis=_axis(axis), keepdims=keepdims)


def max(a, axis=None, *, keepdims=False):
    """``numpy.max``; tied maxima share the gradient evenly (as autograd)."""
    return _fast.MAX(a, axis=_axis(axis), keepdims=keepdims)


def min(a, axis=None, *, keepdims=False):
    """``numpy.min``; tied minima share the gradient evenly (as autograd)."""
    return _fast.MIN(a, axis=_axis(axis), keepdims=keepdims)


amax = max
amin = min


def var(a, axis=None, *, ddof=0, keepdims=False):
    return _fast.VAR(a, axis=_axis(axis), ddof=ddof, keepdims=keepdims)


def std(a, axis=None, *, ddof=0, keepdims=False):
    return sqrt(var(a, axis, ddof=ddof, keepdims=keepdims))


def logsumexp(a, axis=None, keepdims=False):
    """``log(sum(exp(a), axis))`` computed stably (as ``scipy.special.logsumexp``)."""
    return _fast.LOGSUMEXP(a, axis=_axis(axis), keepdims=keepdims)


def _nan_mask(a):
    return np.isnan(_data(a))


def nansum(a, axis=None, *, keepdims=False):
    """``sum`` with NaNs as zeros (they get no gradient)."""
    return sum(where(_nan_mask(a), 0.0, a), axis, keepdims=keepdims)


def nanprod(a, axis=None, *, keepdims=False):
    return prod(where(_nan_mask(a), 1.0, a), axis, keepdims=keepdims)


def nanmean(a, axis=None, *, keepdims=False):
    count = np.sum(~_nan_mask(a), axis=_axis(axis), keepdims=keepdims)
    return nansum(a, axis, keepdims=keepdims) / count.astype(np.asarray(_data(a)).dtype)


def nanmax(a, axis=None, *, keepdims=False):
    return max(where(_nan_mask(a), -np.inf, a), axis, keepdims=keepdims)


def nanmin(a, axis=None, *, keepdims=False):
    return min(where(_nan_mask(a), np.inf, a), axis, keepdims=keepdims)


def nanvar(a, axis=None, *, ddof=0, keepdims=False):
    mask = _nan_mask(a)
    dtype = np.asarray(_data(a)).dtype
    count = np.sum(~mask, axis=_axis(axis), keepdims=True).astype(dtype)
    centred = where(mask, 0.0, a - nansum(a, axis, keepdims=True) / count)
    out = sum(centred * centred, axis, keepdims=keepdims)
    return out / (np.sum(~mask, axis=_axis(axis), keepdims=keepdims).astype(dtype) - ddof)


def nanstd(a, axis=None, *, ddof=0, keepdims=False):
    return sqrt(nanvar(a, axis, ddof=ddof, keepdims=keepdims))


def cumsum(a, axis=None):
    return _fast.CUMSUM(a, axis=axis)


def cumprod(a, axis=None):
    return _fast.CUMPROD(a, axis=axis)


def softmax(x, axis=-1):
    """``exp(x) / sum(exp(x), axis)``, computed stably."""
    return _fast.SOFTMAX(x, axis=axis)


def log_softmax(x, axis=-1):
    """``x - logsumexp(x, axis)``."""
    return _fast.LOG_SOFTMAX(x, axis=axis)


# -- shape and indexing ------------------------------------------------------------

def reshape(a, shape):
    return _ops.reshape(a, shape)


def ravel(a):
    return _ops.reshape(a, (-1,))


def transpose(a, axes=None):
    return _ops.transpose(a, axes)


def expand_dims(a, axis):
    shape = list(np.shape(_data(a)))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    nd = len(shape) + len(axes)
    normalized = sorted(_normalize_axes(axes, nd, "expand_dims"))
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"expand_dims: repeated axis in {axis!r}")
    for ax in normalized:
        shape.insert(ax, 1)
    return _ops.reshape(a, tuple(shape))


def squeeze(a, axis=None):
    shape = np.shape(_data(a))
    if axis is None:
        return _ops.reshape(a, tuple(n for n in shape if n != 1))
    axes = _normalize_axes(axis, len(shape), "squeeze")
    for ax in axes:
        if shape[ax] != 1:
            raise ValueError(f"squeeze: cannot select an axis to squeeze out which has size "
                             f"not equal to one (axis {ax} of shape {shape})")
    return _ops.reshape(a, tuple(n for i, n in enumerate(shape) if i not in axes))


def broadcast_to(array, shape):
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if np.shape(_data(array)) == shape:
        return array if type(array) is Tensor else _constant(np.asarray(array))
    return _fast.BROADCAST_TO(array, shape=shape)


def _normalize_axes(axes, ndim, what):
    single = isinstance(axes, (int, np.integer))
    axes = (axes,) if single else tuple(axes)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise np.exceptions.AxisError(f"{what}: axis {a} is out of bounds for an array of "
                                          f"dimension {ndim}")
        out.append(int(a) % ndim)
    return out


def flipud(m):
    return flip(m, 0)


def fliplr(m):
    if np.ndim(_data(m)) < 2:
        raise ValueError("fliplr: input must be >= 2-d")
    return flip(m, 1)


def rot90(m, k=1, axes=(0, 1)):
    nd = np.ndim(_data(m))
    a0, a1 = _normalize_axes(axes, nd, "rot90")
    if a0 == a1:
        raise ValueError("rot90: axes must be different")
    k %= 4
    if k == 0:
        return m if type(m) is Tensor else _constant(np.asarray(m))
    if k == 2:
        return flip(flip(m, a0), a1)
    perm = list(range(nd))
    perm[a0], perm[a1] = perm[a1], perm[a0]
    if k == 1:
        return _ops.transpose(flip(m, a1), tuple(perm))
    return flip(_ops.transpose(m, tuple(perm)), a1)


def rollaxis(a, axis, start=0):
    nd = np.ndim(_data(a))
    axis = _normalize_axes(axis, nd, "rollaxis")[0]
    if start < 0:
        start += nd
    if not 0 <= start < nd + 1:
        raise np.exceptions.AxisError(f"rollaxis: start {start} is out of bounds")
    if axis < start:
        start -= 1
    order = [n for n in range(nd) if n != axis]
    order.insert(start, axis)
    return _ops.transpose(a, tuple(order))


def swapaxes(a, axis1, axis2):
    nd = np.ndim(_data(a))
    i, j = _normalize_axes((axis1, axis2), nd, "swapaxes")
    perm = list(range(nd))
    perm[i], perm[j] = j, i
    return _ops.transpose(a, tuple(perm))


def moveaxis(a, source, destination):
    nd = np.ndim(_data(a))
    src = _normalize_axes(source, nd, "moveaxis")
    dst = _normalize_axes(destination, nd, "moveaxis")
    if len(src) != len(dst):
        raise ValueError("moveaxis: source and destination must have the same number of "
                         "elements")
    order = [n for n in range(nd) if n not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return _ops.transpose(a, tuple(order))


def flip(m, axis=None):
    nd = np.ndim(_data(m))
    axes = range(nd) if axis is None else _normalize_axes(axis, nd, "flip")
    index = [slice(None)] * nd
    for a in axes:
        index[a] = slice(None, None, -1)
    return _ops.getitem(m, tuple(index))


def roll(a, shift, axis=None):
    shift = tuple(int(s) for s in shift) if isinstance(shift, (tuple, list)) else int(shift)
    axis = tuple(axis) if isinstance(axis, list) else axis
    return _fast.ROLL(a, shift=shift, axis=axis)


def pad(array, pad_width, mode="constant", constant_values=0):
    if mode != "constant":
        raise NotImplementedError(f"pad: adtape has a rule for mode='constant' only, "
                                  f"not mode={mode!r}")
    if type(constant_values) is Tensor and constant_values.requires_grad:
        raise NotImplementedError("pad: adtape has no rule for the argument constant_values "
                                  "(a Tensor that requires grad)")
    return _fast.PAD(array, pad_width=_pad_widths(pad_width, np.ndim(_data(array))),
                  constant_values=_data(constant_values))


def _pad_widths(pad_width, nd):
    """``pad_width`` as one (before, after) pair of ints per axis."""
    if isinstance(pad_width, (int, np.integer)):
        widths = ((int(pad_width), int(pad_width)),) * nd
    elif (isinstance(pad_width, (tuple, list)) and len(pad_width) == nd
          and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pad_width)):
        widths = tuple((int(b), int(a)) for b, a in pad_width)
    else:
        try:
            pairs = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (nd, 2))
        except ValueError:
            raise ValueError(f"pad: pad_width {pad_width!r} does not fit an array of "
                             f"{nd} dimensions") from None
        widths = tuple((int(b), int(a)) for b, a in pairs)
    if any(b < 0 or a < 0 for b, a in widths):
        raise ValueError(f"pad: pad_width must be non-negative, got {pad_width!r}")
    return widths


def concatenate(arrays, axis=0):
    arrays = list(arrays)
    if not arrays:
        raise ValueError("concatenate: need at least one array")
    if axis is None:
        arrays = [ravel(a) for a in arrays]
        axis = 0
    return _t.CONCATENATE(*arrays, axis=axis)


def stack(arrays, axis=0):
    arrays = list(arrays)
    if not arrays:
        raise ValueError("stack: need at least one array")
    shapes = {np.shape(_data(a)) for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"stack: all input arrays must have the same shape, got "
                         f"{sorted(shapes)}")
    shape, = shapes
    ax = _normalize_axes(axis, len(shape) + 1, "stack")[0]
    return _t.STACK(*arrays, axis=ax)


def hstack(tup):
    arrays = [atleast_1d(a) for a in tup]
    return concatenate(arrays, axis=0 if np.ndim(_data(arrays[0])) == 1 else 1)


def vstack(tup):
    return concatenate([atleast_2d(a) for a in tup], axis=0)


def atleast_3d(a):
    shape = np.shape(_data(a))
    if len(shape) >= 3:
        return a
    new = {0: (1, 1, 1), 1: (1,) + shape + (1,), 2: shape + (1,)}[len(shape)]
    return reshape(a, new)


def dstack(tup):
    return concatenate([atleast_3d(a) for a in tup], axis=2)


def column_stack(tup):
    arrays = [reshape(a, (-1, 1)) if np.ndim(_data(a)) < 2 else a for a in tup]
    return concatenate(arrays, axis=1)


def atleast_1d(a):
    return a if np.ndim(_data(a)) >= 1 else reshape(a, (1,))


def atleast_2d(a):
    nd = np.ndim(_data(a))
    return a if nd >= 2 else reshape(a, (1,) * (2 - nd) + np.shape(_data(a)))


def _split(ary, indices_or_sections, axis, numpy_split):
    shape = np.shape(_data(ary))
    ax = _normalize_axes(axis, len(shape), "split")[0]
    sizes = [len(p) for p in numpy_split(np.arange(shape[ax]), indices_or_sections)]
    index = [slice(None)] * len(shape)
    out = []
    start = 0
    for n in sizes:
        index[ax] = slice(start, start + n)
        out.append(_ops.getitem(ary, tuple(index)))
        start += n
    return out


def split(ary, indices_or_sections, axis=0):
    return _split(ary, indices_or_sections, axis, np.split)


def array_split(ary, indices_or_sections, axis=0):
    return _split(ary, indices_or_sections, axis, np.array_split)


def tile(A, reps):
    reps = (int(reps),) if isinstance(reps, (int, np.integer)) else tuple(int(r) for r in reps)
    shape = np.shape(_data(A))
    return _fast.TILE(A, reps=(1,) * (len(shape) - len(reps)) + reps, shape=shape)


def take(a, indices, axis=None):
    indices = np.asarray(_data(indices))
    if indices.dtype.kind not in "iu":
        raise TypeError(f"take: indices must be integers, got {indices.dtype}")
    if axis is None:
        return _ops.getitem(ravel(a), indices)
    ax = _normalize_axes(axis, np.ndim(_data(a)), "take")[0]
    return _ops.getitem(a, (slice(None),) * ax + (indices,))


def repeat(a, repeats, axis=None):
    if axis is None:
        a = ravel(a)
        axis = 0
    n = np.shape(_data(a))[_normalize_axes(axis, np.ndim(_data(a)), "repeat")[0]]
    return take(a, np.repeat(np.arange(n), _data(repeats)), axis)


def take_along_axis(arr, indices, axis):
    indices = np.asarray(_data(indices))
    if indices.dtype.kind not in "iu":
        raise TypeError(f"take_along_axis: indices must be integers, got {indices.dtype}")
    if axis is None:
        return _ops.getitem(ravel(arr), indices.reshape(-1))
    shape = np.shape(_data(arr))
    if indices.ndim != len(shape):
        raise ValueError(f"take_along_axis: indices ({indices.ndim}-d) and arr ({len(shape)}-d) "
                         f"must have the same number of dimensions")
    ax = _normalize_axes(axis, len(shape), "take_along_axis")[0]
    index = []
    for d, n in enumerate(shape):
        if d == ax:
            index.append(np.where(indices < 0, indices + n, indices))
        else:
            index.append(np.arange(n).reshape((-1,) + (1,) * (len(shape) - 1 - d)))
    return _ops.getitem(arr, tuple(index))


def diff(a, n=1, axis=-1):
    nd = np.ndim(_data(a))
    if nd == 0:
        raise ValueError("diff requires input that is at least one dimensional")
    if n < 0:
        raise ValueError(f"diff: order must be non-negative, got {n}")
    ax = _normalize_axes(axis, nd, "diff")[0]
    before = (slice(None),) * ax
    out = a
    for _ in range(n):
        out = _ops.sub(_ops.getitem(out, before + (slice(1, None),)),
                       _ops.getitem(out, before + (slice(None, -1),)))
    return out


def partition(a, kth, axis=-1):
    """``numpy.partition``: the gradient goes back through ``argpartition``'s order."""
    if axis is None:
        a = ravel(a)
        axis = -1
    return take_along_axis(a, np.argpartition(_data(a), kth, axis=axis), axis)


def sort(a, axis=-1):
    """Sorted along ``axis``: the gradient goes back through the sorting permutation."""
    if axis is None:
        a = ravel(a)
        axis = -1
    order = np.argsort(_data(a), axis=axis, kind="stable")
    return take_along_axis(a, order, axis)


def cross(a, b, axis=-1):
    """The cross product of 3-vectors along ``axis``."""
    sa, sb = np.shape(_data(a)), np.shape(_data(b))
    if sa[axis] != 3 or sb[axis] != 3:
        raise NotImplementedError("cross: adtape has a rule for 3-vectors only")
    a = moveaxis(a, axis, -1)
    b = moveaxis(b, axis, -1)
    a0, a1, a2 = (_ops.getitem(a, (Ellipsis, i)) for i in range(3))
    b0, b1, b2 = (_ops.getitem(b, (Ellipsis, i)) for i in range(3))
    out = stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], axis=-1)
    return moveaxis(out, -1, axis)


def diag(v, k=0):
    nd = np.ndim(_data(v))
    if nd == 2:
        return diagonal(v, k)
    if nd != 1:
        raise ValueError("diag: input must be 1- or 2-d")
    n = np.shape(_data(v))[0] + builtins.abs(k)
    return _t.diagonal_embed(v, (n, n), k, 0, 1)


def tril(m, k=0):
    return _fast.TRIL(m, k=k)


def triu(m, k=0):
    return _fast.TRIU(m, k=k)


def diagonal(a, offset=0, axis1=0, axis2=1):
    return _fast.DIAGONAL(a, offset=offset, axis1=axis1, axis2=axis2,
                          shape=a.data.shape if type(a) is Tensor else np.shape(a))


def trace(a, offset=0, axis1=0, axis2=1):
    return sum(diagonal(a, offset, axis1, axis2), -1)


# -- products ----------------------------------------------------------------------

def matmul(x1, x2):
    return _ops.matmul(_by_reference(x1), _by_reference(x2))


def _ndim(a):
    a = _data(a)
    return a.ndim if type(a) is _ndarray else np.ndim(a)


def dot(a, b):
    a_ndim, b_ndim = _ndim(a), _ndim(b)
    if a_ndim == 0 or b_ndim == 0:
        return _ops.mul(a, b)
    if a_ndim <= 2 and b_ndim <= 2:
        return _ops.matmul(_by_reference(a), _by_reference(b))
    return tensordot(a, b, ([a_ndim - 1], [builtins.max(b_ndim - 2, 0)]))


def vdot(a, b):
    return sum(ravel(a) * ravel(b))


def inner(a, b):
    if np.ndim(_data(a)) == 0 or np.ndim(_data(b)) == 0:
        return _ops.mul(a, b)
    return tensordot(a, b, ([-1], [-1]))


def outer(a, b):
    return _ops.mul(_ops.reshape(a, (-1, 1)), _ops.reshape(b, (1, -1)))


def tensordot(a, b, axes=2):
    sa, sb = np.shape(_data(a)), np.shape(_data(b))
    if isinstance(axes, (int, np.integer)):
        axes_a = list(range(len(sa) - axes, len(sa)))
        axes_b = list(range(axes))
    else:
        axes_a, axes_b = axes
        axes_a = [axes_a] if isinstance(axes_a, (int, np.integer)) else list(axes_a)
        axes_b = [axes_b] if isinstance(axes_b, (int, np.integer)) else list(axes_b)
    axes_a = _normalize_axes(axes_a, len(sa), "tensordot")
    axes_b = _normalize_axes(axes_b, len(sb), "tensordot")
    if [sa[i] for i in axes_a] != [sb[i] for i in axes_b]:
        raise ValueError(f"tensordot: shape-mismatch for sum: {sa} axes {axes_a} against "
                         f"{sb} axes {axes_b}")
    free_a = [i for i in range(len(sa)) if i not in axes_a]
    free_b = [i for i in range(len(sb)) if i not in axes_b]
    k = math.prod([sa[i] for i in axes_a])
    left = _as_matrix(a, free_a + axes_a, (math.prod([sa[i] for i in free_a]), k))
    right = _as_matrix(b, axes_b + free_b, (k, math.prod([sb[i] for i in free_b])))
    return _as_shape(_ops.matmul(left, right),
                     tuple(sa[i] for i in free_a) + tuple(sb[i] for i in free_b))


def _as_shape(a, shape):
    """``reshape(a, shape)``, recording nothing when ``a`` has that shape already."""
    return a if np.shape(_data(a)) == shape else _ops.reshape(a, shape)


def _as_matrix(a, order, shape):
    """``a`` with its axes in ``order``, reshaped to the 2-d ``shape``; the identity
    transpose and reshape are not recorded (a view each, and a node each to sweep)."""
    if order != list(range(len(order))):
        a = _ops.transpose(a, tuple(order))
    return _as_shape(a, shape)


def kron(a, b):
    sa, sb = np.shape(_data(a)), np.shape(_data(b))
    d = builtins.max(len(sa), len(sb))
    sa = (1,) * (d - len(sa)) + sa
    sb = (1,) * (d - len(sb)) + sb
    left = _ops.reshape(a, tuple(x for n in sa for x in (n, 1)))
    right = _ops.reshape(b, tuple(x for n in sb for x in (1, n)))
    return _ops.reshape(_ops.mul(left, right), tuple(m * n for m, n in zip(sa, sb)))


def einsum(subscripts, *operands):
    """``numpy.einsum`` in the subscripts form, without ``...`` (write the axes out)."""
    return _t.EINSUM(*operands, subscripts=subscripts)


# -- linear algebra: anp.linalg ----------------------------------------------------

def _solve(a, b):
    return _t.SOLVE(a, b)


def _inv(a):
    return _fast.INV(a)


def _det(a):
    return _fast.DET(a)


def _slogdet(a):
    """``(sign, logabsdet)``; the sign is a constant."""
    sign_ = np.linalg.slogdet(_data(a))[0]
    return _constant(np.asarray(sign_)), _fast.LOGABSDET(a)


def _cholesky(a):
    return _fast.CHOLESKY(a)


def _eigh(a, UPLO="L"):
    """``(w, v)`` of a symmetric matrix (its lower triangle is read); the gradient
    assumes distinct eigenvalues and is symmetric."""
    if UPLO != "L":
        raise NotImplementedError(f"eigh: adtape has a rule for UPLO='L' only, not {UPLO!r}")
    packed = _fast.EIGH(a)
    return _ops.getitem(packed, (Ellipsis, 0, slice(None))), \
        _ops.getitem(packed, (Ellipsis, slice(1, None), slice(None)))


def _svd(a, full_matrices=True, compute_uv=True, hermitian=False):
    """``u, s, vh`` (or ``s``); as autograd, the rule needs ``full_matrices=False`` unless
    the matrix is square, and distinct nonzero singular values."""
    shape = np.shape(_data(a))
    if len(shape) < 2:
        raise ValueError(f"svd: need an array of at least 2 dimensions, got shape {shape}")
    m, n = shape[-2], shape[-1]
    if full_matrices and compute_uv and m != n:
        raise NotImplementedError("svd: adtape has no rule for full_matrices=True with a "
                                  "non-square matrix; pass full_matrices=False")
    if hermitian:
        raise NotImplementedError("svd: adtape has no rule for hermitian=True")
    packed = _fast.SVD(a)
    s = _ops.getitem(packed, (Ellipsis, m, slice(None)))
    if not compute_uv:
        return s
    u = _ops.getitem(packed, (Ellipsis, slice(0, m), slice(None)))
    v = _ops.getitem(packed, (Ellipsis, slice(m + 1, None), slice(None)))
    return u, s, swapaxes(v, -1, -2)


def _pinv(a, rcond=None, hermitian=False):
    """Through ``svd``: singular values below ``rcond * max`` are dropped (their mask is
    constant); the gradient needs the kept ones distinct."""
    if hermitian:
        raise NotImplementedError("pinv: adtape has no rule for hermitian=True")
    shape = np.shape(_data(a))
    if rcond is None:
        rcond = builtins.max(shape[-2:]) * np.finfo(np.asarray(_data(a)).dtype).eps
    u, s, vh = _svd(a, full_matrices=False)
    sd = _data(s)
    kept = sd > rcond * np.max(sd, axis=-1, keepdims=True)
    s_inv = where(kept, reciprocal(where(kept, s, 1.0)), 0.0)
    return _ops.matmul(swapaxes(vh, -1, -2) * expand_dims(s_inv, -2), swapaxes(u, -1, -2))


def _norm(x, ord=None, axis=None, keepdims=False):
    """``numpy.linalg.norm``: vector norms (any ``ord``), matrix norms
    (``'fro'``, ``'nuc'``, 1, -1, 2, -2, inf, -inf)."""
    nd = np.ndim(_data(x))
    if axis is None:
        if ord is None:
            return _fast.NORM2(x, axis=None, keepdims=keepdims)
        if nd not in (1, 2):
            raise ValueError("norm: improper number of dimensions to norm")
        axis = tuple(range(nd))
    axes = tuple(_normalize_axes(axis, nd, "norm"))
    if ((len(axes) == 1 and (ord is None or ord == 2))
            or (len(axes) == 2 and ord in (None, "fro"))):
        # The 2-norm keeps the dimensions itself (no reshape node).
        return _fast.NORM2(x, axis=axes[0] if len(axes) == 1 else axes, keepdims=keepdims)
    if len(axes) == 1:
        out = _vector_norm(x, ord, axes[0])
    elif len(axes) == 2:
        out = _matrix_norm(x, ord, axes)
    else:
        raise ValueError("norm: improper number of dimensions to norm")
    if keepdims:
        shape = np.shape(_data(x))
        out = reshape(out, tuple(1 if i in axes else n for i, n in enumerate(shape)))
    return out


def _vector_norm(x, ord, axis):
    if ord is None or ord == 2:
        return _fast.NORM2(x, axis=axis)
    if ord == np.inf:
        return max(absolute(x), axis)
    if ord == -np.inf:
        return min(absolute(x), axis)
    if ord == 0:
        return _constant(np.asarray(np.sum(_data(x) != 0, axis=axis), dtype=np.asarray(
            _data(x)).dtype))
    if ord == 1:
        return sum(absolute(x), axis)
    if isinstance(ord, str):
        raise ValueError(f"norm: invalid norm order {ord!r} for vectors")
    return sum(absolute(x) ** ord, axis) ** (1.0 / ord)


def _matrix_norm(x, ord, axes):
    row, col = axes
    if ord is None or ord == "fro":
        return _fast.NORM2(x, axis=axes)
    if ord in (1, -1):
        colsums = sum(absolute(x), row)
        return (max if ord == 1 else min)(colsums, col - (col > row))
    if ord in (np.inf, -np.inf):
        rowsums = sum(absolute(x), col)
        return (max if ord == np.inf else min)(rowsums, row - (row > col))
    if ord in ("nuc", 2, -2):
        s = _svd(moveaxis(x, (row, col), (-2, -1)), full_matrices=False, compute_uv=False)
        return {"nuc": sum, 2: max, -2: min}[ord](s, -1)
    raise ValueError(f"norm: invalid norm order {ord!r} for matrices")


linalg = types.ModuleType("adtape.numpy.linalg", "numpy.linalg's functions, recorded.")
for _name, _fun in (("solve", _solve), ("inv", _inv), ("det", _det), ("slogdet", _slogdet),
                    ("cholesky", _cholesky), ("eigh", _eigh), ("svd", _svd), ("norm", _norm),
                    ("pinv", _pinv)):
    _fun.__name__ = _fun.__qualname__ = _name
    setattr(linalg, _name, _fun)
linalg.__all__ = ["solve", "inv", "det", "slogdet", "cholesky", "eigh", "svd", "norm",
                  "pinv"]


def _linalg_getattr(name):
    if name.startswith("__"):
        raise AttributeError(f"module 'adtape.numpy.linalg' has no attribute {name!r}")
    if hasattr(np.linalg, name):
        raise AttributeError(f"adtape.numpy.linalg has no {name!r}: adtape has no derivative "
                             f"rule for numpy.linalg.{name} yet")
    raise AttributeError(f"module 'adtape.numpy.linalg' has no attribute {name!r}")


linalg.__getattr__ = _linalg_getattr
sys.modules["adtape.numpy.linalg"] = linalg


# -- constants and constructors: no gradient to record -----------------------------

def shape(a):
    return np.shape(_data(a))


def ndim(a):
    return np.ndim(_data(a))


def size(a, axis=None):
    return np.size(_data(a), axis)


def zeros_like(a, dtype=None):
    return np.zeros_like(_data(a), dtype=dtype)


def ones_like(a, dtype=None):
    return np.ones_like(_data(a), dtype=dtype)


def full(shape, fill_value, dtype=None):
    """``numpy.full``; a Tensor ``fill_value`` is broadcast (and keeps its gradient)."""
    if type(fill_value) is Tensor:
        return broadcast_to(fill_value, shape)
    return np.full(shape, fill_value, dtype=dtype)


def full_like(a, fill_value, dtype=None):
    """``numpy.full_like``; a Tensor ``fill_value`` is broadcast (and keeps its gradient)."""
    if type(fill_value) is Tensor:
        return broadcast_to(fill_value, np.shape(_data(a)))
    return np.full_like(_data(a), fill_value, dtype=dtype)


def argmax(a, axis=None):
    return np.argmax(_data(a), axis)


def argmin(a, axis=None):
    return np.argmin(_data(a), axis)


def argsort(a, axis=-1):
    return np.argsort(_data(a), axis)


def _comparison(ufunc):
    """``numpy.<ufunc>`` of the values: a boolean array (piecewise constant, so there is no
    gradient to lose; ``x > 0`` in ``anp.where(x > 0, x, 0)``)."""
    def f(x1, x2):
        return ufunc(_data(x1), _data(x2))
    f.__name__ = f.__qualname__ = ufunc.__name__
    f.__doc__ = _comparison.__doc__.replace("<ufunc>", ufunc.__name__)
    return f


less, less_equal = _comparison(np.less), _comparison(np.less_equal)
greater, greater_equal = _comparison(np.greater), _comparison(np.greater_equal)


def isnan(x):
    return np.isnan(_data(x))


def isfinite(x):
    return np.isfinite(_data(x))


def isinf(x):
    return np.isinf(_data(x))


# Tensor's ordering operators compare values (== and != stay identity: Tensors are keys of
# the hook and deferred-zero tables).
Tensor.__lt__ = lambda self, other: np.less(self.data, _data(other))
Tensor.__le__ = lambda self, other: np.less_equal(self.data, _data(other))
Tensor.__gt__ = lambda self, other: np.greater(self.data, _data(other))
Tensor.__ge__ = lambda self, other: np.greater_equal(self.data, _data(other))


def _holds_tensor(obj):
    if type(obj) is Tensor:
        return True
    return isinstance(obj, (list, tuple)) and any(_holds_tensor(o) for o in obj)


def array(object, dtype=None):
    """``numpy.array``; a (nested) list holding Tensors is stacked, so the gradient flows
    (``anp.array([x[0] ** 2, x[1]])``, as autograd)."""
    if type(object) is Tensor:
        if dtype is not None and np.dtype(dtype) != object.dtype:
            raise TypeError(f"array: adtape does not convert a Tensor of {object.dtype} to "
                            f"{np.dtype(dtype)} (it would lose the gradient)")
        return object
    if _holds_tensor(object):
        return stack([array(o, dtype) for o in object])
    return np.array(object, dtype=dtype)


def asarray(a, dtype=None):
    """``numpy.asarray``; a Tensor (or a list holding Tensors) stays recorded, unlike
    ``np.asarray(tensor)``, NumPy's explicit detach."""
    return array(a, dtype) if type(a) is Tensor or _holds_tensor(a) else np.asarray(a, dtype)


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

_UFUNCS = {}            # numpy ufunc -> adtape function
_ARRAY_FUNCTIONS = {}   # numpy function -> (adtape function, its signature)
for _name, _fun in {**_FUNCTIONS, **_LINALG}.items():
    _np_fun = np
    for _part in _name.split("."):
        _np_fun = getattr(_np_fun, _part)
    if isinstance(_np_fun, np.ufunc):
        _UFUNCS[_np_fun] = _fun
    else:
        _ARRAY_FUNCTIONS[_np_fun] = (_fun, inspect.signature(_fun))
del _name, _fun, _np_fun, _part


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


def _array_ufunc(ufunc, method, inputs, kwargs):
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


def _array_function(func, args, kwargs):
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
