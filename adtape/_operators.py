"""What ``t + 1``, ``t[i]``, ``t < 0``, ``t.sum()`` and ``np.sin(t)`` do: every operator,
array method and NumPy protocol of ``Tensor``, in one table.

They are ops of ``adtape.vjps`` and ``adtape.numpy``, which import ``adtape.tensor``;
``adtape/__init__`` imports this module last, so the imports run one way and no module
has to be imported before another for ``Tensor`` to work.
"""
from adtape import numpy as anp
from adtape import vjps
from adtape.numpy import _protocol
from adtape.tensor import Tensor


def _reflected(op):
    """``other (op) tensor``: the op with its operands in the written order."""
    def rop(self, other):
        return op(other, self)
    rop.__name__ = f"r{op.__name__}"
    return rop


# Arithmetic records the built-in ops (a NumPy array on the left comes through
# __array_ufunc__ below, to the same ops).
Tensor.__add__ = vjps.add
Tensor.__radd__ = vjps.add
Tensor.__sub__ = vjps.sub
Tensor.__rsub__ = _reflected(vjps.sub)
Tensor.__mul__ = vjps.mul
Tensor.__rmul__ = vjps.mul
Tensor.__truediv__ = vjps.div
Tensor.__rtruediv__ = _reflected(vjps.div)
Tensor.__pow__ = vjps.power
Tensor.__rpow__ = _reflected(vjps.power)
Tensor.__matmul__ = vjps.matmul
Tensor.__rmatmul__ = _reflected(vjps.matmul)
Tensor.__neg__ = vjps.neg
Tensor.__getitem__ = vjps.getitem

# Ordering compares values: a boolean array, piecewise constant, nothing to record.
# == and != stay identity: Tensors are keys of the hook and deferred-zero tables.
Tensor.__lt__ = anp.less
Tensor.__le__ = anp.less_equal
Tensor.__gt__ = anp.greater
Tensor.__ge__ = anp.greater_equal

# Array methods.
Tensor.exp = vjps.exp
Tensor.log = vjps.log
Tensor.tanh = vjps.tanh
Tensor.sum = vjps.sum
Tensor.mean = vjps.mean
Tensor.reshape = vjps.reshape
Tensor.transpose = vjps.transpose
Tensor.T = property(vjps.transpose, doc="The transpose (all axes reversed), recorded.")

# NumPy hands a Tensor to adtape.numpy's table (ndarray (op) Tensor comes here too):
# the op is recorded, or TypeError says the gradient would be lost.
Tensor.__array_ufunc__ = _protocol.array_ufunc
Tensor.__array_function__ = _protocol.array_function
