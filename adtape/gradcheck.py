"""Finite-difference checks of derivatives (like autograd's ``check_grads``).

``check_grads(f, *args)`` compares, for each float argument and a few random
directions ``u``, the directional derivative ``<grad_i f, u>`` from the reverse
sweep with the central difference ``(f(a + eps u) - f(a - eps u)) / 2 eps``.
A non-scalar ``f`` is checked through a random projection ``sum(f * v)``, which
exercises the full vector-Jacobian product.  ``modes=("rev", "fwd")`` also checks
``jvp``; ``order=2`` then checks the derivatives of ``<grad_i f, w>`` the same way
(and so on), which exercises the rules' own derivatives.  Use float64 arguments.
"""
import warnings

import numpy as np

from adtape.functional import _is_python_float, grad, jvp, value_and_grad
from adtape.tensor import Tensor, no_grad

__all__ = ["check_grads"]


def _value_of(out):
    if type(out) is Tensor:
        return np.asarray(out.data, dtype=np.float64)
    if hasattr(out, "value") and not isinstance(out, np.ndarray):
        return np.asarray(out.value, dtype=np.float64)
    return np.asarray(out, dtype=np.float64)


def check_grads(f, *args, argnums=None, modes=("rev",), order=1, eps=1e-6, rtol=1e-5,
                atol=1e-7, n_directions=2, seed=0):
    """Raise AssertionError naming the argument when a derivative of ``f`` at ``args``
    disagrees with central finite differences.

    ``argnums``: the arguments to check (default: every float array and Python float).
    ``modes``: ``"rev"`` (the reverse sweep) and/or ``"fwd"`` (``jvp``).
    ``order``: 2 checks the first and the second derivatives, and so on.
    """
    for mode in modes:
        if mode not in ("rev", "fwd"):
            raise ValueError(f"check_grads: modes are 'rev' and 'fwd', got {mode!r}")
    if order < 1:
        raise ValueError(f"check_grads: order must be at least 1, got {order}")
    rng = np.random.default_rng(seed)
    if argnums is None:
        argnums = tuple(i for i, a in enumerate(args)
                        if _is_python_float(a) or np.asarray(getattr(a, "data", a)).dtype.kind == "f")
    elif isinstance(argnums, int):
        argnums = (argnums,)
    if not argnums:
        raise ValueError("check_grads: no float argument to check")
    args = [a.data if type(a) is Tensor else a for a in args]
    for i in argnums:
        if not _is_python_float(args[i]) and np.asarray(args[i]).dtype != np.float64:
            raise TypeError(f"check_grads: argument {i} is {np.asarray(args[i]).dtype}; finite "
                            "differences need float64")
    if order > 1 or "fwd" in modes:
        # Derivatives of derivatives and jvp run in tensor mode: Python floats become 0-d.
        args = [np.float64(a) if _is_python_float(a) else a for a in args]

    def as_input(i, a):
        return a if _is_python_float(a) or i not in argnums else Tensor(a)

    with no_grad():
        out0 = _value_of(f(*[as_input(i, a) for i, a in enumerate(args)]))
    projection = None if out0.size == 1 else rng.standard_normal(out0.shape)

    def scalar_f(*a):
        out = f(*a)
        if projection is None:
            return out
        if type(out) is Tensor:
            return (out * projection).sum()
        return float(np.sum(_value_of(out) * projection))

    name = getattr(f, "__name__", repr(f))
    if "rev" in modes:
        with warnings.catch_warnings():
            # A derivative that is constant (order 2 of a linear f) is checked as such.
            warnings.filterwarnings("ignore", "Output seems independent of input")
            _, grads = value_and_grad(scalar_f, argnums)(*args)
    for k, i in enumerate(argnums):
        base = args[i]
        is_float = _is_python_float(base)
        for _ in range(n_directions):
            u = float(rng.standard_normal()) if is_float else rng.standard_normal(np.shape(base))
            plus = [as_input(j, a) for j, a in enumerate(args)]
            minus = list(plus)
            plus[i] = as_input(i, base + eps * u)
            minus[i] = as_input(i, base - eps * u)
            with no_grad():
                fd = (_value_of(scalar_f(*plus)) - _value_of(scalar_f(*minus))) / (2 * eps)
            fd = np.asarray(fd).item()
            derivatives = []
            if "rev" in modes:
                derivatives.append(("reverse mode", float(np.sum(np.asarray(grads[k]) * u))))
            if "fwd" in modes:
                def along(x, i=i):
                    a = list(args)
                    a[i] = x
                    return scalar_f(*a)
                _, tangent = jvp(along, (base,), (np.asarray(u, dtype=np.float64),))
                derivatives.append(("forward mode", float(np.sum(tangent))))
            for how, ad in derivatives:
                if not abs(fd - ad) <= atol + rtol * max(abs(fd), abs(ad)):
                    raise AssertionError(
                        f"gradient of {name} w.r.t. argument {i}: {how} gives a directional "
                        f"derivative {ad!r}, finite differences give {fd!r} "
                        f"(|diff| = {abs(fd - ad):.3g}, eps = {eps})")
    if order > 1:
        for i in argnums:
            w = rng.standard_normal(np.shape(args[i]))

            def directional(*a, i=i, w=w):
                return (grad(scalar_f, i)(*a) * w).sum()
            directional.__name__ = f"<grad of {name} w.r.t. argument {i}, projected>"
            check_grads(directional, *args, argnums=argnums, modes=modes, order=order - 1,
                        eps=eps, rtol=rtol, atol=atol, n_directions=n_directions,
                        seed=seed + 1)
