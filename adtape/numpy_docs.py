"""Generate docs/numpy.md, the list of what adtape.numpy and adtape.scipy.special
differentiate, from the code.

``python -m adtape.numpy_docs > docs/numpy.md``.  Each function of the namespace is
called on small Tensors and the primitives it records are listed beside it, so a
composition shows what it is made of; the derivative table lists every primitive,
its arguments and its VJP rules as written.  tests/adtape/test_numpy_docs.py checks that
the file in the repository is what this prints.
"""
import inspect
import linecache

import numpy as np

from adtape import numpy as anp
from adtape import vjps
from adtape.numpy import _vjps as numpy_vjps
from adtape.scipy import special as asp
from adtape.tensor import Primitive, Tensor, nested_graph

# Calls for the functions that take other than one or two arrays of shape (3, 3)
# (x, y); v is an array of shape (3,), s one of shape ().
_CALLS = {
    "atleast_1d": lambda x, y, v, s: anp.atleast_1d(s),
    "atleast_2d": lambda x, y, v, s: anp.atleast_2d(v),
    "reshape": lambda x, y, v, s: anp.reshape(x, (9,)),
    "expand_dims": lambda x, y, v, s: anp.expand_dims(x, 0),
    "squeeze": lambda x, y, v, s: anp.squeeze(anp.reshape(x, (1, 9))),
    "broadcast_to": lambda x, y, v, s: anp.broadcast_to(x, (2, 3, 3)),
    "swapaxes": lambda x, y, v, s: anp.swapaxes(x, 0, 1),
    "moveaxis": lambda x, y, v, s: anp.moveaxis(x, 0, 1),
    "roll": lambda x, y, v, s: anp.roll(x, 1),
    "pad": lambda x, y, v, s: anp.pad(x, 1),
    "concatenate": lambda x, y, v, s: anp.concatenate([x, y]),
    "stack": lambda x, y, v, s: anp.stack([x, y]),
    "hstack": lambda x, y, v, s: anp.hstack([x, y]),
    "vstack": lambda x, y, v, s: anp.vstack([x, y]),
    "split": lambda x, y, v, s: anp.split(x, 3)[0],
    "array_split": lambda x, y, v, s: anp.array_split(x, 2)[0],
    "tile": lambda x, y, v, s: anp.tile(x, 2),
    "repeat": lambda x, y, v, s: anp.repeat(x, 2),
    "take": lambda x, y, v, s: anp.take(x, np.array([0, 0])),
    "take_along_axis": lambda x, y, v, s: anp.take_along_axis(x, np.zeros((3, 1), int), 1),
    "where": lambda x, y, v, s: anp.where(np.eye(3, dtype=bool), x, y),
    "clip": lambda x, y, v, s: anp.clip(x, 0.0, 1.0),
    "einsum": lambda x, y, v, s: anp.einsum("ij,jk->ik", x, y),
    "slogdet": lambda x, y, v, s: anp.linalg.slogdet(x)[1],
    "eigh": lambda x, y, v, s: anp.linalg.eigh(x)[0],
    "svd": lambda x, y, v, s: anp.linalg.svd(x)[1],
    "cholesky": lambda x, y, v, s: anp.linalg.cholesky(x @ anp.transpose(x)),
    "rollaxis": lambda x, y, v, s: anp.rollaxis(x, 1),
    "ldexp": lambda x, y, v, s: anp.ldexp(x, np.arange(3)),
    "select": lambda x, y, v, s: anp.select([np.eye(3, dtype=bool)], [x], 0.0),
    "dstack": lambda x, y, v, s: anp.dstack([x, y]),
    "column_stack": lambda x, y, v, s: anp.column_stack([v, x]),
    "diag": lambda x, y, v, s: anp.diag(v),
    "partition": lambda x, y, v, s: anp.partition(x, 1),
    "array": lambda x, y, v, s: anp.array([s, s * s]),
    "asarray": lambda x, y, v, s: anp.asarray([s, 1.0]),
    "full": lambda x, y, v, s: anp.full((2, 2), s),
    "full_like": lambda x, y, v, s: anp.full_like(x, s),
}
_BINARY = {"add", "subtract", "multiply", "divide", "true_divide", "power", "matmul",
           "arctan2", "hypot", "logaddexp", "logaddexp2", "maximum", "minimum", "dot", "vdot",
           "inner", "outer", "tensordot", "kron", "solve", "fmax", "fmin", "remainder", "mod",
           "fmod", "cross", "copysign"}
_CONSTANT_VALUED = {"shape", "ndim", "size", "zeros_like", "ones_like", "argmax", "argmin",
                    "argsort", "less", "less_equal", "greater", "greater_equal", "isnan",
                    "isfinite", "isinf"}

# What HIPS/autograd differentiates that adtape.numpy does not, and why.
NOT_COVERED = """\
* Complex numbers (`real`, `imag`, `conj`, `angle`, complex dtypes): Tensors are float32/float64.
* `linalg.eig` (complex eigenvectors), `scipy.linalg.sqrtm`, `linalg.svd` with
  `full_matrices=True` on a non-square matrix (as autograd), `eigh` with `UPLO="U"`,
  `pinv(hermitian=True)`.
* `gradient`, `cumulative_sum`/`cumulative_prod` (NumPy 2.1's names), `nancumsum`,
  `cross` of 2-vectors, `diff` with `prepend`/`append`, `linalg.matrix_power`,
  `linalg.multi_dot`: not in the table yet (each raises AttributeError or
  NotImplementedError naming it).
* `einsum` with `...` or an index repeated within one operand (a diagonal), `pad` modes
  other than `"constant"`, `np.ufunc` methods (`np.add.at`, `.reduce`, `.accumulate`,
  `.outer`) and `out=`: these raise instead of being treated as constants.
* `scipy.special` beyond `adtape.scipy.special` above (autograd also wraps `beta`,
  `betaln`, `erfinv`, `erfcinv`, Bessel functions, ...), `scipy.signal.convolve`,
  `scipy.stats`.
* Forward mode is the transpose of reverse mode (two sweeps), not separate JVP rules.
"""


def _recorded(call):
    """The primitives ``call`` records, in order, each once."""
    rng = np.random.default_rng(0)
    x = Tensor(rng.uniform(0.5, 1.5, (3, 3)) + 3 * np.eye(3), requires_grad=True)
    y = Tensor(rng.uniform(0.5, 1.5, (3, 3)), requires_grad=True)
    v = Tensor(rng.uniform(0.5, 1.5, 3), requires_grad=True)
    s = Tensor(np.float64(0.5), requires_grad=True)
    with nested_graph() as graph, np.errstate(all="ignore"):
        call(x, y, v, s)
        names = [node[0].name for node in graph.nodes]
    return list(dict.fromkeys(names))


def _lambda_body(rule):
    """The source text of a lambda's expression, from its code object's positions."""
    code = rule.__code__
    spans = [p for p in code.co_positions()
             if None not in p and not (p[2] == 0 and p[3] == 0)]
    (line0, col0), (line1, col1) = (min((p[0], p[2]) for p in spans),
                                    max((p[1], p[3]) for p in spans))
    lines = linecache.getlines(code.co_filename)
    if line0 == line1:
        return lines[line0 - 1][col0:col1]
    parts = [lines[line0 - 1][col0:]] + lines[line0:line1 - 1] + [lines[line1 - 1][:col1]]
    return " ".join(part.strip() for part in parts)


def _rule_text(rule):
    if rule is None:
        return "none"
    if rule.__name__ == "<lambda>":
        return "`" + _lambda_body(rule).replace("|", "\\|") + "`"
    doc = (inspect.getdoc(rule) or "").split("\n")[0].replace("``", "`")
    return f"`{rule.__name__}`" + (f": {doc}" if doc else "")


# adtape.scipy.special's calls; the others take x.
_SPECIAL_CALLS = {
    "polygamma": lambda x, y, v, s: asp.polygamma(1, x),
    "xlogy": lambda x, y, v, s: asp.xlogy(x, y),
    "xlog1py": lambda x, y, v, s: asp.xlog1py(x, y),
}


def _primitives():
    prims = {}
    for module in (vjps, numpy_vjps, asp):
        for value in vars(module).values():
            if isinstance(value, Primitive) and value.differentiable:
                prims.setdefault(value.name, value)
    return dict(sorted(prims.items()))


def render():
    lines = ["# adtape.numpy and adtape.scipy.special: what they differentiate", "",
             "Generated by `python -m adtape.numpy_docs > docs/numpy.md` from the derivative "
             "table (`adtape/numpy/_vjps.py`, `adtape/vjps.py`, `adtape/scipy/special.py`); "
             "`tests/adtape/test_numpy_docs.py` checks it is current. Every rule below is written "
             "in NumPy code that records when handed Tensors, so each function can be "
             "differentiated to any order, in reverse and forward mode.", "",
             "## Functions", "",
             "`adtape.numpy.X` and `numpy.X` on a Tensor; the primitives each records "
             "(a composition lists its parts).", "",
             "| function | records |", "|---|---|"]
    names = sorted(set(anp._FUNCTIONS) | set(anp._LINALG) | set(anp._EXTRA))
    for name in names:
        if name in _CONSTANT_VALUED:
            continue
        short = name.split(".")[-1]
        fun = anp._FUNCTIONS.get(name) or anp._LINALG.get(name) or anp._EXTRA[name]
        call = _CALLS.get(short) or ((lambda x, y, v, s, f=fun: f(x, y)) if short in _BINARY
                                     else (lambda x, y, v, s, f=fun: f(x)))
        recorded = ", ".join(f"`{p}`" for p in _recorded(call))
        lines.append(f"| `{name}` | {recorded} |")
    lines += ["", "Constant-valued (they read values or shapes, nothing to record): "
              + ", ".join(f"`{n}`" for n in sorted(_CONSTANT_VALUED)) + ".", "",
              "## adtape.scipy.special", "",
              "`adtape.scipy.special.X` with SciPy's signature (`softmax` and `log_softmax` "
              "default to the whole array, as SciPy's); `scipy.special.X` on a Tensor records "
              "the same where it is a ufunc (marked). SciPy's Python functions (`logsumexp`, "
              "`softmax`, `log_softmax`) raise TypeError on a recorded Tensor.", "",
              "| function | records |", "|---|---|"]
    for name in asp.__all__:
        fun = getattr(asp, name)
        call = _SPECIAL_CALLS.get(name) or (lambda x, y, v, s, f=fun: f(x))
        recorded = ", ".join(f"`{p}`" for p in _recorded(call))
        ufunc = " (ufunc)" if fun in asp.UFUNCS.values() else ""
        lines.append(f"| `{name}`{ufunc} | {recorded} |")
    lines += ["",
              "## Derivative table", "",
              "`g` is the cotangent of the output, `ans` the output, then the operands. A "
              "rule may return a gradient of the broadcast shape: the sweep sums it down "
              "to the operand's.", "",
              "| primitive | arguments | VJP rule per argument |", "|---|---|---|"]
    for name, prim in _primitives().items():
        if prim.vjps is not None:
            rules = "; ".join(_rule_text(r) for r in prim.vjps)
        else:
            rules = _rule_text(prim.bwd) + " (all arguments)"
        lines.append(f"| `{name}` | {', '.join(prim.argnames)} | {rules} |")
    lines += ["", "## Not covered (against HIPS/autograd)", "", NOT_COVERED.rstrip(), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
