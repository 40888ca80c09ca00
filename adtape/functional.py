"""Function transforms, in the spirit of JAX: ``grad``, ``value_and_grad``, ``jvp``,
``jacrev`` (``jacobian``), ``jacfwd``, ``hessian`` and ``hvp``.

``grad(f, argnums)(*args)`` records ``f`` on a fresh graph stacked on the
current tape and sweeps it once.  Arguments that are Python floats are
differentiated in scalar mode (``adtape.scalar``: one statement per scalar op,
swept in nogil Cython); arrays and Tensors in tensor mode.

Derivatives of derivatives: when an argument is a Tensor that an enclosing
transform (or ``requires_grad``) watches, ``grad`` records ``f`` onto that
transform's graph in keep mode (its nodes keep their residual Tensors) and
sweeps it with recording on, so its result is a Tensor that can be
differentiated again (reverse over reverse; PyTorch's ``create_graph``).
Forward mode is the transpose of reverse mode: ``jvp`` records the VJP
``u -> J^T u`` for a symbolic cotangent ``u`` and sweeps that linear graph for
``J v`` (no separate JVP rules, so every function with a VJP rule has a JVP).
"""
import contextlib
import functools
import numbers
import sys
import warnings

import numpy as np

from adtape import numpy as anp
from adtape.scalar import Scalar, ScalarTape
from adtape.tensor import (Primitive, Tensor, _FLOAT_DTYPES, _constant, _state, defvjp,
                           keeping, nested_graph, sweep_keeping)

__all__ = ["grad", "value_and_grad", "jvp", "jacrev", "jacobian", "jacfwd", "hessian", "hvp"]

# A node that marks an argument of a transform, so its cotangent has a place to land.
_IDENTITY = Primitive("identity", ("x",), lambda x: (x, ()))
defvjp(_IDENTITY, lambda g: g, differentiable=True)


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
        for i in nums:
            if _is_active_scalar(args[i]):
                raise TypeError(f"argument {i} of {_fname(f)} is a Scalar recorded by an "
                                f"enclosing transform: scalar mode does not differentiate "
                                f"twice; call the outer transform with a 0-d float64 array "
                                f"(np.float64(x)) for tensor mode, which does")
        if all(_is_python_float(args[i]) for i in nums):
            value, aux, grads, connected = _scalar_mode(f, args, kwargs, nums, has_aux)
        else:
            value, aux, grads, connected = _tensor_mode(f, args, kwargs, nums, has_aux)
        if not connected:
            _warn_independent()
        g = grads[0] if single else tuple(grads)
        return ((value, aux) if has_aux else value), g
    return value_and_grad_f


def _warn_independent():
    """Warn (as autograd) that the output does not depend on the differentiated arguments:
    the zero gradient is right, but it usually means f detached them somewhere.  The
    warning names the first frame outside this module (the user's call)."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
        level += 1
    warnings.warn("Output seems independent of input.", UserWarning, stacklevel=level)


def _is_active_scalar(a):
    return type(a) is Scalar and a.index != 0


def _is_python_float(a):
    return isinstance(a, numbers.Real) and not isinstance(a, (np.ndarray, np.generic, bool))


def _split_aux(out, has_aux, fname):
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{fname} was differentiated with has_aux=True and must return "
                        f"(value, aux), got {type(out).__name__}")
    return out


def _watched(values):
    """True when an enclosing transform records: a Tensor among ``values`` requires grad."""
    return _state.enabled and any(type(a) is Tensor and a.requires_grad for a in values)


def _fname(f):
    return getattr(f, "__name__", repr(f))


def _mark_inputs(args, nums, fname):
    """Replace ``args[i]`` for ``i`` in ``nums`` by identity nodes on the current graph
    (recording in keep mode); returns them."""
    marked = []
    for i in nums:
        a = args[i]
        if type(a) is Tensor and a.requires_grad:
            leaf = a
        else:
            arr = np.asarray(a.data if type(a) is Tensor else a)
            if arr.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"argument {i} of {fname} must be a float32/float64 array "
                                f"or a Python float to be differentiated, got dtype {arr.dtype}")
            leaf = Tensor(arr, requires_grad=True)
        args[i] = _IDENTITY(leaf)
        marked.append(args[i])
    return marked


def _output_tensor(out, fname, what):
    if type(out) is not Tensor:
        if not isinstance(out, (np.ndarray, np.generic, numbers.Real)):
            raise TypeError(f"{fname} must return an array or a Tensor for {what}, "
                            f"got {type(out).__name__}")
        out = Tensor(np.asarray(out, dtype=np.float64) if np.ndim(out) == 0 and not
                     isinstance(out, (np.ndarray, np.generic)) else out)
    return out


def _in_graph(out, graph, fname):
    """True when ``out`` depends on the recording (a node of ``graph``)."""
    if not out.requires_grad or out._is_leaf:
        return False
    if out._graph is not graph:
        raise RuntimeError(f"the result of {fname} was recorded in another graph than its "
                           f"arguments")
    return True


def _zeros_like(t):
    return _constant(np.zeros_like(t.data))


def _recording_mode(f, args, kwargs, nums, has_aux):
    """``grad`` under an enclosing recording: the gradient is a Tensor of its graph.
    Returns ``(out, aux, grads, connected)``: ``connected`` is false when no gradient
    reaches any argument (the output does not depend on them)."""
    fname = _fname(f)
    args = list(args)
    graph = _state.graph
    with keeping(graph):
        start = len(graph.nodes)
        marked = _mark_inputs(args, nums, fname)
        graph = marked[0]._graph
        out, aux = _split_aux(f(*args, **kwargs), has_aux, fname)
        out = _output_tensor(out, fname, "grad")
        if out.data.size != 1:
            raise ValueError(f"grad needs a scalar-valued function: {fname} returned shape "
                             f"{out.data.shape}")
        grads = [None] * len(marked)
        if _in_graph(out, graph, fname):
            grads = sweep_keeping(graph, start, out._ref, _constant(np.ones_like(out.data)),
                                  [m._ref for m in marked], create=True)
    connected = any(g is not None for g in grads)
    grads = [g if g is not None else _zeros_like(m) for g, m in zip(grads, marked)]
    return out, aux, grads, connected


def _tensor_mode(f, args, kwargs, nums, has_aux):
    if _watched(args) or _watched(kwargs.values()):
        return _recording_mode(f, args, kwargs, nums, has_aux)
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
    # The sweep reaches a leaf exactly when the output depends on it.
    connected = any(leaf.grad is not None for leaf in leaves)
    grads = [leaf.grad if leaf.grad is not None else np.zeros_like(leaf.data) for leaf in leaves]
    return out.data, aux, grads, connected


def _scalar_mode(f, args, kwargs, nums, has_aux):
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
            connected = out.index != 0
        elif _is_python_float(out):
            grads = [0.0] * len(variables)
            value = float(out)
            connected = False
        else:
            raise TypeError(f"{fname} called with float arguments must return a float or an "
                            f"adtape Scalar, got {type(out).__name__}")
    return value, aux, grads, connected


# -- forward mode, Jacobians, Hessians ---------------------------------------------------

@contextlib.contextmanager
def _linearized(f, args, nums, fname, what):
    """Record ``f`` in keep mode with ``args[i]`` (``i`` in ``nums``) marked; yields
    ``(graph, out, marked, start, watched)``.  Under an enclosing recording the records go
    onto its graph (so the results can be differentiated again), else onto a nested one."""
    watched = _watched(args)
    with (contextlib.nullcontext() if watched else nested_graph()):
        graph = _state.graph
        with keeping(graph):
            start = len(graph.nodes)
            args = list(args)
            marked = _mark_inputs(args, nums, fname)
            graph = marked[0]._graph
            out = _output_tensor(f(*args), fname, what)
            yield graph, out, marked, start, watched


def _finish(value, watched):
    if watched:
        return value
    return value.data if type(value) is Tensor else value


def _stack(values, shape, watched):
    """Stack Tensors/arrays (each of one shape) and reshape to ``shape``."""
    if not values:
        return np.zeros(shape)
    if watched:
        return anp.reshape(anp.stack(values), shape)
    return np.stack([v.data if type(v) is Tensor else v for v in values]).reshape(shape)


def _transposed(graph, out, marked, start):
    """Record ``u -> J^T u`` for a leaf ``u`` of ``out``'s shape; returns ``(u, cts, mid)``:
    ``cts[i]`` is a node of ``graph`` recorded after ``mid`` (or None: no dependence)."""
    u = Tensor(np.zeros_like(out.data), requires_grad=True)
    cts = [None] * len(marked)
    mid = len(graph.nodes)
    if _in_graph(out, graph, "the function"):
        cts = sweep_keeping(graph, start, out._ref, u, [m._ref for m in marked], create=True)
    # Each cotangent as its own node after mid, so a sweep from it stops there.
    cts = [None if c is None or type(c) is not Tensor or not c.requires_grad else _IDENTITY(c)
           for c in cts]
    return u, cts, mid


def jvp(f, primals, tangents):
    """``(f(*primals), J v)``: the Jacobian-vector product of ``f`` at ``primals`` with
    ``tangents`` (one per primal, of its shape), as ``jax.jvp``.  Forward mode by
    transposition: the VJP is recorded for a symbolic cotangent and swept once more."""
    primals, tangents = tuple(primals), tuple(tangents)
    fname = _fname(f)
    if len(primals) != len(tangents):
        raise ValueError(f"jvp: {len(primals)} primals but {len(tangents)} tangents")
    for i, (p, t) in enumerate(zip(primals, tangents)):
        if np.shape(p.data if type(p) is Tensor else p) != np.shape(
                t.data if type(t) is Tensor else t):
            raise ValueError(f"jvp: tangent {i} has shape {np.shape(t)}, its primal "
                             f"{np.shape(p)}")
    watched = _watched(tangents)
    with _linearized(f, primals, range(len(primals)), fname, "jvp") as (
            graph, out, marked, start, watched_primals):
        watched = watched or watched_primals
        with keeping(graph):
            u, cts, mid = _transposed(graph, out, marked, start)
            total = None
            for c, t in zip(cts, tangents):
                if c is not None:
                    term = (c * t).sum()
                    total = term if total is None else total + term
            tangent_out = None
            if total is not None and total.requires_grad and u._graph is graph:
                tangent_out, = sweep_keeping(graph, mid, total._ref,
                                             _constant(np.ones_like(total.data)), [u._ref],
                                             create=watched)
            if tangent_out is None:
                tangent_out = _zeros_like(out)
        return _finish(out, watched), _finish(tangent_out, watched)


def _argnums(argnums, n_args, fname):
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)
    if not nums or not all(isinstance(i, int) for i in nums):
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}")
    for i in nums:
        if not -n_args <= i < n_args:
            raise ValueError(f"argnums {i} is out of range for {n_args} positional "
                             f"arguments of {fname!r}")
    return single, tuple(i % n_args for i in nums)


def jacrev(f, argnums=0):
    """The Jacobian of ``f`` by reverse mode (one sweep per output element), of shape
    ``out.shape + arg.shape`` (a tuple of them for a tuple ``argnums``)."""
    @functools.wraps(f)
    def jacrev_f(*args):
        fname = _fname(f)
        single, nums = _argnums(argnums, len(args), fname)
        with _linearized(f, args, nums, fname, "jacrev") as (graph, out, marked, start,
                                                             watched):
            rows = [[] for _ in nums]
            if _in_graph(out, graph, fname):
                for k in range(out.data.size):
                    seed = np.zeros(out.data.size, out.data.dtype)
                    seed[k] = 1
                    cts = sweep_keeping(graph, start, out._ref,
                                        _constant(seed.reshape(out.data.shape)),
                                        [m._ref for m in marked], create=watched)
                    for r, c, m in zip(rows, cts, marked):
                        r.append(c if c is not None else _zeros_like(m))
            jacs = [_finish(_stack(r, out.data.shape + m.data.shape, watched) if r else
                            _constant(np.zeros(out.data.shape + m.data.shape, m.data.dtype)),
                            watched) for r, m in zip(rows, marked)]
        return jacs[0] if single else tuple(jacs)
    return jacrev_f


jacobian = jacrev


def jacfwd(f, argnums=0):
    """The Jacobian of ``f`` by forward mode (one tangent per input element), of shape
    ``out.shape + arg.shape`` (a tuple of them for a tuple ``argnums``)."""
    @functools.wraps(f)
    def jacfwd_f(*args):
        fname = _fname(f)
        single, nums = _argnums(argnums, len(args), fname)
        with _linearized(f, args, nums, fname, "jacfwd") as (graph, out, marked, start,
                                                             watched):
            with keeping(graph):
                u, cts, mid = _transposed(graph, out, marked, start)
                jacs = []
                for c, m in zip(cts, marked):
                    shape = out.data.shape + m.data.shape
                    if c is None or u._graph is not graph:
                        jacs.append(_finish(_constant(np.zeros(shape, m.data.dtype)), watched))
                        continue
                    columns = []
                    for k in range(m.data.size):
                        seed = np.zeros(m.data.size, m.data.dtype)
                        seed[k] = 1
                        col, = sweep_keeping(graph, mid, c._ref,
                                             _constant(seed.reshape(m.data.shape)), [u._ref],
                                             create=watched)
                        columns.append(col if col is not None else _zeros_like(out))
                    # columns: one per input element, each of the output's shape
                    jac = _stack(columns, m.data.shape + out.data.shape, watched)
                    nd_in = m.data.ndim
                    perm = tuple(range(nd_in, nd_in + out.data.ndim)) + tuple(range(nd_in))
                    jac = jac.transpose(perm) if perm else jac
                    jacs.append(_finish(jac, watched))
        return jacs[0] if single else tuple(jacs)
    return jacfwd_f


def hessian(f, argnums=0):
    """The Hessian of scalar ``f``: ``jacfwd(grad(f))`` (forward over reverse, as JAX)."""
    if not isinstance(argnums, int):
        raise TypeError("hessian takes one argnums (an int)")
    return jacfwd(grad(f, argnums), argnums)


def hvp(f, argnums=0, mode="reverse"):
    """``hvp(f)(*args, v)``: the Hessian of scalar ``f`` times ``v`` without forming it;
    ``mode="reverse"`` differentiates ``<grad f, v>`` (reverse over reverse),
    ``mode="forward"`` is ``jvp(grad(f), args, v)`` (forward over reverse)."""
    if not isinstance(argnums, int):
        raise TypeError("hvp takes one argnums (an int)")
    if mode not in ("reverse", "forward"):
        raise ValueError(f"hvp: mode must be 'reverse' or 'forward', got {mode!r}")
    df = grad(f, argnums)

    @functools.wraps(f)
    def hvp_f(*args):
        if len(args) < 2:
            raise TypeError("hvp(f)(*args, v): give the arguments of f and a vector v")
        *args, v = args
        if mode == "forward":
            def of_x(x):
                a = list(args)
                a[argnums] = x
                return df(*a)
            return jvp(of_x, (args[argnums],), (v,))[1]

        def directional(*a):
            return (df(*a) * v).sum()
        return grad(directional, argnums)(*args)
    return hvp_f
