"""adtape.numpy's shape and indexing functions: views, joins, splits, gathers and
permutations, each recorded as the built-in ``reshape``/``transpose``/``getitem`` or a
primitive of the table."""
import builtins

import numpy as np

from adtape import vjps as _ops
from adtape.numpy import _vjps as _t
from adtape.numpy._fastpath import _data, _fast
from adtape.numpy._reductions import sum
from adtape.tensor import Tensor, _constant


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
