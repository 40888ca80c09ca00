"""adtape.numpy's reductions.  ``keepdims`` is keyword-only: NumPy's third and fourth
positions are ``dtype`` and ``out``."""
import numpy as np

from adtape import vjps as _ops
from adtape.numpy._elementwise import sqrt, where
from adtape.numpy._fastpath import _data, _fast


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
