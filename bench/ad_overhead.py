"""Recording-and-replay overhead per op for small tensors: adtape against PyTorch autograd.

For each op a chain of ``K`` applications (``y = op(y)``, with leaf operands where
the op has two) is recorded and swept once; the time of forward plus backward
divided by ``K`` is the cost per op.  Tensors are 4x4 float32, so the arithmetic
is negligible and the figure is the AD machinery's overhead.  Both sides run in
this process, interleaved (ours, torch, ours, torch, ...) after a warm-up; the
median of the repetitions is reported.  Scalar-mode rows time ``adtape.Scalar``
against 0-d torch tensors.  Writes bench/results/ad_overhead.json.

    python bench/ad_overhead.py [--k 200] [--reps 7]
"""
import argparse
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
from adtape import nn  # noqa: E402
from kernels import threads  # noqa: E402

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
    for r in records:
        print(f"{r['op']:24s} {r['ours_us']:11.2f} {r['torch_us']:12.2f} {r['ratio']:7.2f}")
    ratios = [r["ratio"] for r in records]
    geo = float(np.exp(np.mean(np.log(ratios))))
    print(f"geometric mean ratio (ours/torch): {geo:.2f}; ops faster than torch: "
          f"{sum(x < 1 for x in ratios)}/{len(ratios)}")
    out = {"config": {"chain_length": K, "reps": args.reps, "shape": [4, 4], "dtype": "float32",
                      "threads": n_threads, "torch": torch.__version__, "numpy": np.__version__,
                      "python": platform.python_version(), "machine": platform.processor()
                      or platform.machine()},
           "geomean_ratio": geo,
           "records": records}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
