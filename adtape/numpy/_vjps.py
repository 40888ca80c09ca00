"""adtape.numpy's primitives and their VJP rules: the derivative table, autograd style.

Each primitive computes its value with NumPy (``fwd``) and saves what its rules
read: the output (``ans``) when a rule needs it, and the array operands.  Static
arguments (axes, shapes, indices, masks) are keyword arguments, kept on the node
and handed to the rules.  Rules are ``pullback(g, ans, *operands, **static)``
and are written in NumPy functions and operators only, so that handed Tensors
(by a sweep that records, for grad of grad, ``hessian`` or ``jvp``) they record
differentiable ops through NumPy's protocols, and handed arrays they run on
plain NumPy.  Masks read values through ``_value``: they are piecewise constant.

Functions that are compositions of primitives (``std``, ``stack``, ``tensordot``,
``take``, ...) are in ``adtape.numpy``; their derivatives come from the parts.
"""
import math

import numpy as np
from scipy.linalg import blas as _blas
from scipy.linalg import lapack as _lapack

from adtape.tensor import Primitive, Tensor, defvjp

_ndarray = np.ndarray
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _value(a):
    """The array of a Tensor (for masks and shapes, which are not differentiated)."""
    return a.data if type(a) is Tensor else a


def _primitive(name, argnames, fun, saves):
    """A primitive computing ``fun(*operands, **static)`` that saves ``(ans, *operands)``,
    with None in place of what ``saves`` leaves out ("ans", "operands", "both", "none")."""
    keep_ans = saves in ("ans", "both")
    keep_operands = saves in ("operands", "both")

    def fwd(*operands, **static):
        ans = np.asarray(fun(*operands, **static))
        saved = operands if keep_operands else (None,) * len(operands)
        return ans, (ans if keep_ans else None,) + saved
    return Primitive(name, argnames, fwd)


TABLE = {}      # name -> primitive: the derivative table (docs are generated from it)
SPEC = {}       # name -> (NumPy function, what it saves): adtape.numpy's fast paths


def _def(name, argnames, fun, *pullbacks, saves="operands"):
    prim = _primitive(name, argnames, fun, saves)
    defvjp(prim, *pullbacks, differentiable=True)
    TABLE[name] = prim
    SPEC[name] = (fun, saves)
    return prim


def _reduced_shape(shape, axis):
    """The keepdims shape of a reduction of an array of ``shape`` over ``axis``."""
    nd = len(shape)
    if axis is None:
        return (1,) * nd
    if type(axis) is int and nd:
        a = axis % nd
        return shape[:a] + (1,) + shape[a + 1:]
    axes = {a % nd for a in (axis if isinstance(axis, tuple) else (axis,))} if nd else set()
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def _keepdims(a, shape, axis):
    """``a``, a reduction's result or cotangent, reshaped to broadcast against ``shape``."""
    if len(a.shape) == len(shape):     # kept already (keepdims, or no axis reduced)
        return a
    kshape = _reduced_shape(shape, axis)
    return a if a.shape == kshape else a.reshape(kshape)


def _sum(a, axis=None, keepdims=False):
    """``np.sum``: on an array without NumPy's Python layers; a Tensor records it."""
    if type(a) is _ndarray:
        return np.add.reduce(a, axis=axis, keepdims=keepdims)
    return np.sum(a, axis=axis, keepdims=keepdims)


def _count(shape, axis):
    """How many elements a reduction over ``axis`` of an array of ``shape`` combines."""
    kept = math.prod(_reduced_shape(shape, axis))
    return math.prod(shape) // kept if kept else 0


# -- elementwise -------------------------------------------------------------------

SIN = _def("sin", ("x",), np.sin, lambda g, ans, x: g * np.cos(x))
COS = _def("cos", ("x",), np.cos, lambda g, ans, x: -g * np.sin(x))
TAN = _def("tan", ("x",), np.tan, lambda g, ans, x: g / np.cos(x) ** 2)
ARCSIN = _def("arcsin", ("x",), np.arcsin, lambda g, ans, x: g / np.sqrt(1 - x * x))
ARCCOS = _def("arccos", ("x",), np.arccos, lambda g, ans, x: -g / np.sqrt(1 - x * x))
ARCTAN = _def("arctan", ("x",), np.arctan, lambda g, ans, x: g / (1 + x * x))
SINH = _def("sinh", ("x",), np.sinh, lambda g, ans, x: g * np.cosh(x))
COSH = _def("cosh", ("x",), np.cosh, lambda g, ans, x: g * np.sinh(x))
ARCSINH = _def("arcsinh", ("x",), np.arcsinh, lambda g, ans, x: g / np.sqrt(x * x + 1))
ARCCOSH = _def("arccosh", ("x",), np.arccosh, lambda g, ans, x: g / np.sqrt(x * x - 1))
ARCTANH = _def("arctanh", ("x",), np.arctanh, lambda g, ans, x: g / (1 - x * x))
SQRT = _def("sqrt", ("x",), np.sqrt, lambda g, ans, x: g * 0.5 / ans, saves="ans")
CBRT = _def("cbrt", ("x",), np.cbrt, lambda g, ans, x: g / (3 * ans * ans), saves="ans")
SQUARE = _def("square", ("x",), np.square, lambda g, ans, x: g * 2 * x)
ABS = _def("absolute", ("x",), np.abs, lambda g, ans, x: g * np.sign(x))
RECIPROCAL = _def("reciprocal", ("x",), np.reciprocal, lambda g, ans, x: -g * ans * ans,
                  saves="ans")
EXP2 = _def("exp2", ("x",), np.exp2, lambda g, ans, x: g * ans * np.log(2.0), saves="ans")
EXPM1 = _def("expm1", ("x",), np.expm1, lambda g, ans, x: g * (ans + 1), saves="ans")
LOG2 = _def("log2", ("x",), np.log2, lambda g, ans, x: g / (x * np.log(2.0)))
LOG10 = _def("log10", ("x",), np.log10, lambda g, ans, x: g / (x * np.log(10.0)))
LOG1P = _def("log1p", ("x",), np.log1p, lambda g, ans, x: g / (1 + x))
SIGMOID = _def("sigmoid", ("x",), lambda x: 0.5 * (np.tanh(0.5 * x) + 1),
               lambda g, ans, x: g * ans * (1 - ans), saves="ans")


def _zero_grad(g, ans, *operands, **static):
    """Zero (the function is piecewise constant)."""
    return np.zeros_like(g)


# Piecewise constant: the derivative is zero wherever it exists (autograd and PyTorch agree).
SIGN = _def("sign", ("x",), np.sign, _zero_grad, saves="none")
FLOOR = _def("floor", ("x",), np.floor, _zero_grad, saves="none")
CEIL = _def("ceil", ("x",), np.ceil, _zero_grad, saves="none")
ROUND = _def("round", ("x",), lambda x, decimals=0: np.round(x, decimals), _zero_grad,
             saves="none")
RINT = _def("rint", ("x",), np.rint, _zero_grad, saves="none")
TRUNC = _def("trunc", ("x",), np.trunc, _zero_grad, saves="none")


def _eq(a, b):
    return np.equal(_value(a), _value(b))


def _balanced(g, x, ans, y):
    """``g`` where ``x`` is the result (half of it on a tie with ``y``): ties split it."""
    out = g * _eq(x, ans)
    tie = _eq(x, y)
    if np.count_nonzero(tie):
        out = out * np.where(tie, 0.5, 1.0).astype(g.dtype)
    return out


ARCTAN2 = _def("arctan2", ("x1", "x2"), np.arctan2,
               lambda g, ans, y, x: g * x / (x * x + y * y),
               lambda g, ans, y, x: -g * y / (x * x + y * y))
HYPOT = _def("hypot", ("x1", "x2"), np.hypot,
             lambda g, ans, x, y: g * x / ans, lambda g, ans, x, y: g * y / ans, saves="both")
LOGADDEXP = _def("logaddexp", ("x1", "x2"), np.logaddexp,
                 lambda g, ans, x, y: g * np.exp(x - ans),
                 lambda g, ans, x, y: g * np.exp(y - ans), saves="both")
LOGADDEXP2 = _def("logaddexp2", ("x1", "x2"), np.logaddexp2,
                  lambda g, ans, x, y: g * np.exp2(x - ans),
                  lambda g, ans, x, y: g * np.exp2(y - ans), saves="both")
def _winner(g, x, y, beats):
    """``g`` where ``x`` beats ``y`` (half of it on a tie): maximum's and minimum's rule,
    from the operands alone."""
    x, y = _value(x), _value(y)
    out = g * beats(x, y)
    tie = np.equal(x, y)
    if np.count_nonzero(tie):
        out = out + g * tie * np.asarray(0.5, g.dtype)
    return out


MAXIMUM = _def("maximum", ("x1", "x2"), np.maximum,
               lambda g, ans, x, y: _winner(g, x, y, np.greater),
               lambda g, ans, x, y: _winner(g, y, x, np.greater))
MINIMUM = _def("minimum", ("x1", "x2"), np.minimum,
               lambda g, ans, x, y: _winner(g, x, y, np.less),
               lambda g, ans, x, y: _winner(g, y, x, np.less))


FMAX = _def("fmax", ("x1", "x2"), np.fmax,
            lambda g, ans, x, y: _balanced(g, x, ans, y),
            lambda g, ans, x, y: _balanced(g, y, ans, x), saves="both")
FMIN = _def("fmin", ("x1", "x2"), np.fmin,
            lambda g, ans, x, y: _balanced(g, x, ans, y),
            lambda g, ans, x, y: _balanced(g, y, ans, x), saves="both")
# x1 - q x2 with q piecewise constant (floor for mod, trunc for fmod), as autograd.
MOD = _def("remainder", ("x1", "x2"), np.remainder,
           lambda g, ans, x, y: g,
           lambda g, ans, x, y: -g * np.floor(_value(x) / _value(y)))
FMOD = _def("fmod", ("x1", "x2"), np.fmod,
            lambda g, ans, x, y: g,
            lambda g, ans, x, y: -g * np.trunc(_value(x) / _value(y)))


COPYSIGN = _def("copysign", ("x1", "x2"), np.copysign,
                lambda g, ans, x, y: g * np.copysign(1.0, _value(x)) * np.copysign(1.0, _value(y)),
                lambda g, ans, x, y: np.zeros_like(g), saves="operands")


def _sinc_rule(g, ans, x):
    """``g (cos(pi x) - sinc(x)) / x``, 0 at 0."""
    zero = _value(x) == 0
    safe = np.where(zero, 1.0, x) if type(x) is not Tensor else x + zero
    return g * np.where(zero, 0.0, (np.cos(np.pi * x) - ans) / safe)


SINC = _def("sinc", ("x",), np.sinc, _sinc_rule, saves="both")
NAN_TO_NUM = _def("nan_to_num", ("x",), lambda x, nan=0.0, posinf=None, neginf=None:
                  np.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf),
                  lambda g, ans, x, **replacements: g * np.isfinite(_value(x)))


def _inside(x, lo, hi):
    x = _value(x)
    if lo is None:
        return x <= _value(hi)
    if hi is None:
        return x >= _value(lo)
    return (x >= _value(lo)) & (x <= _value(hi))


# The bounds' gradients go where the bound is the result (PyTorch's convention at the
# boundary: the input gets it there).
CLIP = _def("clip", ("a", "a_min", "a_max"), np.clip,
            lambda g, ans, x, lo, hi: g * _inside(x, lo, hi),
            lambda g, ans, x, lo, hi: g * (_value(x) < _value(lo)),
            lambda g, ans, x, lo, hi: g * (_value(x) > _value(hi)))
WHERE = _def("where", ("x", "y"), lambda x, y, condition: np.where(condition, x, y),
             lambda g, ans, x, y, condition: g * condition,
             lambda g, ans, x, y, condition: g * ~condition, saves="none")


# -- reductions --------------------------------------------------------------------

def _max_rule(g, ans, x, axis=None, keepdims=False):
    """``g`` to the maxima (minima); tied ones share it evenly, as autograd."""
    shape = x.shape
    winners = _eq(x, _keepdims(ans, shape, axis))
    count = np.add.reduce(winners, axis=axis, keepdims=True, dtype=g.dtype)
    return (_keepdims(g, shape, axis) / count) * winners


MAX = _def("max", ("a",), lambda a, axis=None, keepdims=False:
           np.maximum.reduce(a, axis=axis, keepdims=keepdims), _max_rule, saves="both")
MIN = _def("min", ("a",), lambda a, axis=None, keepdims=False:
           np.minimum.reduce(a, axis=axis, keepdims=keepdims), _max_rule, saves="both")


def _no_zeros(x):
    return bool(np.all(_value(x) != 0))


def _others_product(x, axes):
    """For each element of ``x``, the product of the others along ``axes`` (a tuple):
    exact where ``x`` has zeros, by one product per position (O(n^2) along ``axes``)."""
    nd = np.ndim(x)
    axes = tuple(a % nd for a in axes)
    rest = tuple(a for a in range(nd) if a not in axes)
    moved = np.transpose(x, rest + axes)
    lead = np.shape(moved)[:len(rest)]
    n = int(np.prod([np.shape(x)[a] for a in axes]))
    flat = np.reshape(moved, lead + (n,))
    columns = []
    for k in range(n):
        one_hot = np.arange(n) == k
        columns.append(np.prod(flat * ~one_hot + one_hot, axis=-1))
    others = np.stack(columns, axis=-1) if columns else flat
    others = np.reshape(others, np.shape(moved))
    return np.transpose(others, tuple(np.argsort(rest + axes)))


def _prod_rule(g, ans, x, axis=None, keepdims=False):
    """``g * ans / x``; where ``x`` has zeros, ``g`` times the product of the others."""
    shape = np.shape(x)
    g = _keepdims(g, shape, axis)
    if _no_zeros(x):
        return g * _keepdims(ans, shape, axis) / x
    axes = tuple(range(len(shape))) if axis is None else (
        axis if isinstance(axis, tuple) else (axis,))
    return g * _others_product(x, axes)


PROD = _def("prod", ("a",), np.prod, _prod_rule, saves="both")


def _var_rule(g, ans, x, axis=None, ddof=0, keepdims=False):
    """``g * 2 (x - mean) / (N - ddof)``."""
    shape = x.shape
    count = shape[axis] if type(axis) is int else _count(shape, axis)   # a valid axis
    centred = x - _sum(x, axis=axis, keepdims=True) / count
    # The scale on the reduced cotangent, before it is broadcast.
    return (_keepdims(g, shape, axis) * (2.0 / (count - ddof))) * centred


def _var(x, axis=None, ddof=0, keepdims=False):
    x = np.asarray(x)
    total = np.add.reduce(x, axis=axis, keepdims=True)
    count = x.size // total.size if total.size else 0
    centred = x - total / count
    np.multiply(centred, centred, out=centred)
    return np.add.reduce(centred, axis=axis, keepdims=keepdims) / (count - ddof)


VAR = _def("var", ("a",), _var, _var_rule)


def _logsumexp(x, axis=None, keepdims=False):
    x = np.asarray(x)
    top = np.maximum.reduce(x, axis=axis, keepdims=True)
    top[~np.isfinite(top)] = 0
    out = np.log(np.add.reduce(np.exp(x - top), axis=axis, keepdims=True))
    out += top
    if keepdims:
        return out
    return out.reshape(()) if axis is None else out.squeeze(axis)


LOGSUMEXP = _def("logsumexp", ("a",), _logsumexp,
                 lambda g, ans, x, axis=None, keepdims=False:
                 _keepdims(g, x.shape, axis) * np.exp(x - _keepdims(ans, x.shape, axis)),
                 saves="both")


def _cumulative(fun, g, axis):
    """``fun`` along ``axis`` of ``g`` from the far end (a reverse cumulative op)."""
    reverse = (slice(None),) * (axis % g.ndim) + (slice(None, None, -1),)
    return fun(g[reverse], axis=axis)[reverse]


def _accumulating(ufunc, numpy_fun):
    """``np.cumsum``/``np.cumprod``: a float array through ``ufunc.accumulate`` directly
    (NumPy's wrappers cost more than the op at small sizes); Tensors record."""
    def fun(a, axis=None):
        if type(a) is _ndarray and a.dtype in _FLOATS:
            return ufunc.accumulate(a.reshape(-1) if axis is None else a,
                                    axis=0 if axis is None else axis)
        return numpy_fun(a, axis=axis)
    fun.__name__ = numpy_fun.__name__
    return fun


_cumsum = _accumulating(np.add, np.cumsum)
_cumprod = _accumulating(np.multiply, np.cumprod)


def _cumsum_rule(g, ans, x, axis=None):
    """The reversed cumulative sum of ``g``."""
    if axis is None:
        return np.reshape(_cumulative(_cumsum, g, 0), x.shape)
    return _cumulative(_cumsum, g, axis)


def _cumprod_rule(g, ans, x, axis=None):
    """``revcumsum(g * ans) / x``; exact at zeros."""
    if axis is None:
        return np.reshape(_cumprod_rule(g, ans, np.reshape(x, (-1,)), 0), np.shape(x))
    if _no_zeros(x):
        return _cumulative(_cumsum, g * ans, axis) / x
    # d ans_j / d x_k = prod_{i <= j, i != k} x_i for j >= k.  Along each lane, ans is zero
    # from the first zero x_z on, so the formula above is exact before z; at z the
    # gradient is sum_{j >= z} g_j prod_{i <= j, i != z} x_i, the cumulative product with
    # x_z taken as 1; after z every product holds x_z: zero.
    zero = _value(x) == 0
    count = np.add.accumulate(zero, axis=axis)
    before = count == 0
    first = zero & (count == 1)
    with_one = _cumprod(np.where(first, 1, x), axis=axis)
    at_first = np.sum(np.where(before, 0, g * with_one), axis=axis, keepdims=True)
    prefix = _cumulative(_cumsum, g * ans, axis) / np.where(before, x, 1)
    return np.where(before, prefix, np.where(first, at_first, 0))


CUMSUM = _def("cumsum", ("a",), _cumsum, _cumsum_rule)
CUMPROD = _def("cumprod", ("a",), _cumprod, _cumprod_rule, saves="both")


def _kernels():
    """kernels.softmax, imported on first use (the tape core imports nothing from kernels)."""
    global _softmax_kernels
    if _softmax_kernels is None:
        from kernels import softmax
        _softmax_kernels = softmax
    return _softmax_kernels


_softmax_kernels = None


def _last_axis_kernel(x, axis):
    """True when the softmax kernels take ``x`` (C-contiguous float, the last axis)."""
    return (type(x) is _ndarray and x.ndim and (axis == -1 or axis == x.ndim - 1)
            and x.dtype in _FLOATS and x.flags.c_contiguous)


def _softmax(x, axis=-1):
    x = np.asarray(x)
    if _last_axis_kernel(x, axis):
        out = np.empty_like(x)
        _kernels().softmax_forward(out, x)
        return out
    e = np.exp(x - np.maximum.reduce(x, axis=axis, keepdims=True))
    e /= np.add.reduce(e, axis=axis, keepdims=True)
    return e


def _log_softmax(x, axis=-1):
    x = np.asarray(x)
    if _last_axis_kernel(x, axis):
        out = np.empty_like(x)
        _kernels().softmax_forward(out, x, log=True)
        return out
    shifted = x - np.maximum.reduce(x, axis=axis, keepdims=True)
    shifted -= np.log(np.add.reduce(np.exp(shifted), axis=axis, keepdims=True))
    return shifted


def _softmax_rule(g, ans, x, axis=-1):
    """``ans * (g - sum(g * ans, axis))``."""
    if type(g) is Tensor or type(ans) is Tensor:
        return ans * (g - _sum(g * ans, axis=axis, keepdims=True))
    if _last_axis_kernel(ans, axis) and _last_axis_kernel(g, axis) and g.dtype == ans.dtype:
        out = np.empty_like(g)
        _kernels().softmax_backward(out, g, ans)
        return out
    out = g * ans
    out -= ans * np.add.reduce(out, axis=axis, keepdims=True)
    return out


def _log_softmax_rule(g, ans, x, axis=-1):
    """``g - exp(ans) * sum(g, axis)``."""
    if (type(g) is not Tensor and type(ans) is not Tensor and _last_axis_kernel(ans, axis)
            and _last_axis_kernel(g, axis) and g.dtype == ans.dtype):
        out = np.empty_like(g)
        _kernels().softmax_backward(out, g, ans, log=True)
        return out
    return g - np.exp(ans) * _sum(g, axis=axis, keepdims=True)


SOFTMAX = _def("softmax", ("x",), _softmax, _softmax_rule,
               saves="ans")
LOG_SOFTMAX = _def("log_softmax", ("x",), _log_softmax, _log_softmax_rule, saves="ans")


def _norm2(x, axis=None, keepdims=False):
    x = np.asarray(x)
    return np.sqrt(np.add.reduce(x * x, axis=axis, keepdims=keepdims))


NORM2 = _def("linalg.norm", ("x",), _norm2,
             lambda g, ans, x, axis=None, keepdims=False:
             (_keepdims(g, x.shape, axis) / _keepdims(ans, x.shape, axis)) * x,
             saves="both")


# -- shape and indexing ------------------------------------------------------------

BROADCAST_TO = _def("broadcast_to", ("array",), np.broadcast_to,
                    lambda g, ans, x, shape: g, saves="none")   # the sweep sums g down
def _roll(a, shift, axis=None):
    if axis is None or isinstance(shift, tuple) or isinstance(axis, tuple) or a.ndim == 0:
        return np.roll(a, shift, axis)
    n = a.shape[axis]
    if n == 0:
        return a.copy()
    k = shift % n
    before = (slice(None),) * (axis % a.ndim)
    return np.concatenate((a[before + (slice(n - k, None),)], a[before + (slice(0, n - k),)]),
                          axis=axis)


ROLL = _def("roll", ("a",), _roll,
            lambda g, ans, x, shift, axis=None:
            np.roll(g, tuple(-s for s in shift) if isinstance(shift, tuple) else -shift, axis)
            if type(g) is Tensor else _roll(g, tuple(-s for s in shift) if isinstance(
                shift, tuple) else -shift, axis),
            saves="none")
_TRI_MASKS = {}


def _tri_mask(shape, k, upper):
    key = (shape[-2:], k, upper)
    mask = _TRI_MASKS.get(key)
    if mask is None:
        lower = np.tri(shape[-2], shape[-1], k - upper, dtype=bool)
        mask = ~lower if upper else lower
        if len(_TRI_MASKS) < 256:
            _TRI_MASKS[key] = mask
    return mask


_ZEROS = {}


def _zero(dtype):
    """A 0-d zero of ``dtype`` (cached, read-only)."""
    zero = _ZEROS.get(dtype)
    if zero is None:
        zero = np.zeros((), dtype)
        zero.flags.writeable = False
        if len(_ZEROS) < 64:
            _ZEROS[dtype] = zero
    return zero


def _tril(m, k=0):
    m = np.asarray(m)
    if m.ndim < 2:
        return np.tril(m, k)
    return np.where(_tri_mask(m.shape, k, False), m, _zero(m.dtype))


def _triu(m, k=0):
    m = np.asarray(m)
    if m.ndim < 2:
        return np.triu(m, k)
    return np.where(_tri_mask(m.shape, k, True), m, _zero(m.dtype))


TRIL = _def("tril", ("m",), _tril,
            lambda g, ans, x, k=0: np.tril(g, k) if type(g) is Tensor else _tril(g, k),
            saves="none")
TRIU = _def("triu", ("m",), _triu,
            lambda g, ans, x, k=0: np.triu(g, k) if type(g) is Tensor else _triu(g, k),
            saves="none")


def _pad_rule(g, ans, x, pad_width, constant_values=0):
    """The slice of ``g`` where ``x`` sits."""
    return g[tuple(slice(b, n - a) for (b, a), n in zip(pad_width, g.shape))]


def _pad(array, pad_width, constant_values=0):
    """``np.pad`` in mode "constant", ``pad_width`` one (before, after) pair per axis."""
    array = np.asarray(array)
    out = np.full(tuple(n + b + a for n, (b, a) in zip(array.shape, pad_width)),
                  constant_values, dtype=array.dtype)
    out[tuple(slice(b, b + n) for (b, _), n in zip(pad_width, array.shape))] = array
    return out


PAD = _def("pad", ("array",), _pad, _pad_rule, saves="none")


def _tile(a, reps, shape):
    """``np.tile`` with ``reps`` one count per axis of ``a``'s ``shape`` (with leading ones
    as long as ``reps``): ``a`` as (1, n) pairs copied into the (r, n) pairs of the result."""
    a = np.asarray(a)
    shape = (1,) * (len(reps) - len(shape)) + shape
    out = np.empty(tuple(r * n for r, n in zip(reps, shape)), a.dtype)
    out.reshape(tuple(x for r, n in zip(reps, shape) for x in (r, n)))[...] = a.reshape(
        tuple(x for n in shape for x in (1, n)))
    return out


def _tile_rule(g, ans, a, reps, shape):
    """``g`` summed over its copies."""
    padded = (1,) * (len(reps) - len(shape)) + shape
    split = g.reshape(tuple(x for r, n in zip(reps, padded) for x in (r, n)))
    return _sum(split, axis=tuple(range(0, 2 * len(padded), 2))).reshape(shape)


TILE = _def("tile", ("A",), _tile, _tile_rule, saves="none")


def _diagonal_rule(g, ans, x, offset=0, axis1=0, axis2=1, shape=None):
    """``g`` put on the diagonal of zeros of the input's ``shape`` (``diagonal_embed``)."""
    if type(g) is Tensor:
        return diagonal_embed(g, shape, offset, axis1, axis2)
    return _diagonal_embed(g, shape, offset, axis1, axis2)


DIAGONAL = _def("diagonal", ("a",), lambda a, offset=0, axis1=0, axis2=1, shape=None:
                np.asarray(a).diagonal(offset, axis1, axis2).copy(), _diagonal_rule,
                saves="none")


def _diagonal_embed(g, shape, offset, axis1, axis2):
    out = np.zeros(shape, np.asarray(g).dtype)
    n = np.shape(g)[-1]
    if len(shape) == 2 and axis1 % 2 == 0 and axis2 % 2 == 1:
        # The diagonal of a C-contiguous matrix is a strided slice of its elements.
        start = offset if offset >= 0 else -offset * shape[1]
        out.reshape(-1)[start:start + n * (shape[1] + 1):shape[1] + 1] = g
        return out
    rows = np.arange(n) + max(-offset, 0)
    cols = np.arange(n) + max(offset, 0)
    np.moveaxis(out, (axis1, axis2), (-2, -1))[..., rows, cols] = g
    return out


DIAGONAL_EMBED = _def("diagonal_embed", ("g",), _diagonal_embed,
                      lambda g, ans, d, shape, offset, axis1, axis2:
                      np.diagonal(g, offset, axis1, axis2))


def diagonal_embed(g, shape, offset, axis1, axis2):
    """An array of ``shape``, zero but for ``g`` on the diagonal (``np.diagonal``'s VJP)."""
    return DIAGONAL_EMBED(g, shape=shape, offset=offset, axis1=axis1, axis2=axis2)


def _concatenate(*arrays, axis=0):
    return np.concatenate(arrays, axis=axis)


def _concatenate_fwd(*arrays, axis=0):
    out = np.concatenate(arrays, axis=axis)
    return out, (tuple(np.shape(a)[axis] for a in arrays), axis)


def _concatenate_bwd(res, g):
    """``g`` split at the operands' boundaries."""
    sizes, axis = res
    before = (slice(None),) * (axis % g.ndim)
    out = []
    start = 0
    for n in sizes:
        out.append(g[before + (slice(start, start + n),)])
        start += n
    return out


CONCATENATE = Primitive("concatenate", ("*arrays",), _concatenate_fwd)
CONCATENATE.bwd = _concatenate_bwd
CONCATENATE.differentiable = True
TABLE["concatenate"] = CONCATENATE


def _stack_fwd(*arrays, axis=0):
    return np.stack(arrays, axis=axis), (len(arrays), axis)


def _stack_bwd(res, g):
    """``g`` taken apart along the new axis."""
    n, axis = res
    before = (slice(None),) * axis
    return [g[before + (k,)] for k in range(n)]


# One node for the stack (as a concatenate of reshaped operands it was 1 + n nodes).
STACK = Primitive("stack", ("*arrays",), _stack_fwd)
STACK.bwd = _stack_bwd
STACK.differentiable = True
TABLE["stack"] = STACK


# -- products and linear algebra ---------------------------------------------------

def _parse_einsum(subscripts, n_operands):
    """``(input subscripts, output subscripts)`` of an einsum specification."""
    if not isinstance(subscripts, str):
        raise NotImplementedError("einsum: adtape differentiates the subscripts form "
                                  "(einsum('ij,jk->ik', a, b)), not the sublist form")
    spec = subscripts.replace(" ", "")
    if "." in spec:
        raise NotImplementedError(f"einsum {subscripts!r}: adtape has no rule for '...' "
                                  f"(write the axes out)")
    inputs, arrow, output = spec.partition("->")
    inputs = inputs.split(",")
    if len(inputs) != n_operands:
        raise ValueError(f"einsum {subscripts!r} names {len(inputs)} operands, "
                         f"got {n_operands}")
    if not arrow:
        letters = "".join(inputs)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return inputs, output


def _einsum_fwd(*operands, subscripts):
    inputs, output = _parse_einsum(subscripts, len(operands))
    out = np.einsum(f"{','.join(inputs)}->{output}", *operands)
    return out, (inputs, output) + operands


def _einsum_bwd(res, g):
    """Each operand: einsum of ``g`` with the other operands, to its subscripts."""
    inputs, output = res[0], res[1]
    operands = res[2:]
    grads = []
    for i, (subs, x) in enumerate(zip(inputs, operands)):
        if len(set(subs)) != len(subs):
            raise NotImplementedError(f"einsum: no rule for operand {i} ({subs!r}): an index "
                                      f"repeated within one operand (a diagonal)")
        others = [s for j, s in enumerate(inputs) if j != i]
        seen = set(output).union(*others)
        kept = "".join(c for c in subs if c in seen)
        r = np.einsum(",".join([output] + others) + "->" + kept, g,
                      *[a for j, a in enumerate(operands) if j != i])
        if kept != subs:        # indices summed within this operand alone: broadcast back
            r = np.broadcast_to(np.reshape(r, [np.shape(x)[k] if c in seen else 1
                                               for k, c in enumerate(subs)]), np.shape(x))
        grads.append(r)
    return grads


EINSUM = Primitive("einsum", ("*operands",), _einsum_fwd)
EINSUM.bwd = _einsum_bwd
EINSUM.differentiable = True
TABLE["einsum"] = EINSUM


def _mT(a):
    """The last two axes swapped (an array's method: no dispatch layers)."""
    return a.swapaxes(-1, -2) if type(a) is _ndarray else np.swapaxes(a, -1, -2)


# One 2-D float32/float64 matrix goes to LAPACK and BLAS through SciPy's wrappers: the
# routines np.linalg calls (gesv, potrf), without its Python layers, which cost several
# times the work at small sizes.  Batches, other dtypes and Tensors take np.linalg.
_GESV = {np.dtype(np.float32): _lapack.sgesv, np.dtype(np.float64): _lapack.dgesv}
_POTRF = {np.dtype(np.float32): _lapack.spotrf, np.dtype(np.float64): _lapack.dpotrf}
_TRSM = {np.dtype(np.float32): _blas.strsm, np.dtype(np.float64): _blas.dtrsm}


def _lapack_matrix(a):
    """True when ``a`` is one nonempty square float32/float64 matrix (an ndarray)."""
    return (type(a) is _ndarray and a.ndim == 2 and a.dtype in _FLOATS
            and a.shape[0] == a.shape[1] and a.size)


def _linalg_solve(a, b):
    """``np.linalg.solve(a, b)``; a matrix and a vector or matrix of its dtype through
    LAPACK's gesv directly (C-ordered, as NumPy's).  A singular matrix takes np.linalg,
    which raises."""
    if (_lapack_matrix(a) and type(b) is _ndarray and b.dtype == a.dtype
            and 0 < b.ndim <= 2 and b.shape[0] == a.shape[0] and b.size):
        lu, piv, x, info = _GESV[a.dtype](a, b)
        if info == 0:
            return np.ascontiguousarray(x)
    return np.linalg.solve(a, b)


def _solve_a(g, ans, a, b):
    """``-solve(a.T, g) @ ans.T``."""
    if np.ndim(b) == 1:
        gb = _solve_b(g, ans, a, b)
        return -gb[..., :, None] * ans[..., None, :]
    return -_solve_b(g, ans, a, b) @ _mT(ans)


def _solve_b(g, ans, a, b):
    """``solve(a.T, g)``."""
    if np.ndim(b) == 1:
        if np.ndim(a) == 2:
            return _linalg_solve(_mT(a), g)
        return np.linalg.solve(_mT(a), g[..., None])[..., 0]
    return _linalg_solve(_mT(a), g)


_EYES = {}


def _linalg_inv(a):
    """``np.linalg.inv(a)``; a matrix as gesv against the identity, as NumPy does it."""
    if _lapack_matrix(a):
        key = (a.shape[0], a.dtype)
        eye = _EYES.get(key)
        if eye is None:
            eye = np.eye(a.shape[0], dtype=a.dtype)
            eye.flags.writeable = False
            if len(_EYES) < 256:
                _EYES[key] = eye
        lu, piv, x, info = _GESV[a.dtype](a, eye)
        if info == 0:
            return np.ascontiguousarray(x)
    return np.linalg.inv(a)


SOLVE = _def("linalg.solve", ("a", "b"), _linalg_solve, _solve_a, _solve_b, saves="both")
INV = _def("linalg.inv", ("a",), _linalg_inv,
           lambda g, ans, a: -_mT(ans) @ g @ _mT(ans), saves="ans")
DET = _def("linalg.det", ("a",), np.linalg.det,
           lambda g, ans, a: (g * ans)[..., None, None] * _mT(np.linalg.inv(a)), saves="both")
LOGABSDET = _def("linalg.slogdet", ("a",), lambda a: np.linalg.slogdet(a)[1],
                 lambda g, ans, a: g[..., None, None] * _mT(np.linalg.inv(a)))


def _cholesky(a):
    """``np.linalg.cholesky(a)``; a matrix through LAPACK's potrf directly (the lower
    factor, as NumPy).  One that is not positive definite takes np.linalg, which raises."""
    if _lapack_matrix(a):
        factor, info = _POTRF[a.dtype](a, lower=1, clean=1)
        if info == 0:
            return np.ascontiguousarray(factor)
    return np.linalg.cholesky(a)


_HALF_LOWER = {}


def _half_lower(n, dtype):
    """The n x n matrix of ones below the diagonal, halves on it, zeros above (cached,
    read-only): Murray's phi as one product."""
    key = (n, dtype)
    mask = _HALF_LOWER.get(key)
    if mask is None:
        mask = np.tri(n, dtype=dtype)
        mask[np.diag_indices(n)] = 0.5
        mask.flags.writeable = False
        if len(_HALF_LOWER) < 256:
            _HALF_LOWER[key] = mask
    return mask


def _cholesky_rule(g, ans, a):
    """Murray (2016), symmetrised."""
    # As autograd: with phi keeping the lower triangle and half the
    # diagonal, dA = L^-T phi(L^T dL) L^-1, symmetrised.
    if type(g) is _ndarray and type(ans) is _ndarray:
        n = ans.shape[-1]
        phi = (_mT(ans) @ g) * _half_lower(n, ans.dtype)
        if _lapack_matrix(ans) and g.dtype == ans.dtype:
            # L^-T phi, then half of (L^-T phi) L^-1: two triangular solves (BLAS trsm;
            # halving inside is exact, as outside).
            trsm = _TRSM[ans.dtype]
            s = trsm(0.5, ans, trsm(1.0, ans, phi, side=0, lower=1, trans_a=1),
                     side=1, lower=1)
            return s + s.T
    else:
        n = np.shape(ans)[-1]
        phi = np.tril(_mT(ans) @ g) * (1.0 - 0.5 * np.eye(n))
    s = np.linalg.solve(_mT(ans), _mT(np.linalg.solve(_mT(ans), _mT(phi))))
    return 0.5 * (s + _mT(s))


CHOLESKY = _def("linalg.cholesky", ("a",), _cholesky, _cholesky_rule, saves="ans")


def _eigh_packed(a):
    w, v = np.linalg.eigh(a)
    return np.concatenate([w[..., None, :], v], axis=-2)


def _eigh_rule(g, ans, a):
    """``V (diag(gw) + F * (V^T gV)) V^T``, symmetrised (distinct eigenvalues)."""
    # A = V diag(w) V^T: dA = V (diag(gw) + F * (V^T gV)) V^T with F_ij = 1/(w_j - w_i)
    # off the diagonal (eigenvalues must be distinct), symmetrised.
    n = np.shape(ans)[-1]
    w, v = ans[..., 0, :], ans[..., 1:, :]
    gw, gv = g[..., 0, :], g[..., 1:, :]
    off = 1.0 - np.eye(n)
    f = off / (w[..., None, :] - w[..., :, None] + np.eye(n))
    inner = gw[..., None, :] * np.eye(n) + f * (_mT(v) @ gv)
    s = v @ inner @ _mT(v)
    return 0.5 * (s + _mT(s))


EIGH = _def("linalg.eigh", ("a",), _eigh_packed, _eigh_rule, saves="ans")


def _svd_packed(a):
    u, s, vh = np.linalg.svd(a, full_matrices=False)
    k = s.shape[-1]
    m, n = a.shape[-2], a.shape[-1]
    out = np.zeros(a.shape[:-2] + (m + 1 + n, k), a.dtype)
    out[..., :m, :] = u
    out[..., m, :] = s
    out[..., m + 1:, :] = _mT(vh)
    return out


def _svd_rule(g, ans, a):
    """Townsend (2016) (distinct nonzero singular values)."""
    m, n = np.shape(a)[-2], np.shape(a)[-1]
    k = min(m, n)
    u, s, v = ans[..., :m, :], ans[..., m, :], ans[..., m + 1:, :]
    gu, gs, gv = g[..., :m, :], g[..., m, :], g[..., m + 1:, :]
    eye = np.eye(k)
    s2 = s * s
    f = (1.0 - eye) / (s2[..., None, :] - s2[..., :, None] + eye)
    ut_gu = _mT(u) @ gu
    vt_gv = _mT(v) @ gv
    s_mat = s[..., None, :] * eye
    s_inv = (1.0 / s)[..., None, :] * eye
    middle = (gs[..., None, :] * eye
              + (f * (ut_gu - _mT(ut_gu))) @ s_mat
              + s_mat @ (f * (vt_gv - _mT(vt_gv))))
    out = u @ middle @ _mT(v)
    out = out + (np.eye(m) - u @ _mT(u)) @ gu @ s_inv @ _mT(v)
    out = out + u @ s_inv @ _mT(gv) @ (np.eye(n) - v @ _mT(v))
    return out


SVD = _def("linalg.svd", ("a",), _svd_packed, _svd_rule, saves="both")
