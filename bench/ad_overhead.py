"""Recording-and-replay overhead per op for small tensors: adtape against PyTorch autograd
(and, for the adtape.numpy functions, HIPS/autograd and eager JAX where installed).

For each op a chain of ``K`` applications (``y = op(y)``, with leaf operands where
the op has two) is recorded and swept once; the time of forward plus backward
divided by ``K`` is the cost per op.  Tensors are 4x4 float32, so the arithmetic
is negligible and the figure is the AD machinery's overhead.  Both sides run in
this process, interleaved (ours, torch, ours, torch, ...) after a warm-up; the
median of the repetitions is reported.  Scalar-mode rows time ``adtape.Scalar``
against 0-d torch tensors.

The adtape.numpy rows differentiate ``f(x) = sum(step^K(x))`` with ``adtape.grad``, the
same function body over ``autograd.numpy`` with ``autograd.grad`` and over ``jax.numpy``
with ``jax.grad`` (eager: no jit), and the same chain with PyTorch autograd; the other
operand of a binary step is a constant.  Each row runs two interleaved passes: ours,
PyTorch and autograd in one, ours and JAX in the other.  JAX's eager calls (some 100
times ours) slow whatever runs beside them in one loop (caches, allocator, frequency),
so each ratio is taken against ours measured in the same pass as the other library.
Writes bench/results/ad_overhead.json, naming the CPU and the commit.

    python bench/ad_overhead.py [--k 200] [--reps 7]
"""
import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import _paths  # noqa: E402,F401  (import order: installed packages, source, bench/)

import adtape as ad  # noqa: E402
import adtape.numpy as anp  # noqa: E402
from adtape import nn  # noqa: E402
from kernels import threads  # noqa: E402
from _runinfo import cpu_name, git_commit  # noqa: E402
from harness import interleave  # noqa: E402

try:
    import autograd
    import autograd.numpy as agnp
except ImportError:     # pip install autograd (a benchmark baseline, not a dependency)
    autograd = agnp = None
# JAX's CPU client on one thread, as --threads' default for every other library (its
# 4x4 ops never split; this keeps an idle Eigen pool off the cores).  Set before import.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1")
try:
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_platform_name", "cpu")
except ImportError:
    jax = jnp = None

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ad_overhead.json")


def make_inputs(rng):
    f32 = np.float32
    return {
        "x": (rng.uniform(0.5, 1.5, (4, 4))).astype(f32),
        "w": (rng.uniform(0.9, 1.1, (4, 4))).astype(f32),
        "m": (np.eye(4) + 0.01 * rng.standard_normal((4, 4))).astype(f32),
        "idx": np.array([3, 2, 1, 0]),
        "ln_w": np.ones(4, f32),
        "ln_b": np.zeros(4, f32),
        "lin_w": (np.eye(4) + 0.01 * rng.standard_normal((4, 4))).astype(f32),
        "lin_b": np.zeros(4, f32),
        "qkv_w": (0.3 * rng.standard_normal((12, 4))).astype(f32),
        "c": (rng.uniform(0.9, 1.1, (4, 4)) + 2 * np.eye(4)).astype(f32),
        "tgt": np.array([[1, 2]], np.int32),
    }


# Each entry: name -> (ours step, torch step).  A step maps (y, params) to the next y.
def ops_table(inp):
    idx_t = torch.tensor(inp["idx"])
    tgt = inp["tgt"]
    tgt_t = torch.tensor(tgt, dtype=torch.long).reshape(-1)
    shapes = [(2, 8), (4, 4)]
    return {
        "add": (lambda y, p: y + p["w"], lambda y, p: y + p["w"]),
        "sub": (lambda y, p: y - p["w"], lambda y, p: y - p["w"]),
        "mul": (lambda y, p: y * p["w"], lambda y, p: y * p["w"]),
        "div": (lambda y, p: y / p["w"], lambda y, p: y / p["w"]),
        "neg": (lambda y, p: -y, lambda y, p: -y),
        "power": (lambda y, p: y ** 1.01, lambda y, p: y ** 1.01),
        "matmul": (lambda y, p: y @ p["m"], lambda y, p: y @ p["m"]),
        "exp": (lambda y, p: ad.exp(y * 0.1), lambda y, p: torch.exp(y * 0.1)),
        "log": (lambda y, p: ad.log(y + 2.0), lambda y, p: torch.log(y + 2.0)),
        "tanh": (lambda y, p: ad.tanh(y), lambda y, p: torch.tanh(y)),
        "sum": (lambda y, p: y.sum(axis=-1, keepdims=True), lambda y, p: y.sum(dim=-1, keepdim=True)),
        "mean": (lambda y, p: y.mean(axis=-1, keepdims=True),
                 lambda y, p: y.mean(dim=-1, keepdim=True)),
        "reshape": (lambda y, p: y.reshape(shapes[y.shape[0] == 4]),
                    lambda y, p: y.reshape(shapes[y.shape[0] == 4])),
        "transpose": (lambda y, p: y.T, lambda y, p: y.T),
        "getitem": (lambda y, p: y[::-1], lambda y, p: y.flip(0)),
        "embedding": (lambda y, p: ad.embedding(y, inp["idx"]), lambda y, p: F.embedding(idx_t, y)),
        "layernorm": (lambda y, p: nn.layernorm(y, p["ln_w"], p["ln_b"]),
                      lambda y, p: F.layer_norm(y, (4,), p["ln_w"], p["ln_b"], 1e-5)),
        "gelu": (lambda y, p: nn.gelu(y), lambda y, p: F.gelu(y, approximate="tanh")),
        "linear": (lambda y, p: nn.linear(y, p["lin_w"], p["lin_b"]),
                   lambda y, p: F.linear(y, p["lin_w"], p["lin_b"])),
        "residual": (lambda y, p: nn.residual(y, p["w"]), lambda y, p: y + p["w"]),
        "attention": (lambda y, p: nn.attention(nn.linear(y, p["qkv_w"]).reshape(1, 4, 12), 2)
                      .reshape(4, 4),
                      lambda y, p: _torch_attention(F.linear(y, p["qkv_w"]).reshape(1, 4, 12), 2)
                      .reshape(4, 4)),
        "softmax_cross_entropy": (
            lambda y, p: y + nn.softmax_cross_entropy(y.reshape(1, 4, 4)[:, :2], tgt).mean(),
            lambda y, p: y + F.cross_entropy(y.reshape(1, 4, 4)[:, :2].reshape(2, 4), tgt_t)),
    }


def _torch_attention(qkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (z.view(B, T, n_head, C // n_head).transpose(1, 2) for z in qkv.split(C, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


# Ops that are compositions on both sides: their per-op figure counts several ops.
COMPOSITE = {"exp": 2, "log": 2, "attention": 4, "softmax_cross_entropy": 5}


def run_ours(step, inp, K):
    p = {k: ad.Tensor(inp[k], requires_grad=True) for k in
         ("w", "m", "ln_w", "ln_b", "lin_w", "lin_b", "qkv_w")}
    x = ad.Tensor(inp["x"], requires_grad=True)
    t0 = time.perf_counter()
    y = x
    for _ in range(K):
        y = step(y, p)
    y.sum().backward()
    return time.perf_counter() - t0


def run_torch(step, inp, K):
    p = {k: torch.tensor(inp[k], requires_grad=True) for k in
         ("w", "m", "ln_w", "ln_b", "lin_w", "lin_b", "qkv_w")}
    x = torch.tensor(inp["x"], requires_grad=True)
    t0 = time.perf_counter()
    y = x
    for _ in range(K):
        y = step(y, p)
    y.sum().backward()
    return time.perf_counter() - t0


def run_scalar_ours(op, K):
    t0 = time.perf_counter()
    with ad.ScalarTape() as st:
        x = st.variable(1.0)
        w = st.variable(1.0001)
        y = x
        for _ in range(K):
            y = op(y, w)
        st.gradient(y, [x, w])
    return time.perf_counter() - t0


def run_scalar_torch(op, K):
    x = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(1.0001, dtype=torch.float64, requires_grad=True)
    t0 = time.perf_counter()
    y = x
    for _ in range(K):
        y = op(y, w)
    y.backward()
    return time.perf_counter() - t0


# adtape.numpy functions: name -> (step(ns, y, c) over a NumPy-like namespace ns, the
# same step in PyTorch, NumPy ops per step).  y is 4x4 float32 (values in 0.5..1.5 at the
# start), c a constant 4x4 near 1; each step keeps y bounded along the chain.
_I4 = np.eye(4, dtype=np.float32)
_IDX = np.array([3, 2, 1, 0])
_IDX2 = np.array([[1, 0, 3, 2]] * 4)
_MASK = np.arange(16).reshape(4, 4) % 3 == 0


def _t(a):
    return torch.tensor(a)


NUMPY_OPS = {
    "sin": (lambda ns, y, c: ns.sin(y), lambda y, c: torch.sin(y), 1),
    "cos": (lambda ns, y, c: ns.cos(y), lambda y, c: torch.cos(y), 1),
    "arctan": (lambda ns, y, c: ns.arctan(y), lambda y, c: torch.atan(y), 1),
    "arcsinh": (lambda ns, y, c: ns.arcsinh(y), lambda y, c: torch.asinh(y), 1),
    "sqrt": (lambda ns, y, c: ns.sqrt(y), lambda y, c: torch.sqrt(y), 1),
    "cbrt": (lambda ns, y, c: ns.cbrt(y), lambda y, c: y ** (1 / 3), 1),
    "abs": (lambda ns, y, c: ns.abs(y), lambda y, c: torch.abs(y), 1),
    "reciprocal": (lambda ns, y, c: ns.reciprocal(y), lambda y, c: torch.reciprocal(y), 1),
    "log1p": (lambda ns, y, c: ns.log1p(y), lambda y, c: torch.log1p(y), 1),
    "maximum": (lambda ns, y, c: ns.maximum(y, c), lambda y, c: torch.maximum(y, c), 1),
    "minimum": (lambda ns, y, c: ns.minimum(y, c), lambda y, c: torch.minimum(y, c), 1),
    "hypot": (lambda ns, y, c: ns.hypot(y, c), lambda y, c: torch.hypot(y, c), 1),
    "arctan2": (lambda ns, y, c: ns.arctan2(y, c), lambda y, c: torch.atan2(y, c), 1),
    "logaddexp": (lambda ns, y, c: ns.logaddexp(y, c), lambda y, c: torch.logaddexp(y, c), 1),
    "power_array": (lambda ns, y, c: ns.power(y, c), lambda y, c: torch.pow(y, c), 1),
    "clip": (lambda ns, y, c: ns.clip(y, 0.2, 0.8), lambda y, c: torch.clamp(y, 0.2, 0.8), 1),
    "where": (lambda ns, y, c: ns.where(_MASK, y, c), lambda y, c: torch.where(_t(_MASK), y, c),
              1),
    "max_axis": (lambda ns, y, c: y - ns.max(y, axis=-1, keepdims=True),
                 lambda y, c: y - torch.amax(y, -1, keepdim=True), 2),
    "var_axis": (lambda ns, y, c: y - ns.var(y, axis=0, keepdims=True),
                 lambda y, c: y - torch.var(y, 0, correction=0, keepdim=True), 2),
    "logsumexp": (lambda ns, y, c: y - _logsumexp(ns)(y, axis=-1, keepdims=True),
                  lambda y, c: y - torch.logsumexp(y, -1, keepdim=True), 2),
    "norm": (lambda ns, y, c: y / ns.linalg.norm(y, axis=-1, keepdims=True),
             lambda y, c: y / torch.linalg.vector_norm(y, dim=-1, keepdim=True), 2),
    "cumsum": (lambda ns, y, c: ns.sin(ns.cumsum(y, axis=-1)),
               lambda y, c: torch.sin(torch.cumsum(y, -1)), 2),
    "cumprod": (lambda ns, y, c: ns.sin(ns.cumprod(y, axis=-1)),
                lambda y, c: torch.sin(torch.cumprod(y, -1)), 2),
    "softmax": (lambda ns, y, c: _softmax(ns)(y), lambda y, c: torch.softmax(y, -1), 1),
    "flip": (lambda ns, y, c: ns.flip(y, 0), lambda y, c: torch.flip(y, (0,)), 1),
    "roll": (lambda ns, y, c: ns.roll(y, 1, axis=0), lambda y, c: torch.roll(y, 1, 0), 1),
    "tril": (lambda ns, y, c: ns.tril(y) + c, lambda y, c: torch.tril(y) + c, 2),
    "concatenate": (lambda ns, y, c: ns.concatenate([y[:, 2:], y[:, :2]], axis=1),
                    lambda y, c: torch.cat([y[:, 2:], y[:, :2]], 1), 3),
    "stack": (lambda ns, y, c: ns.stack([y[1], y[2], y[3], y[0]]),
              lambda y, c: torch.stack([y[1], y[2], y[3], y[0]]), 5),
    "pad": (lambda ns, y, c: ns.pad(y[1:, 1:], ((1, 0), (0, 1))) + c,
            lambda y, c: F.pad(y[1:, 1:], (0, 1, 1, 0)) + c, 3),
    "tile": (lambda ns, y, c: ns.tile(y[:2], (2, 1)), lambda y, c: torch.tile(y[:2], (2, 1)), 2),
    "take": (lambda ns, y, c: ns.take(y, _IDX, axis=0), lambda y, c: y[_t(_IDX)], 1),
    "take_along_axis": (lambda ns, y, c: ns.take_along_axis(y, _IDX2, 1),
                        lambda y, c: torch.take_along_dim(y, _t(_IDX2), 1), 1),
    "int_index": (lambda ns, y, c: y[_IDX], lambda y, c: y[_t(_IDX)], 1),
    "diagonal": (lambda ns, y, c: y - ns.diagonal(y), lambda y, c: y - torch.diagonal(y), 2),
    "dot": (lambda ns, y, c: ns.dot(y, c), lambda y, c: y @ c, 1),
    "tensordot": (lambda ns, y, c: ns.tensordot(y, c, 1), lambda y, c: torch.tensordot(y, c, 1),
                  1),
    "einsum": (lambda ns, y, c: ns.einsum("ij,jk->ik", y, c),
               lambda y, c: torch.einsum("ij,jk->ik", y, c), 1),
    "solve": (lambda ns, y, c: ns.linalg.solve(c, y), lambda y, c: torch.linalg.solve(c, y), 1),
    "inv": (lambda ns, y, c: ns.linalg.inv(y + 4 * _I4),
            lambda y, c: torch.linalg.inv(y + 4 * _t(_I4)), 2),
    "cholesky": (lambda ns, y, c: ns.linalg.cholesky(y @ y.T + _I4),
                 lambda y, c: torch.linalg.cholesky(y @ y.T + _t(_I4)), 4),
}


def _logsumexp(ns):
    if ns is anp:
        return anp.logsumexp
    if agnp is not None and ns is agnp:
        from autograd.scipy.special import logsumexp
        return logsumexp
    return jax.scipy.special.logsumexp


def _softmax(ns):
    if ns is anp:
        return anp.softmax
    lse = _logsumexp(ns)
    return lambda y: ns.exp(y - lse(y, axis=-1, keepdims=True))


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _chain(ns, step, c, K):
    def f(x):
        y = x
        for _ in range(K):
            y = step(ns, y, c)
        return ns.sum(y)
    return f


def time_call(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def numpy_op_runners(step, torch_step, inp, K):
    """name -> timed callable for each library that runs this step (None if it cannot)."""
    x = inp["x"]
    c = inp["c"]
    runners = {"ours": lambda: ad.grad(_chain(anp, step, c, K))(x)}

    def run_torch():
        xt = torch.tensor(x, requires_grad=True)
        ct = torch.tensor(c)
        y = xt
        for _ in range(K):
            y = torch_step(y, ct)
        y.sum().backward()
    runners["torch"] = run_torch
    if autograd is not None:
        runners["autograd"] = lambda: autograd.grad(_chain(agnp, step, c, K))(x)
    if jax is not None:
        runners["jax"] = lambda: jax.grad(_chain(jnp, step, c, K))(jnp.asarray(x))
    ok = {}
    for name, run in runners.items():
        try:
            run()
        except Exception as exc:        # that library lacks the function or its derivative
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
            continue
        ok[name] = run
    return ok


SCALAR_OPS = {
    "scalar_add": lambda y, w: y + w,
    "scalar_mul": lambda y, w: y * w,
    "scalar_div": lambda y, w: y / w,
}


def measure(ours, theirs, reps, warmup=2):
    a, b = [], []
    for r in range(warmup + reps):
        ta = ours()
        tb = theirs()
        if r >= warmup:
            a.append(ta)
            b.append(tb)
    return statistics.median(a), statistics.median(b)


def interleaved(runners, reps, warmup=2):
    """name -> median seconds per call of each runner, called in turn after a warm-up
    (harness.interleave)."""
    times, _ = interleave(runners, reps, warmup)
    return {lib: statistics.median(v) for lib, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=200, help="ops per recorded chain")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions (median)")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads on both sides (default 1: at 4x4 a parallel region costs "
                         "more than the op, and the figure measured is the AD overhead)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    n_threads = threads.set_num_threads(args.threads)
    torch.set_num_threads(n_threads)
    rng = np.random.default_rng(0)
    inp = make_inputs(rng)
    K = args.k
    records = []
    print(f"{'op':24s} {'ours us/op':>11s} {'torch us/op':>12s} {'ratio':>7s}")
    with np.errstate(all="ignore"):
        for name, (ours, theirs) in ops_table(inp).items():
            ta, tb = measure(lambda: run_ours(ours, inp, K), lambda: run_torch(theirs, inp, K),
                             args.reps)
            records.append({"op": name, "ours_us": 1e6 * ta / K, "torch_us": 1e6 * tb / K,
                            "ratio": ta / tb, "ops_per_step": COMPOSITE.get(name, 1)})
        for name, op in SCALAR_OPS.items():
            ks = 50 * K
            ta, tb = measure(lambda: run_scalar_ours(op, ks), lambda: run_scalar_torch(op, ks),
                             args.reps)
            records.append({"op": name, "ours_us": 1e6 * ta / ks, "torch_us": 1e6 * tb / ks,
                            "ratio": ta / tb, "ops_per_step": 1})
        numpy_records = []
        for name, (step, torch_step, n_ops) in NUMPY_OPS.items():
            runners = numpy_op_runners(step, torch_step, inp, K)
            med = interleaved({lib: runners[lib] for lib in ("ours", "torch", "autograd")
                               if lib in runners}, args.reps)
            rec = {"op": name, "ops_per_step": n_ops,
                   **{f"{lib}_us": 1e6 * med[lib] / K if lib in med else None
                      for lib in ("ours", "torch", "autograd")}}
            rec["ratio"] = med["ours"] / med["torch"]
            rec["ratio_autograd"] = med["ours"] / med["autograd"] if "autograd" in med else None
            rec["jax_us"] = rec["ours_jax_pass_us"] = rec["ratio_jax"] = None
            if "jax" in runners:
                med_jax = interleaved({lib: runners[lib] for lib in ("ours", "jax")}, args.reps)
                rec["jax_us"] = 1e6 * med_jax["jax"] / K
                rec["ours_jax_pass_us"] = 1e6 * med_jax["ours"] / K
                rec["ratio_jax"] = med_jax["ours"] / med_jax["jax"]
            numpy_records.append(rec)
    for r in records:
        print(f"{r['op']:24s} {r['ours_us']:11.2f} {r['torch_us']:12.2f} {r['ratio']:7.2f}")
    ratios = [r["ratio"] for r in records]
    geo = float(np.exp(np.mean(np.log(ratios))))
    print(f"geometric mean ratio (ours/torch): {geo:.2f}; ops faster than torch: "
          f"{sum(x < 1 for x in ratios)}/{len(ratios)}")
    print(f"\nadtape.numpy through grad: us per step; ratio = ours / theirs")
    print(f"{'function':18s} {'ours':>7s} {'torch':>7s} {'autograd':>9s} {'jax':>7s} "
          f"{'/torch':>7s} {'/autograd':>9s} {'/jax':>7s}")

    def fmt(v, width, spec=".2f"):
        return f"{'-':>{width}s}" if v is None else f"{v:{width}{spec}}"
    for r in numpy_records:
        print(f"{r['op']:18s} {fmt(r['ours_us'], 7)} {fmt(r['torch_us'], 7)} "
              f"{fmt(r['autograd_us'], 9)} {fmt(r['jax_us'], 7)} {fmt(r['ratio'], 7)} "
              f"{fmt(r['ratio_autograd'], 9)} {fmt(r['ratio_jax'], 7)}")
    np_ratios = [r["ratio"] for r in numpy_records]
    geo_np = float(np.exp(np.mean(np.log(np_ratios))))
    ag = [r["ratio_autograd"] for r in numpy_records if r["ratio_autograd"] is not None]
    geo_ag = float(np.exp(np.mean(np.log(ag)))) if ag else None
    jx = [r["ratio_jax"] for r in numpy_records if r["ratio_jax"] is not None]
    geo_jax = float(np.exp(np.mean(np.log(jx)))) if jx else None
    all_ratios = ratios + np_ratios
    geo_all = float(np.exp(np.mean(np.log(all_ratios))))
    print(f"adtape.numpy geometric mean: {geo_np:.2f} of PyTorch's time "
          f"({sum(x < 1 for x in np_ratios)}/{len(np_ratios)} faster)"
          + (f", {geo_ag:.2f} of autograd's" if geo_ag is not None else "")
          + (f", {geo_jax:.2f} of JAX's" if geo_jax is not None else "")
          + f"; every row: {geo_all:.2f} of PyTorch's "
          f"({sum(x < 1 for x in all_ratios)}/{len(all_ratios)} faster)")
    out = {"config": {"chain_length": K, "reps": args.reps, "shape": [4, 4], "dtype": "float32",
                      "threads": n_threads, "torch": torch.__version__, "numpy": np.__version__,
                      "autograd": _version("autograd") if autograd else None,
                      "jax": jax.__version__ if jax else None,
                      "python": platform.python_version(), "cpu": cpu_name(),
                      "commit": git_commit()},
           "geomean_ratio": geo,
           "geomean_ratio_numpy": geo_np,
           "geomean_ratio_numpy_vs_autograd": geo_ag,
           "geomean_ratio_numpy_vs_jax": geo_jax,
           "geomean_ratio_all": geo_all,
           "records": records,
           "numpy_records": numpy_records}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
