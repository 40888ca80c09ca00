"""The matrix products of a training step, each against the CPU's physical peak.

  python bench/products.py [--model gpt2] [--tokens 64,512,4096] [--threads N]
                           [--precision fp32|bf16|both] [--reps 5] [--stat median|best]
                           [--rounds 1] [--lanes 8|16] [--out PATH]

Every linear layer of the model (GPT-2: qkv, attention projection, fc, fc projection
and the tied LM head; a Llama preset: q|k|v, o, gate|up, down and the head) at B*T =
each of --tokens rows, three products each: the forward (out = x @ w.T, kernels.matmul
or kernels.bf16), the weight gradient (dw = g.T @ x) and the whole backward (dx = g @ w
and dw together, the call a step makes: 4*M*N*K FLOPs).  As in a step, each product
reads its weight from memory: the calls take the layers' n_layer weights in turn (the
head's one; with one weight reused, the 64-row products ran from the cache).  A
product's rate is its FLOPs
(2*M*N*K each) over the median (--stat best: the least) of --reps timings after one warm
call; --rounds R runs the whole table R times and keeps each product's best (--stat
median: median) of the rounds, since a shared machine's noisy stretches last minutes.
Its share is that rate over the physical peak of the threads in use (kernels.peak:
register-only multiply-adds, the best of measurements at the start and after each
round; fp32 for fp32 products, the bf16 dot-product peak for bf16 ones where the
CPU has one, fp32's where it emulates them).  SciPy's BLAS sgemm of the forward
shape on as many BLAS threads is a column beside it.  --lanes 8 runs the fp32 products
in eight lanes on an AVX-512 CPU (kernels.gemm.set_skinny_lanes: the AVX2 build and
its routes) against the AVX2 peak: an AVX2 CPU's kernels, measured where its FMA pipes
are as wide (Zen 4 runs a 512-bit FMA as two 256-bit halves); with
OPENBLAS_CORETYPE=Haswell BLAS's column and routes are an AVX2 CPU's too.  bf16
products take operands converted beforehand (the conversions are timed apart: ``conv
ms``, the input's and the output gradient's).

Writes bench/results/products.json (a record per precision, layer, rows and product)
unless --out names another file.
"""
import argparse
import json
import os
import statistics
import sys
import time

import _paths  # noqa: F401  (import order: source if built in place, installed, bench/)
from _runinfo import best_peak, cpu_flags, cpu_name, git_commit, physical_peak
from kernels import blas_dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def layers(config):
    """[(name, K inputs, N outputs)] of the model's linear layers."""
    C = config.n_embd
    if config.family == "gpt2":
        return [("qkv", C, 3 * C), ("attproj", C, C), ("fc", C, 4 * C), ("fcproj", 4 * C, C),
                ("head", C, config.padded_vocab_size)]
    I = config.intermediate_size
    return [("qkv", C, config.qkv_width), ("o", config.n_head * config.head_dim, C),
            ("gateup", C, 2 * I), ("down", I, C), ("head", C, config.padded_vocab_size)]


def limits(peak):
    """{precision: the GFLOP/s its shares are against}: bf16 products against the bf16
    peak where the CPU has one, else (emulated) against fp32's."""
    return {"fp32": peak["fp32_peak_gflops"],
            "bf16": peak.get("bf16_peak_gflops") or peak["fp32_peak_gflops"]}


def lane_peak(peak, lanes):
    """physical_peak's answer with fp32's peak that of ``lanes``-wide FMAs where the CPU
    has wider ones (--lanes 8 on an AVX-512 CPU: the AVX2 loop's)."""
    if lanes == 8 and "avx2" in peak["peak_gflops_by_isa"]:
        peak = dict(peak, fp32_peak_isa="avx2",
                    fp32_peak_gflops=peak["peak_gflops_by_isa"]["avx2"])
    return peak


def record(model, precision, name, M, K, N, n, t, conv, peak_gflops):
    """The record of one layer's products: seconds, GFLOP/s and shares of peak_gflops."""
    flops = 2.0 * M * N * K
    gf = {k: flops * (2 if k == "backward" else 1) / s / 1e9 for k, s in t.items()}
    share = {k: gf[k] / peak_gflops for k in ("forward", "dw", "backward")}
    return {"model": model, "precision": precision, "layer": name, "M": M, "K": K, "N": N,
            "threads": n, "seconds": t, "gflops": gf, "share": share,
            "convert_seconds": conv, "peak_gflops": peak_gflops}


def row(r):
    """A record as a line of the table."""
    gf, share, conv = r["gflops"], r["share"], r["convert_seconds"]
    return (f"{r['precision']:>4} {r['layer']:>8} {r['M']:>5} {r['K']:>5} {r['N']:>6} "
            f"{gf['forward']:>7.1f} {gf['dw']:>7.1f} {gf['backward']:>7.1f} "
            f"{100 * share['forward']:>4.0f}% {100 * share['dw']:>4.0f}% "
            f"{100 * share['backward']:>4.0f}% {gf['blas_forward']:>8.1f} "
            + ("-" if conv is None else f"{1e3 * conv:.2f}").rjust(7))


# Long enough for OpenBLAS's spinning workers to sleep (its thread timeout: 2^28 cycles).
BLAS_SPIN_SECONDS = 0.3


def seconds(fn, reps, stat="median"):
    """The median (or with stat "best", the least) of ``reps`` timings of fn() after one
    untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if stat == "best" else statistics.median(times)


def measure(precision, M, K, N, n, reps, rng, stat="median", copies=1):
    """{product: seconds} of one layer at M rows in ``precision``: each call takes the
    next of ``copies`` weights in turn (a step's layers: each product reads its weight
    from memory, not from the cache the previous call left it in)."""
    import itertools

    import numpy as np
    from adtape import buffers
    from scipy.linalg.blas import sgemm
    from threadpoolctl import threadpool_limits

    from kernels import bf16, matmul
    x, g = buffers.empty((M, K)), buffers.empty((M, N))
    x[...] = rng.standard_normal((M, K), dtype=np.float32)
    g[...] = rng.standard_normal((M, N), dtype=np.float32) * 1e-3
    weights = []
    for _ in range(copies):
        w = buffers.empty((N, K))
        w[...] = rng.standard_normal((N, K), dtype=np.float32) * 0.02
        weights.append(w)
    out, dx, dw = buffers.empty((M, N)), buffers.empty((M, K)), buffers.empty((N, K))
    if precision == "fp32":
        fwd, bwd = matmul.matmul_forward, matmul.matmul_backward
        xs, ws, conv = x, weights, None
    else:
        xs, ws = buffers.empty((M, K), np.uint16), []
        bf16.to_bf16(xs, x, n_threads=n)
        for w in weights:
            ws.append(buffers.empty((N, K), np.uint16))
            bf16.to_bf16(ws[-1], w, n_threads=n)
        fwd, bwd = bf16.matmul_forward_bf16, bf16.matmul_backward_bf16
        conv = seconds(lambda: bf16.to_bf16(xs, x, n_threads=n), reps, stat)
    turn, fp32_turn = itertools.cycle(ws), itertools.cycle(weights)
    t = {"forward": seconds(lambda: fwd(out, xs, next(turn), None, n_threads=n), reps, stat)}
    t["dw"] = seconds(lambda: bwd(None, dw, None, g, xs, next(turn), overwrite=True,
                                  n_threads=n), reps, stat)
    both = seconds(lambda: bwd(dx, dw, None, g, xs, next(turn), overwrite=True, n_threads=n),
                   reps, stat)
    t["backward"] = both
    # SciPy's sgemm of out.T = w @ x.T in Fortran order: the same memory, no copies; on
    # n threads of BLAS's own (the kernels keep it at one, kernels.threads).
    with threadpool_limits(n, user_api="blas"):
        t["blas_forward"] = seconds(lambda: sgemm(1.0, next(fp32_turn).T, x.T, trans_a=True),
                                    reps, stat)
    # OpenBLAS's worker threads spin for a while after a threaded call, on the cores the
    # next layer's products then run on: the 512 x 768 x 768 forward (1 ms a call) that
    # came next measured 86-118 GFLOP/s in the table and 201 alone (Zen 4, 2 threads).
    time.sleep(BLAS_SPIN_SECONDS)
    return t, conv


def parse_tokens(text):
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens is a comma-separated list of row counts, "
                                         f"got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be positive, got {text!r}")
    return values


def main(argv=None):
    from gpt2.config import preset
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--tokens", type=parse_tokens, default=(64, 512, 4096))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--stat", choices=("median", "best"), default="median",
                   help="each rate from the median timing (default) or the best, what the "
                        "kernel does when a shared machine lets it")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole table this many times and keep each product's best "
                        "(--stat median: the median of the rounds'): on a shared machine "
                        "the noisy stretches last minutes, longer than one product's reps")
    p.add_argument("--lanes", type=int, choices=(8, 16), default=None,
                   help="vector lanes of the fp32 products (default: the CPU's widest)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        p.error("--rounds and --reps must be at least 1")
    if argv is None:
        blas_dispatch.ensure()
    import numpy as np
    from kernels import _openmp, bf16, gemm, threads
    if args.lanes:
        try:
            gemm.set_skinny_lanes(args.lanes)
        except ValueError as e:
            sys.exit(f"error: --lanes {args.lanes}: {e}")
    lanes = gemm.skinny_lanes()
    n = args.threads or len(os.sched_getaffinity(0))
    threads.set_num_threads(n)
    _openmp.set_flush_denormal(True, n)
    try:
        config = preset(args.model)
    except (KeyError, ValueError) as e:
        sys.exit(f"error: {e}")
    peak = lane_peak(physical_peak(n), lanes)
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    limit = limits(peak)
    print(f"{args.model} products, {n} threads, {lanes} lanes, {cpu_name()}; physical peak fp32 "
          f"{limit['fp32']:.1f} GFLOP/s, bf16 "
          + (f"{peak['bf16_peak_gflops']:.1f}" if peak.get("bf16_peak_gflops") else
             "none (emulated: shares against fp32's)")
          + f"; bf16 path {bf16.bf16_path()}; BLAS {blas_dispatch.record()}", flush=True)
    head = (f"{'prec':>4} {'layer':>8} {'M':>5} {'K':>5} {'N':>6} {'fwd GF':>7} {'dW GF':>7} "
            f"{'bwd GF':>7} {'fwd%':>5} {'dW%':>5} {'bwd%':>5} {'sgemm GF':>8} {'conv ms':>7}")
    rng = np.random.default_rng(0)
    start = limit
    timings = {}            # (precision, M, layer) -> [(seconds by product, conv s)] a round
    for rnd in range(args.rounds):
        if args.rounds > 1:
            print(f"round {rnd + 1} of {args.rounds}")
        print(head + "\n" + "-" * len(head))
        for precision in precisions:
            for M in args.tokens:
                for name, K, N in layers(config):
                    t, conv = measure(precision, M, K, N, n, args.reps, rng, args.stat,
                                      1 if name == "head" else config.n_layer)
                    timings.setdefault((precision, M, name), []).append((t, conv))
                    print(row(record(args.model, precision, name, M, K, N, n, t, conv,
                                     limit[precision])), flush=True)
        # the peak again after every round: the shares are against the best probe
        peak = best_peak(peak, physical_peak(n))    # keeps peak's ISAs (lane_peak's)
        limit = limits(peak)
    if limit != start:
        print(f"physical peak, best of {args.rounds + 1} probes: fp32 {limit['fp32']:.1f} "
              f"GFLOP/s, bf16 {limit['bf16']:.1f}; the shares below and in the record are "
              f"against it")
    # across the rounds: each product's best timing (median: the median of the rounds')
    combine = min if args.stat == "best" else statistics.median
    records = []
    for precision in precisions:
        for M in args.tokens:
            for name, K, N in layers(config):
                runs = timings[(precision, M, name)]
                t = {k: combine([r[0][k] for r in runs]) for k in runs[0][0]}
                conv = None if runs[0][1] is None else combine([r[1] for r in runs])
                records.append(record(args.model, precision, name, M, K, N, n, t, conv,
                                      limit[precision]))
    if args.rounds > 1:
        print(f"best of the {args.rounds} rounds" if args.stat == "best" else
              f"median of the {args.rounds} rounds")
        print(head + "\n" + "-" * len(head))
        for r in records:
            print(row(r))
    for precision in precisions:
        shares = [min(r["share"].values()) for r in records if r["precision"] == precision]
        print(f"{precision}: lowest share {100 * min(shares):.0f}%, median "
              f"{100 * statistics.median(shares):.0f}% of the physical {precision} peak")
    out = args.out or os.path.join(RESULTS, "products.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"cpu": cpu_name(), "cpu_flags": cpu_flags(), "commit": git_commit(),
                   "threads": n, "lanes": lanes, "stat": args.stat, "rounds": args.rounds,
                   "peak": peak,
                   "bf16_path": bf16.bf16_path(),
                   **blas_dispatch.record(), "records": records}, f, indent=1)
    print(f"wrote {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
