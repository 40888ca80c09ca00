"""numpy.linalg's functions, recorded: ``adtape.numpy.linalg`` (``anp.linalg.solve(a, b)``).

A numpy.linalg name without a rule raises AttributeError naming it."""
import builtins

import numpy as np

from adtape import vjps as _ops
from adtape.numpy import _vjps as _t
from adtape.numpy._elementwise import absolute, reciprocal, where
from adtape.numpy._fastpath import _data, _fast
from adtape.numpy._reductions import max, min, sum
from adtape.numpy._shapes import _normalize_axes, expand_dims, moveaxis, reshape, swapaxes
from adtape.tensor import _constant

__all__ = ["solve", "inv", "det", "slogdet", "cholesky", "eigh", "svd", "norm", "pinv"]


def solve(a, b):
    return _t.SOLVE(a, b)


def inv(a):
    return _fast.INV(a)


def det(a):
    return _fast.DET(a)


def slogdet(a):
    """``(sign, logabsdet)``; the sign is a constant."""
    sign_ = np.linalg.slogdet(_data(a))[0]
    return _constant(np.asarray(sign_)), _fast.LOGABSDET(a)


def cholesky(a):
    return _fast.CHOLESKY(a)


def eigh(a, UPLO="L"):
    """``(w, v)`` of a symmetric matrix (its lower triangle is read); the gradient
    assumes distinct eigenvalues and is symmetric."""
    if UPLO != "L":
        raise NotImplementedError(f"eigh: adtape has a rule for UPLO='L' only, not {UPLO!r}")
    packed = _fast.EIGH(a)
    return _ops.getitem(packed, (Ellipsis, 0, slice(None))), \
        _ops.getitem(packed, (Ellipsis, slice(1, None), slice(None)))


def svd(a, full_matrices=True, compute_uv=True, hermitian=False):
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


def pinv(a, rcond=None, hermitian=False):
    """Through ``svd``: singular values below ``rcond * max`` are dropped (their mask is
    constant); the gradient needs the kept ones distinct."""
    if hermitian:
        raise NotImplementedError("pinv: adtape has no rule for hermitian=True")
    shape = np.shape(_data(a))
    if rcond is None:
        rcond = builtins.max(shape[-2:]) * np.finfo(np.asarray(_data(a)).dtype).eps
    u, s, vh = svd(a, full_matrices=False)
    sd = _data(s)
    kept = sd > rcond * np.max(sd, axis=-1, keepdims=True)
    s_inv = where(kept, reciprocal(where(kept, s, 1.0)), 0.0)
    return _ops.matmul(swapaxes(vh, -1, -2) * expand_dims(s_inv, -2), swapaxes(u, -1, -2))


def norm(x, ord=None, axis=None, keepdims=False):
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
        s = svd(moveaxis(x, (row, col), (-2, -1)), full_matrices=False, compute_uv=False)
        return {"nuc": sum, 2: max, -2: min}[ord](s, -1)
    raise ValueError(f"norm: invalid norm order {ord!r} for matrices")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(f"module 'adtape.numpy.linalg' has no attribute {name!r}")
    if hasattr(np.linalg, name):
        raise AttributeError(f"adtape.numpy.linalg has no {name!r}: adtape has no derivative "
                             f"rule for numpy.linalg.{name} yet")
    raise AttributeError(f"module 'adtape.numpy.linalg' has no attribute {name!r}")
