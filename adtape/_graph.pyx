"""The AD runtime's per-op path in C: recording a node and the reverse sweep.

``adtape.tensor`` defines the user-facing classes (Tensor, OpTape, Primitive) and
the rules' registry; this module holds what every recorded op and every swept node
runs: ``record`` (a node's inputs, shapes and residuals; residual arrays go onto the
byte tape as raw records, their shape and dtype stay on the node in a ``Saved``),
``constant``, and ``sweep_nodes`` (the reverse loop: pop, call the rule, hand out
or accumulate the gradients).  At 4x4 the Python versions of these cost more than
the NumPy work of the op itself; here they are C loops over the node tuples.
"""
cimport numpy as cnp
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdlib cimport free, malloc
from libc.string cimport memset

import weakref

import numpy as np

from adtape import buffers as _buffers
from adtape._tape cimport RECORD_BYTES, Tape, tape_pop_record, tape_push_record

from adtape._tape import TapeClosedError

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_Empty(int nd, cnp.npy_intp* dims, cnp.dtype descr, int fortran)

cdef enum:
    MAX_DIMS = 32
    # Residuals of this many bytes or more are copied onto (and off) the tape with the
    # GIL released, as Tape.push_array does: a copy that waits on the disk lets other
    # threads run.  Below it, releasing and taking the GIL costs more than the copy.
    NOGIL_BYTES = 1 << 16

cdef type ndarray = np.ndarray
cdef type Tensor = None       # adtape.tensor.Tensor, set by bind()

# Leaves whose gradient counts as zero until the next backward writes it
# (Tensor.zero_grad(deferred=True)).
deferred_zero = weakref.WeakSet()


def bind(tensor_class):
    """Make ``tensor_class`` (adtape.tensor.Tensor, a subclass of TensorBase) the
    class record() and constant() create and recognise."""
    global Tensor
    if not issubclass(tensor_class, TensorBase):
        raise TypeError(f"bind takes a subclass of TensorBase, got {tensor_class!r}")
    Tensor = tensor_class


cdef class TensorBase:
    """The fields of ``adtape.tensor.Tensor``, read in C by the recording and the sweep."""


cdef class State:
    """Process-wide recording state: the graph ops record into, and grad mode."""

    def __init__(self):
        self.graph = None
        self.enabled = True


state = State()
cdef State _state = state


cdef class Graph:
    """One recording: the node list over a byte tape, and the leaves it reads."""

    def __init__(self, tape, owner, mark=None):
        self.nodes = []
        self.leaves = []
        self.tape = tape
        self.owner = owner
        self.freed = False
        self.child = None
        self.mark = mark
        self.held = []
        self.held_ids = set()
        self.held_bytes = 0
        self.keep = 0

    def release(self):
        """Make the residuals this graph held by reference writable again."""
        for a in self.held:
            try:
                a.flags.writeable = True
            except ValueError:      # its base was made read-only meanwhile
                pass
        self.held = []
        self.held_ids = set()
        self.held_bytes = 0

    cpdef adopt(self, TensorBase t):
        """Return the input reference of ``t``, a tensor not yet seen by this graph."""
        if t._is_leaf:
            t._graph = self
            t._ref = ~len(self.leaves)
            self.leaves.append(t)
            return t._ref
        if t._graph is not None and (<Graph>t._graph).freed:
            raise RuntimeError(
                "this tensor was computed in a graph that backward() already consumed; "
                "use .detach() to take it as a constant, or pass retain_graph=True to backward()")
        raise RuntimeError(
            "this tensor was recorded in another graph (another OpTape, or outside the "
            "function being differentiated or checkpointed); pass it in as an argument "
            "or .detach() it")


cdef class Saved:
    """A residual array on the byte tape (its shape and dtype; the tape has its bytes)."""

    def __repr__(self):
        return f"<residual on the tape: {self.dtype} {self.shape}>"


cdef inline TensorBase new_tensor():
    return <TensorBase>Tensor.__new__(Tensor)


cpdef constant(arr):
    """A Tensor of ``arr`` that needs no gradient."""
    cdef TensorBase t = new_tensor()
    t.data = arr
    t._is_leaf = True
    return t


cdef Saved push_saved(Tape tape, cnp.ndarray a):
    """Copy ``a``'s bytes onto ``tape`` as one raw record; returns its descriptor."""
    cdef int rc
    cdef Saved s
    cdef const char* src
    cdef size_t n
    if a.dtype.kind not in "biufcmM":
        raise TypeError(f"cannot save an array of dtype {a.dtype} for the backward pass on "
                        f"the byte tape: numbers, booleans and datetimes only")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        a = np.ascontiguousarray(a)
    s = Saved.__new__(Saved)
    s.shape = (<object>a).shape
    s.dtype = a.dtype
    s.nbytes = cnp.PyArray_NBYTES(a)
    src = <const char*>cnp.PyArray_DATA(a)
    n = s.nbytes
    if n >= NOGIL_BYTES:
        with nogil:
            rc = tape_push_record(&tape.t, src, n, RECORD_BYTES)
    else:
        rc = tape_push_record(&tape.t, src, n, RECORD_BYTES)
    if rc:
        tape.check(rc)
    return s


cdef cnp.ndarray pop_saved(Tape tape, Saved s):
    """Pop the record ``s`` describes (the top one) into a new array."""
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef int k, rc, ndim = len(s.shape)
    cdef char* dst
    cdef size_t n = s.nbytes
    for k in range(ndim):
        dims[k] = s.shape[k]
    Py_INCREF(s.dtype)      # PyArray_Empty steals a reference
    cdef cnp.ndarray out = PyArray_Empty(ndim, dims, s.dtype, 0)
    dst = <char*>cnp.PyArray_DATA(out)
    if n >= NOGIL_BYTES:
        with nogil:
            rc = tape_pop_record(&tape.t, dst, n, RECORD_BYTES)
    else:
        rc = tape_pop_record(&tape.t, dst, n, RECORD_BYTES)
    if rc:
        tape.check(rc)
    return out


def push_array(Tape tape, a):
    """Push ``a`` as record() does; returns its Saved descriptor (for tests and for
    parking residuals on another tape)."""
    return push_saved(tape, a)


def pop_array(Tape tape, Saved saved):
    """Pop the array ``saved`` describes off the top of ``tape``."""
    return pop_saved(tape, saved)


cdef Graph reopen(Graph graph):
    """The current graph was swept: recording goes on in a fresh root graph."""
    owner = graph.owner
    if graph is owner.graph:
        owner._fresh_root()
        return owner.graph
    raise RuntimeError("cannot record into a nested graph that was already swept")


cdef object _record_hook = None


def set_record_hook(hook):
    """Call ``hook(prim)`` after each node is recorded (``adtape.profile`` times the
    forward passes so); None removes it.  Returns the previous hook."""
    global _record_hook
    previous = _record_hook
    _record_hook = hook
    return previous


cpdef record(prim, out, inputs, res, kwargs):
    """Append a node for ``prim`` and return its output tensor.

    ``inputs``: the op's arguments (Tensors; anything else is a constant).
    ``res``: residuals; a Tensor item means that input's array (kept by reference
    for leaves and constants, pushed to the byte tape otherwise), an ndarray is
    pushed, any other object is kept on the node as it is.
    """
    cdef Graph graph = _state.graph
    cdef TensorBase t, rt
    cdef Py_ssize_t i, n_in, n_res
    cdef int n_tape = 0
    cdef bint by_reference
    if graph.freed:
        if graph.owner.closed:
            raise TapeClosedError(f"cannot record {prim.name!r}: the OpTape is closed")
        graph = reopen(graph)
    inputs = tuple(inputs)
    n_in = len(inputs)
    refs = PyTuple_New(n_in)
    shapes = PyTuple_New(n_in)
    for i in range(n_in):
        x = inputs[i]
        if type(x) is Tensor and (<TensorBase>x).requires_grad:
            t = <TensorBase>x
            ref = t._ref if t._graph is graph else graph.adopt(t)
            shape = t.data.shape
        else:
            ref = None
            shape = None
        Py_INCREF(ref)
        PyTuple_SET_ITEM(refs, i, ref)
        Py_INCREF(shape)
        PyTuple_SET_ITEM(shapes, i, shape)
    if graph.keep:
        kept_t = record_keeping(graph, prim, out, refs, shapes, res, kwargs)
        if _record_hook is not None:
            _record_hook(prim)
        return kept_t
    if res:
        res = tuple(res)
        n_res = len(res)
        kept = PyTuple_New(n_res)
        by_reference = graph.owner.by_reference
        for i in range(n_res):
            r = res[i]
            if type(r) is Tensor:
                rt = <TensorBase>r
                if rt._is_leaf:
                    r = rt.data
                    Py_INCREF(r)
                    PyTuple_SET_ITEM(kept, i, r)
                    continue
                r = rt.data
            if type(r) is ndarray:
                if by_reference:
                    if r.flags.writeable:
                        r.flags.writeable = False
                        graph.held.append(r)
                    # An array two ops save (attention's output is also the projection's
                    # input) is counted once, read-only or not.
                    if id(r) not in graph.held_ids:
                        graph.held_ids.add(id(r))
                        graph.held_bytes += cnp.PyArray_NBYTES(<cnp.ndarray>r)
                else:
                    r = push_saved(graph.tape, r)
                    n_tape += 1
            Py_INCREF(r)
            PyTuple_SET_ITEM(kept, i, r)
    else:
        kept = ()
    nodes = graph.nodes
    t = new_tensor()
    t.data = out
    t.requires_grad = True
    t._graph = graph
    t._ref = len(nodes)
    nodes.append((prim, refs, shapes, kept, n_tape, kwargs))
    if _record_hook is not None:
        _record_hook(prim)
    return t


cdef record_keeping(Graph graph, prim, out, refs, shapes, res, kwargs):
    """``record`` for a graph that a derivative of a derivative will sweep: the node
    keeps its residual Tensors (so the rules see them connected to the graph) and the
    output's array as the output Tensor; ``n_tape`` -1 marks such a node."""
    nodes = graph.nodes
    cdef TensorBase t = new_tensor()
    t.data = out
    t.requires_grad = True
    t._graph = graph
    t._ref = len(nodes)
    kept = tuple([t if r is out else r for r in res]) if res else ()
    nodes.append((prim, refs, shapes, kept, -1, kwargs))
    return t


def unbroadcast(r, shape):
    """Sum a gradient of a broadcast result down to the input's shape."""
    extra = r.ndim - len(shape)
    if extra > 0:
        r = r.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and r.shape[i] != 1)
    if axes:
        r = r.sum(axis=axes, keepdims=True)
    if r.shape != shape:
        raise ValueError(f"gradient of shape {r.shape} does not match its input's shape {shape}")
    return r


cpdef bint take_deferred(leaf):
    """True (once) if ``leaf``'s gradient awaited a deferred zero."""
    if leaf in deferred_zero:
        deferred_zero.discard(leaf)
        return True
    return False


cdef inline bint deferred(leaf):
    return len(deferred_zero) and take_deferred(leaf)


cdef int accumulate(list grads, char* owned, list leaves, Py_ssize_t ref, r,
                    shape) except -1:
    cdef TensorBase leaf
    if type(r) is not ndarray:
        r = np.asarray(r)
    if r.shape != shape:
        r = unbroadcast(r, shape)
    if ref >= 0:
        cur = grads[ref]
        if cur is None:
            grads[ref] = r
        elif owned[ref]:
            cur += r
        else:
            s = cur + r
            if type(s) is ndarray:
                owned[ref] = 1
            else:
                s = np.asarray(s)
            grads[ref] = s
    else:
        leaf = <TensorBase>leaves[~ref]
        lg = leaf.grad
        if lg is None:
            leaf.grad = np.array(r, dtype=leaf.data.dtype, copy=True)
        elif deferred(leaf):
            lg[...] = r
        else:
            lg += r
    return 0


cdef dest(list grads, char* owned, list leaves, Py_ssize_t ref, shape, dtype):
    """A buffer this sweep owns that the accumulating rule may add into."""
    cdef TensorBase leaf
    if ref >= 0:
        cur = grads[ref]
        if cur is None:
            cur = _buffers.zeros(shape, dtype)
        elif not owned[ref]:
            cur = np.array(cur, dtype=dtype, copy=True)
        else:
            return cur
        grads[ref] = cur
        owned[ref] = 1
        return cur
    leaf = <TensorBase>leaves[~ref]
    if leaf.grad is None:
        leaf.grad = _buffers.zeros(leaf.data.shape, leaf.data.dtype)
    elif deferred(leaf):
        leaf.grad[...] = 0
    return leaf.grad


cdef dest_fresh(list grads, char* owned, list leaves, Py_ssize_t ref, shape, dtype,
                bint* fresh):
    """The buffer for an overwriting rule: like ``dest``, but a buffer that holds no
    gradient yet comes back uninitialised with ``fresh[0]`` set."""
    cdef TensorBase leaf
    fresh[0] = False
    if ref >= 0:
        cur = grads[ref]
        if cur is None:
            cur = _buffers.empty(shape, dtype)
            grads[ref] = cur
            owned[ref] = 1
            fresh[0] = True
            return cur
        if not owned[ref]:
            cur = np.array(cur, dtype=dtype, copy=True)
            grads[ref] = cur
            owned[ref] = 1
        return cur
    leaf = <TensorBase>leaves[~ref]
    if leaf.grad is None:
        leaf.grad = _buffers.empty(leaf.data.shape, leaf.data.dtype)
        fresh[0] = True
    elif deferred(leaf):
        fresh[0] = True
    return leaf.grad


def sweep_nodes(Graph graph, Py_ssize_t seed_ref, seed, parked, hooks_at, fire_hooks):
    """The reverse loop over ``graph``'s nodes from the last: pop each node's residuals
    (mirror order of the pushes) and apply its rule to its cotangent.

    ``parked``: None, or a Tape that receives every popped residual (retain_graph);
    returns the list of their Saved descriptors, in the order parked.  ``hooks_at``:
    None, or node index -> what ``fire_hooks`` is called with after that node."""
    cdef list nodes = graph.nodes
    cdef list leaves = graph.leaves
    cdef Tape tape = graph.tape
    cdef Py_ssize_t n = len(nodes), i, j, k, n_refs, n_kept, ref
    cdef int n_tape
    cdef tuple node, refs, shapes, kept
    cdef list grads = [None] * n
    cdef list parked_saved = [] if parked is not None else None
    cdef char* owned = <char*>malloc(n if n else 1)
    cdef bint fr
    if owned == NULL:
        raise MemoryError(f"sweep: no memory for the flags of {n} nodes")
    memset(owned, 0, n)
    grads[seed_ref] = seed
    try:
        for i in range(n - 1, -1, -1):
            node = <tuple>nodes[i]
            prim = node[0]
            refs = <tuple>node[1]
            shapes = <tuple>node[2]
            kept = <tuple>node[3]
            n_tape = node[4]
            kwargs = node[5]
            g = grads[i]
            res = kept
            if n_tape > 0:
                # Pop every residual, needed or not: the tape is a stack.
                n_kept = len(kept)
                res = list(kept)
                for k in range(n_kept - 1, -1, -1):
                    r = kept[k]
                    if type(r) is Saved:
                        a = pop_saved(tape, <Saved>r)
                        res[k] = a
                        if parked is not None:
                            parked_saved.append(push_saved(<Tape>parked, a))
            elif n_tape < 0:
                res = [(<TensorBase>r).data if type(r) is Tensor else r for r in kept]
            if g is None:
                if hooks_at is not None and i in hooks_at:
                    fire_hooks(hooks_at[i])
                continue
            grads[i] = None
            n_refs = len(refs)
            vjps = prim.vjps
            if vjps is not None:
                args = (g,) + tuple(res)
                for j in range(n_refs):
                    ref_obj = refs[j]
                    if ref_obj is None:
                        continue
                    ref = ref_obj
                    pullback = vjps[j]
                    if pullback is None:
                        raise prim.missing_rule(j)
                    r = pullback(*args, **kwargs) if kwargs else pullback(*args)
                    if (ref >= 0 and grads[ref] is None and type(r) is ndarray
                            and r.shape == shapes[j]):
                        grads[ref] = r
                    else:
                        accumulate(grads, owned, leaves, ref, r, shapes[j])
            elif prim.bwd_acc is not None:
                overwrite = prim.bwd_overwrite
                dests = [None] * n_refs
                fresh = [False] * n_refs
                for j in range(n_refs):
                    ref_obj = refs[j]
                    if ref_obj is None:
                        continue
                    if overwrite:
                        dests[j] = dest_fresh(grads, owned, leaves, ref_obj, shapes[j],
                                              g.dtype, &fr)
                        fresh[j] = fr
                    else:
                        dests[j] = dest(grads, owned, leaves, ref_obj, shapes[j], g.dtype)
                args = (g, dests, fresh) + tuple(res) if overwrite else (g, dests) + tuple(res)
                if kwargs:
                    prim.bwd_acc(*args, **kwargs)
                else:
                    prim.bwd_acc(*args)
            elif prim.bwd is not None:
                out = prim.bwd(tuple(res), g)
                if not isinstance(out, (tuple, list)) or len(out) != n_refs:
                    raise TypeError(f"the VJP of {prim.name!r} must return a tuple of "
                                    f"{n_refs} gradients, got {out!r:.80}")
                for j in range(n_refs):
                    ref_obj = refs[j]
                    if ref_obj is None:
                        continue
                    if out[j] is None:
                        raise prim.missing_rule(j)
                    accumulate(grads, owned, leaves, ref_obj, np.asarray(out[j]), shapes[j])
            else:
                for j in range(n_refs):
                    if refs[j] is not None:
                        raise prim.missing_rule(j)
            if hooks_at is not None and i in hooks_at:
                fire_hooks(hooks_at[i])
    finally:
        free(owned)
    return parked_saved
