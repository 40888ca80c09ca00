"""The AMX bf16 products' task tiles, interleaved in one process.

  python bench/amx_tiles.py [--rows 1024] [--threads N] [--tiles auto,256x128,256x64]
                            [--rounds 3] [--out PATH]

GPT-2 124M's linear layers at --rows rows, three products each (the forward x @ w.T,
the weight gradient g.T @ x and the input gradient g @ w, each its own call:
kernels.bf16 rounds g to bf16 inside each backward call), every product timed with
each task tiling (``kernels.bf16._set_task_tiles``; "auto" is the default: the largest
square giving each thread about four tasks) in turn, --rounds times; a rate is
2*M*N*K over the median of three calls after one warm call, and the table gives each
rate's median over the rounds.  The tiles change no bit of the results, only where the
operands are read from.  Needs a CPU with AMX-BF16.  Writes bench/results/amx_tiles.json.
"""
import argparse
import json
import os
import statistics
import sys

import _paths  # noqa: F401  (import order: source if built in place, installed, bench/)
from _runinfo import cpu_name, git_commit
from products import seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [("qkv", 768, 2304), ("attproj", 768, 768), ("fc", 768, 3072),
          ("fcproj", 3072, 768), ("head", 768, 50304)]


def parse_tiles(text):
    tiles = {}
    for item in text.split(","):
        if item == "auto":
            tiles[item] = (0, 0)
            continue
        try:
            m, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a tiling is auto or MxN, got {item!r}") from None
        tiles[item] = (m, n)
    return tiles


def main(argv=None):
    import numpy as np

    from kernels import bf16
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--tiles", type=parse_tiles, default=parse_tiles("auto,256x128,256x64"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "amx_tiles.json"))
    args = p.parse_args(argv)
    if not bf16.cpu_has_amx_bf16():
        sys.exit("error: this CPU has no AMX-BF16 (or Linux does not grant its tiles)")
    M, n = args.rows, args.threads
    rng = np.random.default_rng(0)
    rates = {t: {} for t in args.tiles}
    try:
        for name, K, N in SHAPES:
            xs, ws = np.empty((M, K), np.uint16), np.empty((N, K), np.uint16)
            bf16.to_bf16(xs, rng.standard_normal((M, K), dtype=np.float32))
            bf16.to_bf16(ws, rng.standard_normal((N, K), dtype=np.float32) * 0.02)
            g = rng.standard_normal((M, N), dtype=np.float32) * 1e-3
            out, dx, dw = (np.empty(s, np.float32) for s in ((M, N), (M, K), (N, K)))
            calls = {
                "forward": lambda: bf16.matmul_forward_bf16(out, xs, ws, None, n_threads=n),
                "dw": lambda: bf16.matmul_backward_bf16(None, dw, None, g, xs, ws,
                                                        overwrite=True, n_threads=n),
                "dx": lambda: bf16.matmul_backward_bf16(dx, None, None, g, None, ws,
                                                        overwrite=True, n_threads=n)}
            for _ in range(args.rounds):
                for tiling, (tm, tn) in args.tiles.items():
                    bf16._set_task_tiles(tm, tn)
                    for prod, fn in calls.items():
                        rates[tiling].setdefault(f"{name}.{prod}", []).append(
                            2 * M * K * N / seconds(fn, 3) / 1e9)
    finally:
        bf16._set_task_tiles()
    print(f"AMX bf16 products at {M} rows, {n} threads, {cpu_name()}: GFLOP/s, medians of "
          f"{args.rounds} interleaved rounds")
    print(f"{'product':>16} " + " ".join(f"{t:>9}" for t in args.tiles))
    for key in rates[next(iter(args.tiles))]:
        print(f"{key:>16} " + " ".join(f"{statistics.median(rates[t][key]):9.0f}"
                                       for t in args.tiles))
    record = {"cpu": cpu_name(), "commit": git_commit(), "rows": M, "threads": n,
              "rounds": args.rounds, "gflops": rates}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
