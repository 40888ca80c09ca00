"""Function transforms: ``grad`` and ``value_and_grad``, in the spirit of JAX and clad::gradient.

``grad(f, argnums)(*args)`` records ``f`` on a fresh graph stacked on the
current tape and sweeps it once.  Arguments that are Python floats are
differentiated in scalar mode (``adtape.scalar``: one statement per scalar op,
swept in nogil Cython); arrays and Tensors in tensor mode.
"""
import functools
import numbers

import numpy as np

from adtape.tensor import Tensor, _FLOAT_DTYPES, nested_graph

__all__ = ["grad", "value_and_grad"]


def grad(f, argnums=0, has_aux=False):
    """Return a function computing the gradient of scalar-valued ``f`` with
    respect to the positional arguments ``argnums`` (an int or a tuple of ints)."""
    vg = value_and_grad(f, argnums, has_aux)

    @functools.wraps(f)
    def grad_f(*args, **kwargs):
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g
    return grad_f


def value_and_grad(f, argnums=0, has_aux=False):
    """Return a function computing ``(f(*args), gradient)``; with ``has_aux``,
    ``f`` returns ``(value, aux)`` and the result is ``((value, aux), gradient)``."""
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)
    if not nums or not all(isinstance(i, int) for i in nums):
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}")

    @functools.wraps(f)
    def value_and_grad_f(*args, **kwargs):
        for i in nums:
            if not -len(args) <= i < len(args):
                raise ValueError(f"argnums {i} is out of range for {len(args)} positional "
                                 f"arguments of {getattr(f, '__name__', f)!r}")
        if all(_is_python_float(args[i]) for i in nums):
            value, aux, grads = _scalar_mode(f, args, kwargs, nums, has_aux)
        else:
            value, aux, grads = _tensor_mode(f, args, kwargs, nums, has_aux)
        g = grads[0] if single else tuple(grads)
        return ((value, aux) if has_aux else value), g
    return value_and_grad_f


def _is_python_float(a):
    return isinstance(a, numbers.Real) and not isinstance(a, (np.ndarray, np.generic, bool))


def _split_aux(out, has_aux, fname):
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{fname} was differentiated with has_aux=True and must return "
                        f"(value, aux), got {type(out).__name__}")
    return out


def _tensor_mode(f, args, kwargs, nums, has_aux):
    fname = getattr(f, "__name__", repr(f))
    args = list(args)
    with nested_graph():
        leaves = []
        for i in nums:
            a = args[i]
            arr = np.asarray(a.data if type(a) is Tensor else a)
            if arr.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"argument {i} of {fname} must be a float32/float64 array "
                                f"or a Python float to be differentiated, got dtype {arr.dtype}")
            leaf = Tensor(arr, requires_grad=True)
            args[i] = leaf
            leaves.append(leaf)
        out, aux = _split_aux(f(*args, **kwargs), has_aux, fname)
        if type(out) is not Tensor:
            out = Tensor(out)
        if out.data.size != 1:
            raise ValueError(f"grad needs a scalar-valued function: {fname} returned shape "
                             f"{out.data.shape}; reduce it (e.g. .sum()) or call "
                             f".backward(seed) for a vector-Jacobian product")
        if out.requires_grad:
            out.backward()
    grads = [leaf.grad if leaf.grad is not None else np.zeros_like(leaf.data) for leaf in leaves]
    return out.data, aux, grads


def _scalar_mode(f, args, kwargs, nums, has_aux):
    from adtape.scalar import Scalar, ScalarTape
    fname = getattr(f, "__name__", repr(f))
    args = list(args)
    with ScalarTape() as st:
        variables = []
        for i in nums:
            v = st.variable(float(args[i]))
            args[i] = v
            variables.append(v)
        out, aux = _split_aux(f(*args, **kwargs), has_aux, fname)
        if isinstance(out, Scalar):
            grads = st.gradient(out, variables)
            value = out.value
        elif _is_python_float(out):
            grads = [0.0] * len(variables)
            value = float(out)
        else:
            raise TypeError(f"{fname} called with float arguments must return a float or an "
                            f"adtape Scalar, got {type(out).__name__}")
    return value, aux, grads
