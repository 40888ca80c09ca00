"""The built-in tensor ops and their VJP rules, in one table.

Each op computes its value with NumPy and records a node when an input needs a
gradient.  Residuals name what the rule needs: an input Tensor (its array is
kept by reference for leaves and constants, copied onto the byte tape
otherwise), a computed array (copied onto the tape) or a small Python value
(kept on the node).  ``exp``, ``log`` and ``tanh`` of a ``Scalar`` go to scalar
mode.  Rules for broadcasting ops may return a gradient of the
broadcast shape; the sweep sums it down to the input's shape.
"""
import numpy as np

from adtape.scalar import Scalar
from adtape.tensor import Primitive, Tensor, _constant, _record, _state, defvjp

__all__ = ["add", "sub", "mul", "div", "neg", "power", "matmul", "exp", "log", "tanh",
           "sum", "mean", "reshape", "transpose", "getitem", "embedding"]

_ndarray = np.ndarray


def _broadcast_error(op, a, b, exc):
    return ValueError(f"{op}: operand shapes {np.shape(a)} and {np.shape(b)} are incompatible "
                      f"({exc})")


def _binary(name):
    return Primitive(name, ("x", "y"))


ADD = _binary("add")
SUB = _binary("sub")
MUL = _binary("mul")
DIV = _binary("div")
POW = _binary("power")
MATMUL = _binary("matmul")
NEG = Primitive("neg", ("x",))
EXP = Primitive("exp", ("x",))
LOG = Primitive("log", ("x",))
TANH = Primitive("tanh", ("x",))
SUM = Primitive("sum", ("x",))
MEAN = Primitive("mean", ("x",))
RESHAPE = Primitive("reshape", ("x",))
TRANSPOSE = Primitive("transpose", ("x",))
GETITEM = Primitive("getitem", ("x",))
EMBEDDING = Primitive("embedding", ("weight", "ids"))


# -- forward ops -------------------------------------------------------------------

def add(x, y):
    xd = x.data if type(x) is Tensor else x
    yd = y.data if type(y) is Tensor else y
    try:
        out = xd + yd
    except ValueError as exc:
        raise _broadcast_error("add", xd, yd, exc) from None
    if type(out) is not _ndarray:
        out = np.asarray(out)
    if _state.enabled and ((type(x) is Tensor and x.requires_grad)
                           or (type(y) is Tensor and y.requires_grad)):
        return _record(ADD, out, (x, y), (), None)
    return _constant(out)


def sub(x, y):
    xd = x.data if type(x) is Tensor else x
    yd = y.data if type(y) is Tensor else y
    try:
        out = xd - yd
    except ValueError as exc:
        raise _broadcast_error("sub", xd, yd, exc) from None
    if type(out) is not _ndarray:
        out = np.asarray(out)
    if _state.enabled and ((type(x) is Tensor and x.requires_grad)
                           or (type(y) is Tensor and y.requires_grad)):
        return _record(SUB, out, (x, y), (), None)
    return _constant(out)


def mul(x, y):
    xd = x.data if type(x) is Tensor else x
    yd = y.data if type(y) is Tensor else y
    try:
        out = xd * yd
    except ValueError as exc:
        raise _broadcast_error("mul", xd, yd, exc) from None
    if type(out) is not _ndarray:
        out = np.asarray(out)
    xg = type(x) is Tensor and x.requires_grad
    yg = type(y) is Tensor and y.requires_grad
    if _state.enabled and (xg or yg):
        # Save only what the needed gradients read.
        return _record(MUL, out, (x, y), (y if xg else None, x if yg else None), None)
    return _constant(out)


def div(x, y):
    xd = x.data if type(x) is Tensor else x
    yd = y.data if type(y) is Tensor else y
    try:
        out = xd / yd
    except ValueError as exc:
        raise _broadcast_error("div", xd, yd, exc) from None
    if type(out) is not _ndarray:
        out = np.asarray(out)
    xg = type(x) is Tensor and x.requires_grad
    yg = type(y) is Tensor and y.requires_grad
    if _state.enabled and (xg or yg):
        # Save only what the needed gradients read.
        return _record(DIV, out, (x, y), (y, out if yg else None), None)
    return _constant(out)


def power(x, y):
    xd = x.data if type(x) is Tensor else x
    yd = y.data if type(y) is Tensor else y
    try:
        out = xd ** yd
    except ValueError as exc:
        raise _broadcast_error("power", xd, yd, exc) from None
    if type(out) is not _ndarray:
        out = np.asarray(out)
    xg = type(x) is Tensor and x.requires_grad
    yg = type(y) is Tensor and y.requires_grad
    if _state.enabled and (xg or yg):
        # Save only what the needed gradients read.
        return _record(POW, out, (x, y), (x, y, out if yg else None), None)
    return _constant(out)


def matmul(x, y):
    xd = x.data if type(x) is Tensor else x
    yd = y.data if type(y) is Tensor else y
    try:
        out = xd @ yd
    except ValueError as exc:
        raise _broadcast_error("matmul", xd, yd, exc) from None
    if type(out) is not _ndarray:
        out = np.asarray(out)
    xg = type(x) is Tensor and x.requires_grad
    yg = type(y) is Tensor and y.requires_grad
    if _state.enabled and (xg or yg):
        # Save only what the needed gradients read.
        return _record(MATMUL, out, (x, y), (x if yg else None, y if xg else None,
                                            np.ndim(xd), np.ndim(yd)), None)
    return _constant(out)


def neg(x):
    out = -(x.data if type(x) is Tensor else np.asarray(x))
    if type(out) is not _ndarray:
        out = np.asarray(out)
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        return _record(NEG, out, (x,), (), None)
    return _constant(out)


def exp(x):
    if type(x) is Scalar:
        return x.exp()
    out = np.exp(x.data if type(x) is Tensor else x)
    if type(out) is not _ndarray:
        out = np.asarray(out)
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        return _record(EXP, out, (x,), (out,), None)
    return _constant(out)


def log(x):
    if type(x) is Scalar:
        return x.log()
    out = np.log(x.data if type(x) is Tensor else x)
    if type(out) is not _ndarray:
        out = np.asarray(out)
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        return _record(LOG, out, (x,), (x,), None)
    return _constant(out)


def tanh(x):
    if type(x) is Scalar:
        return x.tanh()
    out = np.tanh(x.data if type(x) is Tensor else x)
    if type(out) is not _ndarray:
        out = np.asarray(out)
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        return _record(TANH, out, (x,), (out,), None)
    return _constant(out)


def _reduce(x, axis, keepdims, scale):
    """Sum (times ``scale``) over ``axis``; also the keepdims shape the rule expands from."""
    xd = x.data if type(x) is Tensor else np.asarray(x)
    kept = np.add.reduce(xd, axis=axis, keepdims=True)
    if scale is not None:
        kept = kept * (kept.size / xd.size if xd.size else np.nan)
    if keepdims:
        out = kept
    elif axis is None:
        out = kept.reshape(())
    else:
        out = kept.squeeze(axis)
    return xd, out, kept.shape


def sum(x, axis=None, keepdims=False):
    xd, out, kshape = _reduce(x, axis, keepdims, None)
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        return _record(SUM, out, (x,), (xd.shape, kshape, 1.0), None)
    return _constant(out)


def mean(x, axis=None, keepdims=False):
    xd, out, kshape = _reduce(x, axis, keepdims, True)
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        count = xd.size // max(out.size, 1)
        return _record(MEAN, out, (x,), (xd.shape, kshape, 1.0 / count if count else np.nan),
                       None)
    return _constant(out)


def reshape(x, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    xd = x.data if type(x) is Tensor else np.asarray(x)
    try:
        out = xd.reshape(shape)
    except ValueError as exc:
        raise ValueError(f"reshape: cannot reshape an array of shape {xd.shape} "
                         f"into {shape} ({exc})") from None
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        return _record(RESHAPE, out, (x,), (xd.shape,), None)
    return _constant(out)


def transpose(x, *axes):
    if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
        axes = axes[0]
    axes = tuple(axes) if axes else None
    xd = x.data if type(x) is Tensor else np.asarray(x)
    out = xd.transpose(axes)
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        return _record(TRANSPOSE, out, (x,), (axes,), None)
    return _constant(out)


def getitem(x, index):
    if type(index) is Tensor:
        index = index.data
    xd = x.data if type(x) is Tensor else np.asarray(x)
    out = xd[index]
    if type(out) is not _ndarray:
        out = np.asarray(out)
    if _state.enabled and type(x) is Tensor and x.requires_grad:
        return _record(GETITEM, out, (x,), (xd.shape, index, _is_basic_index(index)), None)
    return _constant(out)


def embedding(weight, ids):
    """Rows ``weight[ids]`` for an integer array ``ids`` (any shape)."""
    wd = weight.data if type(weight) is Tensor else np.asarray(weight)
    ids = np.asarray(ids.data if type(ids) is Tensor else ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding: ids must be an integer array, got {ids.dtype}")
    if wd.ndim != 2:
        raise ValueError(f"embedding: weight must be 2-D (rows, features), got shape {wd.shape}")
    if ids.size and (np.minimum.reduce(ids, axis=None) < 0
                     or np.maximum.reduce(ids, axis=None) >= wd.shape[0]):
        raise IndexError(f"embedding: ids must lie in [0, {wd.shape[0]}), "
                         f"got values in [{ids.min()}, {ids.max()}]")
    out = wd[ids]
    if _state.enabled and type(weight) is Tensor and weight.requires_grad:
        # The ids as a constant Tensor: kept by reference, not copied onto the tape.
        return _record(EMBEDDING, out, (weight, None), (wd.shape, _constant(ids)), None)
    return _constant(out)


def _is_basic_index(index):
    """True when ``index`` selects each element at most once (slices, ints, None, ...)."""
    items = index if type(index) is tuple else (index,)
    for it in items:
        if not (it is None or it is Ellipsis or isinstance(it, (slice, int, np.integer))):
            return False
    return True


# -- VJP rules ---------------------------------------------------------------------

def _matmul_x(g, x, y, x_ndim, y_ndim):
    """``g @ y.T`` (vectors and batches as matmul treats them)."""
    if x_ndim == 2 and y_ndim == 2:
        return g @ y.T
    if y_ndim == 1:
        if x_ndim == 1:
            return g * y
        return g[..., None] * y
    if x_ndim == 1:
        return (g[..., None, :] @ np.swapaxes(y, -1, -2))[..., 0, :]
    return g @ np.swapaxes(y, -1, -2)


def _matmul_y(g, x, y, x_ndim, y_ndim):
    """``x.T @ g`` (vectors and batches as matmul treats them)."""
    if x_ndim == 2 and y_ndim == 2:
        return x.T @ g
    if x_ndim == 1:
        if y_ndim == 1:
            return g * x
        return x[:, None] * g[..., None, :]
    if y_ndim == 1:
        return (np.swapaxes(x, -1, -2) @ g[..., None])[..., 0]
    return np.swapaxes(x, -1, -2) @ g


def _reduced_grad(g, shape, kshape, scale):
    """``g`` (times 1/count for mean) broadcast back over the reduced axes."""
    if type(g) is Tensor:       # a sweep that records: stay differentiable
        g = g.reshape(kshape)
        return np.broadcast_to(g if scale == 1.0 else g * scale, shape)
    out = np.empty(shape, g.dtype)
    out[...] = g.reshape(kshape) if scale == 1.0 else g.reshape(kshape) * scale
    return out


def _getitem_vjp(g, shape, index, basic):
    """``g`` added into zeros at ``index`` (repeated indices accumulate)."""
    if type(g) is Tensor:
        return scatter_add(g, shape, index, basic)
    out = np.zeros(shape, g.dtype)
    if basic:
        out[index] = g
    else:
        np.add.at(out, index, g)
    return out


def _embedding_vjp(g, shape, ids):
    """``g``'s rows added into zeros at ``ids``."""
    if type(g) is Tensor:
        return scatter_add(g, shape, ids, False)
    out = np.zeros(shape, g.dtype)
    np.add.at(out, ids.reshape(-1), g.reshape(-1, shape[1]))
    return out


def _transpose_vjp(g, axes):
    """``g`` transposed back."""
    return g.transpose() if axes is None else g.transpose(tuple(np.argsort(axes).tolist()))


def scatter_add(g, shape, index, basic):
    """An array of ``shape``, zero but for ``g`` added at ``index`` (repeats accumulate):
    the gradient of ``x[index]``, recorded so that it can be differentiated again."""
    gd = g.data if type(g) is Tensor else g
    out = np.zeros(shape, gd.dtype)
    if basic:
        out[index] = gd
    else:
        np.add.at(out, index, gd)
    if _state.enabled and type(g) is Tensor and g.requires_grad:
        return _record(SCATTER_ADD, out, (g,), (), {"index": index})
    return _constant(out)


SCATTER_ADD = Primitive("scatter_add", ("g",))

# The rules are written in NumPy functions and operators, which record when handed
# Tensors (a sweep that records for a derivative of a derivative hands them Tensors).
defvjp(ADD, lambda g: g, lambda g: g, differentiable=True)
defvjp(SUB, lambda g: g, lambda g: -g, differentiable=True)
defvjp(MUL, lambda g, y, x: g * y, lambda g, y, x: g * x, differentiable=True)
defvjp(DIV, lambda g, y, out: g / y, lambda g, y, out: -g * out / y, differentiable=True)
defvjp(POW, lambda g, x, y, out: g * y * x ** (y - 1),
       lambda g, x, y, out: g * out * np.log(x), differentiable=True)
defvjp(MATMUL, _matmul_x, _matmul_y, differentiable=True)
defvjp(NEG, lambda g: -g, differentiable=True)
defvjp(EXP, lambda g, out: g * out, differentiable=True)
defvjp(LOG, lambda g, x: g / x, differentiable=True)
defvjp(TANH, lambda g, out: g * (1 - out * out), differentiable=True)
defvjp(SUM, _reduced_grad, differentiable=True)
defvjp(MEAN, _reduced_grad, differentiable=True)
defvjp(RESHAPE, lambda g, shape: g.reshape(shape), differentiable=True)
defvjp(TRANSPOSE, _transpose_vjp, differentiable=True)
defvjp(GETITEM, _getitem_vjp, differentiable=True)
defvjp(EMBEDDING, _embedding_vjp, None, differentiable=True)
defvjp(SCATTER_ADD, lambda g, index: g[index], differentiable=True)

