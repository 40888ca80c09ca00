"""adtape: a layered tape for reverse-mode AD, and the AD runtime built on it.

* ``Tape``: a LIFO store with a small inline buffer, linked slabs, optional
  locking, a memory budget with disk spill and a prefetching I/O thread.
* Tensor mode: ``Tensor`` operators record onto an ``OpTape`` (whose values live
  on a ``Tape``); ``loss.backward()``, ``grad``, ``value_and_grad``; custom
  derivatives (``defvjp``, ``custom_vjp``); ``checkpoint`` and
  ``checkpoint_loop`` (binomial schedule).  GPT-2 ops over the OpenMP kernels
  are in ``adtape.nn``.
* ``adtape.numpy`` (NumPy's functions, recorded) and the transforms ``grad``,
  ``jvp``, ``jacrev``/``jacobian``, ``jacfwd``, ``hessian``, ``hvp``, to any order.
* Scalar mode: ``Scalar`` variables on a ``ScalarTape`` for plain Python functions
  (``adtape.math`` for the ``math`` module's functions).
"""
import os as _os

try:
    from adtape._tape import (Tape, TapeMark, TapeError, TapeClosedError,
                              TapeCorruptionError, TapeForkError, SpillError,
                              ThreadLocalTapes)
except ImportError as exc:  # pragma: no cover - only hit from an unbuilt source tree
    _here = _os.path.dirname(_os.path.abspath(__file__))
    raise ImportError(
        f"adtape's compiled core is missing in {_here}: this looks like the source "
        "tree, not an installed package. Install with `pip install .` and run from "
        "another directory, or build in place with `pip install -e .`."
    ) from exc

from adtape.tensor import (Tensor, OpTape, Primitive, primitive, defvjp, defvjp_accumulate,
                           custom_vjp, no_grad, enable_grad, is_grad_enabled, current_op_tape,
                           tensor)
from adtape.vjps import (add, sub, mul, div, neg, power, matmul, exp, log, tanh, sum, mean,
                         reshape, transpose, getitem, embedding)
from adtape.scalar import Scalar, ScalarTape
from adtape.functional import (grad, value_and_grad, jvp, jacrev, jacobian, jacfwd, hessian,
                               hvp)
from adtape.gradcheck import check_grads
from adtape import math, numpy
from adtape.profiling import OpProfile, profile
from adtape.checkpointing import checkpoint, checkpoint_loop, revolve_cost, revolve_schedule
# Last: Tensor's operators, array methods and NumPy protocols (they need adtape.numpy).
from adtape import _operators  # noqa: F401

__all__ = [
    # the tape
    "Tape", "TapeMark", "TapeError", "TapeClosedError", "TapeCorruptionError", "TapeForkError",
    "SpillError", "ThreadLocalTapes",
    # tensor mode
    "Tensor", "OpTape", "Primitive", "primitive", "defvjp", "defvjp_accumulate", "custom_vjp",
    "no_grad", "enable_grad", "is_grad_enabled", "current_op_tape", "tensor",
    "add", "sub", "mul", "div", "neg", "power", "matmul", "exp", "log", "tanh", "sum", "mean",
    "reshape", "transpose", "getitem", "embedding",
    # scalar mode, transforms, checking, checkpointing
    "Scalar", "ScalarTape", "grad", "value_and_grad", "jvp", "jacrev", "jacobian", "jacfwd",
    "hessian", "hvp", "check_grads",
    "checkpoint", "checkpoint_loop", "revolve_cost", "revolve_schedule",
    # where the time goes
    "profile", "OpProfile",
]
__version__ = "0.1.0"
