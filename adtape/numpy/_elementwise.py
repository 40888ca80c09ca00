"""adtape.numpy's elementwise functions: NumPy's ufuncs and their kin, recorded.
Comparisons and ``isnan``/``isfinite``/``isinf`` give boolean arrays of the values
(piecewise constant: nothing to record)."""
import numpy as np

from adtape import vjps as _ops
from adtape.numpy import _vjps as _t
from adtape.numpy._fastpath import _binary, _data, _elementwise, _fast
from adtape.tensor import Tensor, _constant, _record, _state

_ndarray = np.ndarray


def positive(x):
    """``+x``: a Tensor is returned as it is (there is nothing to record)."""
    return x if type(x) is Tensor else _constant(np.asarray(np.positive(x)))


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
