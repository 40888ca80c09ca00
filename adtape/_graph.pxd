# The C side of the AD runtime (adtape/_graph.pyx): the fields of a Tensor, of a
# recording (Graph) and of the process-wide recording state, as C structs that
# record() and the reverse sweep read without Python attribute lookups.  Python code
# reads and writes the same fields as attributes (adtape.tensor.Tensor subclasses
# TensorBase; OpTape owns Graphs).

cdef class TensorBase:
    cdef public object data           # the float32/float64 ndarray
    cdef public object grad           # a leaf's gradient (ndarray) or None
    cdef public bint requires_grad
    cdef public object _graph         # the Graph this tensor was recorded in, or None
    cdef public object _ref           # node index (>= 0) or ~leaf index (< 0), or None
    cdef public bint _is_leaf
    cdef object __weakref__


cdef class Graph:
    cdef public list nodes            # (prim, refs, shapes, kept, n_tape, kwargs) tuples
    cdef public list leaves
    cdef public object tape           # the byte tape (adtape._tape.Tape) residuals go on
    cdef public object owner          # the OpTape
    cdef public bint freed
    cdef public object child          # a nested Graph recording above this one, or None
    cdef public object mark           # the tape mark a nested graph rewinds to, or None
    cdef public list held             # residuals kept by reference and made read-only here
    cdef public set held_ids          # id() of every array kept by reference
    cdef public Py_ssize_t held_bytes # bytes of the distinct arrays kept by reference
    # > 0 while a transform records for a derivative of a derivative: nodes then keep
    # their residual Tensors themselves (see record_keeping), nothing goes on the tape.
    cdef public int keep
    cpdef object adopt(self, TensorBase t)


cdef class State:
    cdef public Graph graph           # the graph ops record into
    cdef public bint enabled          # grad mode


cdef class Saved:
    # Stands in a node's residuals for an array pushed onto the byte tape: the record
    # holds its bytes only, this its shape and dtype.
    cdef readonly tuple shape
    cdef readonly object dtype
    cdef Py_ssize_t nbytes
