"""adtape.numpy's products: ``matmul``, ``dot``, ``tensordot`` and their kin, written
with the built-in ``matmul``, ``mul``, ``reshape`` and ``transpose``; ``einsum``."""
import builtins
import math

import numpy as np

from adtape import vjps as _ops
from adtape.numpy import _vjps as _t
from adtape.numpy._fastpath import _by_reference, _data
from adtape.numpy._reductions import sum
from adtape.numpy._shapes import _normalize_axes, ravel

_ndarray = np.ndarray


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
