"""Validate the performance model: published figures and our own measurements.

  python bench/perfmodel_validation.py [--profile this-machine] [--repeats 7] [--rounds 3]
                                      [--precision fp32|bf16|both]

Writes bench/results/perfmodel_validation.json: one record per check with name,
predicted, measured and the signed relative error (predicted - measured) / measured,
and bench/results/perfmodel_validation.png (predicted against measured).

Own measurements (CPU, shapes held out from calibration, which used (B, T) in
calibrate.FULL_CONFIGS):
- time of one GPT-2 124M transformer block, forward then backward, as the sequence of
  our kernels the op graph lists, interleaved across configurations, median of runs;
- bytes of the block's saved activations: the arrays our kernels produce that their
  backward needs, pushed on an adtape.Tape (its byte counter) and the process RSS growth;
- the full training step through ``gpt2.model.time_training_step`` (time, peak RSS,
  tape bytes), each (B, T) in a fresh process, --rounds of them in turn, with float32
  products and with bf16 ones (``--precision bf16``'s step: rows named ``..._bf16``).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import psutil

import _paths  # noqa: E402,F401  (import order: installed packages, source, bench/)
from _runinfo import cpu_name, git_commit  # noqa: E402

from gpt2.perfmodel import GraphOptions, ModelSpec, ParallelConfig, Workload, estimate, load_profile, op_time, \
    step_graph  # noqa: E402
from gpt2.perfmodel.calibrate import FULL_CONFIGS  # noqa: E402
from gpt2.perfmodel.published import published_checks, record  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HELD_OUT = ((2, 32), (1, 128), (2, 128), (8, 64))
GPT2 = ModelSpec(12, 12, 768, 50257)


class Block:
    """One transformer block's buffers and the kernel sequence of its forward and backward."""

    def __init__(self, spec, b, t, rng, aligned=True):
        from kernels import attention, layers, matmul
        self.k_att, self.k_layers, self.k_mm = attention, layers, matmul
        C, F, nh = spec.n_embd, spec.ffn_hidden, spec.n_head
        self.nh = nh
        from adtape import buffers

        # 64-byte aligned, as the training's arenas and buffers (with numpy's 16-byte
        # alignment the block took 20.4 ms against 15.5 at B=2, T=32 on Zen 4); numpy's
        # lazily mapped zeros for the RSS check (``aligned=False``), where the forward's
        # first writes are what RSS sees grow
        new = buffers.empty if aligned else (lambda shape: np.empty(shape, np.float32))

        def f(*shape, scale=0.02):
            out = new(shape)
            out[...] = rng.standard_normal(shape, dtype=np.float32) * scale
            return out

        def z(*shape, value=0.0):
            if not aligned and value == 0.0:
                return np.zeros(shape, np.float32)
            out = new(shape)
            out[...] = value
            return out

        self.w = {"ln1w": z(C, value=1.0), "ln1b": z(C), "qkvw": f(3 * C, C), "qkvb": z(3 * C),
                  "attprojw": f(C, C), "attprojb": z(C), "ln2w": z(C, value=1.0), "ln2b": z(C),
                  "fcw": f(F, C), "fcb": z(F), "fcprojw": f(C, F), "fcprojb": z(C)}
        self.g = {k: z(*v.shape) for k, v in self.w.items()}
        self.x = f(b, t, C, scale=1.0)
        # Saved activations (what backward reads), exactly the adtape layout of graph.py.
        self.saved = {"ln1": z(b, t, C), "ln1_mean": z(b, t), "ln1_rstd": z(b, t), "qkv": z(b, t, 3 * C),
                      "att_lse": z(b, nh, t), "atty": z(b, t, C), "res2": z(b, t, C), "ln2": z(b, t, C),
                      "ln2_mean": z(b, t), "ln2_rstd": z(b, t), "fch": z(b, t, F), "fch_gelu": z(b, t, F)}
        self.y, self.tmp = z(b, t, C), z(b, t, C)
        self.d = {"out": f(b, t, C, scale=1.0), "res2": z(b, t, C), "ln2": z(b, t, C), "fch": z(b, t, F),
                  "fch_gelu": z(b, t, F), "atty": z(b, t, C), "qkv": z(b, t, 3 * C), "ln1": z(b, t, C),
                  "x": z(b, t, C)}

    def forward(self):
        L, M, A, s, w = self.k_layers, self.k_mm, self.k_att, self.saved, self.w
        L.layernorm_forward(s["ln1"], s["ln1_mean"], s["ln1_rstd"], self.x, w["ln1w"], w["ln1b"])
        M.matmul_forward(s["qkv"], s["ln1"], w["qkvw"], w["qkvb"])
        A.attention_forward(s["atty"], s["att_lse"], s["qkv"], self.nh)
        M.matmul_forward(self.tmp, s["atty"], w["attprojw"], w["attprojb"])
        L.residual_forward(s["res2"], self.x, self.tmp)
        L.layernorm_forward(s["ln2"], s["ln2_mean"], s["ln2_rstd"], s["res2"], w["ln2w"], w["ln2b"])
        M.matmul_forward(s["fch"], s["ln2"], w["fcw"], w["fcb"])
        L.gelu_forward(s["fch_gelu"], s["fch"])
        M.matmul_forward(self.tmp, s["fch_gelu"], w["fcprojw"], w["fcprojb"])
        L.residual_forward(self.y, s["res2"], self.tmp)

    def backward(self):
        # As a training step runs it: every gradient written where it is first produced
        # (overwrite: the weights' gradients too, deferred zeroing), added where a second
        # contribution arrives (the layer norms' input gradients into the residual's)
        L, M, A, s, w, g, d = self.k_layers, self.k_mm, self.k_att, self.saved, self.w, self.g, self.d
        L.residual_backward(d["res2"], self.tmp, d["out"], overwrite=True)
        M.matmul_backward(d["fch_gelu"], g["fcprojw"], g["fcprojb"], self.tmp, s["fch_gelu"], w["fcprojw"],
                          overwrite=True)
        L.gelu_backward(d["fch"], s["fch"], d["fch_gelu"], overwrite=True)
        M.matmul_backward(d["ln2"], g["fcw"], g["fcb"], d["fch"], s["ln2"], w["fcw"], overwrite=True)
        L.layernorm_backward(d["res2"], g["ln2w"], g["ln2b"], d["ln2"], s["res2"], w["ln2w"], s["ln2_mean"],
                             s["ln2_rstd"], overwrite=(False, True, True))
        L.residual_backward(d["x"], self.tmp, d["res2"], overwrite=True)
        M.matmul_backward(d["atty"], g["attprojw"], g["attprojb"], self.tmp, s["atty"], w["attprojw"],
                          overwrite=True)
        A.attention_backward(d["qkv"], d["atty"], s["qkv"], s["atty"], s["att_lse"], self.nh, overwrite=True)
        M.matmul_backward(d["ln1"], g["qkvw"], g["qkvb"], d["qkv"], s["ln1"], w["qkvw"], overwrite=True)
        L.layernorm_backward(d["x"], g["ln1w"], g["ln1b"], d["ln1"], self.x, w["ln1w"], s["ln1_mean"],
                             s["ln1_rstd"], overwrite=(False, True, True))

    def step(self):
        self.forward()
        self.backward()


def predicted_block_time(spec, b, t, profile):
    ops = step_graph(spec, Workload(b, t), ParallelConfig())
    return sum(op_time(op, profile, "fp32") for op in ops if op.layer == 0)


def block_time_checks(profile, repeats):
    rng = np.random.default_rng(0)
    blocks = {cfg: Block(GPT2, *cfg, rng) for cfg in HELD_OUT}
    for blk in blocks.values():
        blk.step()
    samples = {cfg: [] for cfg in HELD_OUT}
    # three times the step's repeats: a block takes 16-120 ms, and on the shared VMs the
    # median of 7 of the 64-token block moved 15% between runs (of 21: 5%)
    for _ in range(3 * repeats):
        for cfg, blk in blocks.items():
            t0 = time.perf_counter()
            blk.step()
            samples[cfg].append(time.perf_counter() - t0)
    out = []
    for (b, t), times in samples.items():
        measured = float(np.median(times))
        out.append(record(f"block_fwd_bwd_time_B{b}_T{t}", predicted_block_time(GPT2, b, t, profile), measured,
                          "s", f"our kernels, GPT-2 124M block, median of {3 * repeats} interleaved runs",
                          f"held out from calibration configs {list(FULL_CONFIGS)}; "
                          f"spread {min(times):.4g}..{max(times):.4g} s"))
    return out


def run_child(flag, b, t, *args, env=None):
    """This script in a fresh process with ``flag B,T``: the last line it printed."""
    child = subprocess.run([sys.executable, os.path.abspath(__file__), flag, f"{b},{t}", *args],
                           env=env, capture_output=True, text=True, check=True)
    return child.stdout.splitlines()[-1]


def block_rss_growth(b, t):
    """RSS growth of one block's forward, weights and gradient buffers left out (run in a
    child process whose allocator maps every array of 64 KiB and more on its own)."""
    proc = psutil.Process()
    # A first forward of the same shape: the OpenMP threads' stacks and the kernels' packing
    # and per-thread scratch are the runtime's, not the block's (freed arrays are unmapped).
    Block(GPT2, b, t, np.random.default_rng(0), aligned=False).forward()
    blk = Block(GPT2, b, t, np.random.default_rng(1), aligned=False)
    # np.zeros maps pages lazily: the forward's first writes are what RSS sees grow.  The
    # block's input x (saved by the first layernorm) was written at construction.
    rss0 = proc.memory_info().rss
    blk.forward()
    return proc.memory_info().rss - rss0 - blk.y.nbytes - blk.tmp.nbytes + blk.x.nbytes


def block_memory_checks(b, t):
    """Predicted saved bytes of one block vs the tape's byte counter and RSS growth.

    The byte tape copies every record: the attention's output is pushed twice, by the
    attention (its backward reads it) and by the projection after it (its input), so the
    tape check counts it twice, as the model's ``Saved`` list does.  Held by reference
    (RSS) it is one array: that check leaves the model's ``shared`` tensors out.  glibc
    raises its mmap threshold when a large block is freed and then serves later arrays
    from heap pages that are already resident, which RSS would not see grow: the RSS
    growth is measured in a child process with the threshold fixed at 64 KiB."""
    import adtape
    ops = [op for op in step_graph(GPT2, Workload(b, t), ParallelConfig())
           if op.phase == "fwd" and op.layer == 0]
    predicted = sum(sum(s.nbytes for s in op.saved) for op in ops)
    referenced = predicted - sum(s.nbytes for op in ops for s in op.saved if s.shared)
    blk = Block(GPT2, b, t, np.random.default_rng(1))
    blk.forward()
    tape = adtape.Tape(dtype=np.float32)
    for arr in [blk.x] + list(blk.saved.values()) + [blk.saved["atty"]]:
        tape.push_array(arr)
    tape_bytes = tape.nbytes
    tape.close()
    rss_growth = int(run_child("--rss-child", b, t, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")))
    src = "numpy arrays written by our kernels' block forward"
    return [record(f"block_saved_bytes_tape_B{b}_T{t}", predicted, tape_bytes, "B", src + ", adtape.Tape.nbytes",
                   "tape bytes include each record's header"),
            record(f"block_saved_bytes_rss_B{b}_T{t}", referenced, rss_growth, "B",
                   src + ", process RSS growth minus weights and gradient buffers (child process, "
                   "mmap threshold 64 KiB)", "arrays two ops save counted once")]


def step_child(b, t, repeats, precision):
    """One training step's measurement in this (fresh) process, as JSON on stdout, its
    products in ``precision`` (gpt2-train's --precision)."""
    from adtape import nn
    from gpt2.config import GPT2Config
    from gpt2.model import time_training_step
    nn.set_precision(precision)
    print(json.dumps(time_training_step(GPT2Config.preset("gpt2"), b, t, repeats)))


def training_step_checks(profile, repeats, rounds, precisions):
    """Whole-step checks through gpt2.model.time_training_step, each (B, T) and precision
    in a fresh process: the peak RSS is that of a run of this step alone, as gpt2-train's
    would be (in this process the block checks' arrays set it first).  ``rounds`` passes
    over the held-out shapes, one fresh process each, the shapes and precisions taking
    turns: the measured time is the median of the rounds' medians (on the shared Zen 3
    VM one round's times moved 10-15% from the next a minute later).  A bf16 step is
    predicted with ``GraphOptions(precision="bf16")``: the profile's bf16 product peak
    and attention curves, the inputs saved in bf16, the conversions."""
    try:
        from gpt2.model import time_training_step  # noqa: F401
    except ImportError as exc:
        return [], [f"training step (time within 10%, memory within 5%): needs gpt2.model.time_training_step ({exc})"]
    runs = {(shape, precision): [] for shape in HELD_OUT for precision in precisions}
    for _ in range(rounds):
        for (b, t), precision in runs:
            runs[((b, t), precision)].append(json.loads(run_child(
                "--step-child", b, t, "--repeats", str(repeats), "--precision", precision)))
    out = []
    for ((b, t), precision), ms in runs.items():
        seconds = sorted(m["seconds"] for m in ms)
        est = estimate(GPT2, Workload(b, t), ParallelConfig(), profile, GraphOptions(precision=precision))
        name = f"B{b}_T{t}" + ("" if precision == "fp32" else f"_{precision}")
        out.append(record(f"step_time_{name}", est.step_time, float(np.median(seconds)), "s",
                          f"gpt2.model training step, {precision} products (median of {rounds} fresh "
                          f"processes' medians)", f"rounds {seconds[0]:.4g}..{seconds[-1]:.4g} s"))
        out.append(record(f"step_peak_rss_{name}", est.memory.total, max(m["peak_rss"] for m in ms), "B",
                          "process peak RSS (fresh process, the largest of the rounds)"))
        if ms[0].get("tape_bytes"):
            out.append(record(f"step_tape_bytes_{name}", est.memory.activations, ms[0]["tape_bytes"], "B",
                              "adtape byte counter (held by reference: an array two ops save counts once)"))
    return out, []


def plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(records) + 1.5))
    names = [r["name"] for r in records]
    errs = [100 * r["rel_error"] for r in records]
    ax.barh(names, errs, color=["tab:green" if abs(e) <= 10 else "tab:red" for e in errs])
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("signed relative error, predicted vs measured (%)")
    ax.set_title("perfmodel validation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="this-machine")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per training-step shape (default 3)")
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both",
                   help="the training steps' products (default both: bf16 is predicted from the profile's "
                        "bf16 rates; where the CPU has no AVX512_BF16 it measures the emulated path)")
    p.add_argument("--rss-child", metavar="B,T", help=argparse.SUPPRESS)
    p.add_argument("--step-child", metavar="B,T", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        print(block_rss_growth(*map(int, args.rss_child.split(","))))
        return 0
    if args.step_child:
        from kernels import threads
        threads.set_num_threads(load_profile(args.profile).threads or None)
        step_child(*map(int, args.step_child.split(",")), args.repeats, args.precision)
        return 0
    profile = load_profile(args.profile)
    from kernels import _openmp, threads
    threads.set_num_threads(profile.threads or None)
    _openmp.set_malloc_retention()      # the block's kernels as calibration and training run them
    records = published_checks()
    records += block_time_checks(profile, args.repeats)
    records += block_memory_checks(4, 128)
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    step_records, pending = training_step_checks(profile, args.repeats, args.rounds, precisions)
    records += step_records
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "perfmodel_validation.json"), "w") as f:
        json.dump({"profile": profile.name, "profile_source": profile.source, "threads": profile.threads,
                   "cpu": cpu_name(), "commit": git_commit(), "precisions": list(precisions),
                   "records": records, "pending": pending}, f, indent=2)
    plot(records, os.path.join(RESULTS, "perfmodel_validation.png"))
    print(f"{'check':<44}{'predicted':>14}{'measured':>14}{'error':>10}  unit")
    for r in records:
        print(f"{r['name']:<44}{r['predicted']:>14.5g}{r['measured']:>14.5g}{r['rel_error']:>+10.2%}  {r['unit']}")
    for line in pending:
        print(f"pending: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
