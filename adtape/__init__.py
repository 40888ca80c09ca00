"""adtape: a layered tape for reverse-mode AD, and the AD runtime built on it.

The tape (``adtape.Tape``) is a LIFO store with a small inline buffer, linked
slabs, optional locking, a memory budget with disk spill and a prefetching I/O
thread.  See README.md for the model and examples.
"""
import os as _os

try:
    from adtape._tape import (Tape, TapeMark, TapeError, TapeClosedError,
                              TapeCorruptionError, SpillError, ThreadLocalTapes)
except ImportError as exc:  # pragma: no cover - only hit from an unbuilt source tree
    _here = _os.path.dirname(_os.path.abspath(__file__))
    raise ImportError(
        f"adtape's compiled core is missing in {_here}: this looks like the source "
        "tree, not an installed package. Install with `pip install .` and run from "
        "another directory, or build in place with `pip install -e .`."
    ) from exc

__all__ = ["Tape", "TapeMark", "TapeError", "TapeClosedError", "TapeCorruptionError",
           "SpillError", "ThreadLocalTapes"]
__version__ = "0.1.0"

# The AD runtime (tensor mode, scalar mode, transforms, checkpointing) on the tape.
from adtape.tensor import (Tensor, OpTape, Primitive, primitive, defvjp, defvjp_accumulate,
                           custom_vjp, no_grad, enable_grad, is_grad_enabled, current_op_tape,
                           tensor)
from adtape.vjps import (add, sub, mul, div, neg, power, matmul, exp, log, tanh, sum, mean,
                         reshape, transpose, getitem, embedding)
from adtape.scalar import Scalar, ScalarTape
from adtape.functional import grad, value_and_grad
from adtape.gradcheck import check_grads
from adtape.checkpointing import checkpoint, checkpoint_loop, revolve_cost, revolve_schedule

__all__ += ["Tensor", "OpTape", "Primitive", "primitive", "defvjp", "defvjp_accumulate",
            "custom_vjp", "no_grad", "enable_grad", "is_grad_enabled", "current_op_tape",
            "tensor", "add", "sub", "mul", "div", "neg", "power", "matmul", "exp", "log", "tanh",
            "sum", "mean", "Scalar", "ScalarTape", "reshape", "transpose", "getitem", "embedding", "grad",
            "value_and_grad", "check_grads", "checkpoint", "checkpoint_loop", "revolve_cost",
            "revolve_schedule"]
