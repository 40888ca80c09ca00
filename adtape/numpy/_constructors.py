"""adtape.numpy's constructors and queries: shapes, ``*_like``, ``arg*`` read values or
shapes (nothing to record); ``array``/``asarray`` stack Tensors and ``full``/``full_like``
broadcast a Tensor fill value, so the gradient flows."""
import numpy as np

from adtape.numpy._fastpath import _data
from adtape.numpy._shapes import broadcast_to, stack
from adtape.tensor import Tensor


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
