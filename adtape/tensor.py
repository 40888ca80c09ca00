"""Tensors that record reverse-mode AD on the layered tape, and the reverse sweep.

A ``Tensor`` wraps a float32/float64 NumPy array.  An op computes its value
eagerly and, when an input requires a gradient, appends a node to the graph of
the active ``OpTape``: the primitive, where each input comes from (a node index,
or a leaf), the input shapes, and the residuals its VJP rule needs.  Residual
arrays computed by the program are copied into the byte tape (one raw record
each, its shape and dtype kept on the node), so under a ``memory_budget`` they
spill to disk; the data of leaves and constants is kept by reference, since
nothing rewrites it between the forward and the backward pass (the optimizer
steps after).

``backward()`` walks the node list from the end in a plain loop (no recursion,
so a chain of 10^5 ops is fine), pops each node's residuals in mirror order of
their pushes and calls the primitive's rule.  Rules come from a registry
(``defvjp``, ``custom_vjp``); the built-in table is in ``adtape.vjps``.  The
recording of a node and the reverse loop are C (``adtape._graph``): at small
sizes they are most of an op's cost.
"""
import contextlib
import functools
import sys
import weakref

import numpy as np

from adtape import _graph
from adtape._graph import Graph as _Graph
from adtape._graph import TensorBase
from adtape._graph import constant as _constant
from adtape._graph import deferred_zero as _deferred_zero
from adtape._graph import record as _record
from adtape._graph import state as _state
from adtape._graph import take_deferred as _take_deferred
from adtape._graph import unbroadcast as _unbroadcast
from adtape._tape import Tape, TapeClosedError

__all__ = ["Tensor", "OpTape", "Primitive", "primitive", "defvjp", "defvjp_accumulate",
           "custom_vjp", "no_grad", "enable_grad", "is_grad_enabled", "current_op_tape",
           "tensor"]

_ndarray = np.ndarray
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# Every Primitive alive, for adtape.profile(), which times their rules.
_PRIMITIVES = weakref.WeakSet()


def all_primitives():
    """Every Primitive alive (the built-in ops, the kernel ops, user ones)."""
    return list(_PRIMITIVES)


class Primitive:
    """An op with a VJP rule.

    Three kinds of rule can be registered (see ``defvjp``, ``defvjp_accumulate``
    and ``custom_vjp``): one pullback per argument, ``pullback(g, *res, **kw)``
    returning that argument's gradient; a joint ``bwd(res, g)`` returning a
    tuple of gradients; or an accumulating ``bwd(g, dests, *res, **kw)`` that
    adds (+=) into preallocated gradient buffers (the kernel ops use it: their
    backward kernels accumulate in place, so nothing is allocated per step).
    An accumulating rule registered with ``overwrite=True`` is called as
    ``bwd(g, dests, fresh, *res, **kw)`` and must write (not add) ``dests[i]``
    where ``fresh[i]``: that buffer holds no gradient yet, only garbage.
    """
    __slots__ = ("name", "argnames", "fwd", "vjps", "bwd", "bwd_acc", "bwd_overwrite",
                 "differentiable", "__weakref__")

    def __init__(self, name, argnames, fwd=None):
        self.name = name
        self.argnames = tuple(argnames)
        self.fwd = fwd
        self.vjps = None
        self.bwd = None
        self.bwd_acc = None
        self.bwd_overwrite = False
        # True when the rules are written in NumPy functions that also take Tensors, so
        # that a sweep that records (higher order, forward mode) can differentiate them.
        self.differentiable = False
        _PRIMITIVES.add(self)

    def __repr__(self):
        return f"<adtape primitive {self.name}({', '.join(self.argnames)})>"

    def __call__(self, *args, **kwargs):
        """Apply a primitive whose ``fwd(*arrays, **kwargs)`` returns ``(out, residuals)``."""
        if len(args) != len(self.argnames) and not self.argnames[-1].startswith("*"):
            raise TypeError(f"{self.name} takes {len(self.argnames)} arguments "
                            f"({', '.join(self.argnames)}), got {len(args)}")
        arrays = [a.data if type(a) is Tensor else a for a in args]
        out, res = self.fwd(*arrays, **kwargs)
        out = _as_array(out, self.name)
        if _state.enabled and _needs_grad(args):
            # Residuals that are the very arrays of the inputs are those inputs: a leaf's
            # or constant's array (an ndarray argument is a constant) is kept by reference.
            by_input = {}
            for a in args:
                if type(a) is Tensor:
                    by_input[id(a.data)] = a
                elif type(a) is _ndarray:
                    by_input[id(a)] = _constant(a)
            res = [by_input.get(id(r), r) if type(r) is _ndarray else r for r in res]
            return _record(self, out, args, res, kwargs)
        return _constant(out)

    def missing_rule(self, argnum):
        name = self.argnames[min(argnum, len(self.argnames) - 1)]
        return NotImplementedError(
            f"no VJP rule for argument {argnum} ({name!r}) of op {self.name!r}; "
            f"register one with adtape.defvjp({self.name}, ...)")


# Libraries whose functions convert their arguments with np.asarray and compute on the
# arrays: a recorded Tensor handed to one would come out as a value without derivative.
_CONVERTING_LIBRARIES = ("scipy",)


def _carries_derivative(t):
    """True when a derivative flows through ``t``'s value: it requires grad, grad mode is
    on, and it is a leaf or a node of a graph not swept yet (after ``backward()`` nothing
    flows through it any more, so ``float(loss)`` is safe there)."""
    return t.requires_grad and _state.enabled and (t._is_leaf or not t._graph.freed)


def _lost_derivative(what):
    return TypeError(
        f"{what} would drop the derivative of a recorded Tensor (one that requires grad): "
        f"use adtape.numpy's functions (anp.sin(t)) or adtape.scipy.special's, or take the "
        f"value as a constant deliberately with t.item() or np.asarray(t)")


def _needs_grad(args):
    for a in args:
        if type(a) is Tensor and a.requires_grad:
            return True
    return False


def _as_array(out, opname):
    if type(out) is _ndarray:
        return out
    if isinstance(out, (_ndarray, np.generic, float, int)):
        return np.asarray(out)
    raise TypeError(f"op {opname!r} must return an ndarray, got {type(out).__name__}")


def primitive(fun):
    """Make ``fun`` (a NumPy function of arrays) a primitive, autograd style.

    Its residuals are ``(ans, *args)``; register pullbacks with
    ``defvjp(f, lambda g, ans, x, y: ..., ...)``, one per argument.
    """
    def fwd(*args, **kwargs):
        ans = fun(*args, **kwargs)
        return ans, (ans,) + args
    return Primitive(fun.__name__, _argnames(fun), fwd)


def _argnames(fun):
    code = fun.__code__
    return code.co_varnames[:code.co_argcount]


def defvjp(prim, *pullbacks, differentiable=False):
    """Register one pullback per argument of ``prim``; ``None`` marks an argument
    without a rule (differentiating through it raises NotImplementedError).

    ``differentiable=True`` declares that the pullbacks are written in NumPy
    functions and operators that adtape can record when handed Tensors (as the
    built-in table's are), so ``grad`` of ``grad``, ``hessian`` and ``jvp`` may
    differentiate them; otherwise those transforms raise NotImplementedError."""
    if not isinstance(prim, Primitive):
        raise TypeError(f"defvjp needs an adtape Primitive, got {type(prim).__name__}")
    if len(pullbacks) > len(prim.argnames):
        raise ValueError(f"{prim.name} has {len(prim.argnames)} arguments, "
                         f"got {len(pullbacks)} pullbacks")
    prim.vjps = tuple(pullbacks) + (None,) * (len(prim.argnames) - len(pullbacks))
    prim.bwd = prim.bwd_acc = None
    prim.bwd_overwrite = False
    prim.differentiable = bool(differentiable)
    return prim


def defvjp_accumulate(prim, bwd, overwrite=False):
    """Register ``bwd(g, dests, *res, **kw)`` that adds each input's gradient into
    ``dests[i]`` (a zero-initialised or running buffer; ``None`` if not needed).

    With ``overwrite=True`` the rule is ``bwd(g, dests, fresh, *res, **kw)``: where
    ``fresh[i]`` is true, ``dests[i]`` holds no gradient yet (a new ``np.empty``
    buffer, or a leaf's ``.grad`` after ``zero_grad(deferred=True)``) and the rule
    writes its result there instead of adding it, which saves zeroing the buffer
    and reading it back.  Destinations are handed out in argument order, so when
    two of them are one buffer only the first is fresh: write that one first.
    """
    if not isinstance(prim, Primitive):
        raise TypeError(f"defvjp_accumulate needs an adtape Primitive, got {type(prim).__name__}")
    prim.bwd_acc = bwd
    prim.bwd_overwrite = bool(overwrite)
    prim.vjps = prim.bwd = None
    prim.differentiable = False
    return prim


class custom_vjp:
    """JAX-style custom derivative: ``f = custom_vjp(fun)``, then
    ``f.defvjp(fwd, bwd)`` with ``fwd(*args) -> (out, residuals)`` and
    ``bwd(residuals, g) -> tuple of gradients`` (``None`` for no gradient).
    ``fun`` and the rules work on NumPy arrays; residual arrays go on the tape."""

    def __init__(self, fun):
        self.fun = fun
        self.prim = Primitive(fun.__name__, _argnames(fun), lambda *a, **k: (fun(*a, **k), ()))
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd, bwd):
        self.prim.fwd = fwd
        self.prim.bwd = bwd
        self.prim.vjps = self.prim.bwd_acc = None
        self.prim.bwd_overwrite = False
        self.prim.differentiable = False
        return self

    def __call__(self, *args, **kwargs):
        return self.prim(*args, **kwargs)


class OpTape:
    """An AD recording context: a byte ``Tape`` for residuals plus the node list.

    ``with OpTape(memory_budget=64 << 20) as t: ...`` records the ops inside
    onto ``t``; outside any ``with`` the process-wide default is used.  The
    keyword arguments other than ``residuals`` are those of ``adtape.Tape``.

    ``residuals``: ``"tape"`` (the default) copies every array an op saves for its
    backward onto the byte tape, which spills under ``memory_budget``;
    ``"reference"`` keeps the arrays themselves, as PyTorch keeps saved tensors: no
    copy in and out, no spilling (so no ``memory_budget``).  Held arrays are made
    read-only until the backward sweep that uses them (or ``reset``/``close``)
    is done, so writing into one in place raises instead of silently changing
    the gradient.
    """

    def __init__(self, memory_budget=None, spill_dir=None, slab_size=None, sbo_size=32,
                 prefetch_depth=2, spill_unit=1 << 20, keep_free_slabs=None,
                 residuals="tape", write_ahead=True):
        if residuals not in ("tape", "reference"):
            raise ValueError(f"residuals must be 'tape' or 'reference', got {residuals!r}")
        if residuals == "reference" and memory_budget is not None:
            raise ValueError("residuals='reference' keeps the arrays in memory: it cannot "
                             "honour a memory_budget (use residuals='tape')")
        self.by_reference = residuals == "reference"
        self._tape_kwargs = dict(sbo_size=sbo_size, slab_size=slab_size,
                                 memory_budget=memory_budget, spill_dir=spill_dir,
                                 prefetch_depth=prefetch_depth, threadsafe=False,
                                 spill_unit=spill_unit, keep_free_slabs=keep_free_slabs,
                                 write_ahead=write_ahead)
        self.tape = Tape(np.float64, **self._tape_kwargs)
        self.graph = _Graph(self.tape, self)
        self.closed = False
        self._outer = []

    def new_scratch_tape(self):
        """A byte tape with this one's settings (retain_graph parks residuals on it)."""
        return Tape(np.float64, **self._tape_kwargs)

    def __enter__(self):
        if self.closed:
            raise TapeClosedError("this OpTape is closed")
        self._outer.append(_state.graph)
        _state.graph = self.graph
        return self

    def __exit__(self, *exc):
        _state.graph = self._outer.pop()
        return False

    def close(self):
        """Close the byte tape; recording onto this OpTape afterwards raises TapeClosedError."""
        self.closed = True
        self.graph.freed = True
        self.graph.nodes = []
        self.graph.release()
        self.tape.close()

    def reset(self):
        """Drop everything recorded and not yet swept."""
        self.graph.freed = True
        self.graph.release()
        self.tape.clear()
        self._fresh_root()

    def _fresh_root(self):
        new = _Graph(self.tape, self)
        if _state.graph is self.graph:
            _state.graph = new
        self.graph = new

    @property
    def n_nodes(self):
        return len(self.graph.nodes)

    @property
    def saved_bytes(self):
        """Bytes of residuals saved for the backward by the current recording: on the
        byte tape, or held by reference."""
        return self.tape.nbytes + self.graph.held_bytes

    @property
    def stats(self):
        s = dict(self.tape.stats)
        s["nodes"] = len(self.graph.nodes)
        s["nbytes"] = self.tape.nbytes
        s["held_bytes"] = self.graph.held_bytes
        return s


def current_op_tape():
    """The OpTape ops record onto now."""
    return _state.graph.owner


@contextlib.contextmanager
def nested_graph():
    """Record onto a fresh graph stacked on the current byte tape (LIFO: its
    residuals sit above the outer graph's), with grad mode on.  On exit the
    outer graph is current again and anything the nested graph left on the tape
    (a sweep that never happened) is dropped."""
    outer = _state.graph
    if outer.owner.closed:
        raise TapeClosedError("cannot record: the current OpTape is closed")
    graph = _Graph(outer.tape, outer.owner, outer.tape.mark())
    outer.child = graph
    enabled = _state.enabled
    _state.graph = graph
    _state.enabled = True
    try:
        yield graph
    finally:
        _state.graph = outer
        _state.enabled = enabled
        outer.child = None
        if not graph.freed:
            graph.freed = True
            graph.release()
            graph.tape.rewind(graph.mark)


class no_grad(contextlib.ContextDecorator):
    """Context manager / decorator: ops inside compute values without recording."""

    def __enter__(self):
        self._prev = _state.enabled
        _state.enabled = False
        return self

    def __exit__(self, *exc):
        _state.enabled = self._prev
        return False


class enable_grad(contextlib.ContextDecorator):
    """Context manager / decorator: turn recording back on inside ``no_grad``."""

    def __enter__(self):
        self._prev = _state.enabled
        _state.enabled = True
        return self

    def __exit__(self, *exc):
        _state.enabled = self._prev
        return False


def is_grad_enabled():
    return _state.enabled


class Tensor(TensorBase):
    """A float32/float64 NumPy array that records the ops applied to it.

    ``requires_grad=True`` makes a leaf: gradients accumulate into ``.grad``
    (a NumPy array of the same shape and dtype; set it to a preallocated buffer
    to have backward add into it in place).  Its fields (``data``, ``grad``,
    ``requires_grad``, ...) are those of ``adtape._graph.TensorBase``.

    Its operators (``t + 1``, ``t @ w``, ``t[i]``, ``t < 0``), array methods (``sum``,
    ``reshape``, ``T``, ...) and NumPy's protocols (``np.sin(t)``) are assigned in one
    table, ``adtape._operators``: they are ops of ``adtape.vjps`` and ``adtape.numpy``,
    which import this module.
    """
    __slots__ = ()

    def __init__(self, data, requires_grad=False, dtype=None):
        if type(data) is Tensor:
            data = data.data
        arr = np.asarray(data, dtype=dtype)
        if arr.dtype not in _FLOAT_DTYPES:
            if dtype is None and arr.dtype.kind in "biu":
                arr = arr.astype(np.float64)
            else:
                raise TypeError(f"Tensor data must be float32 or float64, got {arr.dtype}")
        self.data = arr
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._graph = None
        self._ref = None
        self._is_leaf = True

    # -- array-like properties ---------------------------------------------
    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return self.data.size

    @property
    def is_leaf(self):
        return self._is_leaf

    def __len__(self):
        return len(self.data)

    def numpy(self):
        return self.data

    def item(self):
        """The value of a one-element Tensor as a Python number: a constant taken
        deliberately (no gradient flows back through it), recorded or not."""
        return self.data.item()

    # Conversions.  A conversion that would hand on the value of a recorded Tensor (see
    # _carries_derivative) without its derivative raises TypeError: the math module's
    # functions, np.float64(t), np.float32(t), np.vectorize and SciPy's functions all
    # convert.  t.item() and np.asarray(t) are the deliberate ways to take a constant.
    # Any other Tensor (a constant, one under no_grad, a loss after its backward())
    # converts as a NumPy array does.

    def __float__(self):
        """``float(t)`` of a one-element Tensor, as NumPy; TypeError when ``t`` is recorded."""
        if _carries_derivative(self):
            raise _lost_derivative("float(t) (math.sin(t), np.float64(t) and '%f' % t call it)")
        return float(self.data)

    def __complex__(self):
        """``complex(t)`` of a one-element Tensor, as NumPy; TypeError when ``t`` is recorded."""
        if _carries_derivative(self):
            raise _lost_derivative("complex(t) (cmath's functions call it)")
        return complex(self.data)

    def __int__(self):
        """``int(t)`` of a one-element Tensor, as NumPy, recorded or not: an integer part
        is piecewise constant, its derivative is zero (as adtape's ``trunc``)."""
        return int(self.data)

    def __bool__(self):
        """The truth of the value, as NumPy: a one-element Tensor is its value's truth,
        a larger or an empty one raises ValueError.  A branch carries no derivative."""
        return bool(self.data)

    def __array__(self, dtype=None, copy=None):
        """``np.asarray(t)``: the explicit detach, the data without the gradient.

        For a recorded Tensor it is the only one: a ``dtype`` (``np.float32(t)``,
        ``np.asarray(t, dtype)``, ``np.vectorize``'s object arrays) raises TypeError, and
        so does a call from SciPy's code (``scipy.special.logsumexp(t)`` converts its
        argument with ``np.asarray``): adtape.scipy.special records those."""
        if _carries_derivative(self):
            if dtype is not None:
                raise _lost_derivative(
                    f"converting to {np.dtype(dtype)} (np.float32(t), np.asarray(t, dtype), "
                    f"a[...] = t and np.vectorize(f)(t) do)")
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.partition(".")[0] in _CONVERTING_LIBRARIES:
                raise _lost_derivative(
                    f"np.asarray(t) called from {caller} (SciPy's functions convert their "
                    f"arguments; adtape.scipy.special records logsumexp, softmax, erf, ...)")
        data = self.data
        arr = data if dtype is None else data.astype(dtype, copy=False)
        if copy and arr is data:
            return arr.copy()
        if copy is False and arr is not data:
            raise ValueError(f"np.asarray(t, dtype={np.dtype(dtype)}, copy=False): a Tensor "
                             f"of {data.dtype} needs a copy to convert")
        return arr

    def __repr__(self):
        flag = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({np.array2string(self.data, separator=', ')}{flag})"

    def detach(self):
        """The same array as a constant (no gradient flows through it)."""
        return _constant(self.data)

    def zero_grad(self, deferred=False):
        """Reset ``.grad`` to zero.

        ``deferred=True`` does no pass over memory now: the gradient counts as zero
        and the next backward that reaches this leaf writes over ``.grad`` instead of
        adding to it (until then ``.grad`` keeps its old values).  A training step
        that zeroes a large gradient arena every step saves that pass and the read
        of the zeros in the backward kernels."""
        if self.grad is None:
            return
        if deferred:
            _deferred_zero.add(self)
        else:
            _deferred_zero.discard(self)
            self.grad[...] = 0

    def register_grad_hook(self, hook):
        """Call ``hook(self, remaining)`` in each reverse sweep that reaches this leaf,
        after every node that reads it has been swept (``remaining``: how many such
        nodes are still to come in this sweep).  At ``remaining == 0`` the sweep is done
        with ``self.grad``, so the hook may hand it to something that runs beside the
        rest of the backward (a non-blocking allreduce); before that, it may point
        ``self.grad`` elsewhere to keep the contributions still to come apart.  A leaf
        recorded into several graphs (checkpointed blocks that close over it) counts
        per graph swept.  Returns a handle whose ``remove()`` unregisters the hook."""
        if not (self._is_leaf and self.requires_grad):
            raise RuntimeError("register_grad_hook needs a leaf tensor with requires_grad=True")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        hooks = _grad_hooks.setdefault(self, [])
        hooks.append(hook)
        return _HookHandle(hooks, hook)

    # -- the reverse pass ----------------------------------------------------
    def backward(self, seed=None, retain_graph=False):
        """Sweep the graph this tensor was recorded in, seeded with ``seed``
        (default 1 for a single-element tensor), accumulating into leaves' ``.grad``.

        The sweep consumes the graph (its residuals are popped off the tape);
        ``retain_graph=True`` keeps it for another backward.
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad "
                               "(no input of its computation has requires_grad=True)")
        data = self.data
        if seed is None:
            if data.size != 1:
                raise ValueError(f"backward() needs a seed for a non-scalar tensor of shape "
                                 f"{data.shape}: pass seed=<array of that shape>")
            seed = np.ones_like(data)
        else:
            seed = np.asarray(seed.data if type(seed) is Tensor else seed, dtype=data.dtype)
            if seed.shape != data.shape:
                raise ValueError(f"backward() seed has shape {seed.shape}, the tensor has "
                                 f"shape {data.shape}")
        if self._is_leaf:
            if self.grad is None:
                self.grad = seed.copy()
            elif _take_deferred(self):
                self.grad[...] = seed
            else:
                self.grad += seed
            return
        graph = self._graph
        if graph.freed:
            raise RuntimeError("backward() through a graph that was already swept: "
                               "pass retain_graph=True to the first backward() to sweep twice")
        if graph.child is not None:
            raise RuntimeError("backward() on an outer graph while a nested recording is open")
        sweep(graph, self._ref, seed, retain_graph)


_graph.bind(Tensor)


def tensor(data, requires_grad=False, dtype=None):
    """Make a Tensor (a leaf when ``requires_grad``)."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def sweep(graph, seed_ref, seed, retain_graph=False):
    """The reverse pass over ``graph``: seed node ``seed_ref`` with ``seed``, pop
    every node's residuals (mirror order of the pushes) and apply its rule
    (``adtape._graph.sweep_nodes``)."""
    tape = graph.tape
    parked = graph.owner.new_scratch_tape() if retain_graph else None
    hooks_at = _grad_hooks_by_node(graph.nodes, graph.leaves) if _grad_hooks else None
    enabled = _state.enabled
    _state.enabled = False
    try:
        parked_saved = _graph.sweep_nodes(graph, seed_ref, seed, parked, hooks_at,
                                          _fire_grad_hooks)
    except BaseException:
        # A failed sweep leaves the tape part-popped: drop what this graph owns (a nested
        # graph's records are dropped by nested_graph, which rewinds to its mark).
        if parked is not None:
            parked.close()
        if graph.mark is None:
            graph.freed = True
            graph.nodes = []
            graph.release()
            tape.clear()
            if graph is graph.owner.graph:
                graph.owner._fresh_root()
        raise
    finally:
        _state.enabled = enabled
    if parked is not None:
        # Back onto the tape in the order they were first pushed.
        for saved in reversed(parked_saved):
            _graph.push_array(tape, _graph.pop_array(parked, saved))
        parked.close()
        return
    graph.freed = True
    graph.nodes = []
    graph.leaves = []
    graph.release()
    if graph.mark is None and graph is graph.owner.graph:
        graph.owner._fresh_root()


@contextlib.contextmanager
def keeping(graph):
    """Record onto ``graph`` in keep mode (see ``_record_keeping``) inside the block."""
    graph.keep += 1
    try:
        yield graph
    finally:
        graph.keep -= 1


def sweep_keeping(graph, start, out_ref, seed, wrt_refs, create):
    """A reverse sweep over nodes ``start..out_ref`` of ``graph`` (recorded in keep mode)
    that leaves the graph as it is, so it can run again with another seed.

    Returns the cotangents reaching ``wrt_refs`` (node indices, or leaf refs) in that
    order, ``None`` where none does.  With ``create`` the rules run with recording on,
    onto the current graph, so the result can be differentiated again (their inputs
    are Tensors of ``graph``); without it they run on constants.  An op whose rules
    cannot take Tensors raises NotImplementedError: nothing is silently a constant.
    """
    nodes = graph.nodes
    wanted = set(wrt_refs)
    grads = {out_ref: seed}
    enabled = _state.enabled
    _state.enabled = create
    try:
        for i in range(out_ref, start - 1, -1):
            if i in wanted:
                continue
            g = grads.pop(i, None)
            if g is None:
                continue
            prim, refs, shapes, kept, n_tape, kwargs = nodes[i]
            if n_tape >= 0 or not prim.differentiable:
                raise NotImplementedError(
                    f"op {prim.name!r} has no rule adtape can differentiate again (grad of "
                    f"grad, hessian, jvp, jacfwd, jacrev record its VJP rule); the built-in "
                    f"ops and adtape.numpy have such rules, kernel ops of adtape.nn do not"
                    + ("" if n_tape < 0 else " (or it was recorded before the transform)"))
            if prim.vjps is not None:
                outs = []
                for j, ref in enumerate(refs):
                    if ref is None or (ref < start and ref not in wanted):
                        outs.append(None)
                        continue
                    pullback = prim.vjps[j]
                    if pullback is None:
                        raise prim.missing_rule(j)
                    outs.append(pullback(g, *kept, **kwargs) if kwargs else pullback(g, *kept))
            else:
                outs = prim.bwd(kept, g)
            for j, ref in enumerate(refs):
                if ref is None or (ref < start and ref not in wanted):
                    continue
                r = outs[j]
                if r is None:
                    raise prim.missing_rule(j)
                if type(r) is not Tensor and type(r) is not _ndarray:
                    r = np.asarray(r)
                if r.shape != shapes[j]:
                    r = _unbroadcast(r, shapes[j])
                cur = grads.get(ref)
                grads[ref] = r if cur is None else cur + r
    finally:
        _state.enabled = enabled
    return [grads.get(ref) for ref in wrt_refs]


# Leaf -> its gradient hooks (Tensor.register_grad_hook).
_grad_hooks = weakref.WeakKeyDictionary()


class _HookHandle:
    __slots__ = ("hooks", "hook")

    def __init__(self, hooks, hook):
        self.hooks = hooks
        self.hook = hook

    def remove(self):
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


def _grad_hooks_by_node(nodes, leaves):
    """node index -> [(hooked leaf, nodes reading it that the sweep has yet to reach)]
    for every node that reads a hooked leaf.  One scan of the node list per sweep, only
    when some leaf has a hook, so recording pays nothing."""
    hooked = {~k for k, leaf in enumerate(leaves) if _grad_hooks.get(leaf)}
    if not hooked:
        return None
    readers = {}
    for i, node in enumerate(nodes):
        for ref in dict.fromkeys(node[1]):     # in argument order, each leaf once
            if ref in hooked:
                readers.setdefault(ref, []).append(i)
    hooks_at = {}
    for ref, where in readers.items():
        # The sweep meets the readers from the last recorded to the first: the first
        # recorded leaves none to come.
        for remaining, i in enumerate(where):
            hooks_at.setdefault(i, []).append((leaves[~ref], remaining))
    return hooks_at


def _fire_grad_hooks(due):
    for leaf, remaining in due:
        # A leaf whose every contribution was skipped (a zero cotangent) still awaits its
        # deferred zero: make .grad read as zeros before anyone else reads it.
        if (remaining == 0 and leaf.grad is not None and _deferred_zero
                and _take_deferred(leaf)):
            leaf.grad[...] = 0
        for hook in tuple(_grad_hooks.get(leaf, ())):
            hook(leaf, remaining)


def apply_deferred_zero(tensors):
    """Zero now the ``.grad`` of every tensor in ``tensors`` still awaiting a deferred
    zero (one no backward reached), so that its ``.grad`` reads as zeros."""
    for t in tensors:
        if _deferred_zero and _take_deferred(t):
            t.grad[...] = 0


def _install_default():
    _state.graph = OpTape().graph


_install_default()
