"""Where a training step's time goes: each op's forward and backward, AdamW, the rest.

    python bench/step_profile.py [--model gpt2] [--configs 1x64,4x256]
                                 [--precision fp32|bf16|both] [--threads N] [--steps 5]

Runs our tape engine's training step (zero grad, forward, backward, AdamW, as
bench/train_step.py times it) under ``adtape.profile()``: every op's forward and
backward rule is timed per call (self time), AdamW as one call; "(not in ops)" is the
step's measured time less those (Python between ops, the tape's records, the weights'
bf16 copies where the precision makes them outside an op).  One warm-up step, then
--steps profiled steps; times are per step (the profiled steps' sum over their count),
with each row's share of the step.  The ops that hold the matrix products (PRODUCT_OPS)
give the products' GFLOP/s (a lower bound: their fused elementwise work counts as
product time) and its share of the physical peak of the threads in use (kernels.peak,
probed in this run: the fp32 FMA, or the bf16 one with --precision bf16).
The step itself is also timed without the profile, interleaved, so the profile's own
cost shows (``overhead``).  Flush-to-zero on and freed memory kept mapped, as in
bench/train_step.py and gpt2-train.

Writes bench/results/step_profile.json (a run replaces its model's records).
"""
import argparse
import json
import os
import statistics
import sys
import time

import _paths  # noqa: F401  (import order: source if built in place, installed, bench/)
import numpy as np
from _runinfo import cpu_flags, cpu_name, git_commit, physical_peak

import train_step
import adtape
from adtape import nn
from kernels import blas_dispatch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LR = 1e-4


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=train_step.model_choices())
    p.add_argument("--configs", type=train_step.parse_configs,
                   default=train_step.parse_configs("1x64,4x256"))
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="default: all cores this process may use")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="rows printed per profile (all are written)")
    return p


# The ops that hold the step's matrix products (a linear layer alone or fused with
# the GELU, SwiGLU or attention before it; attention's own products): their time over
# the step's FLOPs is a lower bound on the products' rate (the fused elementwise work
# and attention's softmax count as product time).
PRODUCT_OPS = ("linear", "gelu_linear", "swiglu_linear", "attention_linear", "attention",
               "lora_linear")


def product_flops(model, B, T):
    """FLOPs of the step's matrix products, bench/train_step.py's count: 6 N B T (N the
    parameters in products) and attention's 6 L B T^2 C."""
    return train_step.step_flops(model.config, B, T)


def profile_config(model, B, T, precision, steps, seed=0):
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    inputs = rng.integers(0, V, (B, T), dtype=np.int32)
    targets = rng.integers(0, V, (B, T), dtype=np.int32)
    previous = nn.set_precision(precision)
    try:
        def step():
            t0 = time.perf_counter()
            model.train_step(inputs, targets, LR, weight_decay=0.1)
            return time.perf_counter() - t0
        step()                                              # warm-up
        plain, profiled, prof = [], [], adtape.OpProfile()
        for _ in range(steps):
            plain.append(step())
            with adtape.profile() as one:
                one.time(model.state, "adamw", "adamw", "step")
                profiled.append(step())
            prof.merge(one)
    finally:
        nn.set_precision(previous)
    return prof, statistics.median(plain), sum(profiled) / steps


def main(argv=None):
    args = build_parser().parse_args(argv)
    if argv is None:
        blas_dispatch.ensure()
    from kernels import _openmp, threads
    n = args.threads or threads.available_cores()
    # As bench/train_step.py's workers and gpt2-train: flush-to-zero before any thread
    # starts, freed memory kept mapped.
    _openmp.set_flush_denormal(True, n)
    _openmp.set_malloc_retention()
    n = threads.set_num_threads(n)
    _openmp.set_flush_denormal(True, n)
    config = train_step.model_config(args.model)
    from gpt2.model import GPT2
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    peaks = physical_peak(n)
    records = []
    print(f"{args.model} training step profile, {n} threads, {cpu_name()}, {args.steps} steps")
    for B, T in args.configs:
        model = GPT2(config, seed=0)
        for precision in precisions:
            prof, plain_s, step_s = profile_config(model, B, T, precision, args.steps)
            peak = peaks.get("bf16_peak_gflops") if precision == "bf16" else None
            peak = peak or peaks["fp32_peak_gflops"]
            flops = product_flops(model, B, T)
            rows = [dict(r, seconds=r["seconds"] / args.steps, calls=r["calls"] // args.steps)
                    for r in prof.as_dict()]
            products = sum(r["seconds"] for r in rows if r["name"] in PRODUCT_OPS)
            rec = {"model": args.model, "B": B, "T": T, "precision": precision, "threads": n,
                   "step_ms": 1e3 * step_s, "plain_step_ms": 1e3 * plain_s,
                   "overhead": step_s / plain_s - 1, "timed_ms": 1e3 * prof.seconds / args.steps,
                   "products_ms": 1e3 * products, "product_flops": flops,
                   "product_gflops": flops / products / 1e9 if products else None,
                   "product_share_of_peak": flops / products / 1e9 / peak if products else None,
                   "peak_gflops": peak, "ops": rows}
            records.append(rec)
            print(f"\n({B}, {T}) {precision}: step {rec['step_ms']:.1f} ms profiled, "
                  f"{rec['plain_step_ms']:.1f} ms plain ({100 * rec['overhead']:+.1f}%); products "
                  f"{rec['products_ms']:.1f} ms = {100 * products / step_s:.0f}% of the step, "
                  + (f"{rec['product_gflops']:.0f} GFLOP/s, {100 * rec['product_share_of_peak']:.0f}% "
                     f"of the {peak:.0f} GFLOP/s peak" if products else "no product ops seen"))
            print(prof.table(total=step_s, top=args.top, per=args.steps))
        model.close()
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "step_profile.json")
    try:
        with open(path) as f:
            kept = [r for r in json.load(f)["records"] if r["model"] != args.model]
    except (FileNotFoundError, KeyError, ValueError):
        kept = []
    meta = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "commit": git_commit(),
            **blas_dispatch.record(), "peaks": peaks, "steps": args.steps}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "records": kept + records}, f, indent=1)
    os.replace(tmp, path)
    print(f"\nwrote bench/results/step_profile.json")


if __name__ == "__main__":
    sys.exit(main())
